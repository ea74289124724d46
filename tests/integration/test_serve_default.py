"""`tandem serve` on its embedded defaults (it starts and stops its own local Ray), with two
prefill workers and round-robin routing: nothing it starts listens beyond loopback; then a graceful
SIGTERM to its whole process group under load."""

from __future__ import annotations

import subprocess
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from cluster.serve.local_ray import session_members
from kv_store.transfer.listeners import listening_sockets
from tests.integration.logit_rules_check import check_logit_rules
from tests.integration.logprobs_check import check_logprobs
from tests.integration.serve_harness import metric, start_server
from tests.integration.tools_check import check_tools

pytestmark = pytest.mark.slow

SMALL = ["--set", "engine.num_pages=512", "--set", "decode.host_pages=512"]


def ray_daemon_pids() -> set[int]:
    """Live Ray daemons on this host. A daemon that exited but is not yet reaped (a zombie: Ray's
    daemons are re-parented to init once `ray start` exits) holds nothing and does not count."""
    out = subprocess.run(["pgrep", "-f", "raylet|gcs_server"], capture_output=True, text=True).stdout
    return {int(pid) for pid in out.split() if _alive(int(pid))}


def _alive(pid: int) -> bool:
    try:
        stat = open(f"/proc/{pid}/stat").read()
    except OSError:  # gone since the listing
        return False
    return stat[stat.rindex(")") + 2] != "Z"


@pytest.fixture(scope="module")
def default_server(tmp_path_factory):
    server = start_server(tmp_path_factory.mktemp("serve-default"),
                          ["--policy", "round_robin", "--num-prefill", "2", *SMALL,
                           # every prompt crosses: a shared prefix would otherwise stay on the decode worker
                           "--set", "router.local_prefill_max_tokens=0"])
    try:
        yield server
    finally:
        server.terminate()


def routed_prefill_worker(server, body: dict) -> str:
    before = server.metrics()
    resp = httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    after = server.metrics()
    moved = [w for w in ("prefill-0", "prefill-1")
             if metric(after, "tandem:requests_routed_total", prefill_worker=w)
             > metric(before, "tandem:requests_routed_total", prefill_worker=w)]
    assert len(moved) == 1, moved
    return moved[0]


