"""`tandem serve --address` on a real multi-node Ray cluster, on loopback only: a head on 127.0.0.1 (no
CPUs: the gateway's driver and the controller only), a prefill node on 127.0.0.2 advertising
`tandem_prefill` and a decode node on 127.0.0.3 advertising `tandem_decode`, each its own raylet,
object store and OS session (`multinode_harness`). The serve config asks each group for its
resource, so each worker must land on its own node, and KV crosses between the two node addresses
over Mooncake TCP. Then the decode node is stopped under load, and started again.

Reference: `tandem run` (the offline engine, in this process) on the same prompts.
Which node runs a worker: the OS session of its pid (a node's raylet starts its workers in its
session) and the address its transfer engine listens on, both read from /proc, not from tandem.
"""

from __future__ import annotations

import contextlib
import io
import ipaddress
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from cluster.cli.main import main as tandem_main
from cluster.serve.local_ray import session_members
from kv_store.transfer.listeners import listening_sockets
from tests.integration.multinode_harness import LoopbackCluster
from tests.integration.serve_harness import REPO, metric, start_server, streams_across_a_fault
from tests.integration.test_serve import wait_workers_at_rest, workers

pytestmark = pytest.mark.slow

API_KEY = "sk-tandem-multinode"
PREFILL_IP, DECODE_IP = "127.0.0.2", "127.0.0.3"
CONFIG = """
model: smollm2
engine: {num_pages: 256, chunk_size: 128, max_model_len: 1024}
prefill: {count: 1, num_cpus: 1, resources: {tandem_prefill: 1}}
decode: {count: 1, num_cpus: 1, host_pages: 256, resources: {tandem_decode: 1}}
transport: {hostname: auto}
router: {max_queue_delay_s: 600, max_queued_requests: 64, local_prefill_max_tokens: 0,  # every prompt crosses nodes
         migration_timeout_s: 5.0}  # a stream whose decode node is gone waits this long for a worker
cluster: {heartbeat_timeout_s: 10.0, drain_timeout_s: 5.0, worker_start_timeout_s: 120.0}
"""
PROMPTS = ["The three primary colors are", "A KV cache stores"]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def reference() -> dict[str, str]:
    """`tandem run`'s greedy text for each prompt, one run per prompt (no batching to differ by)."""
    texts = {}
    for prompt in PROMPTS:
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            assert tandem_main(["run", "--prompt", prompt, "--max-tokens", str(MAX_TOKENS), "--json", "--raw"]) == 0
        texts[prompt] = json.loads(out.getvalue().strip().splitlines()[-1])["text"]
    return texts


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("multinode")
    (tmp / "cluster.yaml").write_text(CONFIG)
    ray_cluster = LoopbackCluster.start(head_cpus=0)
    server = None
    try:
        ray_cluster.add_node(PREFILL_IP, {"tandem_prefill": 1})
        ray_cluster.add_node(DECODE_IP, {"tandem_decode": 1})
        server = start_server(tmp, ["--config", str(tmp / "cluster.yaml"), "--address", ray_cluster.address],
                              api_key=API_KEY, env=ray_cluster.ray_env(single_node=True))
        server.ray = ray_cluster
        yield server
    finally:
        code = server.terminate() if server is not None else 0
        left = ray_cluster.stop() + (session_members(server.proc.pid) if server is not None else [])
        assert code == 0, f"tandem serve exited with {code}:\n{server.log_tail()}"
        assert left == [], f"processes left behind: {left}"  # the server is a session leader, as each node


def complete(server, prompt: str, timeout_s: float = 120) -> httpx.Response:
    return httpx.post(f"{server.base_url}/v1/completions", headers=server.headers(), timeout=timeout_s,
                      json={"model": "smollm2", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0})


def worker(server, worker_id: str) -> dict:
    return next(w for w in workers(server) if w["worker_id"] == worker_id)


