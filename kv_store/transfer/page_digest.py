"""Digests of KV pages that cross the prefill -> decode transfer, computed where the pages live.

The prefill worker digests each page where the transport reads it (its pool in place, on any
device, or its host staging copy) and ships the digests in `KVComplete.page_sums`; the decode
worker digests the landed pages and drops a landing that differs (`decode_worker/receiver.py`).
So a pool read in place on a GPU is digested on the GPU, with no copy to the host but the digests.

A page's digest: for each of its tensors (layer 0 K, layer 0 V, layer 1 K, ...), the page's bytes
as 32-bit words x_i, summed as sum(w_i * x_i) in int64 with fixed weights w_i in [1, 2^15) (the same
on every device: drawn once from a seeded CPU generator); those per-tensor sums are folded in
Python modulo 2^61 - 1. Any single changed word changes its tensor's sum (w_i != 0), a swap of two
words does unless their weights are equal, and one batched gather + multiply + sum per tensor costs
about what reading the pages does. Exact integer arithmetic, so CPU and CUDA agree bit for bit
(`tests/gpu`). Not a defence against an adversary: a guard against a transport that wrote the wrong
bytes or none.
"""

from __future__ import annotations

import torch

from kernels.kv_layout import KVCacheTensors

MODULUS = (1 << 61) - 1
FOLD = 1_000_003
WEIGHT_SEED = 0x7A4D
MAX_WORDS = 1 << 16  # words per page per tensor: sum(w * x) stays below 2^63


class PageDigest:
    """Digests of pages of one `KVCacheTensors` (any device). Holds views of it, not copies."""

    def __init__(self, kv: KVCacheTensors):
        tensors = [t for pair in zip(kv.k, kv.v) for t in pair]
        if not all(t.is_contiguous() for t in tensors):
            raise ValueError("page digests need contiguous KV tensors (as KVCacheTensors.allocate makes)")
        page_bytes = tensors[0][0].numel() * tensors[0].element_size()
        word = torch.int32 if page_bytes % 4 == 0 else torch.int16 if page_bytes % 2 == 0 else torch.uint8
        self._views = [t.view(t.shape[0], -1).view(word) for t in tensors]  # [num_pages, words]
        words = self._views[0].shape[1]
        if words > MAX_WORDS:
            raise ValueError(f"a KV page of {page_bytes} bytes per tensor is too large to digest ({words} words)")
        gen = torch.Generator().manual_seed(WEIGHT_SEED)
        self._weights = torch.randint(1, 1 << 15, (words,), generator=gen, dtype=torch.int64).to(tensors[0].device)
        self.device = tensors[0].device

    def digests(self, page_ids: list[int]) -> list[int]:
        """One digest per page of `page_ids`, in order (one device -> host copy for all of them)."""
        if not page_ids:
            return []
        idx = torch.tensor(page_ids, dtype=torch.int64, device=self.device)
        sums = torch.stack([(v.index_select(0, idx).to(torch.int64) * self._weights).sum(dim=1)
                            for v in self._views], dim=1).tolist()  # [pages, tensors]
        return [_fold(row) for row in sums]

    def damage(self, page_id: int) -> None:
        """Invert the bits of one word in the middle of page `page_id` (fault injection, `common/chaos.py`)."""
        view = self._views[0][page_id]
        view[view.numel() // 2] = ~view[view.numel() // 2]


def _fold(sums: list[int]) -> int:
    acc = 0
    for s in sums:
        acc = (acc * FOLD + s % (1 << 64)) % MODULUS
    return acc