def test_round_robin_alternates_prefill_workers_even_for_a_shared_prefix(default_server):
    server = default_server
    system = "You are a terse assistant. " + "Remember the following facts about caches. " * 30
    order = [routed_prefill_worker(server, {
        "model": "smollm2", "max_tokens": 2, "temperature": 0,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": f"Fact {i}?"}]})
        for i in range(4)]
    assert set(order) == {"prefill-0", "prefill-1"}
    assert all(a != b for a, b in zip(order, order[1:])), f"round robin should alternate: {order}"


def test_nothing_tandem_started_listens_beyond_loopback(default_server):
    """Every listening socket of every process of the server's sessions (the gateway, the Ray driver, the
    local Ray's GCS, raylet, agents and workers, the workers' Mooncake ports) is on loopback."""
    server = default_server
    processes = {pid for session in server.sessions() for pid in session_members(session)}
    listeners = [lst for pid in processes for lst in listening_sockets(pid)]
    names = {Path(f"/proc/{pid}/comm").read_text().strip() for pid in processes if Path(f"/proc/{pid}/comm").exists()}
    assert {"gcs_server", "raylet"} <= names, f"the local Ray's daemons were not found: {names}"
    ports = {lst.port for lst in listeners}
    transfer_ports = {int(w["session"].rpartition(":")[2]) for w in server.workers()}
    assert {server.port, *transfer_ports} <= ports, "the gateway or a worker's transfer port was not seen"
    beyond = [str(lst) for lst in listeners if not lst.is_loopback]
    assert beyond == [], f"listening beyond loopback: {beyond}"


def test_sigterm_to_the_process_group_drains_in_flight_requests_then_stops_ray(default_server):
    """systemd and shell entrypoints signal the whole group: Ray's processes must not die with it."""
    server = default_server
    ray_sessions = server.sessions() - {server.proc.pid}
    started, result = threading.Event(), {}

    def stream() -> None:
        body = {"model": "smollm2", "prompt": "Once upon a time", "max_tokens": 40, "ignore_eos": True,
                "stream": True, "temperature": 0}
        frames = []
        with httpx.stream("POST", f"{server.base_url}/v1/completions", json=body, timeout=120) as resp:
            for line in resp.iter_lines():
                if line.startswith("data: "):
                    frames.append(line[6:])
                    started.set()
        result["frames"] = frames

    reader = threading.Thread(target=stream)
    reader.start()
    assert started.wait(120), "the stream never started"
    t0 = time.monotonic()
    code = server.terminate(timeout_s=120, whole_group=True)
    exit_s = time.monotonic() - t0
    reader.join(60)
    assert code == 0, server.log_tail()
    frames = result["frames"]
    assert frames[-1] == "[DONE]" and '"finish_reason":"length"' in frames[-2].replace(" ", ""), frames[-3:]
    assert exit_s < 30, f"exit took {exit_s:.0f}s"
    assert ray_sessions, "the Ray instance ran in the server's own session: a group SIGTERM reached it"
    left = {session: session_members(session) for session in ray_sessions}
    assert not any(left.values()), f"Ray processes outlived tandem serve: {left}"


def test_start_up_failures_are_one_clear_line_and_leave_nothing_running():
    import sys

    from tests.integration.serve_harness import REPO, free_port

    def serve(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "cluster.cli", "serve", "--port", str(free_port()), *args],
                              cwd=REPO, capture_output=True, text=True, timeout=300)

    before = ray_daemon_pids()
    bad_model = serve("--model", "/no/such/model")  # caught before Ray starts
    assert bad_model.returncode == 2 and "tandem: error: model '/no/such/model'" in bad_model.stderr
    too_long = serve("--set", "engine.max_model_len=100000", *SMALL)  # caught by the workers
    assert too_long.returncode == 1, too_long.stderr[-3000:]
    error = [line for line in too_long.stderr.splitlines() if line.startswith("tandem: error:")]
    assert len(error) == 1 and "max_model_len 100000 exceeds the model's" in error[0], too_long.stderr[-3000:]
    assert ray_daemon_pids() <= before, "a failed start left Ray running"


def test_colocated_shape_serves_on_every_worker(tmp_path, capsys):
    """No prefill or decode group: two colocated workers, each prefilling its own requests. (Their
    decode steps stay eager: two compiles beside these few answers took ~20 s of 2 cores; a colocated
    worker's compile is tested on its own, `test_worker_host`.)"""
    import json

    from cluster.cli.main import main as tandem_main

    server = start_server(tmp_path, ["--num-prefill", "0", "--num-decode", "0", "--num-colocated", "2",
                                     "--policy", "round_robin", *SMALL,
                                     "--set", "colocated.engine.cpu_compile=false"])
    try:
        question = "Name a primary color."
        capsys.readouterr()
        assert tandem_main(["run", "--prompt", question, "--max-tokens", "8", "--json"]) == 0
        reference = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["text"]
        before = server.metrics()
        for _ in range(4):
            resp = httpx.post(f"{server.base_url}/v1/chat/completions", timeout=120, json={
                "model": "smollm2", "messages": [{"role": "user", "content": question}], "max_tokens": 8,
                "temperature": 0})
            assert resp.status_code == 200 and resp.json()["choices"][0]["message"]["content"] == reference
        after = server.metrics()
        for worker in ("colocated-0", "colocated-1"):
            moved = (metric(after, "tandem:requests_routed_total", prefill_worker="", decode_worker=worker)
                     - metric(before, "tandem:requests_routed_total", prefill_worker="", decode_worker=worker))
            assert moved == 2, (worker, moved)
        workers = httpx.get(f"{server.base_url}/debug/workers", timeout=30).json()["workers"]
        assert sorted(w["role"] for w in workers) == ["colocated", "colocated"]
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none", max_retries=0, timeout=300)
        check_logit_rules(client)
        check_logprobs(client)
        check_tools(server.base_url)  # a forced call's grammar on a colocated worker
        before = server.metrics()
        done = client.completions.create(model="smollm2", prompt="Three random words, each on its own line:\n",
                                         n=3, seed=1, temperature=1.0, top_p=1.0, max_tokens=8,
                                         extra_body={"ignore_eos": True})
        assert len({c.text for c in done.choices}) == 3
        after = server.metrics()
        moved = sorted(metric(after, "tandem:requests_routed_total", decode_worker=w)
                       - metric(before, "tandem:requests_routed_total", decode_worker=w)
                       for w in ("colocated-0", "colocated-1"))
        assert moved == [0, 3], "the siblings follow choice 0 to its worker"
    finally:
        assert server.terminate() == 0, server.log_tail()
