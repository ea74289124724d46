"""`tandem bench decode --speculative eagle` (cluster/bench/spec_decode.py) on the tiny Llama: both
systems generate the same tokens, the speculative one's acceptance is summarised from its counters,
and a mismatch between the systems is caught."""

from __future__ import annotations

import dataclasses

from cluster.bench.spec_decode import counted_since, measure, mode_config, summarize
from common.config import EngineConfig, SamplingParams
from common.protocol import SpecStats
from engine import build_engine
from tests.helpers import make_prompts, tiny_draft_head, tiny_models


def _factory(topk: int = 1, tree_nodes: int = 0):
    ours, _, arch = tiny_models()
    head = tiny_draft_head()
    base = EngineConfig(page_size=4, num_pages=256, host_cache_ratio=0.0, speculative_max_batch=8,
                        speculative_adaptive=False, speculative_topk=topk, speculative_tree_nodes=tree_nodes)

    def make_engine(mode: str, batch: int):
        return build_engine(mode_config(base, mode, batch), ours, arch, draft_head=None if mode == "plain" else head)
    return base, make_engine


def test_plain_and_eagle_agree_and_acceptance_is_summarised_per_batch():
    base, make_engine = _factory()
    prompts, params = make_prompts(5, seed=7), SamplingParams(max_tokens=12)
    runs = [measure(make_engine, prompts, params, batch, mode) for batch in (1, 4) for mode in ("plain", "eagle")]
    summary = summarize(runs, dataclasses.replace(base, speculative="eagle"))
    for batch in (1, 4):
        b = summary["batches"][batch]
        eagle = next(r for r in runs if r.batch == batch and r.mode == "eagle")
        assert b["identical_outputs"] and b["output_tokens"] == 5 * 12
        assert b["verifies"] == eagle.verifies > 0 and 1.0 <= b["mean_accepted_length"] <= 4.0
        assert b["speedup"] == b["eagle_tok_per_s"] / b["plain_tok_per_s"]
        assert set(b["acceptance_rate_per_position"]) == {1, 2, 3}

    broken = [dataclasses.replace(r, tokens=((1,),) + r.tokens[1:]) if r.mode == "eagle" and r.batch == 1 else r
              for r in runs]
    assert not summarize(broken, base)["batches"][1]["identical_outputs"]


def test_the_adaptive_engine_is_timed_beside_and_must_agree():
    base, make_engine = _factory()
    prompts, params = make_prompts(3, seed=7), SamplingParams(max_tokens=12)
    runs = [measure(make_engine, prompts, params, 2, mode) for mode in ("plain", "eagle", "adaptive")]
    b = summarize(runs, base)["batches"][2]
    adaptive = runs[2]
    assert b["identical_outputs"] and b["adaptive_verifies"] == adaptive.verifies > 0  # it explored drafting
    assert b["adaptive_speedup"] == b["adaptive_tok_per_s"] / b["plain_tok_per_s"]
    broken = runs[:2] + [dataclasses.replace(adaptive, tokens=((1,),) + adaptive.tokens[1:])]
    assert not summarize(broken, base)["batches"][2]["identical_outputs"]


def test_a_tree_is_timed_beside_a_chain_of_the_same_depth():
    base, make_engine = _factory(topk=3, tree_nodes=5)
    prompts, params = make_prompts(3, seed=9), SamplingParams(max_tokens=12)
    runs = [measure(make_engine, prompts, params, 1, mode) for mode in ("plain", "eagle", "chain")]
    summary = summarize(runs, base)
    b = summary["batches"][1]
    assert summary["speculative_topk"] == 3 and summary["speculative_tree_nodes"] == 5 and b["identical_outputs"]
    assert b["verifies"] == runs[1].verifies > 0 and b["chain_verifies"] == runs[2].verifies > 0
    assert b["chain_speedup"] == b["chain_tok_per_s"] / b["plain_tok_per_s"]
    assert set(b["acceptance_rate_per_position"]) <= set(b["chain_acceptance_rate_per_position"]) == {1, 2, 3}
    broken = runs[:2] + [dataclasses.replace(runs[2], tokens=((1,),) + runs[2].tokens[1:])]
    assert not summarize(broken, base)["batches"][1]["identical_outputs"]


def test_load_back_mode_compares_second_turns_on_device_and_loaded_back():
    from cluster.bench.spec_decode import measure_load_back

    ours, _, arch = tiny_models()
    head = tiny_draft_head()

    def make_engine(mode: str, batch: int):
        config = EngineConfig(page_size=4, num_pages=128, host_cache_ratio=2.0, speculative="eagle",
                              speculative_adaptive=False)
        return build_engine(config, ours, arch, draft_head=head)
    result = measure_load_back(make_engine, make_prompts(2, min_len=20, max_len=30, seed=3), [5, 6, 7],
                               SamplingParams(max_tokens=10))
    on, off = result["on_device"], result["loaded_back"]
    assert on["host_hit_tokens"] == 0 < off["host_hit_tokens"]
    assert on["verifies"] == off["verifies"] > 0  # the same drafts: the draft KV came back with the pages
    assert result["ratio"] == off["mean_accepted_length"] / on["mean_accepted_length"] == 1.0


def test_a_closed_engine_and_its_kv_pool_are_freed_when_dropped():
    """No part of an engine refers back to it (`build_engine` wires them downward): dropping the last
    reference to a colocated engine (the benches' kind) frees it and its KV pool at once, without the
    collector, so a bench making one engine after another holds one pool at a time. (A P/D worker's
    connector holds the engine's `new_request` among its ports, a cycle the collector frees;
    `collect_engines` stays the benches' safety net.)"""
    import gc
    import weakref

    _, make_engine = _factory()
    engine = make_engine("eagle", 2)
    engine.generate(make_prompts(2, seed=3), SamplingParams(max_tokens=4))
    engine.check_integrity()
    engine.close()
    freed, kv = weakref.ref(engine), weakref.ref(engine.kv_cache.k[0])
    gc.disable()
    try:
        del engine
        assert freed() is None and kv() is None, "an engine part still refers back to it (a cycle)"
    finally:
        gc.enable()


def test_counted_since_reads_as_counters_reset_at_the_first_snapshot():
    """Positions drafted since keep their accepted count, 0 too; one drafted only before is gone."""
    warm = SpecStats(3, ((0, 1), (2, 2)), ((1, 3), (2, 2), (3, 1)), ((1, 2), (2, 2), (3, 0)), 1)
    after = SpecStats(5, ((0, 2), (1, 1), (2, 2)), ((1, 5), (2, 3), (3, 1)), ((1, 3), (2, 2), (3, 0)), 1)
    assert counted_since(warm, after) == SpecStats(2, ((0, 1), (1, 1)), ((1, 2), (2, 1)), ((1, 1), (2, 0)), 0)
    assert counted_since(SpecStats(), SpecStats()) == SpecStats()  # speculation off
