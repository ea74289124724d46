"""Digests of transferred KV pages (`kv_store/transfer/page_digest.py`): equal to a plain-Python
computation of the documented sum over the page's bytes, the same for a page wherever it sits and
however many are asked at once, and changed by any single flipped byte of any layer's K or V, by two
swapped words, and by `damage`."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from kernels.kv_layout import KVCacheTensors
from kv_store.transfer import page_digest
from kv_store.transfer.page_digest import PageDigest

LAYERS, PAGES = 3, 9


def _pool(dtype=torch.bfloat16, head_dim=8, seed=0) -> KVCacheTensors:
    kv = KVCacheTensors.allocate(LAYERS, PAGES, 4, 2, head_dim, dtype, "cpu")
    gen = torch.Generator().manual_seed(seed)
    for t in (*kv.k, *kv.v):
        t.view(torch.uint8).copy_(torch.randint(0, 256, t.view(torch.uint8).shape, dtype=torch.uint8, generator=gen))
    return kv


def _reference(kv: KVCacheTensors, page: int) -> int:
    """The module docstring's sum, in Python integers over little-endian 32-bit words."""
    num_words = kv.k[0][page].numel() * kv.k[0].element_size() // 4
    gen = torch.Generator().manual_seed(page_digest.WEIGHT_SEED)
    weights = torch.randint(1, 1 << 15, (num_words,), generator=gen, dtype=torch.int64).tolist()
    acc = 0
    for t in (x for pair in zip(kv.k, kv.v) for x in pair):
        words = np.frombuffer(t[page].contiguous().view(torch.uint8).numpy().tobytes(), dtype="<i4").tolist()
        acc = (acc * page_digest.FOLD + sum(w * x for w, x in zip(weights, words)) % (1 << 64)) % page_digest.MODULUS
    return acc


def test_a_digest_is_the_documented_sum_and_does_not_depend_on_the_batch():
    kv = _pool()
    digest = PageDigest(kv)
    pages = [7, 1, 4, 4]
    assert digest.digests(pages) == [_reference(kv, p) for p in pages]
    assert digest.digests(pages) == [digest.digests([p])[0] for p in pages] and digest.digests([]) == []
    other = _pool(seed=1)
    for a, b in zip((*other.k, *other.v), (*kv.k, *kv.v)):
        a[2].copy_(b[7])  # the same bytes in another pool's page 2
    assert PageDigest(other).digests([2]) == digest.digests([7])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn], ids=str)
def test_any_flipped_bit_or_swapped_pair_of_words_changes_the_digest(dtype):
    rng = random.Random(3)
    before = PageDigest(_pool(dtype)).digests([5, 6])
    for _ in range(40):  # one bit of one byte of one layer's K or V
        kv = _pool(dtype)
        tensors = [t for pair in zip(kv.k, kv.v) for t in pair]
        page = tensors[rng.randrange(len(tensors))][5].view(-1).view(torch.uint8)
        page[rng.randrange(page.numel())] ^= 1 << rng.randrange(8)
        assert PageDigest(kv).digests([5, 6]) == [PageDigest(kv).digests([5])[0], before[1]]
        assert PageDigest(kv).digests([5])[0] != before[0]
    kv = _pool(dtype)
    words = kv.v[1][5].view(-1).view(torch.int16)
    first, last = words[0].clone(), words[-1].clone()
    assert first != last
    words[0], words[-1] = last, first
    assert PageDigest(kv).digests([5])[0] != before[0]
    kv = _pool(dtype)
    PageDigest(kv).damage(5)
    assert PageDigest(kv).digests([5, 6]) != before and PageDigest(kv).digests([6]) == before[1:]


@pytest.mark.parametrize("heads,prefill,decode", [(3, 1, 1), (3, 2, 1), (3, 1, 2), (3, 2, 3), (3, 3, 2), (2, 4, 1),
                                                  (2, 1, 4)])
def test_ranks_parts_add_up_to_each_decode_ranks_digest_of_its_shard(heads, prefill, decode):
    """Over tensor-parallel ranks: each prefill rank's `shard_sums` of the heads it sends, added up by
    `PartialSums`, are each decode rank's own digests of its part of the pages (shard-major); a byte
    flipped in any rank's part changes that shard's digest only; a page some rank did not add gives
    no digests at all."""
    from kv_store.transfer.heads import sent_heads
    from kv_store.transfer.page_digest import PartialSums
    from tests.unit.kv_store.test_rank_writes import held_by

    full = KVCacheTensors.allocate(LAYERS, PAGES, 4, heads, 8, torch.bfloat16, "cpu")
    gen = torch.Generator().manual_seed(heads * 10 + prefill * 3 + decode)
    for t in (*full.k, *full.v):
        t.view(torch.int16).copy_(torch.randint(-1 << 15, 1 << 15, t.shape, dtype=torch.int16, generator=gen))

    def part(heads_held: range) -> KVCacheTensors:
        return KVCacheTensors(*([t[:, :, heads_held.start:heads_held.stop].contiguous() for t in ts]
                                for ts in (full.k, full.v)))

    held_p, held_d = held_by(heads, prefill), held_by(heads, decode)
    shards = [(h.start, h.stop) for h in held_d]
    pages, later = [6, 2, 3], [8]
    sums = PartialSums(prefill)
    for rank, mine in enumerate(held_p):  # two writes each: pages [0, 3) and [3, 4) of the request
        digest = PageDigest(part(mine))
        sums.add(0, digest.shard_sums(pages, mine, sent_heads(held_p, rank), shards))
        sums.add(3, digest.shard_sums(later, mine, sent_heads(held_p, rank), shards))
    landed = [part(mine) for mine in held_d]  # each decode rank's landing: its heads of the same pages
    expected = tuple(d for kv in landed for d in PageDigest(kv).digests(pages + later))
    assert sums.digests(4) == expected and len(set(expected)) == 4 * len(set(shards))  # ranks may share heads
    for shard, kv in enumerate(landed):
        kv.v[LAYERS - 1][2].view(-1).view(torch.uint8)[5] ^= 0x10
        got = tuple(d for k in landed for d in PageDigest(k).digests(pages + later))
        changed = [i for i, (a, b) in enumerate(zip(got, expected)) if a != b]
        assert changed == [shard * 4 + 1], "the flipped byte must change its shard's page 2 alone"
        kv.v[LAYERS - 1][2].view(-1).view(torch.uint8)[5] ^= 0x10
    short = PartialSums(prefill)
    short.add(0, PageDigest(part(held_p[0])).shard_sums(pages, held_p[0], sent_heads(held_p, 0), shards))
    first_three = tuple(d for kv in landed for d in PageDigest(kv).digests(pages))
    assert short.digests(3) == (() if prefill > 1 else first_three) and short.digests(4) == ()
