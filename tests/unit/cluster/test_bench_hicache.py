"""`tandem bench hicache` (cluster/bench/hicache.py) on the tiny model: with L2 on, later turns and
resumed requests load their prefix back instead of computing it again; after a restart, an engine with
L3 (a real redis-server) is served the prompts from L3. The greedy outputs are those of the tier off
and of HF transformers' own generate. Timing is measured, never asserted. Each run ends with
`engine.check_integrity()` inside the bench (`warm_engine` in cluster/bench/hicache_engines.py), after
draining the backups."""

from __future__ import annotations

import json

import pytest

from cluster.bench.hicache import (
    MultiTurnSpec,
    RetractSpec,
    bench_hicache,
    compare_multiturn,
    compare_retract,
    retract_prompts,
    user_turns,
)
from cluster.bench.hicache_l3 import L3Spec, compare_l3, l3_phase, l3_prompts
from cluster.cli.main import build_parser
from common.config import EngineConfig
from engine import EngineCore, build_engine
from kv_store.l3.config import L3Config
from tests.helpers import hf_greedy, tiny_models
from tests.redis_server import RedisServer

BASE = EngineConfig(page_size=4, chunk_size=64, debug_kv=True)


def tiny_engine(config: EngineConfig, l3: L3Config | None = None) -> EngineCore:
    ours, _, arch = tiny_models()
    return build_engine(config, ours, arch, l3=l3)


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


def test_restarted_engine_is_served_the_prompts_from_l3(tmp_path):
    spec = L3Spec(prompts=2, prompt_tokens=40)
    server = RedisServer(tmp_path).start()
    try:
        run = compare_l3(tiny_engine, BASE, spec, server.url)
    finally:
        server.stop()
    # 40 tokens fill 10 pages of 4, all written; a match leaves the last token to compute, so 9 come back
    _, reference, arch = tiny_models()
    for p, prompt in zip(run.prompts, l3_prompts(spec, arch.vocab_size), strict=True):
        assert p.cached_tokens_cold == 0 and p.l3_hit_tokens == p.cached_tokens_l3 == 36, p
        assert p.computed_tokens_l3 == 40 - 36, p
        assert p.first_token_l3 == p.first_token_cold == hf_greedy(reference, prompt, 1)[0], p
    assert run.written.put_pages == 2 * 10 and run.read.get_pages == 2 * 9
    assert run.written.errors == run.read.errors == run.read.corrupt == 0
    assert run.read.prefetches == {"completed": spec.prompts}


def test_without_redis_the_l3_phase_is_skipped_or_under_only_l3_an_error(monkeypatch, capsys):
    monkeypatch.setenv("PATH", "")  # no redis-server to start
    args = build_parser().parse_args(["bench", "hicache"])
    spec = L3Spec(prompts=1, prompt_tokens=8)
    assert "skipped" in l3_phase(args, tiny_engine, BASE, spec)
    assert "L3 after restart: skipped, redis-server is not installed" in capsys.readouterr().out
    args.only = "l3"
    with pytest.raises(FileNotFoundError, match="--only l3: redis-server is not installed"):
        l3_phase(args, tiny_engine, BASE, spec)


def test_the_command_prints_all_phases_and_writes_json(tmp_path, capsys):
    path = tmp_path / "hicache.json"
    args = build_parser().parse_args([
        "bench", "hicache", "--page-size", "4", "--chunk-size", "32", "--conversations", "2", "--turns", "3",
        "--turn-input-len", "12", "--turn-output-len", "4", "--l1-conversations", "1", "--requests", "4",
        "--prompt-len", "8", "--output-len", "24", "--l1-fraction", "0.5", "--json", str(path)])
    args.l3_prompts, args.l3_prompt_len = 2, 24  # L3 on a redis-server the bench starts and stops
    assert bench_hicache(args, tiny_engine) == 0
    printed = capsys.readouterr().out
    assert "TTFT ratio off / on (turns >= 2)" in printed and "throughput ratio on / off" in printed
    assert "ratio cold / from L3" in printed and "redis-server started by the bench" in printed
    summary = json.loads(path.read_text())
    mt, rt, l3 = summary["multiturn"], summary["retract"], summary["l3"]
    assert mt["outputs_identical"] and rt["outputs_identical"]
    assert mt["workload"]["final_tokens"] == 3 * (12 + 4)
    assert [len(mt[k]["turns"]) for k in ("l2_on", "l2_off")] == [6, 6]
    assert mt["l2_on"]["l2_hit_tokens_turns2plus"] > 0 and mt["l2_off"]["l2_hit_tokens_turns2plus"] == 0
    assert rt["l2_on"]["output_tokens"] == rt["l2_off"]["output_tokens"] == 4 * 24
    assert mt["ttft_ratio_off_over_on"] > 0 and rt["throughput_ratio_on_over_off"] > 0
    assert [p["prompt_tokens"] for p in l3["prompts"]] == [24, 24] and l3["first_tokens_identical"]
    assert l3["l3_hit_tokens"] > 0 and l3["restarted"]["get_pages"] > 0 and l3["writer"]["put_pages"] > 0
    assert l3["ttft_ratio_cold_over_l3"] > 0 and l3["restarted"]["get_ms_per_page"] > 0
