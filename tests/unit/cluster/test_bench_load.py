"""`tandem bench serve`, the load harness (cluster/bench/load), against an in-process stub OpenAI server.

The stub (starlette on 127.0.0.1, a uvicorn thread) streams `max_tokens` content frames at once and a
usage frame, and records every request it gets with its arrival time, so tests can check what the
harness sent against what it reports: vLLM's result keys, statistics recomputed with numpy from the
raw samples, arrival rates, goodput, and exact once-only delivery across Ray actor clients."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from cluster.bench.load.arrivals import arrival_offsets_s
from cluster.bench.load.client import ClientRun, LoadShape, RequestOutput, Target, run_client
from cluster.bench.load.datasets import Conversation, DatasetSpec, SampleRequest, make_jobs
from cluster.bench.load.metrics import compute_result, is_good, parse_goodput, tpot_s
from cluster.bench.load.multinode import client_node_ids, merge_runs, split_plans
from cluster.cli.main import main as tandem_main

REPO = Path(__file__).resolve().parents[3]
VLLM_KEYS = {"duration", "completed", "failed", "total_input_tokens", "total_output_tokens", "request_throughput",
             "request_goodput", "output_throughput", "total_token_throughput", "max_output_tokens_per_s",
             "max_concurrent_requests", "input_lens", "output_lens", "ttfts", "itls", "latencies", "start_times",
             "errors", "date", "backend", "model_id", "num_prompts", "request_rate", "burstiness", "max_concurrency",
             *(f"{stat}_{m}_ms" for stat in ("mean", "median", "std", "p50", "p90", "p99")
               for m in ("ttft", "tpot", "itl", "e2el"))}


# ---- the stub server -----------------------------------------------------------------------------
class StubServer:
    """An OpenAI-style streaming server answering at once; `requests`: (perf_counter at arrival, body)."""

    def __init__(self):
        import uvicorn
        from starlette.applications import Starlette
        from starlette.responses import JSONResponse, StreamingResponse
        from starlette.routing import Route

        self.requests: list[tuple[float, dict]] = []
        self.fail: dict[int, str] = {}  # request number (arrival order) -> "status" | "frame"

        async def models(request):
            return JSONResponse({"object": "list", "data": [{"id": "stub-model", "object": "model"}]})

        async def generate(request):
            body = await request.json()
            self.requests.append((time.perf_counter(), body))
            failure = self.fail.get(len(self.requests) - 1)
            if failure == "status":
                return JSONResponse({"error": {"message": "overloaded"}}, status_code=429)
            if failure == "frame":
                return StreamingResponse(iter([f"data: {json.dumps({'error': {'message': 'overloaded'}})}\n\n"]),
                                         media_type="text/event-stream")
            chat = "messages" in body
            prompt_len = (sum(len(m["content"].split()) for m in body["messages"]) if chat else
                          len(body["prompt"]) if isinstance(body["prompt"], list) else len(body["prompt"].split()))
            return StreamingResponse(self._frames(body["max_tokens"], prompt_len, chat), media_type="text/event-stream")

        app = Starlette(routes=[Route("/v1/models", models), Route("/v1/completions", generate, methods=["POST"]),
                                Route("/v1/chat/completions", generate, methods=["POST"])])
        # proto given: asyncio sets TCP_NODELAY on accepted sockets only when it says TCP (else
        # Nagle + delayed ACK hold every keep-alive response ~40 ms)
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline, "the stub server did not start"
            time.sleep(0.02)

    @staticmethod
    async def _frames(num_tokens: int, prompt_len: int, chat: bool):
        for i in range(num_tokens):
            choice = {"index": 0, "delta": {"content": f" t{i}"}} if chat else {"index": 0, "text": f" t{i}"}
            yield f"data: {json.dumps({'choices': [choice]})}\n\n"
        usage = {"prompt_tokens": prompt_len, "completion_tokens": num_tokens}
        yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
        yield "data: [DONE]\n\n"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)


@pytest.fixture
def stub():
    server = StubServer()
    yield server
    server.stop()


class WordCodec:
    """Token id i <-> the word "w<i>"; a streamed " t<k>" re-encodes to 1000 + k."""

    def decode(self, token_ids):
        return " ".join(f"w{i}" for i in token_ids)

    def encode(self, text):
        return [1000 + int(w[1:]) if w.startswith("t") else int(w[1:]) for w in text.split()]


def run(target, jobs, shape, codec=None):
    import asyncio

    return asyncio.run(run_client(target, jobs, shape, codec))


# ---- tests ---------------------------------------------------------------------------------------
def test_result_has_vllm_keys_and_statistics_equal_numpy_on_the_raw_samples(stub, capsys, tmp_path):
    out_file = tmp_path / "result.json"
    code = tandem_main(["bench", "serve", "--base-url", stub.url, "--num-prompts", "60", "--random-input-len", "16",
                        "--random-output-len", "8", "--random-range-ratio", "0.5", "--random-vocab-size", "500",
                        "--max-concurrency", "8", "--goodput", "ttft:1000", "e2el:5000", "--disable-tqdm",
                        "--save-result", "--result-filename", str(out_file)])
    printed = capsys.readouterr().out
    assert code == 0, printed
    result = json.loads(out_file.read_text())
    assert VLLM_KEYS <= result.keys(), VLLM_KEYS - result.keys()
    assert "Serving Benchmark Result" in printed and "P99 TTFT (ms):" in printed
    warmup, *measured = [body for _, body in stub.requests]
    assert warmup["max_tokens"] == 4 and len(measured) == 60, "one untimed warm-up request, then the run"
    assert warmup["prompt"] == [10] * 16, "the warm-up shares no prefix with the run's prompts"
    assert result["completed"] == 60 and result["failed"] == 0
    assert result["model_id"] == "stub-model" and all(b["model"] == "stub-model" for b in measured)
    sent = sorted((len(b["prompt"]), b["max_tokens"]) for b in measured)
    assert sorted(zip(result["input_lens"], result["output_lens"])) == sent, "lengths are the usage's, per request"
    assert all(8 <= n <= 24 and 4 <= m <= 12 for n, m in sent)  # range ratio 0.5 around 16 and 8
    assert result["total_output_tokens"] == sum(result["output_lens"])
    ttfts, lats, outs = map(np.asarray, (result["ttfts"], result["latencies"], result["output_lens"]))
    raw_ms = {"ttft": ttfts * 1e3, "e2el": lats * 1e3,
              "itl": np.concatenate([np.asarray(g) for g in result["itls"]]) * 1e3,
              "tpot": ((lats - ttfts) / (outs - 1))[outs > 1] * 1e3}
    for name, values in raw_ms.items():
        assert result[f"mean_{name}_ms"] == pytest.approx(np.mean(values), rel=1e-9)
        assert result[f"median_{name}_ms"] == pytest.approx(np.median(values), rel=1e-9)
        assert result[f"std_{name}_ms"] == pytest.approx(np.std(values), rel=1e-9, abs=1e-12)
        for p in (50, 90, 99):
            assert result[f"p{p}_{name}_ms"] == pytest.approx(np.percentile(values, p), rel=1e-9)
    assert all(len(g) == n - 1 for g, n in zip(result["itls"], outs)), "one gap between each two content frames"
    assert result["request_throughput"] == pytest.approx(60 / result["duration"])
    assert 1 <= result["max_concurrent_requests"] <= 8


def test_a_sweep_writes_one_table_and_the_plots_of_each_run_and_of_the_sweep(stub, capsys, tmp_path):
    import matplotlib.image

    code = tandem_main(["bench", "serve", "--base-url", stub.url, "--num-prompts", "12", "--random-input-len", "8",
                        "--random-output-len", "6", "--random-vocab-size", "500", "--sweep", "max-concurrency=1,4",
                        "--disable-tqdm", "--save-result", "--result-filename", str(tmp_path / "sweep.json"),
                        "--plot-dir", str(tmp_path / "plots")])
    printed = capsys.readouterr().out
    assert code == 0, printed
    runs = json.loads((tmp_path / "sweep.json").read_text())["runs"]
    assert [r["completed"] for r in runs] == [12, 12] and [r["max_concurrent_requests"] for r in runs][0] == 1
    table = printed[printed.index("max_concurrency"):].splitlines()
    assert len(table) >= 3 and table[1].split()[:2] == ["1", "12"] and table[2].split()[:2] == ["4", "12"]
    written = sorted(p.name for p in (tmp_path / "plots").iterdir())
    per_run = [f"sweep-max-concurrency{v}-{kind}.png" for v in (1, 4) for kind in ("latency-cdf", "over-time")]
    assert written == sorted(per_run + ["sweep-sweep.png"])
    sizes = {"latency-cdf": (770, 1100), "over-time": (660, 1100), "sweep": (495, 1210)}  # inches x dpi 110
    for name in written:
        pixels = matplotlib.image.imread(tmp_path / "plots" / name)
        assert pixels.shape[:2] == next(v for k, v in sizes.items() if name.endswith(f"{k}.png")), name
        assert (pixels[..., :3] < 0.5).mean() > 0.005, f"{name} is blank"  # axes, lines and labels drew


def test_poisson_and_gamma_gaps_have_the_asked_mean_rate_and_spread():
    rng = np.random.default_rng(7)
    n, rate = 20000, 50.0
    gaps = np.diff(arrival_offsets_s(n, rate, 1.0, rng, normalize=False), prepend=0.0)
    assert abs(gaps.mean() - 1 / rate) < 4 * (1 / rate) / np.sqrt(n)  # exponential: sd = mean
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, abs=0.04)  # Poisson: CV 1
    even = np.diff(arrival_offsets_s(n, rate, 4.0, rng, normalize=False), prepend=0.0)
    assert even.mean() == pytest.approx(1 / rate, rel=0.02) and even.std() / even.mean() == pytest.approx(0.5, abs=0.03)
    assert arrival_offsets_s(100, rate, 1.0, rng)[-1] == pytest.approx(100 / rate)  # normalized: vLLM's rule
    assert not arrival_offsets_s(5, float("inf"), 1.0, rng).any()


def test_requests_reach_the_server_at_the_asked_poisson_rate(stub):
    """At 100 requests/s the stub sees 150 arrivals over 1.5 s, gaps shaped like an exponential's."""
    jobs = make_jobs(DatasetSpec("random", 150, 4, 2, vocab_size=300), seed=3)
    run_ = run(Target(stub.url), jobs, LoadShape(request_rate=100.0, seed=3))
    arrivals = np.array(sorted(t for t, _ in stub.requests))
    assert len(arrivals) == 150 and all(o.success for o in run_.outputs)
    observed_rate = (len(arrivals) - 1) / (arrivals[-1] - arrivals[0])
    assert observed_rate == pytest.approx(100.0, rel=0.2)
    gaps = np.diff(arrivals)
    # exponential gaps: P(gap < mean) = 1 - 1/e = 0.63 (even arrivals ~0.5); robust to a stalled scheduler
    assert np.mean(gaps < gaps.mean()) == pytest.approx(1 - np.exp(-1), abs=0.15)


