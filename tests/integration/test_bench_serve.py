"""`tandem bench serve` end to end on tiny workloads: the offline baseline, the HTTP load and the relay
histogram (random dataset), TTFT per turn and the cached history (multi-turn dataset), both against one
`tandem serve` the module starts (embedded defaults, local Ray; a start costs half a minute on a laptop
CPU) and stops cleanly at the end. `tandem bench overload` starts and stops its own server (a SIGTERM,
a clean exit), at a rate no CPU server sustains."""

from __future__ import annotations

import json

import pytest

from cluster.bench.serve import LAPTOP_SETS, QUEUE_ALL_SETS, SpawnedServer, wait_ready
from cluster.cli.main import main as tandem_main

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server_url():
    """A `tandem serve` as `tandem bench serve` starts it (laptop pools, admission that queues all)."""
    server = SpawnedServer([f for s in (*LAPTOP_SETS, *QUEUE_ALL_SETS) for f in ("--set", s)])
    try:
        wait_ready(server, {}, timeout_s=300)
        yield server.url
    finally:
        assert server.stop() == 0, "the shared tandem serve did not stop cleanly"


def test_bench_serve_measures_both_systems_and_the_relay(capsys, server_url):
    code = tandem_main(["bench", "serve", "--url", server_url, "--num-requests", "6", "--concurrency", "3",
                        "--input-len", "8", "24", "--output-len", "3", "6", "--seed", "1", "--json"])
    out = capsys.readouterr().out
    assert code == 0, out
    summary = json.loads(out.strip().splitlines()[-1])
    by_system = {r["system"]: r for r in summary["results"]}
    served, offline = by_system["served"], by_system["offline"]
    assert served["output_tokens_per_s"] > 0 and offline["output_tokens_per_s"] > 0
    assert summary["ratio_served_over_offline"] == pytest.approx(
        served["output_tokens_per_s"] / offline["output_tokens_per_s"])
    requested = summary["workload"]["output_tokens"]
    assert 6 * 3 <= requested <= 6 * 6
    assert served["output_tokens"] == offline["output_tokens"] == requested
    relay = summary["relay"]
    assert relay["num_tokens"] == requested, "the diff of /metrics should cover exactly the measured requests"
    assert 0 < relay["num_messages"] <= relay["num_tokens"]
    assert 0 < relay["num_decode_polls"] <= relay["num_messages"]  # one call carries one or more messages
    assert relay["p50_s"] is not None and 0 <= relay["p50_s"] <= relay["p99_s"]
    latency = summary["latency_s"]
    assert 0 < latency["ttft_p50"] <= latency["e2e_p50"]
    assert summary["server_exit_code"] == 0
    assert "ratio served / offline" in out and "bucket resolution" in out


def test_bench_serve_multiturn_reports_ttft_per_turn_and_the_cached_history(capsys, server_url):
    """2 conversations x 3 turns, each turn resending the history: one row per turn index; a turn's
    history is the previous one plus its answer plus at least `--turn-input-len` MIN new tokens; the
    prefix cache serves part of every later turn's history and none of the first turn's."""
    code = tandem_main(["bench", "serve", "--url", server_url, "--dataset", "multiturn", "--conversations", "2",
                        "--turns", "3", "--concurrency", "2", "--turn-input-len", "20", "28", "--turn-output-len",
                        "3", "5", "--think-time-s", "0", "0.05", "--seed", "1", "--json"])
    out = capsys.readouterr().out
    assert code == 0, out
    summary = json.loads(out.strip().splitlines()[-1])
    turns = summary["turns"]
    assert [(t["turn"], t["requests"]) for t in turns] == [(1, 2), (2, 2), (3, 2)]
    for t in turns:
        assert t["prompt_tokens_mean"] == t["history_tokens_mean"], "the server counted another prompt than sent"
        assert 0 < t["ttft_p50_s"] <= t["ttft_p99_s"] and t["ttft_mean_s"] > 0
    assert turns[0]["cached_tokens_mean"] == 0, "random first turns share no prefix"
    for before, t in zip(turns, turns[1:]):
        assert before["answer_tokens_mean"] > 0, "the streamed answer did not make it into the history"
        assert t["history_tokens_mean"] >= before["history_tokens_mean"] + before["answer_tokens_mean"] + 20
        assert 0 < t["cached_tokens_mean"] < t["history_tokens_mean"], "the prefix cache did not serve the history"
    served = summary["results"][0]
    assert 6 * 3 <= served["output_tokens"] <= 6 * 5 and served["output_tokens_per_s"] > 0
    assert summary["ttft_mean_turns2plus_over_turn1"] > 0
    assert "mean TTFT turns>=2 / turn 1" in out and "offline baseline: skipped" in out


def test_bench_overload_gets_fast_429s_and_no_other_failure(capsys):
    """`tandem bench overload` on a tiny workload, its capacity given (no measuring run): arrivals at
    4 x 5 requests/s are far beyond a CPU server, so some are refused; every refusal is a 429 with
    Retry-After that comes at once, and nothing else fails."""
    code = tandem_main(["bench", "overload", "--unloaded-requests", "2", "--capacity-rps", "5", "--duration-s", "3",
                        "--input-len", "8", "24", "--output-len", "3", "6", "--seed", "1", "--json"])
    out = capsys.readouterr().out
    assert code == 0, out
    summary = json.loads(out.strip().splitlines()[-1])
    over = summary["overload"]
    assert summary["capacity_rps"] == 5.0 and not summary["capacity_measured"] and over["arrival_rps"] == 20.0
    assert over["num_failed"] == 0, over["failures"]
    assert over["num_admitted"] >= 1 and over["num_refused_429"] >= 1, over
    assert over["num_admitted"] + over["num_refused_429"] == over["num_requests"]
    assert over["refusal_p99_s"] < 2.0 and over["retry_after_s"] and min(over["retry_after_s"]) >= 1
    assert 0 < summary["unloaded"]["ttft_p50_s"] and 0 < over["ttft_p50_s"]
    assert 0.0 <= over["answered_or_refused_in_time"] <= 1.0
    assert summary["admission_after"]["prefill-0"]["tokens_per_s"] > 0  # the router measured the prefill worker
    assert summary["admission_after"]["decode-0"]["limit"] >= 1
    assert summary["server_exit_code"] == 0 and "first token or 429 within 2s" in out
