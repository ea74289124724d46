"""The CPU's native kernels (`*.c` beside this file, one source per kernel, sharing the headers):
built into one library once per machine, loaded with ctypes. `paged_decode` is the "cpu" attention
backend's decode (`attention.c`), `linear_bf16` a bf16 matmul (`linear.c`), and `decode_layer.c` a
whole decoder layer (`kernels/cpu/decode_layer.py`).

Why: a batched CPU decode step attended in two passes over each layer's KV, a gather of every
sequence's pages into one padded copy (`index_select`) and SDPA's flash kernel over it, which treats
a GQA group's few query heads as a query block and runs far from the memory's speed: over a third
of a batched step (docs/results.md#cpu-decode). The kernel reads the pages in place, once, every
query head of a group per K/V row, with the softmax online (`tandem_paged_decode_f32`).

Built on first use with the C compiler torch.compile uses too (`$CC`, else cc / gcc / clang),
`-O3 -march=native -fopenmp` (`$TANDEM_CPU_MARCH` names another `-march`, e.g. `x86-64-v3`: the
AVX2 baseline CI also tests on a wider CPU; the kernel's results do not depend on it: its sums run
in a fixed order, contraction off), into ``<cache root>/kernels/`` under a name keyed by the source, the
flags, the compiler and this CPU, so a cache shared between different machines never loads another
CPU's build; a worker process that finds it there only loads it, and workers that start at once build it
once (a file lock beside it). Its OpenMP team is torch's: torch ships the libgomp the process has loaded,
and `torch.set_num_threads` sets the caller's team size. Where no compiler works, `kernel()` is None,
one warning says why, and the torch path serves.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import torch

log = logging.getLogger("tandem.kernels")

HERE = Path(__file__).parent
SOURCES = tuple(HERE / name for name in ("attention.c", "decode_layer.c", "linear.c"))
HEADERS = tuple(HERE / name for name in ("numerics.h", "attend.h", "matvec.h"))
LIBRARY = "cpu_kernels"
"""The library's name in the cache (`cpu_kernels-<key>.so`)."""
MARCH_ENV = "TANDEM_CPU_MARCH"
"""Environment variable naming the `-march` the kernel is built for; unset: `native`."""
BASE_FLAGS = ("-O3", "-fopenmp", "-fPIC", "-shared", "-std=c11", "-ffp-contract=off")
BUILD_TIMEOUT_S = 120.0
_I64, _F32P, _I64P = ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p

_lock = threading.Lock()
_loaded: list = []  # [] before the first try; then [CDLL or None]


def kernel() -> ctypes.CDLL | None:
    """The loaded kernel library, built first if this machine has none; None where it cannot be built
    (the reason logged once per process)."""
    with _lock:
        if not _loaded:
            _loaded.append(_build_and_load())
        return _loaded[0]


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, page_table: torch.Tensor,
                 seq_lens: torch.Tensor, scale: float) -> torch.Tensor | None:
    """Decode attention of ``q [B, H, D]`` (one token a sequence) over positions ``[0, seq_lens[b])``
    of sequence b's pages ``page_table [B, >= num_pages]`` in ``k_cache, v_cache [P, page_size, KVH,
    D]``: ``[B, H, D]``, a new tensor. None when the kernel does not take these inputs (not float32
    CPU tensors in its layouts, more heads or a larger head than its bounds, no kernel here): the caller
    runs its torch path. Reads no tensor's values on the host."""
    lib = kernel()
    if lib is None or not _takes(lib, q, k_cache, v_cache, page_table, seq_lens):
        return None
    batch, num_heads, head_dim = q.shape
    out = torch.empty(batch, num_heads, head_dim, dtype=torch.float32)
    lib.tandem_paged_decode_f32(q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(),
                                page_table.data_ptr(), page_table.stride(0), seq_lens.data_ptr(), out.data_ptr(),
                                batch, num_heads, k_cache.shape[2], head_dim, k_cache.shape[1], scale)
    return out