def test_goodput_counts_exactly_the_requests_meeting_every_slo():
    def sample(i, ttft_s, latency_s, tokens, ok=True):
        return RequestOutput(i, 0, ok, 10, tokens, ttft_s, (), latency_s, 0.0, 0.0)

    outputs = [sample(0, 0.100, 0.500, 9),  # tpot 50 ms: meets all (the boundary is inside)
               sample(1, 0.101, 0.300, 5),  # ttft over
               sample(2, 0.050, 0.700, 11),  # tpot 65 ms over
               sample(3, 0.020, 1.001, 101),  # e2el over (tpot 9.8 ms meets)
               sample(4, 0.090, 0.090, 1),  # one token: tpot counts as 0
               sample(5, 0.010, 0.020, 3, ok=False),  # failed: never good
               sample(6, 0.030, 0.430, 9)]  # tpot exactly 50 ms: meets
    slos = parse_goodput(["ttft:100", "tpot:50", "e2el:1000"])
    assert [is_good(o, slos) for o in outputs] == [True, False, False, False, True, False, True]
    result = compute_result(outputs, duration_s=2.0, slos_ms=slos)
    assert result["request_goodput"] == 3 / 2.0 and result["completed"] == 6 and result["failed"] == 1
    assert tpot_s(outputs[4]) is None and compute_result(outputs, 2.0)["request_goodput"] is None
    with pytest.raises(ValueError, match="NAME:MS"):
        parse_goodput(["latency:5"])


