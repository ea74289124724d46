"""`tandem bench serve` end to end on a tiny workload: the offline baseline, then a `tandem serve` it
starts on its own (embedded defaults, local Ray), the HTTP load, the relay histogram, a clean stop.
`tandem bench overload` the same way, at a rate no CPU server sustains."""

from __future__ import annotations

import json

import pytest

from cluster.cli.main import main as tandem_main

pytestmark = pytest.mark.slow


def test_bench_serve_measures_both_systems_and_the_relay(capsys):
    code = tandem_main(["bench", "serve", "--num-requests", "6", "--concurrency", "3", "--input-len", "8", "24",
                        "--output-len", "3", "6", "--seed", "1", "--json"])
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
