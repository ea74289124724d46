"""The FlashInfer backend's planning of sliding-window and soft-capped layers, over a stand-in `flashinfer`.

The stand-in wrappers are `test_backend_choice`'s, with a ``run`` that also honours the two plan
arguments as FlashInfer documents them: ``window_left`` (a query at position p sees ``[p - window_left, p]``;
-1 or absent: no window) and ``logits_soft_cap`` (scores become ``cap * tanh(score / cap)``; absent: none).
Outputs are checked against `test_triton_window`'s dense reference, and the wrappers' plan and run counts
show that each variant a model uses is planned once per step (Gemma alternates windowed and global layers).
"""

from __future__ import annotations

import dataclasses
import sys
import types

import pytest
import torch

from kernels.cuda.flashinfer_backend import FlashInferAttentionBackend
from tests.unit.kernels.test_backend_choice import FakeDecode, FakePrefill, make_step
from tests.unit.kernels.test_triton_window import dense_reference, window_masks

LOCAL, GLOBAL = (5, 2.0), (None, 2.0)  # (window, softcap) of Gemma-2-like local and global layers


class _WindowRun:
    """`_FakeWrapper.run` plus the window and the soft cap of the plan."""

    def run(self, q, paged_kv_cache):
        k_cache, v_cache = paged_kv_cache
        qo_indptr, indptr, indices, last, heads, kv_heads, head_dim, page_size = self.plan_args
        window_left, cap = self.kwargs.get("window_left", -1), self.kwargs.get("logits_soft_cap")
        out = torch.full_like(q, float("nan"))
        for b in range(len(last)):
            pages = indices[int(indptr[b]):int(indptr[b + 1])].long()
            kv_len = (len(pages) - 1) * page_size + int(last[b]) if len(pages) else 0
            k, v = (c[pages].reshape(-1, kv_heads, head_dim)[:kv_len].double().repeat_interleave(heads // kv_heads, 1)
                    for c in (k_cache, v_cache))
            rows = slice(int(qo_indptr[b]), int(qo_indptr[b + 1]))
            scores = torch.einsum("qhd,khd->hqk", q[rows].double(), k) * self.kwargs["sm_scale"]
            if cap is not None:
                scores = cap * torch.tanh(scores / cap)
            row_pos = torch.arange(kv_len - scores.shape[1], kv_len)[:, None]
            col = torch.arange(kv_len)[None, :]
            visible = (col <= row_pos) & ((col >= row_pos - window_left) if window_left >= 0 else True)
            out[rows] = torch.einsum("hqk,khd->qhd", scores.masked_fill(~visible, float("-inf")).softmax(-1),
                                     v).to(q.dtype)
        self.runs += 1
        return out


@pytest.fixture
def fake_flashinfer(monkeypatch):
    """A `flashinfer` module of window-aware stand-in wrappers; its `.log` lists every wrapper built."""
    module = types.ModuleType("flashinfer")
    module.log = []
    module.BatchDecodeWithPagedKVCacheWrapper = type("Decode", (_WindowRun, FakeDecode), {"log": module.log})
    module.BatchPrefillWithPagedKVCacheWrapper = type("Prefill", (_WindowRun, FakePrefill), {"log": module.log})
    monkeypatch.setitem(sys.modules, "flashinfer", module)
    return module


def run_model(backend, step, rules, meta=None):
    """A model step: layer l writes the new K/V, then attends with ``rules[l] = (window, softcap)``;
    each output is checked against the dense reference. ``meta`` replaces the step's (a graph's)."""
    step_meta, k_cache, v_cache, q, k, v = step
    meta = meta or step_meta
    scale = q.shape[-1] ** -0.5
    for window, softcap in rules:
        backend.write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
        out = backend.attention(q, k_cache, v_cache, meta, scale, window=window, softcap=softcap)
        expected = dense_reference(step_meta, k_cache, v_cache, q, window_masks(step_meta, window), scale, softcap)
        torch.testing.assert_close(out, expected.to(out.dtype), atol=1e-2, rtol=1.6e-2)


def by_kwargs(log) -> dict[tuple, object]:
    """The wrappers of `log` keyed by (class name, window_left, logits_soft_cap, graph)."""
    return {(type(w).__name__, w.kwargs.get("window_left"), w.kwargs.get("logits_soft_cap"), w.use_cuda_graph): w
            for w in log}


@pytest.mark.parametrize("page_size", [1, 16])
def test_decode_plans_each_variant_once_a_step(fake_flashinfer, page_size):
    backend = FlashInferAttentionBackend(workspace_bytes=64)
    assert backend.supports_window and backend.supports_softcap
    for seed in (1, 2):
        step = make_step([1, 1, 1], [0, 6, 40], page_size, 6, 2, torch.bfloat16, seed)
        run_model(backend, step, [LOCAL, GLOBAL, LOCAL, GLOBAL, LOCAL])
    wrappers = by_kwargs(fake_flashinfer.log)
    assert set(wrappers) == {("Decode", 4, 2.0, False), ("Decode", None, 2.0, False)}
    assert (wrappers["Decode", 4, 2.0, False].plans, wrappers["Decode", 4, 2.0, False].runs) == (2, 6)
    assert (wrappers["Decode", None, 2.0, False].plans, wrappers["Decode", None, 2.0, False].runs) == (2, 4)


@pytest.mark.parametrize("page_size", [1, 16])
def test_prefill_extend_and_mixed_steps(fake_flashinfer, page_size):
    backend = FlashInferAttentionBackend(workspace_bytes=64)
    # a fresh prompt longer than the window, an extend over a prefix, a decode row, an idle sequence
    run_model(backend, make_step([20, 7, 1, 0], [0, 21, 9, 4], page_size, 4, 2, torch.float16, 3),
              [LOCAL, GLOBAL, (1, None), LOCAL])
    wrappers = by_kwargs(fake_flashinfer.log)
    assert set(wrappers) == {("Prefill", 4, 2.0, False), ("Prefill", None, 2.0, False), ("Prefill", 0, None, False)}
    assert [(w.plans, w.runs) for w in fake_flashinfer.log] == [(1, 2), (1, 1), (1, 1)]
    assert all(w.kwargs["causal"] for w in fake_flashinfer.log)


def test_graph_decode_plans_every_variant_the_eager_step_used(fake_flashinfer):
    """Warm-up teaches the variants; each prepare plans one graph wrapper per variant, and the
    captured/replayed layers run those, never an eager plan."""
    dtype, page_size, width, rules = torch.bfloat16, 4, 6, [LOCAL, GLOBAL, LOCAL]
    backend = FlashInferAttentionBackend(workspace_bytes=64)
    meta, k_cache, v_cache, q, k, v = make_step([1, 1, 1], [3, 9, 0], page_size, 4, 2, dtype, seed=5)
    run_model(backend, (meta, k_cache.clone(), v_cache.clone(), q, k, v), rules)  # the warm-up step
    eager = list(fake_flashinfer.log)
    table = torch.zeros(3, width, dtype=torch.int64)
    static = dataclasses.replace(meta, page_table=table, seq_lens_cpu=(width * page_size,) * 3)
    backend.prepare_graph_decode(static)  # the capture's plan, capacity lengths
    graph = by_kwargs(fake_flashinfer.log[len(eager):])
    assert set(graph) == {("Decode", 4, 2.0, True), ("Decode", None, 2.0, True)}

    for seed in (6, 7):  # replays: the same static tensors refilled, real lengths
        step = make_step([1, 1, 1], [3 + seed, 9, 2 * seed], page_size, 4, 2, dtype, seed)
        table.zero_()
        table[:, :step[0].page_table.shape[1]] = step[0].page_table
        for name in ("seq_lens", "slot_mapping"):
            getattr(static, name).copy_(getattr(step[0], name))
        replay = dataclasses.replace(static, seq_lens_cpu=step[0].seq_lens_cpu)
        backend.prepare_graph_decode(replay)
        run_model(backend, step, rules, meta=replay)
    assert [(w.plans, w.runs) for w in graph.values()] == [(3, 4), (3, 2)]
    assert [w.plans for w in eager] == [1, 1], "graph steps plan no eager wrapper"


def test_a_variant_first_seen_after_prepare_is_planned_eagerly_then_in_every_graph_plan(fake_flashinfer):
    backend = FlashInferAttentionBackend(workspace_bytes=64)
    step = make_step([1, 1], [3, 9], 4, 4, 2, torch.float16, seed=8)
    run_model(backend, step, [GLOBAL])
    backend.prepare_graph_decode(step[0])
    run_model(backend, step, [GLOBAL, LOCAL])  # not capturing: LOCAL falls back to an eager plan
    assert [(type(w).__name__, w.use_cuda_graph, w.plans, w.runs) for w in fake_flashinfer.log] == [
        ("Decode", False, 1, 1), ("Decode", True, 1, 1), ("Decode", False, 1, 1)]
    backend.prepare_graph_decode(step[0])
    assert set(by_kwargs(fake_flashinfer.log)) >= {("Decode", 4, 2.0, True), ("Decode", None, 2.0, True)}


def test_window_left_counts_positions_left_of_the_query(fake_flashinfer):
    backend = FlashInferAttentionBackend(workspace_bytes=64)
    run_model(backend, make_step([1, 1], [3, 9], 4, 4, 4, torch.float16, seed=9), [(1, None), (100, None)])
    assert [w.kwargs.get("window_left") for w in fake_flashinfer.log] == [0, 99]
    assert all("logits_soft_cap" not in w.kwargs for w in fake_flashinfer.log)
    meta, k_cache, v_cache, q, *_ = make_step([1], [3], 4, 4, 4, torch.float16, seed=10)
    with pytest.raises(AssertionError, match="window=0 must be >= 1"):
        backend.attention(q, k_cache, v_cache, meta, 0.25, window=0)
    with pytest.raises(AssertionError, match="softcap=-1.0 must be > 0"):
        backend.attention(q, k_cache, v_cache, meta, 0.25, softcap=-1.0)
