"""A Triton kernel that copies whole KV pages of one layer, K and V, between two page tensors.

One side may be pinned host memory: pages allocated with cudaHostAlloc (torch's `pin_memory`) are
mapped into the device's address space under unified addressing, so the kernel's loads (host ->
device) or stores (device -> host) cross PCIe directly, with no gather or scatter on the host and
no staging buffer. Triton's launcher accepts such a tensor as it is: it resolves every pointer
argument with `cuPointerGetAttribute(DEVICE_POINTER)`, which pinned memory answers (pageable memory
does not, and the launch raises "cannot be accessed from Triton (cpu tensor?)").

A program copies one chunk of one page of K or of V; the grid is (page, K or V, chunk). With
s = src_idx[i], d = dst_idx[i] and the tensors viewed as rows of PAGE_WORDS words::

    program (i, kv, c)   reads  src[s * PAGE_WORDS + c * BLOCK : ... + BLOCK]   (K for kv == 0, V for 1)
                         writes dst[d * PAGE_WORDS + c * BLOCK : ... + BLOCK]
    chunks c = 0 .. ceil(PAGE_WORDS / BLOCK) - 1; words past PAGE_WORDS in the last chunk are masked

Pages move as raw words (int32 where a page's bytes allow, else int16 or bytes), so any dtype is
copied bit for bit. Each program's accesses are contiguous, 16-byte vectors when the page tensors
are 16-byte aligned (as allocations are), so both directions run close to a plain contiguous pinned
`copy_` (measured on an H200: docs/results.md#kv-tiers). Under `TRITON_INTERPRET=1` the kernel runs on
CPU tensors (both sides host memory): how the tests run it without a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

PROGRAM_BYTES = 4096
"""Bytes one program copies at most (a page larger than this is split into chunks)."""
_WORD_DTYPES = ((4, torch.int32), (2, torch.int16), (1, torch.uint8))


@triton.jit
def copy_pages_kernel(
    src_k_ptr, src_v_ptr, dst_k_ptr, dst_v_ptr, src_idx_ptr, dst_idx_ptr,
    PAGE_WORDS: tl.constexpr, BLOCK: tl.constexpr, EVEN: tl.constexpr,
):
    """Program (i, kv, c): words [c * BLOCK, (c + 1) * BLOCK) of page src_idx[i] -> dst_idx[i]."""
    i = tl.program_id(0)
    offs = tl.program_id(2).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)  # [BLOCK] words within the page
    src_off = tl.load(src_idx_ptr + i) * PAGE_WORDS + offs
    dst_off = tl.load(dst_idx_ptr + i) * PAGE_WORDS + offs
    if EVEN:
        mask = None
    else:
        mask = offs < PAGE_WORDS
    # K and V written out twice rather than a pointer picked by an if: each branch keeps its
    # pointer's alignment facts, so the loads and stores stay vectorized
    if tl.program_id(1) == 0:
        tl.store(dst_k_ptr + dst_off, tl.load(src_k_ptr + src_off, mask=mask), mask=mask)
    else:
        tl.store(dst_v_ptr + dst_off, tl.load(src_v_ptr + src_off, mask=mask), mask=mask)


@dataclass(frozen=True)
class PageCopy:
    """One layer's copy, checked and sized once (`plan_copy`); `launch` per job. Planning ahead keeps
    the per-launch host work to Triton's own: a layer's copy can be that short on the GPU, and
    launches that cost as much would leave it idle between layers."""

    words: tuple[torch.Tensor, ...]  # src K, src V, dst K, dst V, each [num_pages, page_words]
    page_words: int
    block: int  # words per program, a power of two
    num_chunks: int  # programs per page (of K or of V): ceil(page_words / block)

    def launch(self, src_idx: torch.Tensor, dst_idx: torch.Tensor) -> None:
        """Pages `src_idx[i]` -> `dst_idx[i]`, K and V, on the current stream; returns without waiting
        (no host sync). Indices: int64 `[n]` on the device that runs the kernel, destinations
        distinct (two programs writing one page race); not bounds-checked: callers own page ids."""
        assert src_idx.shape == dst_idx.shape, (
            f"{src_idx.numel()} source pages for {dst_idx.numel()} destination pages: one destination per source"
        )
        num_pages = src_idx.shape[0]
        if num_pages == 0:
            return
        copy_pages_kernel[(num_pages, 2, self.num_chunks)](
            *self.words, src_idx, dst_idx, PAGE_WORDS=self.page_words, BLOCK=self.block,
            EVEN=self.num_chunks * self.block == self.page_words, num_warps=4,
        )


def plan_copy(src_k: torch.Tensor, src_v: torch.Tensor, dst_k: torch.Tensor, dst_v: torch.Tensor,
              program_bytes: int = PROGRAM_BYTES) -> PageCopy:
    """The copy of pages of `src_k`/`src_v` into `dst_k`/`dst_v`: contiguous `[num_pages, page_size,
    kv_heads, head_dim]` of one dtype and page shape (the page counts of src and dst may differ); on
    CUDA one side may be pinned host memory. The tensors are viewed, not copied: the plan stays valid
    as long as they live."""
    _check(src_k, src_v, dst_k, dst_v)
    tensors = (src_k, src_v, dst_k, dst_v)
    page_bytes = src_k[0].numel() * src_k.element_size()
    word_bytes, word_dtype = next((b, d) for b, d in _WORD_DTYPES
                                  if page_bytes % b == 0 and all(t.data_ptr() % b == 0 for t in tensors))
    page_words = page_bytes // word_bytes
    block = min(triton.next_power_of_2(max(1, program_bytes // word_bytes)), triton.next_power_of_2(page_words))
    words = tuple(t.view(t.shape[0], -1).view(word_dtype) for t in tensors)
    return PageCopy(words, page_words, block, triton.cdiv(page_words, block))


def copy_pages(
    src_k: torch.Tensor, src_v: torch.Tensor, dst_k: torch.Tensor, dst_v: torch.Tensor,
    src_idx: torch.Tensor, dst_idx: torch.Tensor, program_bytes: int = PROGRAM_BYTES,
) -> None:
    """`dst_k[dst_idx[i]] = src_k[src_idx[i]]` and the same for V, for every i, in one launch on the
    current stream (`plan_copy` then `PageCopy.launch`: see both for the contract)."""
    assert src_idx.dtype == dst_idx.dtype == torch.int64, (
        f"page indices must be int64, not {src_idx.dtype}/{dst_idx.dtype}"
    )
    plan_copy(src_k, src_v, dst_k, dst_v, program_bytes).launch(src_idx, dst_idx)


def _check(src_k, src_v, dst_k, dst_v) -> None:
    page = src_k.shape[1:]
    for name, t in (("src_k", src_k), ("src_v", src_v), ("dst_k", dst_k), ("dst_v", dst_v)):
        assert t.dim() == 4 and t.shape[1:] == page, (
            f"{name} is {tuple(t.shape)}, not [pages, {', '.join(map(str, page))}]: K/V of another layout?"
        )
        assert t.dtype == src_k.dtype, f"{name} is {t.dtype}, src_k {src_k.dtype}: pages are copied, never converted"
        assert t.is_contiguous(), f"{name} is not contiguous: a view of a page tensor passed?"
    assert src_k.shape[0] == src_v.shape[0] and dst_k.shape[0] == dst_v.shape[0], "K and V of one side differ in pages"
