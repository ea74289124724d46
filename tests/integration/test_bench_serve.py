"""`tandem bench serve` end to end on tiny workloads: the offline baseline, the HTTP load and the relay
histogram (random dataset), TTFT per turn and the cached history (multi-turn dataset), and `tandem
bench overload` at a rate no CPU server sustains, all against one `tandem serve` the module starts
(embedded defaults but for small pools and the overload's admission, local Ray; a start costs ~25 s
of a 2-core CPU) and stops cleanly at the end."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from cluster.bench.serve import LAPTOP_SETS, SpawnedServer, wait_ready
from cluster.cli.main import main as tandem_main

pytestmark = pytest.mark.slow


OVERLOAD_SETS = ["router.max_queue_delay_s=2",  # a 30 s budget would queue all 100 arrivals
                 # the prefill worker's lane predicts each prompt's first token (short prompts
                 # prefilled on the decode worker meet only its slot limit: 64 here)
                 "router.local_prefill_max_tokens=0"]


def warm_up(url: str, timeout_s: float = 120.0) -> None:
    """Two prompts prefilled before anything is measured: right after ready, a cold first prefill (in a
    fresh clone, beside the first compile) can make the 2 s admission budget refuse what the runs below
    send, which is not what they test."""
    deadline, done = time.monotonic() + timeout_s, 0
    while done < 2:
        resp = httpx.post(f"{url}/v1/completions", timeout=timeout_s,
                          json={"model": "smollm2", "prompt": f"Warm up {done}.", "max_tokens": 2})
        if resp.status_code == 200:
            done += 1
        else:
            assert resp.status_code == 429 and time.monotonic() < deadline, resp.text
            time.sleep(1.0)


@pytest.fixture(scope="module")
def server_url():
    """A `tandem serve` with laptop pools, whose admission refuses what would wait over 2 s (the
    bench serve runs below stay far from that)."""
    server = SpawnedServer([f for s in (*LAPTOP_SETS, *OVERLOAD_SETS) for f in ("--set", s)])
    try:
        wait_ready(server, {}, timeout_s=300)
        warm_up(server.url)
        yield server.url
    finally:
        assert server.stop() == 0, "the shared tandem serve did not stop cleanly"


def test_bench_serve_measures_the_server_the_offline_baseline_and_the_relay(capsys, server_url):
    code = tandem_main(["bench", "serve", "--base-url", server_url, "--num-prompts", "6", "--max-concurrency", "3",
                        "--random-input-len", "16", "--random-output-len", "4", "--random-range-ratio", "0.5",
                        "--seed", "1", "--offline-baseline", "--disable-tqdm", "--json"])
    captured = capsys.readouterr()
    out = captured.out
    assert code == 0, out
    result = json.loads(out.strip().splitlines()[-1])
    # the harness prints why requests failed on stderr
    assert result["completed"] == 6 and result["failed"] == 0, captured.err[-3000:]
    assert result["max_concurrency"] == 3
    offline = result["offline_baseline"]
    assert 6 * 2 <= result["total_output_tokens"] <= 6 * 6
    assert result["total_output_tokens"] == offline["output_tokens"], "both ran the same exact-length requests"
    assert result["output_throughput_ratio_served_over_offline"] == pytest.approx(
        result["output_throughput"] / offline["output_throughput"])
    relay = result["relay"]
    assert relay["num_tokens"] == result["total_output_tokens"], "the /metrics diff covers the measured requests only"
    assert 0 < relay["num_messages"] <= relay["num_tokens"]
    assert 0 < relay["num_decode_polls"] <= relay["num_messages"]  # one call carries one or more messages
    assert relay["p50_s"] is not None and 0 <= relay["p50_s"] <= relay["p99_s"]
    assert 0 < result["median_ttft_ms"] <= result["median_e2el_ms"]
    assert "Serving Benchmark Result" in out and "bucket resolution" in out
    # the server's timelines of the same requests (joined by response id): where the first tokens went
    split = result["ttft_phases"]
    assert split["requests"] == 6 and {"queued", "reserving", "prefilling"} <= set(split["phases"])
    server_ttft = split["server_ttft"]["mean_ms"]
    assert 0 < server_ttft <= result["mean_ttft_ms"]  # the client's also counts HTTP and the gateway
    assert sum(ph["mean_ms"] for ph in split["phases"].values()) == pytest.approx(server_ttft, rel=0.02, abs=1.0)
    assert {"prefill", "transfer"} <= set(split["worker_spans"]) and "TTFT split (server timelines)" in out


def test_bench_serve_multi_turn_reports_ttft_per_turn_and_the_cached_history(capsys, server_url):
    """2 conversations x 3 turns, each turn resending the history: one row per turn index; a turn's
    input is the previous one plus its answer plus at least the new user tokens; the prefix cache
    serves part of every later turn's history and none of the first turn's. One request at a time: this
    module's server refuses what it predicts would wait over 2 s (for the overload test), and a cold
    machine's first TTFTs can cut its decode worker's admission limit to one."""
    code = tandem_main(["bench", "serve", "--base-url", server_url, "--dataset-name", "multi-turn", "--num-prompts",
                        "2", "--multi-turn-turns", "3", "--max-concurrency", "1", "--random-input-len", "24",
                        "--random-output-len", "4", "--random-range-ratio", "0.2", "--seed", "1", "--disable-tqdm",
                        "--json"])
    out = capsys.readouterr().out
    assert code == 0, out
    result = json.loads(out.strip().splitlines()[-1])
    turns = result["turns"]
    assert [(t["turn"], t["completed"]) for t in turns] == [(1, 2), (2, 2), (3, 2)]
    assert turns[0]["mean_cached_tokens"] == 0, "random first turns share no prefix"
    for before, t in zip(turns, turns[1:]):
        assert t["mean_input_tokens"] >= before["mean_input_tokens"] + 19 + 1  # new user tokens + an answer
        assert 0 < t["mean_cached_tokens"] < t["mean_input_tokens"], "the prefix cache did not serve the history"
    assert result["completed"] == 6 and 6 * 3 <= result["total_output_tokens"] <= 6 * 5
    assert "turn  2:" in out
    by_turn = result["ttft_phases"]["by_turn"]  # the server's view of each turn's first token
    assert sorted(by_turn) == ["1", "2", "3"] and all(row["requests"] == 2 for row in by_turn.values())
    assert all(row["mean_ms"] for row in by_turn.values()) and "turn 3 (2 requests), mean ms:" in out


def test_bench_overload_gets_fast_429s_and_no_other_failure(capsys, server_url):
    """`tandem bench overload` on a tiny workload, its capacity given (no measuring run): arrivals at
    4 x 5 requests/s of 96-160-token prompts (~2,500 prompt tokens/s, ~3x what a CPU prefills) for 5 s
    are far beyond a CPU server, so some are refused; every refusal is a 429 with Retry-After that
    comes at once, and nothing else fails. (Prompts of 8-24 tokens were not an overload in a fast
    hour; 200-400-token ones for 3 s left no first token inside the served-tokens window in a slow one.)"""
    code = tandem_main(["bench", "overload", "--url", server_url, "--unloaded-requests", "2", "--capacity-rps", "5",
                        "--duration-s", "5", "--input-len", "96", "160", "--output-len", "3", "6", "--seed", "1",
                        "--json", *(f for s in OVERLOAD_SETS for f in ("--set", s))])  # what that server runs
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
    assert 0.0 <= over["kept_promise"] <= 1.0 and summary["workload"]["ttft_budget_s"] == 2.0
    assert over["output_tok_s"] > 0 and summary["peak_output_tok_s"] is None  # capacity given: no peak measured
    assert summary["admission_after"]["prefill-0"]["tokens_per_s"] > 0  # the router measured the prefill worker
    assert summary["admission_after"]["decode-0"]["limit"] >= 1
    assert summary["server_exit_code"] == 0 and "first token within the 2s budget + 2s, or 429 within 2s" in out
