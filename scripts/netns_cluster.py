"""A cluster of real network hosts on one machine: each host a network namespace with its own address
on a bridge, Ray nodes started inside them, and faults on the links between them.

    root namespace: bridge tdm<id>br   10.213.0.254/24 (this process reaches the hosts through it)
      veth tdm<id>v1 <-> eth0 in tdm<id>-head     10.213.0.1   Ray head (no CPUs), `tandem serve`
      veth tdm<id>v2 <-> eth0 in tdm<id>-prefill  10.213.0.2   Ray node advertising tandem_prefill
      veth tdm<id>v3 <-> eth0 in tdm<id>-decode   10.213.0.3   Ray node advertising tandem_decode

Each host's processes run through `ip netns exec` in an OS session of their own, so a host is
killed as a machine dies (every process in its namespace at once); its files live under the
cluster's work directory. Faults: `cut(host)` / `restore(host)` set the host's link down and up
(`ip link set ... down`), `netem(host, delay_ms, loss_pct)` delays and drops on it (`tc qdisc ...
netem` where the kernel has it, else `scripts/link_relay.py` in user space between the host's veth
and the bridge), `throttle(host, rate_kbit)` slows it (`tbf`), `kill(host)` SIGKILLs
every process in it. `down()` stops everything and removes the namespaces,
the links and the bridge; `sweep()` removes any left by a run that died.

Needs root (CAP_NET_ADMIN) and iproute2: `unavailable()` says why not, in one line.

    sudo .venv/bin/python scripts/netns_cluster.py up      # prints the hosts, leaves them up
    sudo .venv/bin/python scripts/netns_cluster.py down    # removes every tandem test namespace
"""

from __future__ import annotations

import argparse
import contextlib
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

PREFIX = "tdm"
SUBNET = "10.213.0"
BRIDGE_IP = f"{SUBNET}.254"
HOSTS = ("head", "prefill", "decode")
RAY_PORT = 6380


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30, check=check)


def unavailable() -> str | None:
    """Why namespaces cannot be made here (None: they can)."""
    if shutil.which("ip") is None:
        return "iproute2's `ip` is not installed"
    if os.geteuid() != 0:
        return "creating network namespaces needs root (CAP_NET_ADMIN)"
    probe = f"{PREFIX}probe{os.getpid()}"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"`ip netns add` failed: {made.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


@dataclass
class Host:
    name: str
    ns: str
    ip: str
    veth: str  # its link's root-side end: the one a fault sets down or shapes


