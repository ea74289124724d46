"""Ahead-of-time builds of every Triton kernel for real GPU targets, on a machine without a GPU.

Triton compiles to a cubin with the ptxas it ships (`triton.compile` on an `ASTSource` for a
`GPUTarget`); only loading the cubin needs a device. So each kernel, at the tiles the backend launches
it with (`triton_backend.default_tiles`) for every head size and KV dtype it serves, is built here for
sm_80 (A100) and sm_90 (H100/H200), and what the build uses is read off the cubin with the bundled
`cuobjdump --dump-resource-usage`: registers, local memory (spills) and shared memory (static, plus
the dynamic amount in the kernel's metadata). `check` holds each to the budgets below, so a tile or
kernel change that would not launch on a GPU, or would spill heavily, fails on the CPU.

Must run where ``TRITON_INTERPRET`` is unset when the kernels are first imported (the interpreter
swaps `@triton.jit` for an interpreted function there): `python -m kernels.cuda.triton_aot`
prints one JSON line per build; `tests/unit/kernels/test_triton_aot.py` runs it as a child process.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

TARGETS = (80, 90)
SHARED_LIMIT_BYTES = {80: 166_912, 90: 232_448}
"""Shared memory one block may use on each target (the opt-in maximum: 163 and 227 KiB)."""
MAX_REGISTERS = 255
SPILL_BUDGET_BYTES = 256
"""Local memory (register spills) a thread may use: the extend kernel's 64-row half-precision tiles
spill up to ~190 B on sm_80 (slower, still correct); more means a tile that does not fit its registers."""
HEAD_DIMS = (64, 128, 256)
DTYPES = ("float32", "bfloat16", "float16")
PAGE_SIZE = 16
GROUP = 4  # query heads per KV head (Llama-3-8B's)
FLOAT_ARGS = {"qk_scale", "softcap_log2"}
"""The kernels' runtime arguments that are fp32; every other non-pointer is an int64."""
SCORE_RULES = {
    "": {"HAS_WINDOW": False, "HAS_SOFTCAP": False},
    "_window": {"HAS_WINDOW": True, "HAS_SOFTCAP": False},  # Mistral, Gemma 3's local layers
    "_softcap": {"HAS_WINDOW": False, "HAS_SOFTCAP": True},  # Gemma 2's global layers
    "_window_softcap": {"HAS_WINDOW": True, "HAS_SOFTCAP": True},  # Gemma 2's local layers
}
"""Name suffix -> flags of each build of the attention kernels; the register allocator's spills do not
grow monotonically with the code, so each combination a model launches is built."""


@dataclass(frozen=True)
class Build:
    """What one kernel build for one target uses (bytes, except registers)."""

    kernel: str
    target: int
    dtype: str
    head_dim: int
    num_warps: int
    registers: int
    local_bytes: int
    shared_bytes: int  # static + dynamic


