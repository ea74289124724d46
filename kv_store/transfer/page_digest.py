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

Across tensor-parallel ranks a landing page is split by KV heads: each decode rank's shard of it is
`[page_size, its heads, head_dim]` and is digested as a page of its own (weights drawn for its word
count). Each prefill rank writes some heads of it; the per-tensor sums are linear in the words, so
each prefill rank computes the part of every shard's sums its heads contribute (`shard_sums`, the
weights taken at the words' places in the shard), rank 0 adds the ranks' parts (`PartialSums`) and
folds them: the digest the decode rank computes of what landed. The digests then travel shard-major
(shard 0's pages, then shard 1's, ...).
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
        self.device = tensors[0].device
        self._weights = _weights(words, self.device)
        self._token_heads = tensors[0].shape[1:3]  # (page_size, heads): a shard's weights are laid out by them
        self._head_whole = tensors[0].shape[3] * tensors[0].element_size() % self._views[0].element_size() == 0
        self._shard_weights: dict[int, torch.Tensor] = {}

    def digests(self, page_ids: list[int]) -> list[int]:
        """One digest per page of `page_ids`, in order (one device -> host copy for all of them)."""
        if not page_ids:
            return []
        idx = torch.tensor(page_ids, dtype=torch.int64, device=self.device)
        sums = torch.stack([(v.index_select(0, idx).to(torch.int64) * self._weights).sum(dim=1)
                            for v in self._views], dim=1).tolist()  # [pages, tensors]
        return [_fold(row) for row in sums]

    def shard_sums(self, page_ids: list[int], held: range, sent: range,
                   shards: list[tuple[int, int]]) -> list[list[list[int]]]:
        """Per page of `page_ids`, per landing shard (its heads `[lo, hi)`), per tensor: the part of
        the shard page's sums that this pool's heads `sent` contribute (it holds heads `held`; heads
        it does not send count 0). `[pages][shards][tensors]`, for `PartialSums`."""
        if not page_ids:
            return []
        if not self._head_whole:
            raise ValueError("a head's bytes are not whole words: its pages cannot be digested by shard")
        page_size, num_held = self._token_heads
        idx = torch.tensor(page_ids, dtype=torch.int64, device=self.device)
        pages = [v.index_select(0, idx).view(len(page_ids), page_size, num_held, -1) for v in self._views]
        per_shard = []
        for lo, hi in shards:
            first, stop = max(sent.start, lo), min(sent.stop, hi)
            if first >= stop:
                per_shard.append(torch.zeros(len(page_ids), len(pages), dtype=torch.int64, device=self.device))
                continue
            weights = self._weights_of(hi - lo, pages[0].shape[-1])[:, first - lo:stop - lo]
            part = slice(first - held.start, stop - held.start)
            per_shard.append(torch.stack([(p[:, :, part].to(torch.int64) * weights).sum(dim=(1, 2, 3)) for p in pages],
                                         dim=1))
        return torch.stack(per_shard, dim=1).tolist()

    def _weights_of(self, shard_heads: int, head_words: int) -> torch.Tensor:
        """A shard page's weights as `[page_size, shard_heads, head_words]`."""
        if shard_heads not in self._shard_weights:
            page_size = self._token_heads[0]
            self._shard_weights[shard_heads] = _weights(page_size * shard_heads * head_words, self.device).view(
                page_size, shard_heads, head_words)
        return self._shard_weights[shard_heads]

    def damage(self, page_id: int) -> None:
        """Invert the bits of one word in the middle of page `page_id` (fault injection, `common/chaos.py`)."""
        view = self._views[0][page_id]
        view[view.numel() // 2] = ~view[view.numel() // 2]


class PartialSums:
    """One request's landing digests being added up from every prefill rank's `shard_sums`."""

    def __init__(self, num_ranks: int) -> None:
        self.num_ranks = num_ranks
        self._sums: dict[int, list[list[int]]] = {}  # request page index -> [shard][tensor]
        self._parts: dict[int, int] = {}  # request page index -> ranks that added theirs

    def add(self, start: int, sums: list[list[list[int]]]) -> None:
        """A rank's `shard_sums` of the request's pages `[start, start + len(sums))`."""
        for i, shards in enumerate(sums, start):
            held = self._sums.get(i)
            self._sums[i] = shards if held is None else [[a + b for a, b in zip(x, y)] for x, y in zip(held, shards)]
            self._parts[i] = self._parts.get(i, 0) + 1

    def digests(self, num_pages: int) -> tuple[int, ...]:
        """Every shard's digests of pages `[0, num_pages)`, shard-major; () unless every rank added every page."""
        if any(self._parts.get(i) != self.num_ranks for i in range(num_pages)):
            return ()
        shards = len(self._sums[0]) if num_pages else 0
        return tuple(_fold(self._sums[i][s]) for s in range(shards) for i in range(num_pages))


def _weights(words: int, device: torch.device) -> torch.Tensor:
    gen = torch.Generator().manual_seed(WEIGHT_SEED)
    return torch.randint(1, 1 << 15, (words,), generator=gen, dtype=torch.int64).to(device)


def _fold(sums: list[int]) -> int:
    acc = 0
    for s in sums:
        acc = (acc * FOLD + s % (1 << 64)) % MODULUS
    return acc