@dataclass
class NetnsCluster:
    """Hosts on a bridge (module docstring), each process started in one via `run`."""

    tag: str
    workdir: Path
    hosts: dict[str, Host]
    bridge: str
    procs: list[subprocess.Popen] = field(default_factory=list)
    relays: dict[str, subprocess.Popen] = field(default_factory=dict)  # host -> its link's user-space netem

    @classmethod
    def up(cls, names: tuple[str, ...] = HOSTS) -> NetnsCluster:
        tag = f"{PREFIX}{secrets.token_hex(2)}"
        bridge = f"{tag}br"
        cluster = cls(tag, Path(tempfile.mkdtemp(prefix=f"{tag}-")), {}, bridge)
        try:
            _ip("link", "add", bridge, "type", "bridge")
            _ip("addr", "add", f"{BRIDGE_IP}/24", "dev", bridge)
            _ip("link", "set", bridge, "up")
            for i, name in enumerate(names, start=1):
                host = Host(name, f"{tag}-{name}", f"{SUBNET}.{i}", f"{tag}v{i}")
                _ip("netns", "add", host.ns)
                _ip("link", "add", host.veth, "type", "veth", "peer", "name", "eth0", "netns", host.ns)
                _ip("link", "set", host.veth, "master", bridge, "up")
                _ip("-n", host.ns, "addr", "add", f"{host.ip}/24", "dev", "eth0")
                _ip("-n", host.ns, "link", "set", "eth0", "up")
                _ip("-n", host.ns, "link", "set", "lo", "up")
                cluster.hosts[name] = host
        except BaseException:
            cluster.down()
            raise
        return cluster

    def run(self, host: str, cmd: list[str], env: dict[str, str] | None = None, log_name: str = "",
            **popen) -> subprocess.Popen:
        """`cmd` in `host`'s namespace, in its own OS session; output to a log under the work directory."""
        log = open(self.workdir / f"{host}-{log_name or Path(cmd[0]).name}-{len(self.procs)}.log", "wb")
        proc = subprocess.Popen(["ip", "netns", "exec", self.hosts[host].ns, *cmd], stdout=log,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, start_new_session=True,
                                **popen)
        log.close()
        self.procs.append(proc)
        return proc

    def pids(self, host: str) -> list[int]:
        """Every process in `host`'s namespace."""
        out = _ip("netns", "pids", self.hosts[host].ns, check=False).stdout
        return [int(pid) for pid in out.split()]

    def kill(self, host: str) -> None:
        """The host dies: SIGKILL to every process in its namespace."""
        for _ in range(3):  # a process may fork while the first pass runs
            for pid in self.pids(host):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.2)

    def cut(self, host: str) -> None:
        _ip("link", "set", self.hosts[host].veth, "down")

    def restore(self, host: str) -> None:
        _ip("link", "set", self.hosts[host].veth, "up")

    def netem(self, host: str, delay_ms: float = 0.0, loss_pct: float = 0.0, seed: int = 0) -> None:
        """Delay and loss on `host`'s link (0, 0: the link as it was): `tc netem` on traffic to the
        host where the kernel has it; else every frame either way through `scripts/link_relay.py`."""
        self.unshape(host)
        if not delay_ms and not loss_pct:
            return
        try:
            self._tc(host, "netem", "delay", f"{delay_ms}ms", "loss", f"{loss_pct}%")
        except RuntimeError:
            self._relay(host, delay_ms, loss_pct, seed)

    def _relay(self, host: str, delay_ms: float, loss_pct: float, seed: int) -> None:
        veth = self.hosts[host].veth
        tap = f"{veth}t"
        proc = subprocess.Popen([sys.executable, str(Path(__file__).with_name("link_relay.py")), veth, tap,
                                 "--delay-ms", str(delay_ms), "--loss-pct", str(loss_pct), "--seed", str(seed)],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        first = proc.stdout.readline().strip()  # "ready", or why not
        if first != "ready":
            proc.kill()
            raise RuntimeError(f"the user-space netem for {host} did not start: {first} {proc.stdout.read()[-2000:]}")
        self.relays[host] = proc
        _ip("link", "set", veth, "nomaster")
        _ip("link", "set", tap, "master", self.bridge, "up")

    def throttle(self, host: str, rate_kbit: int) -> None:
        """Traffic to `host` at most `rate_kbit` kbit/s (a token bucket: a slow link)."""
        self._tc(host, "tbf", "rate", f"{rate_kbit}kbit", "burst", "32kbit", "latency", "400ms")

    def unshape(self, host: str) -> None:
        """`host`'s link as it was: no queueing discipline, no relay (its veth back on the bridge)."""
        subprocess.run(["tc", "qdisc", "del", "dev", self.hosts[host].veth, "root"], capture_output=True, timeout=30)
        proc = self.relays.pop(host, None)
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
            _ip("link", "set", self.hosts[host].veth, "master", self.bridge)

    def _tc(self, host: str, kind: str, *args: str) -> None:
        done = subprocess.run(["tc", "qdisc", "replace", "dev", self.hosts[host].veth, "root", kind, *args],
                              capture_output=True, text=True, timeout=30)
        if done.returncode != 0:
            raise RuntimeError(f"`tc qdisc ... {kind}` failed: {done.stderr.strip()} (a kernel without sch_{kind}?)")

    def down(self) -> None:
        """Kill every host's processes, remove the namespaces, links, bridge and work directory."""
        for name in list(self.relays):
            self.unshape(name)
        for name in self.hosts:
            self.kill(name)
        for proc in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(5)
        for host in self.hosts.values():
            _ip("link", "del", host.veth, check=False)
            _ip("netns", "del", host.ns, check=False)
        _ip("link", "del", self.bridge, check=False)
        shutil.rmtree(self.workdir, ignore_errors=True)

    # ---- Ray --------------------------------------------------------------------------------------
    def ray_env(self) -> dict[str, str]:
        """What a process joining this cluster's Ray needs: its token (made on first use)."""
        token = self.workdir / "ray_token"
        if not token.exists():
            token.touch(mode=0o600)
            token.write_text(secrets.token_hex(32))
        drop = ("RAY_ADDRESS", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH", "TANDEM_API_KEY")
        return {**{k: v for k, v in os.environ.items() if k not in drop},
                "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token)}

    @property
    def ray_address(self) -> str:
        return f"{self.hosts['head'].ip}:{RAY_PORT}"

    def start_ray(self, resources: dict[str, dict[str, float]], cpus: dict[str, int] | None = None,
                  timeout_s: float = 120.0) -> None:
        """A Ray head on the head host (no CPUs: the gateway and the controller only) and a node on
        every other host advertising `resources[host]` and `cpus[host]` CPUs (default 1)."""
        ray = str(Path(sys.executable).with_name("ray"))
        common = ["--disable-usage-stats", "--object-store-memory=100000000"]
        head = self.hosts["head"]
        self._ray_start(head.name, [ray, "start", "--head", f"--node-ip-address={head.ip}", f"--port={RAY_PORT}",
                                    "--num-cpus=0", "--include-dashboard=false", *common], timeout_s)
        for name in self.hosts:
            if name != "head":
                self.add_ray_node(name, resources.get(name, {}), (cpus or {}).get(name, 1), timeout_s)

    def add_ray_node(self, host: str, resources: dict[str, float], num_cpus: int = 1, timeout_s: float = 120.0) -> None:
        import json

        ray = str(Path(sys.executable).with_name("ray"))
        self._ray_start(host, [ray, "start", f"--address={self.ray_address}",
                               f"--node-ip-address={self.hosts[host].ip}", f"--num-cpus={num_cpus}",
                               f"--resources={json.dumps(resources)}", "--disable-usage-stats",
                               "--object-store-memory=100000000"], timeout_s)

    def _ray_start(self, host: str, cmd: list[str], timeout_s: float) -> None:
        temp_dir = self.workdir / f"r-{host}"  # short: Ray's socket paths live under it
        proc = self.run(host, [*cmd, f"--temp-dir={temp_dir}"], env=self.ray_env(), log_name="ray-start")
        if proc.wait(timeout_s) != 0:
            log = max(self.workdir.glob(f"{host}-ray-start-*.log"), key=lambda p: p.stat().st_mtime)
            raise RuntimeError(f"`ray start` on {host} failed (exit {proc.returncode}):\n{log.read_text()[-3000:]}")


def serve_config(gateway_ip: str) -> str:
    """`tandem serve`'s config for these hosts: the gateway on the head host, prefill-0 on the prefill
    host, two decode workers (one each on the prefill and decode hosts), every prompt crossing a link."""
    return f"""
model: smollm2
engine: {{num_pages: 256, chunk_size: 128, max_model_len: 1024}}
prefill: {{count: 1, num_cpus: 1, resources: {{tandem_prefill: 1}}}}
decode: {{count: 2, num_cpus: 1, host_pages: 256, resources: {{tandem_decode: 1}}}}
transport: {{hostname: auto}}
router: {{max_queue_delay_s: 600, local_prefill_max_tokens: 0, migration_timeout_s: 30.0}}
gateway: {{host: "{gateway_ip}", allowed_hosts: ["{gateway_ip}"]}}
cluster: {{heartbeat_timeout_s: 5.0, drain_timeout_s: 5.0, worker_start_timeout_s: 120.0, max_restarts: 10000}}
"""


def sweep() -> list[str]:
    """Remove every namespace and bridge named like this module's (a run that died left them)."""
    gone = []
    for line in _ip("netns", "list", check=False).stdout.splitlines():
        ns = line.split()[0] if line.strip() else ""
        if ns.startswith(PREFIX):
            for pid in _ip("netns", "pids", ns, check=False).stdout.split():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(pid), signal.SIGKILL)
            _ip("netns", "del", ns, check=False)
            gone.append(ns)
    for line in _ip("-o", "link", "show", "type", "bridge", check=False).stdout.splitlines():
        name = line.split(":")[1].strip()
        if name.startswith(PREFIX):
            _ip("link", "del", name, check=False)
            gone.append(name)
    return gone


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=("up", "down"))
    args = parser.parse_args()
    why = unavailable()
    if why:
        print(f"netns cluster: {why}", file=sys.stderr)
        return 2
    if args.command == "down":
        print("removed:", " ".join(sweep()) or "nothing")
        return 0
    cluster = NetnsCluster.up()
    for host in cluster.hosts.values():
        print(f"{host.name:8} {host.ip:12} ip netns exec {host.ns} ...   (link {host.veth})")
    print(f"work directory {cluster.workdir}; remove it all with: {sys.argv[0]} down")
    return 0


if __name__ == "__main__":
    sys.exit(main())
