"""`tandem bench chaos` across network hosts: the same load, faults, replay and report
(`cluster/bench/chaos.py`) on a cluster of three network namespaces (`scripts/netns_cluster.py`):

    head     10.213.0.1   Ray head, `tandem serve` (gateway, controller), the L3 Redis
    prefill  10.213.0.2   prefill-0 and decode-1
    decode   10.213.0.3   decode-0 alone

every prompt's KV crossing a link over Mooncake TCP. Beside the local run's faults (workers killed,
SIGTERMed, rolling-restarted; Redis killed and restarted), a host's link is cut for `LINK_DOWN_S`
and restored (`cut_decode_link`, `cut_prefill_link`), or made far and lossy for `LOSSY_S`
(`lossy_decode_link`: `LOSSY_DELAY_MS` each way, `LOSSY_LOSS_PCT`% of frames lost). Needs root and iproute2; cleans up
after itself (and `scripts/netns_cluster.py down` after a run that died).

    sudo .venv/bin/python scripts/netns_chaos.py --duration-s 600 --json chaos-netns.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from cluster.bench.chaos import _print, add_chaos_args, fault_kinds, run_chaos  # noqa: E402 - after the path
from cluster.bench.chaos_targets import REDIS_DOWN_S, WORKER_FAULTS, hurt_worker  # noqa: E402
from scripts.netns_cluster import NetnsCluster, serve_config, unavailable  # noqa: E402

LINK_DOWN_S = 10.0
LOSSY_S, LOSSY_DELAY_MS, LOSSY_LOSS_PCT = 20.0, 40.0, 3.0
REDIS_PORT = 6390
SERVE_PORT = 8000


def serve_flags(gateway_ip: str, args) -> list[str]:
    """As the local chaos run: a small decode pool with a host tier, L3 on the head host's Redis,
    KV damaged at `--inject`'s rates; then the caller's `--set`s."""
    sets = ["decode.engine.num_pages=128", "decode.engine.host_cache_ratio=4", "kv_store.l3.backend=redis",
            f"kv_store.l3.url=redis://{gateway_ip}:{REDIS_PORT}/0",
            *([f"cluster.inject_faults={args.inject}"] if args.inject else []), *args.set]
    return [f for s in sets for f in ("--set", s)]


class NetnsTarget:
    """The three-host cluster: worker faults through its gateway, Redis on the head host, link cuts."""

    kinds = (*WORKER_FAULTS, "kill_redis", "cut_decode_link", "cut_prefill_link", "lossy_decode_link")

    def __init__(self, net: NetnsCluster) -> None:
        self.net, self.redis = net, None
        self.url = f"http://{net.hosts['head'].ip}:{SERVE_PORT}"
        self._down: set[str] = set()

    def start_redis(self) -> None:
        binary = shutil.which("redis-server")
        assert binary, "redis-server is not installed (scripts/setup.sh test installs it)"
        self.redis = self.net.run("head", [binary, "--port", str(REDIS_PORT), "--bind", self.net.hosts["head"].ip,
                                           "--save", "", "--appendonly", "no", "--protected-mode", "no"],
                                  log_name="redis")

    def inflict(self, kind: str) -> bool:
        if kind in WORKER_FAULTS:
            return hurt_worker(self.url, kind)
        if kind == "kill_redis":
            if self.redis is None or self.redis.poll() is not None:
                return False
            self.redis.kill()
            self._later(REDIS_DOWN_S, self.start_redis)
            return True
        host = kind.split("_")[1]
        if host in self._down:
            return False
        self._down.add(host)
        lossy = kind.startswith("lossy")
        if lossy:
            self.net.netem(host, LOSSY_DELAY_MS, LOSSY_LOSS_PCT)
        else:
            self.net.cut(host)

        def restore() -> None:
            self.net.netem(host) if lossy else self.net.restore(host)
            self._down.discard(host)
        self._later(LOSSY_S if lossy else LINK_DOWN_S, restore)
        return True

    @staticmethod
    def _later(delay_s: float, fn) -> None:
        timer = threading.Timer(delay_s, fn)
        timer.daemon = True
        timer.start()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_chaos_args(parser)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per request otherwise
    if args.once:
        parser.error("--once is the local run's (`tandem bench chaos --once`)")
    try:
        fault_kinds(NetnsTarget, args.faults)
    except ValueError as exc:
        parser.error(str(exc))
    why = unavailable()
    if why:
        print(f"netns chaos: {why}", file=sys.stderr)
        return 2
    net = NetnsCluster.up()
    code = 1
    try:
        target = NetnsTarget(net)
        target.start_redis()
        net.start_ray({"prefill": {"tandem_prefill": 1, "tandem_decode": 1}, "decode": {"tandem_decode": 1}},
                      cpus={"prefill": 2})
        head = net.hosts["head"].ip
        (net.workdir / "cluster.yaml").write_text(serve_config(head))
        serve = net.run("head", [sys.executable, "-m", "cluster.cli", "serve", "--config",
                                 str(net.workdir / "cluster.yaml"), "--address", net.ray_address, "--port",
                                 str(SERVE_PORT), *serve_flags(head, args)],
                        env={**net.ray_env(), "PYTHONUNBUFFERED": "1"}, log_name="serve", cwd=REPO)
        _wait_ready(target.url, serve, args.ready_timeout_s, net)
        report = asyncio.run(run_chaos(target, args))
        serve.send_signal(signal.SIGTERM)
        report["server_exit_code"] = serve.wait(120)
        report["hosts"] = {name: host.ip for name, host in net.hosts.items()}
        _print(report)
        if args.json:
            Path(args.json).write_text(json.dumps(report, indent=2))
        ok = report["hung"] == 0 and report["wrong"] == 0 and not report["integrity_errors"]
        code = 0 if ok and report["server_exit_code"] == 0 else 1
    finally:
        net.down()
    return code


def _wait_ready(url: str, serve: subprocess.Popen, timeout_s: float, net: NetnsCluster) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    while True:
        if serve.poll() is not None:
            raise RuntimeError(f"tandem serve exited with {serve.returncode}:\n{_serve_log(net)}")
        try:
            if httpx.get(f"{url}/health/ready", timeout=30).status_code == 200:
                print(f"netns chaos: serving at {url}", flush=True)
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"tandem serve not ready within {timeout_s:.0f} s:\n{_serve_log(net)}")
        print(f"netns chaos: waiting for tandem serve ({time.monotonic() - deadline + timeout_s:.0f} s)", flush=True)
        time.sleep(5.0)


def _serve_log(net: NetnsCluster) -> str:
    logs = sorted(net.workdir.glob("head-serve-*.log"))
    return logs[-1].read_text(errors="replace")[-6000:] if logs else "(no log)"


if __name__ == "__main__":
    sys.exit(main())