@pytest.mark.parametrize("http_library", ["aiohttp", "httpx"])
def test_multi_turn_resends_the_history_with_the_streamed_answer_on_the_chat_endpoint(stub, http_library):
    conv = Conversation(0, ((11, 12), (13,), (14, 15)), (2, 3, 1), 0.0)
    target = Target(stub.url, "/v1/chat/completions", http_library=http_library)
    outputs = run(target, [conv], LoadShape(), WordCodec()).outputs
    assert [(o.turn, o.success, o.output_tokens) for o in outputs] == [(1, True, 2), (2, True, 3), (3, True, 1)]
    prompts = [b["messages"][0]["content"] for _, b in stub.requests]
    assert prompts == ["w11 w12", "w11 w12 w1000 w1001 w13", "w11 w12 w1000 w1001 w13 w1000 w1001 w1002 w14 w15"]
    assert [o.prompt_len for o in outputs] == [2, 5, 10]  # the server's usage


def test_a_refusal_and_a_broken_stream_are_failed_samples_not_a_crash(stub):
    """A 4xx answer and an error frame: each its own failed request with the error text; the run goes on."""
    jobs = make_jobs(DatasetSpec("random", 3, 4, 2, vocab_size=300), seed=1)
    stub.fail = {1: "status", 2: "frame"}
    outputs = run(Target(stub.url), jobs, LoadShape()).outputs
    assert [o.success for o in outputs] == [True, False, False]
    assert outputs[1].error.startswith("HTTP 429") and "overloaded" in outputs[2].error
    result = compute_result(list(outputs), 1.0)
    assert result["completed"] == 1 and result["failed"] == 2 and result["output_lens"] == [2, 0, 0]


