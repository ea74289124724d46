"""The paged KV cache tensors of one model: layout only, no ownership.

Per layer, K and V are ``[num_pages, page_size, num_kv_heads, head_dim]``. A token's slot is
``page_id * page_size + offset``; page 0 is the scratch page that padded writes land in, so
it is allocated like every other page but never handed to a request (kv_store owns that rule).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import math
import mmap
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from common.protocol import KVLayout

log = logging.getLogger("tandem.engine")

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
"""Config dtype name -> torch dtype."""
DTYPE_NAMES = {dtype: name for name, dtype in TORCH_DTYPES.items()}


def kv_layout(num_layers: int, page_size: int, num_kv_heads: int, head_dim: int, dtype: str) -> KVLayout:
    """The layout a pool of this shape would have (sizes a pool before allocating it)."""
    return KVLayout(num_layers=num_layers, page_size=page_size, num_kv_heads=num_kv_heads, head_dim=head_dim,
                    dtype=dtype, element_bytes=TORCH_DTYPES[dtype].itemsize)


@dataclass(frozen=True)
class KVCacheTensors:
    """Per-layer K and V page tensors; ``k[i]`` / ``v[i]`` belong to decoder layer ``i``.

    The tensors are mutated in place by the attention backend's ``write_kv``; the list
    objects themselves are never replaced.
    """

    k: list[torch.Tensor]  # num_layers x [num_pages, page_size, num_kv_heads, head_dim]
    v: list[torch.Tensor]  # num_layers x [num_pages, page_size, num_kv_heads, head_dim]

    def __post_init__(self) -> None:
        assert len(self.k) == len(self.v) and len(self.k) > 0, (
            f"KV cache needs one K and one V tensor per layer, got {len(self.k)} K and {len(self.v)} V"
        )
        shape = self.k[0].shape
        assert len(shape) == 4, f"KV page tensor must be [num_pages, page_size, kvh, hd], got {tuple(shape)}"
        for k, v in zip(self.k, self.v):
            assert k.shape == shape and v.shape == shape, "every layer's K and V must share one page shape"

    @classmethod
    def allocate(
        cls,
        num_layers: int,
        num_pages: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> KVCacheTensors:
        """Zero-filled cache. ``num_pages`` includes the scratch page 0. On a CPU the zeros are the
        operating system's (`zeros_lazy`): a page of memory is touched when first written, not here."""
        assert num_pages >= 2, f"num_pages={num_pages}: page 0 is scratch, so at least 2 are needed"
        assert page_size >= 1 and num_layers >= 1, f"bad page_size={page_size} or num_layers={num_layers}"
        shape = (num_pages, page_size, num_kv_heads, head_dim)
        zeros = zeros_lazy if torch.device(device).type == "cpu" else torch.zeros
        k = [zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        v = [zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        return cls(k=k, v=v)

    @property
    def num_layers(self) -> int:
        return len(self.k)

    @property
    def num_pages(self) -> int:
        return self.k[0].shape[0]

    @property
    def page_size(self) -> int:
        return self.k[0].shape[1]

    @property
    def layout(self) -> KVLayout:
        """The wire description of these tensors (`KVLayout.page_bytes` is the one bytes-per-page formula)."""
        page = self.k[0]
        return kv_layout(self.num_layers, page.shape[1], page.shape[2], page.shape[3], DTYPE_NAMES[page.dtype])


CPU_ALIGN_BYTES = 64
"""Alignment of a `zeros_lazy` tensor's first element at least (a page's, in fact), as torch's own CPU allocator
gives."""


def zeros_lazy(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    """A zero CPU tensor whose memory is zeroed by the operating system page by page, as it is first
    touched, rather than written here: `torch.zeros` of a decode worker's pool faulted in every
    page at start-up (seconds, and all of it resident before any request). An anonymous
    mapping of its own, not the allocator's (which may hand back memory it already touched): fresh
    zero pages, page-aligned, storage offset 0 (the compiled step guards on offsets)."""
    import numpy as np

    assert torch.device(device).type == "cpu", f"zeros_lazy allocates CPU memory, not {device}"
    num_bytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if num_bytes == 0:
        return torch.zeros(shape, dtype=dtype)
    block = np.frombuffer(mmap.mmap(-1, num_bytes), dtype=np.uint8)  # the array keeps the mapping alive
    return torch.from_numpy(block).view(dtype).view(shape)


MADV_POPULATE_WRITE = 23
"""Linux 5.14+: map a range's pages writable now, leaving their contents as they are."""
POPULATE_CHUNK_BYTES = 2 << 20
"""Mapped in a call (milliseconds): the longest a step that arrives meanwhile waits on it."""
POPULATE_PAUSE_S = 0.05
"""How often a paused populate looks again whether the worker still has work."""
POPULATE_NICE = 19
"""The populating thread's niceness (Linux threads have their own): it takes idle cores only."""


def populate_in_background(tensors: list[torch.Tensor], name: str = "tandem-kv-populate",
                           busy: Callable[[], bool] = lambda: False) -> threading.Thread | None:
    """Fault in the memory of CPU tensors made by `zeros_lazy` on a thread of its own, chunk by chunk,
    without changing a byte (`MADV_POPULATE_WRITE`), so requests that write KV later do not pay the
    page faults: left to the writes, a decode worker's first pass through its pool made each KV write
    many times slower (docs/results.md#start-up). Safe beside requests using the pages
    (contents are kept); the thread runs no OpenMP region. None where there is nothing to do or the
    kernel has no such advice (then pages fault as they are first written, as before). Between chunks
    it waits while `busy()` (a served worker: while it has requests), so it takes only idle time: even at
    nice 19 it took one of a lone stream's two OpenMP threads now and then, and every step waited for it."""
    tensors = [t for t in tensors if t.device.type == "cpu" and t.numel()]
    if not tensors:
        return None
    try:
        madvise = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]

    def run() -> None:
        # only on a core nothing else wants: a worker's start-up, its compile and requests come first
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), POPULATE_NICE)
        start_s, done = time.perf_counter(), 0
        for t in tensors:
            page = mmap.PAGESIZE
            first = t.data_ptr() - t.data_ptr() % page
            end = -(-(t.data_ptr() + t.numel() * t.element_size()) // page) * page
            for addr in range(first, end, POPULATE_CHUNK_BYTES):
                while busy():
                    time.sleep(POPULATE_PAUSE_S)
                if madvise(addr, min(POPULATE_CHUNK_BYTES, end - addr), MADV_POPULATE_WRITE) != 0:
                    log.info("KV memory left to fault in as it is written (madvise: errno %d)", ctypes.get_errno())
                    return
            done += end - first
        log.info("KV memory mapped in: %.2f GiB in %.1f s", done / 2**30, time.perf_counter() - start_s)

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    return thread