def assert_on_node(w: dict, node) -> None:
    """The worker's process lives in the node's OS session, and its transfer engine listens on (and
    advertises) the node's address."""
    assert w["alive"] and w["pid"] in node.pids(), f"{w['worker_id']} (pid {w['pid']}) is not on {node.ip}: {w}"
    host, _, port = w["session"].rpartition(":")
    assert host == node.ip, f"{w['worker_id']} advertises {w['session']}, not {node.ip}"
    listeners = {(str(lst.host), lst.port) for lst in listening_sockets(w["pid"])}
    assert (node.ip, int(port)) in listeners, f"{w['worker_id']}: nothing listens on {w['session']}: {listeners}"


def test_each_role_runs_on_its_own_node_and_the_head_listens_on_loopback_only(cluster):
    prefill_node, decode_node = cluster.ray.nodes
    assert_on_node(worker(cluster, "prefill-0"), prefill_node)
    assert_on_node(worker(cluster, "decode-0"), decode_node)
    # The gateway's process and the head. (Ray binds a node's servers to its address only when that is
    # 127.0.0.1 itself; a raylet on 127.0.0.2 listens on the wildcard, which tandem does not control.)
    pids = [pid for sid in (cluster.ray.head_session_id, cluster.proc.pid) for pid in session_members(sid)]
    open_to_the_network = [str(lst) for pid in pids for lst in listening_sockets(pid) if not lst.is_loopback]
    assert open_to_the_network == []


