"""A real multi-node Ray cluster on one host, on loopback only: each node is its own raylet, object
store and OS session, with its own 127.0.0.x address.

    head     127.0.0.1   `cluster.serve.local_ray.LocalRay` (what `tandem serve` starts for itself:
                         loopback binds, a private 0600 token, its own session), run in a child process
    node     127.0.0.N   `ray start --address <head> --node-ip-address 127.0.0.N --resources ...`,
                         its own session and temp dir inside the head's private directory

Why the head runs in a child: `LocalRay.start` needs Ray's single-node switch read when `ray` is
first imported, and the test process may have imported ray already (collection imports modules).

Why nodes start through `_JOIN` and not the plain `ray` script: Ray's CLI rewrites a GCS address of
127.0.0.1 to the machine's network address (`services.resolve_ip_for_localhost`) unless the
single-node switch is on, and with the switch on it refuses to start a non-head node. `_JOIN` keeps
the address as given; everything else is the stock `ray start`.

A node is stopped as `ray stop` would stop it (SIGTERM, SIGKILL after a grace period), but only its
own session's processes: `ray stop` itself kills every Ray process on the host.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from cluster.serve.local_ray import LOOPBACK, end_session, session_members
from tests.integration.serve_harness import REPO

_JOIN = ("import sys; from ray._private import services; "
         "services.resolve_ip_for_localhost = lambda host: host; "
         "from ray.scripts.scripts import main; main()")
SINGLE_NODE_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


def head_main(num_cpus: int) -> None:
    """The head's child process: start a LocalRay, report it on stdout, stop it when stdin says so."""
    from cluster.serve.local_ray import LocalRay

    head = LocalRay.start(num_cpus=num_cpus, num_gpus=None)
    print(json.dumps({"address": head.address, "session_id": head.session_id, "workdir": str(head.workdir),
                      "token_path": os.environ["RAY_AUTH_TOKEN_PATH"]}), flush=True)
    sys.stdin.readline()
    head.stop()
    print(json.dumps({"left": session_members(head.session_id)}), flush=True)


@dataclass
class Node:
    """A worker node: its address, the OS session of its processes, the resources it advertises."""

    ip: str
    session_id: int
    resources: dict[str, float]

    def pids(self) -> list[int]:
        return session_members(self.session_id)

    def stop(self, grace_s: float = 2.0) -> None:
        """What `ray stop` does, to this node only: SIGTERM (the raylet leaves the cluster), SIGKILL later."""
        end_session(self.session_id, grace_s)


@dataclass
class LoopbackCluster:
    head_proc: subprocess.Popen
    address: str
    head_session_id: int
    workdir: Path
    token_path: Path
    nodes: list[Node] = field(default_factory=list)

    @classmethod
    def start(cls, head_cpus: int = 0, timeout_s: float = 120.0) -> LoopbackCluster:
        proc = subprocess.Popen([sys.executable, "-c", "from tests.integration.multinode_harness import head_main; "
                                 f"head_main({head_cpus})"], cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                text=True, env=_clean_env())
        line = proc.stdout.readline()  # the child's own LocalRay.start timeout bounds this
        if not line:
            proc.kill()
            raise RuntimeError(f"the head did not start (exit {proc.wait(30)})")
        info = json.loads(line)
        return cls(proc, info["address"], info["session_id"], Path(info["workdir"]), Path(info["token_path"]))

    def ray_env(self, single_node: bool) -> dict[str, str]:
        """The environment of a process joining this cluster: its token, and Ray's single-node switch
        (on for drivers, which then keep the head's 127.0.0.1 as given; a node needs it off)."""
        env = {**_clean_env(), "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(self.token_path)}
        if single_node:
            env[SINGLE_NODE_ENV] = "0"
        return env

    def add_node(self, ip: str, resources: dict[str, float], num_cpus: int = 1, timeout_s: float = 120.0) -> Node:
        assert ip.startswith("127.") and ip != LOOPBACK, f"a worker node needs its own loopback address, got {ip}"
        temp_dir = self.workdir / f"n{len(self.nodes) + 1}"  # short: Ray's socket paths live under it
        cmd = [sys.executable, "-c", _JOIN, "start", f"--address={self.address}", f"--node-ip-address={ip}",
               f"--num-cpus={num_cpus}", "--num-gpus=0", f"--resources={json.dumps(resources)}",
               "--object-store-memory=100000000", f"--temp-dir={temp_dir}", "--disable-usage-stats"]
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, text=True, env=self.ray_env(single_node=False),
                                start_new_session=True)
        try:
            output, _ = proc.communicate(timeout=timeout_s)
        except BaseException:
            end_session(proc.pid, 0.0)
            raise
        node = Node(ip, proc.pid, dict(resources))
        if proc.returncode != 0:
            node.stop(0.0)
            raise RuntimeError(f"`ray start` for {ip} failed (exit {proc.returncode}):\n{output[-3000:]}")
        self.nodes.append(node)
        return node

    def sessions(self) -> list[int]:
        return [self.head_session_id, *(n.session_id for n in self.nodes)]

    def stop(self) -> list[int]:
        """Stop every node, then the head (which removes the token and every node's files); returns
        the processes of any of their sessions still alive after that (none, when all went well)."""
        for node in self.nodes:
            node.stop()
        if self.head_proc.poll() is None:
            try:
                self.head_proc.stdin.write("stop\n")
                self.head_proc.stdin.flush()
                self.head_proc.stdout.readline()
                self.head_proc.wait(60)
            except (OSError, subprocess.TimeoutExpired):
                self.head_proc.kill()
                self.head_proc.wait(30)
        end_session(self.head_session_id, 0.0)  # a no-op unless the child failed to stop it
        return [pid for sid in self.sessions() for pid in session_members(sid)]


def _clean_env() -> dict[str, str]:
    """This process's environment less what would point Ray elsewhere (another cluster, another token)."""
    drop = ("RAY_ADDRESS", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH", SINGLE_NODE_ENV, "TANDEM_API_KEY")
    return {k: v for k, v in os.environ.items() if k not in drop}
