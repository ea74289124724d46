"""`cluster.serve.local_ray.LocalRay`: the Ray instance `tandem serve` starts for itself is private (a 0600
token it alone holds, enforced by the GCS), listens on loopback only, and leaves nothing behind.

`LocalRay.start` must run before `ray` is imported, so it runs in a child process (`child`)."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import time
from pathlib import Path

from cluster.serve.local_ray import end_session, session_members
from kv_store.transfer.listeners import listening_sockets
from tests.integration.serve_harness import REPO


def child() -> None:
    """Start a LocalRay, report it on stdout, stop it when stdin says so, report what is left."""
    from cluster.serve.local_ray import LocalRay

    env_before = {name: os.environ.get(name) for name in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN_PATH")}
    ray = LocalRay.start(num_cpus=1, num_gpus=None)
    print(json.dumps({"address": ray.address, "session_id": ray.session_id, "workdir": str(ray.workdir),
                      "token_path": os.environ["RAY_AUTH_TOKEN_PATH"]}), flush=True)
    sys.stdin.readline()
    killed = ray.stop()
    env_after = {name: os.environ.get(name) for name in env_before}
    print(json.dumps({"left": session_members(ray.session_id), "killed": killed,
                      "workdir_exists": ray.workdir.exists(), "env_restored": env_after == env_before}), flush=True)


def connect_with_wrong_token(address: str, timeout_s: float = 60) -> str:
    """The first auth complaint a driver with someone else's token gets from the GCS ('' if none)."""
    env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "0" * 64,
           "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}  # keep 127.0.0.1 as given
    env.pop("RAY_AUTH_TOKEN_PATH", None)
    proc = subprocess.Popen([sys.executable, "-c", f"import ray; ray.init(address={address!r})"], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + timeout_s
    try:
        for line in proc.stderr:
            if "InvalidAuthToken" in line or "Unauthenticated" in line:
                return line
            if time.monotonic() > deadline:
                break
        return ""
    finally:
        proc.kill()
        proc.wait(30)


def test_local_ray_is_private_loopback_only_and_leaves_nothing():
    proc = subprocess.Popen([sys.executable, "-c", "from tests.integration.test_local_ray import child; child()"],
                            cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    session_id = None
    try:
        started = json.loads(proc.stdout.readline())
        session_id = started["session_id"]
        workdir, token_path = Path(started["workdir"]), Path(started["token_path"])
        assert stat.S_IMODE(workdir.stat().st_mode) == 0o700 and token_path.parent == workdir
        assert stat.S_IMODE(token_path.stat().st_mode) == 0o600 and len(token_path.read_text()) == 64

        pids = session_members(session_id)
        names = {Path(f"/proc/{pid}/comm").read_text().strip() for pid in pids}
        assert {"gcs_server", "raylet"} <= names, names
        listeners = [lst for pid in pids for lst in listening_sockets(pid)]
        assert started["address"] == f"127.0.0.1:{next(lst.port for lst in listeners if 'gcs_server' in str(lst))}"
        assert [str(lst) for lst in listeners if not lst.is_loopback] == []

        assert "InvalidAuthToken" in connect_with_wrong_token(started["address"])

        proc.stdin.write("stop\n")
        proc.stdin.flush()
        stopped = json.loads(proc.stdout.readline())
        # the raylet (and the workers it owns) ended on SIGTERM: signalled first, alone (signalled with
        # the GCS, it outlived any grace); a GCS slow to end is killed (STOP_GRACE_S), and nothing is left
        assert "raylet" not in stopped.pop("killed").values()
        assert stopped == {"left": [], "workdir_exists": False, "env_restored": True}
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
        if session_id is not None:
            end_session(session_id, 0.0)


def gpu_child() -> None:
    """The default CUDA cluster (a prefill and a decode worker) fitted on a node of one (declared) GPU,
    in a LocalRay told of that one GPU: each worker's bundle and actor as the controller makes them;
    reports Ray's GPU total and each actor's GPU ids."""
    from cluster.serve import launch
    from cluster.serve.config_load import load_serve_config

    config = launch.fit_gpus(load_serve_config(overrides={"engine.device": "cuda"}), 1)
    local = launch._start_local_ray(config, 1)  # before ray is imported (module docstring)
    import ray
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from cluster.serve.controller import worker_bundle

    try:
        ray.init(address=local.address)
        report = {"gpus": ray.cluster_resources().get("GPU", 0), "ids": []}
        for group in (config.prefill, config.decode):
            pg = placement_group([worker_bundle(group)])
            ray.get(pg.ready(), timeout=60)

            @ray.remote
            def gpu_ids():
                return [int(i) for i in ray.get_gpu_ids()]

            task = gpu_ids.options(num_cpus=group.num_cpus, num_gpus=group.num_gpus,
                                   scheduling_strategy=PlacementGroupSchedulingStrategy(pg, 0))
            report["ids"].append(ray.get(task.remote(), timeout=60))
        print(json.dumps(report), flush=True)
    finally:
        ray.shutdown()
        local.stop()


def test_two_cuda_workers_on_one_gpu_share_device_0():
    """On a one-GPU node both workers are placed, and both are handed GPU 0: Ray is told of one GPU
    (not the two whole GPUs the groups asked for), and each worker asks half of it."""
    done = subprocess.run([sys.executable, "-c", "from tests.integration.test_local_ray import gpu_child; gpu_child()"],
                          cwd=REPO, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report == {"gpus": 1.0, "ids": [[0], [0]]}