def linear_bf16(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor | None:
    """``x [M, K] @ weight [N, K]^T + bias`` for a bfloat16 CPU weight in HF's row-major layout, the
    products summed in float32 and rounded to bf16 once (as torch's bf16 matmul rounds): ``[M, N]`` in
    x's dtype. For CPUs without bf16 dot products, where torch's bf16 matmul is several times slower
    than `tandem_linear` (docs/results.md#cpu-decode). None where the kernel does not take it (no
    kernel here, another dtype or layout): the caller runs its torch path."""
    lib = kernel()
    if lib is None or weight.dtype != torch.bfloat16 or not weight.is_contiguous() or weight.dim() != 2:
        return None
    if x.dim() != 2 or x.shape[1] != weight.shape[1] or x.device.type != "cpu" or weight.device.type != "cpu":
        return None
    rows = x.float().contiguous()
    bias32 = None if bias is None else bias.float().contiguous()
    out, scratch = torch.empty(rows.shape[0], weight.shape[0], dtype=torch.float32), torch.empty_like(rows)
    lib.tandem_linear(rows.shape[0], rows.data_ptr(), rows.shape[1], weight.data_ptr(),
                      None if bias32 is None else bias32.data_ptr(), out.data_ptr(), weight.shape[0], weight.shape[1],
                      1, scratch.data_ptr())
    return out.to(x.dtype)


def _takes(lib, q, k_cache, v_cache, page_table, seq_lens) -> bool:
    if not all(t.device.type == "cpu" for t in (q, k_cache, v_cache, page_table, seq_lens)):
        return False
    if q.dtype != torch.float32 or k_cache.dtype != torch.float32 or v_cache.dtype != torch.float32:
        return False
    if page_table.dtype != torch.int64 or seq_lens.dtype != torch.int64 or seq_lens.stride(0) != 1:
        return False
    num_heads, head_dim, num_kv_heads = q.shape[1], q.shape[2], k_cache.shape[2]
    return (q.dim() == 3 and q.stride(2) == 1 and q.stride(1) == head_dim and k_cache.is_contiguous()
            and v_cache.is_contiguous() and v_cache.shape == k_cache.shape and k_cache.shape[3] == head_dim
            and page_table.dim() == 2 and page_table.stride(1) == 1
            and takes_heads(lib, num_heads, num_kv_heads, head_dim))


def takes_heads(lib: ctypes.CDLL, num_heads: int, num_kv_heads: int, head_dim: int) -> bool:
    """Whether the kernel's attention (`attend`) serves this many heads of this size: whole GQA
    groups, within the bounds of its on-stack accumulators."""
    return (num_heads % num_kv_heads == 0 and num_heads <= lib.tandem_max_heads()
            and head_dim <= lib.tandem_max_head_dim() and num_heads * head_dim <= lib.tandem_max_head_floats())


def flags() -> tuple[str, ...]:
    """The compiler flags of this process's build: `-march` from `MARCH_ENV` (default native)."""
    march = os.environ.get(MARCH_ENV, "").strip() or "native"
    return (f"-march={march}", *BASE_FLAGS)


def _compiler() -> str | None:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and (path := shutil.which(name)):
            return path
    return None


def _cpu_identity() -> str:
    """What a build with -march=native depends on: the CPU's model and feature flags."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor() or platform.machine()
    wanted = [line for line in lines if line.startswith(("model name", "flags"))]
    return "\n".join(dict.fromkeys(wanted)) or platform.machine()


def _library_path(compiler: str) -> Path:
    from kernels.model.convert import default_cache_root

    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        version = ""
    texts = [p.read_text() for p in SOURCES + HEADERS]
    key = hashlib.sha256("\0".join([*texts, *flags(), compiler, version, _cpu_identity()]).encode())
    return default_cache_root() / "kernels" / f"{LIBRARY}-{key.hexdigest()[:16]}.so"


def _build_and_load() -> ctypes.CDLL | None:
    from kernels.model.convert import file_lock

    compiler = _compiler()
    if compiler is None:
        log.warning("no C compiler (cc, gcc, clang or $CC): CPU decode attention takes the slower torch path")
        return None
    path = _library_path(compiler)
    try:
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            # Workers that start at once on a fresh machine build it once: the others wait here (a build
            # ends within BUILD_TIMEOUT_S; a holder that dies drops the lock) and then find it built.
            with file_lock(path.parent / f".{LIBRARY}.lock"):
                if not path.exists():
                    start_s = time.perf_counter()
                    build(compiler, path)
                    log.info("built the CPU decode-attention kernel (%s) in %.1f s: %s", flags()[0],
                             time.perf_counter() - start_s, path)
        return load(path)
    except (OSError, subprocess.SubprocessError) as e:
        log.warning("building the CPU decode-attention kernel failed (%s): it takes the slower torch path", e)
        return None


def load(path: Path) -> ctypes.CDLL:
    """The library built at `path`, its entry points typed."""
    lib = ctypes.CDLL(str(path))
    lib.tandem_paged_decode_f32.restype = None
    lib.tandem_paged_decode_f32.argtypes = [_F32P, _I64, _F32P, _F32P, _I64P, _I64, _I64P, _F32P,
                                            _I64, _I64, _I64, _I64, _I64, ctypes.c_float]
    lib.tandem_decode_layer_scratch.restype = _I64
    lib.tandem_decode_layer_scratch.argtypes = [_I64] * 6
    lib.tandem_decode_layer.restype = None
    lib.tandem_decode_layer.argtypes = [_I64, _F32P, _I64, ctypes.c_float, *[_F32P] * 8, _I64, _F32P, _F32P,
                                        _F32P, _F32P, _I64P, _I64, _I64P, _I64P, _I64, _I64, _I64, _I64,
                                        ctypes.c_float, _F32P, ctypes.c_int]
    lib.tandem_linear.restype = None
    lib.tandem_linear.argtypes = [_I64, _F32P, _I64, _F32P, _F32P, _F32P, _I64, _I64, ctypes.c_int, _F32P]
    return lib


def build(compiler: str, path: Path) -> None:
    """Compile into a temporary file beside `path`, then rename: workers that build at once each
    write their own and the last rename wins, so none ever loads a half-written library. Other
    builds there go (an older source's; a cache shared with another CPU rebuilds its own, a short build)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=path.parent)
    os.close(fd)
    try:
        done = subprocess.run([compiler, *flags(), *map(str, SOURCES), "-o", tmp, "-lm"], capture_output=True,
                              text=True, timeout=BUILD_TIMEOUT_S)
        if done.returncode != 0:
            raise OSError(f"{Path(compiler).name} exited {done.returncode}: {done.stderr.strip()[-400:]}")
        os.replace(tmp, path)
        for stale in path.parent.glob(f"{LIBRARY}-*.so"):  # builds of an older source (or another CPU)
            if stale != path:
                stale.unlink(missing_ok=True)  # a process that has one loaded keeps its mapping
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
