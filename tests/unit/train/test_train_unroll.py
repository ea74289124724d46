"""The dense training forward (`cluster.train.unroll`) against the head's own inference forward over
paged KV, as the engine runs a speculative round: real-feature rows up to n-1, then one row per later
draft step at n, n+1 whose feature is the previous step's x. Equal rows mean training sees exactly
what inference computes."""

from __future__ import annotations

import pytest
import torch

from cluster.train.unroll import draft_rows, logits, unrolled_forward
from kernels.attention.metadata import build_attn_metadata
from kernels.kv_layout import KVCacheTensors
from tests.unit.train.conftest import random_head, tiny_corpus, tiny_vocab

PAGE_SIZE = 4
PAGES = [5, 2, 9, 7, 3, 11, 6, 8, 10, 4, 1]  # out of order on purpose


def _inference_round(head, input_ids, features, n: int, num_steps: int):
    """Step 0 over rows [0, n) with real features, then rows n, n+1, ... one per later step, each
    reading the previous step's x one position back. Returns (x, logits) per step: step 0's for all
    n rows, each later step's for its single row."""
    arch = head.arch.layer
    kv = KVCacheTensors.allocate(1, 12, PAGE_SIZE, arch.num_kv_heads, arch.head_dim, torch.float32, "cpu")
    meta, positions = build_attn_metadata(PAGE_SIZE, [n], [n], [PAGES], list(range(n)), "cpu")
    x, row_logits = head(input_ids[:n], features[:n], positions, meta, kv)
    out = [(x, row_logits)]
    for step in range(1, num_steps):
        pos = n - 1 + step
        meta, positions = build_attn_metadata(PAGE_SIZE, [1], [pos + 1], [PAGES], [0], "cpu")
        x, row_logits = head(input_ids[pos:pos + 1], x[-1:], positions, meta, kv)
        out.append((x, row_logits))
    return out


@pytest.mark.parametrize("n", [1, 6, 17])
def test_dense_unrolled_steps_equal_the_head_over_paged_kv(n):
    samples, aux = tiny_corpus()
    head = random_head(tiny_vocab(samples))
    # two sequences of different lengths in one padded dense batch
    rows = [draft_rows(torch.tensor(s.token_ids), a) for s, a in zip(samples[:2], aux[:2])]
    length = max(len(ids) for ids, _ in rows)
    assert min(len(ids) for ids, _ in rows) < length, "the test wants padding: pick samples of different lengths"
    ids = torch.stack([torch.nn.functional.pad(i, (0, length - len(i))) for i, _ in rows])
    feats = torch.stack([torch.nn.functional.pad(a, (0, 0, 0, length - len(a))) for _, a in rows])
    with torch.no_grad():
        xs = unrolled_forward(head, ids, feats, 3)
    for b, (row_ids, row_aux) in enumerate(rows):
        rounds = _inference_round(head, row_ids, head.combine(row_aux), n, 3)
        torch.testing.assert_close(xs[0][b, :n], rounds[0][0], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(logits(head, xs[0][b, :n]), rounds[0][1], atol=1e-4, rtol=1e-4)
        for step in (1, 2):
            row = n - 1 + step
            torch.testing.assert_close(xs[step][b, row:row + 1], rounds[step][0], atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(logits(head, xs[step][b, row:row + 1]), rounds[step][1], atol=1e-4, rtol=1e-4)


def test_a_later_step_is_not_the_real_feature_row():
    """Guards the comparison above: the unrolled steps differ from step 0 at the same rows."""
    samples, aux = tiny_corpus()
    head = random_head(tiny_vocab(samples))
    ids, row_aux = draft_rows(torch.tensor(samples[0].token_ids), aux[0])
    with torch.no_grad():
        xs = unrolled_forward(head, ids[None], row_aux[None], 3)
    assert (xs[1][0, 1:] - xs[0][0, 1:]).abs().max() > 1e-2
    assert (xs[2][0, 2:] - xs[1][0, 2:]).abs().max() > 1e-2
