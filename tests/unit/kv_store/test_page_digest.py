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