def _specs(dtype_name: str, head_dim: int):
    """(name, jit function, signature, constexprs, num_warps) of every kernel the backends launch
    for this KV dtype and head size, at the backend's tiles."""
    import torch
    import triton
    import triton.language as tl

    from kernels.cuda import page_copy as kv_copy
    from kernels.cuda import triton_kernels as tk
    from kernels.cuda.triton_backend import MAX_KV_SPLITS, _block_d, default_tiles

    dtype = getattr(torch, dtype_name)
    tiles = default_tiles(head_dim, dtype, interpreted=False)
    kv = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}[dtype_name]
    dot = {"float32": tl.float32, "bfloat16": tl.bfloat16, "float16": tl.float16}[dtype_name]
    block_d = _block_d(head_dim)
    pointers = {"q_ptr": kv, "k_ptr": kv, "v_ptr": kv, "k_cache_ptr": kv, "v_cache_ptr": kv, "out_ptr": kv,
                "mid_o_ptr": "fp32", "mid_lse_ptr": "fp32", "tree_mask_ptr": "i1"}
    shared = {"HEAD_DIM": head_dim, "BLOCK_D": block_d, "PAGE_SIZE": PAGE_SIZE}
    word_bytes, word_dtype = kv_copy._WORD_DTYPES[0]
    page_words = PAGE_SIZE * 8 * head_dim * torch.tensor([], dtype=dtype).element_size() // word_bytes
    copy_block = min(triton.next_power_of_2(kv_copy.PROGRAM_BYTES // word_bytes), triton.next_power_of_2(page_words))
    copy_word = {torch.int32: "i32", torch.int16: "i16", torch.uint8: "u8"}[word_dtype]
    decode = {**shared, "GROUP": GROUP, "BLOCK_H": 16, "BLOCK_N": tiles.decode_block_n, "DOT_DTYPE": dot}
    # float32 on CUDA is the reference dtype (served models are half): its plain kernels only
    rules = SCORE_RULES if dtype_name != "float32" else {"": SCORE_RULES[""]}
    specs = [
        *((f"decode_split{suffix}", tk.decode_split_kernel, {**decode, **flags}, tiles.num_warps)
          for suffix, flags in rules.items()),
        ("decode_combine", tk.decode_combine_kernel, {"HEAD_DIM": head_dim, "BLOCK_D": block_d,
                                                      "BLOCK_S": MAX_KV_SPLITS}, 4),
        ("write_kv", tk.write_kv_kernel, {"NUM_KV_HEADS": 8, "HEAD_DIM": head_dim, "BLOCK_KVH": 8, "BLOCK_D": block_d,
                                          "PAGE_SIZE": PAGE_SIZE, "BLOCK_T": 4}, 4),
        ("copy_pages", kv_copy.copy_pages_kernel, {"PAGE_WORDS": page_words, "BLOCK": copy_block,
                                                   "EVEN": page_words % copy_block == 0}, 4),
    ]
    extend = {**shared, "GROUP": GROUP, "BLOCK_N": tiles.extend_block_n, "DOT_DTYPE": dot}
    for suffix, flags in rules.items():
        specs.append((f"extend{suffix}", tk.extend_kernel,
                      {**extend, "BLOCK_M": tiles.extend_block_m, "HAS_TREE": False, **flags}, tiles.num_warps))
    specs.append(("extend_tree", tk.extend_kernel,  # never with a window (the backend refuses it)
                  {**extend, "BLOCK_M": tiles.tree_block_m, "HAS_TREE": True, **SCORE_RULES[""]}, tiles.num_warps))
    out = []
    for name, fn, constexprs, warps in specs:
        signature = {}
        for arg in fn.arg_names:
            if arg in constexprs:
                signature[arg] = "constexpr"
            elif arg.endswith("_ptr"):
                default = copy_word if name == "copy_pages" and not arg.endswith("idx_ptr") else "i64"
                signature[arg] = "*" + pointers.get(arg, default)
            else:
                signature[arg] = "fp32" if arg in FLOAT_ARGS else "i64"
        out.append((name, fn, signature, constexprs, warps))
    return out


def build(target: int, dtype_name: str, head_dim: int, workdir: Path) -> list[Build]:
    """Every kernel for this dtype and head size, compiled for sm_`target`."""
    builds = []
    for name, fn, signature, constexprs, warps in _specs(dtype_name, head_dim):
        cubin = workdir / f"{name}-{target}-{dtype_name}-{head_dim}.cubin"
        regs, local, shared = compile_kernel(fn, signature, constexprs, target, warps, cubin)
        builds.append(Build(name, target, dtype_name, head_dim, warps, regs, local, shared))
    return builds


def compile_kernel(fn, signature: dict, constexprs: dict, target: int, num_warps: int, cubin: Path
                   ) -> tuple[int, int, int]:
    """Compile the Triton kernel `fn` for sm_`target` into `cubin`; (registers, local bytes a thread,
    shared bytes: static and dynamic)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    index = {arg: i for i, arg in enumerate(fn.arg_names)}
    source = ASTSource(fn=fn, signature=signature, constexprs={(index[k],): v for k, v in constexprs.items()})
    kernel = triton.compile(source, target=GPUTarget("cuda", target, 32), options={"num_warps": num_warps})
    cubin.write_bytes(kernel.asm["cubin"])
    regs, local, static_shared = _resource_usage(cubin)
    return regs, local, static_shared + int(kernel.metadata.shared)


def _resource_usage(cubin: Path) -> tuple[int, int, int]:
    """(registers, per-thread local memory bytes: stack frame and local arrays, static shared bytes)
    of the one kernel in `cubin`."""
    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    text = subprocess.run([str(tool), "--dump-resource-usage", str(cubin)], capture_output=True, text=True,
                          check=True, timeout=60).stdout
    found = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", text)
    if found is None:
        raise RuntimeError(f"no resource usage in cuobjdump's output: {text[-400:]}")
    regs, stack, shared, local = (int(g) for g in found.groups())
    return regs, stack + local, shared  # spilled registers live in the stack frame


def check(b: Build) -> str | None:
    """Why `b` would fail or is over budget on its target (None: it is within every budget)."""
    if b.shared_bytes > SHARED_LIMIT_BYTES[b.target]:
        return f"{b.shared_bytes} B of shared memory > sm_{b.target}'s {SHARED_LIMIT_BYTES[b.target]}"
    if b.registers > MAX_REGISTERS:
        return f"{b.registers} registers > {MAX_REGISTERS}"
    if b.local_bytes > SPILL_BUDGET_BYTES:
        return f"{b.local_bytes} B spilled a thread > the budget {SPILL_BUDGET_BYTES}"
    return None


def main(argv: list[str]) -> int:
    """One JSON line per build: targets, dtypes and head sizes from argv (`80,90 bfloat16 128`), else all."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("TRITON_INTERPRET=1: the interpreter cannot compile for a GPU; unset it", file=sys.stderr)
        return 2
    targets = [int(t) for t in argv[0].split(",")] if argv else list(TARGETS)
    dtypes = argv[1].split(",") if len(argv) > 1 else list(DTYPES)
    head_dims = [int(h) for h in argv[2].split(",")] if len(argv) > 2 else list(HEAD_DIMS)
    with tempfile.TemporaryDirectory(prefix="tandem-aot-") as tmp:
        for target in targets:
            for dtype_name in dtypes:
                for head_dim in head_dims:
                    for b in build(target, dtype_name, head_dim, Path(tmp)):
                        print(json.dumps(asdict(b)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