def test_datasets_shared_prefix_lengths_and_jsonl_lines(tmp_path):
    jobs = make_jobs(DatasetSpec("shared-prefix", 6, 10, 5, 0.2, shared_prefix_len=12, shared_prefix_groups=2,
                                 vocab_size=300), seed=4)
    assert [j.prompt[:12] == jobs[j.index % 2].prompt[:12] for j in jobs] == [True] * 6
    assert jobs[0].prompt[:12] != jobs[1].prompt[:12]
    assert all(12 + 8 <= j.prompt_len == len(j.prompt) <= 12 + 12 and 4 <= j.output_len <= 6 for j in jobs)
    assert make_jobs(DatasetSpec("shared-prefix", 6, 10, 5, 0.2, shared_prefix_len=12, shared_prefix_groups=2,
                                 vocab_size=300), seed=4) == jobs, "seeded"
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "hello there", "output_len": 3}\n\n{"prompt": [5, 6, 7], "max_tokens": 2}\n'
                    '{"messages": [{"role": "user", "content": "hi"}], "output_len": 4}\n')
    rows = make_jobs(DatasetSpec("jsonl", 4, path=str(path)), seed=0)
    assert rows == [SampleRequest(0, "hello there", None, 3), SampleRequest(1, (5, 6, 7), 3, 2),
                    SampleRequest(2, ({"role": "user", "content": "hi"},), None, 4),
                    SampleRequest(3, "hello there", None, 3)]
    with pytest.raises(ValueError, match="--dataset-path"):
        DatasetSpec("random", path=str(path))


TRACE = [{"timestamp": 1000, "input_length": 20, "output_length": 8, "hash_ids": [7, 8]},
         {"timestamp": 1500, "input_length": 28, "output_length": 4, "hash_ids": [7, 8, 9, 10]},
         {"timestamp": 1600, "input_length": 6, "output_length": 2, "hash_ids": [11]},
         {"timestamp": 3000, "input_length": 30, "output_length": 6, "hash_ids": [7]}]


def write_trace(tmp_path) -> str:
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in TRACE))
    return str(path)


def test_a_mooncake_trace_shares_equal_blocks_cuts_to_its_lengths_and_keeps_its_times(tmp_path):
    """Blocks of 8 tokens (16 * 0.5): equal hash ids give equal blocks, so request 1 starts with
    request 0's 16 tokens; each prompt is cut to (or, past its blocks, filled to) its scaled length;
    arrivals are the timestamps' offsets, times the time scale."""
    spec = DatasetSpec("mooncake-trace", 100, path=write_trace(tmp_path), vocab_size=300, trace_block_size=16,
                       trace_token_scale=0.5, trace_time_scale=2.0)
    jobs = make_jobs(spec, seed=5)
    assert [(j.prompt_len, j.output_len, j.arrival_s) for j in jobs] == [(10, 4, 0.0), (14, 2, 1.0), (3, 1, 1.2),
                                                                         (15, 3, 4.0)]
    assert all(len(j.prompt) == j.prompt_len for j in jobs)
    assert jobs[1].prompt[:10] == jobs[0].prompt and jobs[3].prompt[:8] == jobs[0].prompt[:8]
    assert jobs[3].prompt[8:] != jobs[1].prompt[8:15]  # past its one block: its own tokens
    assert jobs[2].prompt[:3] != jobs[0].prompt[:3]
    assert make_jobs(spec, seed=5) == jobs and make_jobs(spec, seed=6)[0].prompt != jobs[0].prompt
    with pytest.raises(ValueError, match="line 1 needs"):
        bad = tmp_path / "bad.jsonl"
        bad.write_text('{"timestamp": 0, "input_length": "x", "output_length": 1, "hash_ids": []}\n')
        make_jobs(DatasetSpec("mooncake-trace", 1, path=str(bad)), seed=0)