def connections(pid: int) -> set[tuple[tuple[str, int], tuple[str, int]]]:
    """(local, remote) of each established TCP socket `pid` holds, from /proc."""
    inodes = {int(link[len("socket:["):-1]) for fd in os.listdir(f"/proc/{pid}/fd")
              if (link := _readlink(f"/proc/{pid}/fd/{fd}")).startswith("socket:[")}
    found = set()
    for line in Path(f"/proc/{pid}/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if fields[3] == "01" and int(fields[9]) in inodes:  # TCP_ESTABLISHED
            found.add(tuple((str(ipaddress.IPv4Address(bytes.fromhex(h)[::-1])), int(p, 16))
                            for h, p in (end.split(":") for end in fields[1:3])))
    return found


def _readlink(path: str) -> str:
    try:
        return os.readlink(path)
    except OSError:  # closed since the listing
        return ""


def test_greedy_output_over_http_matches_tandem_run(cluster, reference):
    before = cluster.metrics()
    texts = {}
    for prompt in PROMPTS:
        resp = complete(cluster, prompt)
        assert resp.status_code == 200, resp.text
        texts[prompt] = resp.json()["choices"][0]["text"]
    assert texts == reference
    after = cluster.metrics()
    moved = metric(after, "tandem:kv_transfer_bytes_total") - metric(before, "tandem:kv_transfer_bytes_total")
    assert moved > 0, "no KV moved from the prefill node to the decode node"
    # KV crossed between the node addresses: one worker holds a connection to the other's listener there.
    p, d = worker(cluster, "prefill-0")["pid"], worker(cluster, "decode-0")["pid"]
    listening = {pid: {(str(lst.host), lst.port) for lst in listening_sockets(pid)} for pid in (p, d)}
    peers = {pid: {remote for _, remote in connections(pid)} for pid in (p, d)}
    to_decode, to_prefill = peers[p] & listening[d], peers[d] & listening[p]
    assert to_decode or to_prefill, f"no connection between the workers: {peers}, listening {listening}"
    assert {host for host, _ in to_decode} <= {DECODE_IP} and {host for host, _ in to_prefill} <= {PREFILL_IP}
    wait_workers_at_rest(cluster, expect=2)


def test_two_load_clients_on_two_nodes_count_every_request_once(cluster, tmp_path):
    """`tandem bench serve --num-clients 2 --address`: the clients run as Ray actors on two different
    nodes of the cluster; the merged result counts each request once, as the server's own counter does."""
    before = metric(cluster.metrics(), "tandem:request_success_total")
    result_file = tmp_path / "result.json"
    cmd = [sys.executable, "-c", "import sys; from cluster.cli.main import main; sys.exit(main())",
           "bench", "serve", "--base-url", cluster.base_url, "--api-key", API_KEY,
           "--num-clients", "2", "--client-cpus", "0", "--address", cluster.ray.address,
           "--num-prompts", "10", "--max-concurrency", "4", "--random-input-len", "16", "--random-output-len", "4",
           "--random-range-ratio", "0.5", "--seed", "3", "--num-warmups", "0", "--disable-tqdm", "--save-result",
           "--result-filename", str(result_file)]
    proc = subprocess.run(cmd, cwd=REPO, env=cluster.ray.ray_env(single_node=True), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(result_file.read_text())
    assert result["num_clients"] == 2 and len(set(result["client_nodes"])) == 2, result["client_nodes"]
    assert set(result["client_nodes"]) <= {"127.0.0.1", PREFILL_IP, DECODE_IP}
    assert result["completed"] == 10 and result["failed"] == 0
    assert len(result["ttfts"]) == 10  # one raw sample per request, merged from both clients
    served = metric(cluster.metrics(), "tandem:request_success_total") - before
    assert served == 10, f"the server finished {served} requests for 10 prompts"
    wait_workers_at_rest(cluster, expect=2)


def test_stopping_the_decode_node_under_load_then_starting_it_again(cluster, reference):
    """In-flight streams wait `migration_timeout_s` for a worker to resume on, then end with a clean error,
    none hanging; with no node that has room,
    the controller says so and leaves the decode worker down (waiting spends no restart); the prefill
    worker holds nothing; a new decode node brings decode-0 back, and output is the reference again."""
    server, ray_cluster = cluster, cluster.ray
    decode_node = next(n for n in ray_cluster.nodes if n.ip == DECODE_IP)
    decode = worker(server, "decode-0")
    # `ray stop` for the decode node only, mid-stream; every stream ends within 60 s (no hang)
    outcomes = streams_across_a_fault(server.base_url, API_KEY, 4, decode_node.stop, 60)
    assert all(o == "length" or (o.startswith("error: ") and len(o) > len("error: ")) for o in outcomes), outcomes
    assert any(o.startswith("error") for o in outcomes), "stopping the decode node mid-stream failed nothing"
    assert all("no worker could resume its stream within 5 s" in o for o in outcomes if o.startswith("error")), outcomes

    resp = complete(server, PROMPTS[0], timeout_s=30)  # refused at once: no decode worker
    assert resp.status_code == 503 and "retry-after" in resp.headers, resp.text
    assert httpx.get(f"{server.base_url}/health", timeout=30).status_code == 503
    wait_for_log(server, r"decode-0 cannot be restarted: .*no node has room", timeout_s=60)
    down = worker(server, "decode-0")
    assert not down["alive"]
    assert down["restarts"] <= 1, down  # one try may start before Ray has marked the node dead, never more
    wait_workers_at_rest(server, expect=1)  # the prefill worker, the only one alive

    new_node = ray_cluster.add_node(DECODE_IP, {"tandem_decode": 1})
    deadline = time.monotonic() + 120
    while (resp := complete(server, PROMPTS[0])).status_code == 503 and time.monotonic() < deadline:
        time.sleep(1.0)
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["text"] == reference[PROMPTS[0]]
    reborn = worker(server, "decode-0")
    assert reborn["restarts"] == down["restarts"] + 1 and reborn["pid"] != decode["pid"]
    assert_on_node(reborn, new_node)
    assert_on_node(worker(server, "prefill-0"), ray_cluster.nodes[0])
    wait_workers_at_rest(server, expect=2)


def wait_for_log(server, pattern: str, timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = re.search(pattern, server.log_path.read_text(errors="replace"))
        if found:
            return found.group(0)
        time.sleep(0.5)
    raise AssertionError(f"no log line like {pattern!r} within {timeout_s}s:\n{server.log_tail()}")
