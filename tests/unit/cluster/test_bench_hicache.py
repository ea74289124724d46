"""`tandem bench hicache` (cluster/bench/hicache.py) on the tiny model: with L2 on, later turns and
resumed requests load their prefix back instead of computing it again, and the greedy outputs are
those of L2 off and of HF transformers' own generate. Timing is measured, never asserted. Each run
ends with `engine.check_integrity()` inside the bench (`_engine`), after draining the backups."""

from __future__ import annotations

import json

from cluster.bench.hicache import (MultiTurnSpec, RetractSpec, bench_hicache, compare_multiturn, compare_retract,
                                   retract_prompts, user_turns)
from cluster.cli.main import build_parser
from cluster.config import EngineConfig
from prefill_worker.engine import EngineCore
from tests.helpers import hf_greedy, tiny_models

BASE = EngineConfig(page_size=4, chunk_size=64, debug_kv=True)


def tiny_engine(config: EngineConfig) -> EngineCore:
    ours, _, arch = tiny_models()
    return EngineCore(config, ours, arch)


def test_multiturn_loads_evicted_histories_back_from_l2():
    spec = MultiTurnSpec(conversations=3, turns=4, user_tokens=20, output_tokens=6, l1_conversations=1.0)
    on, off = compare_multiturn(tiny_engine, BASE, spec)
    assert on.l2_pages > 0 and off.l2_pages == 0 and on.l1_pages == off.l1_pages
    for t in on.turns + off.turns:  # each turn ran alone: the forward count is what the cache did not serve
        assert t.computed_prefill_tokens == t.prompt_tokens - t.cached_tokens, t
    assert all(t.host_hit_tokens == 0 for t in off.turns)
    assert all(t.host_hit_tokens > 0 for t in on.turns if t.turn == spec.turns), "L1 kept a history: not tight"
    for a, b in zip(on.later(), off.later()):
        assert (a.conversation, a.turn) == (b.conversation, b.turn)
        assert a.computed_prefill_tokens <= b.computed_prefill_tokens
    assert on.total("computed_prefill_tokens") < off.total("computed_prefill_tokens")
    assert on.outputs == off.outputs
    _, reference, arch = tiny_models()
    users = user_turns(spec, arch.vocab_size)
    for c, answers in enumerate(on.outputs):
        history: list[int] = []
        for turn, answer in enumerate(answers):
            prompt = history + users[c][turn]
            assert answer == hf_greedy(reference, prompt, spec.output_tokens), (c, turn + 1)
            history = prompt + answer


def test_retracted_requests_resume_from_l2_with_less_recomputation():
    spec = RetractSpec(requests=6, prompt_tokens=12, output_tokens=40, l1_fraction=0.5)
    on, off = compare_retract(tiny_engine, BASE, spec)
    assert on.retractions > 0 and off.retractions > 0, "L1 was not tight enough to retract"
    assert on.output_tokens == off.output_tokens == spec.requests * spec.output_tokens
    assert on.l2_hit_tokens > 0 and off.l2_hit_tokens == 0
    assert 0 <= on.recomputed_tokens < off.recomputed_tokens
    assert on.outputs == off.outputs
    _, reference, arch = tiny_models()
    prompts = retract_prompts(spec, arch.vocab_size)
    assert on.outputs == [hf_greedy(reference, p, spec.output_tokens) for p in prompts]


def test_the_command_prints_both_workloads_and_writes_json(tmp_path, capsys):
    path = tmp_path / "hicache.json"
    args = build_parser().parse_args([
        "bench", "hicache", "--page-size", "4", "--chunk-size", "32", "--conversations", "2", "--turns", "3",
        "--turn-input-len", "12", "--turn-output-len", "4", "--l1-conversations", "1", "--requests", "4",
        "--prompt-len", "8", "--output-len", "24", "--l1-fraction", "0.5", "--json", str(path)])
    assert bench_hicache(args, tiny_engine) == 0
    printed = capsys.readouterr().out
    assert "TTFT ratio off / on (turns >= 2)" in printed and "throughput ratio on / off" in printed
    summary = json.loads(path.read_text())
    mt, rt = summary["multiturn"], summary["retract"]
    assert mt["outputs_identical"] and rt["outputs_identical"]
    assert mt["workload"]["final_tokens"] == 3 * (12 + 4)
    assert [len(mt[k]["turns"]) for k in ("l2_on", "l2_off")] == [6, 6]
    assert mt["l2_on"]["l2_hit_tokens_turns2plus"] > 0 and mt["l2_off"]["l2_hit_tokens_turns2plus"] == 0
    assert rt["l2_on"]["output_tokens"] == rt["l2_off"]["output_tokens"] == 4 * 24
    assert mt["ttft_ratio_off_over_on"] > 0 and rt["throughput_ratio_on_over_off"] > 0