def test_a_trace_is_sent_at_its_own_times_not_the_load_shapes(stub, tmp_path):
    jobs = make_jobs(DatasetSpec("mooncake-trace", 4, path=write_trace(tmp_path), vocab_size=300,
                                 trace_block_size=4, trace_time_scale=0.25), seed=1)
    run_ = run(Target(stub.url), jobs, LoadShape(request_rate=1000.0))
    arrivals = np.array(sorted(t for t, _ in stub.requests))
    assert all(o.success for o in run_.outputs)
    assert np.diff(arrivals) == pytest.approx([0.125, 0.025, 0.35], abs=0.02)  # 500, 100, 1400 ms / 4


def test_split_and_merge_count_every_request_once_on_one_time_axis():
    jobs = make_jobs(DatasetSpec("random", 7, 4, 2, vocab_size=300), seed=0)
    plans = split_plans(jobs, LoadShape(request_rate=9.0, max_concurrency=5, seed=2), 3)
    assert [[j.index for j in p.jobs] for p in plans] == [[0, 3, 6], [1, 4], [2, 5]]
    assert [p.shape.request_rate for p in plans] == [3.0] * 3 and [p.shape.max_concurrency for p in plans] == [2, 2, 1]
    assert len({p.shape.seed for p in plans}) == 3

    def out(i, start_s):
        return RequestOutput(i, 0, True, 4, 2, 0.1, (0.05,), 0.15, start_s, 0.0)

    runs = [ClientRun((out(0, 0.0), out(2, 1.0)), start_wall_s=100.0, duration_s=1.5),
            ClientRun((out(1, 0.5),), start_wall_s=100.25, duration_s=2.0)]
    merged, duration_s, t0 = merge_runs(runs)
    assert [(o.index, o.start_s) for o in merged] == [(0, 0.0), (1, 0.75), (2, 1.0)] and t0 == 100.0
    assert duration_s == 2.25


@pytest.mark.slow
def test_clients_go_round_robin_over_the_alive_nodes_with_room():
    def node(ip, cpus, alive=True):
        return {"NodeManagerAddress": ip, "NodeID": f"id-{ip}", "Alive": alive,
                "Resources": {"CPU": cpus} if cpus else {}}

    nodes = [node("127.0.0.3", 1), node("127.0.0.1", 0), node("127.0.0.2", 4), node("127.0.0.4", 8, alive=False)]
    assert client_node_ids(nodes, 1.0) == ["id-127.0.0.2", "id-127.0.0.3"]
    # a node with no CPU (a head started with num-cpus 0) gets no client, not even one asking for none
    assert client_node_ids(nodes, 0.0) == ["id-127.0.0.2", "id-127.0.0.3"]
    with pytest.raises(RuntimeError, match="no alive Ray node takes work with 6"):
        client_node_ids(nodes, 6)


def test_two_ray_actor_clients_send_every_request_exactly_once(stub, tmp_path):
    """`--num-clients 2` in a fresh process (it starts a loopback Ray there), against the stub here."""
    out_file = tmp_path / "result.json"
    cmd = [sys.executable, "-m", "cluster.cli", "bench", "serve", "--base-url", stub.url, "--num-clients", "2",
           "--num-prompts", "40", "--random-input-len", "6", "--random-output-len", "3", "--random-vocab-size", "400",
           "--request-rate", "80", "--num-warmups", "0", "--seed", "5", "--save-result", "--result-filename",
           str(out_file), "--disable-tqdm"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=240,
                          env={**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out_file.read_text())
    expected = sorted(tuple(j.prompt) for j in make_jobs(DatasetSpec("random", 40, 6, 3, vocab_size=400), seed=5))
    assert sorted(tuple(b["prompt"]) for _, b in stub.requests) == expected, "each prompt exactly once"
    assert result["completed"] == 40 and result["failed"] == 0 and result["num_clients"] == 2
    assert sorted(i for i, _ in result["request_ids"]) == list(range(40))
    assert len(result["client_nodes"]) == 2
