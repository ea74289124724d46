"""The single-node Ray instance `tandem serve` starts when it joins none: loopback only, token
auth, in its own OS session, and gone when tandem is.

    tandem serve (this process, the driver)      ray start --head (start_new_session)
      ray.init("127.0.0.1:<gcs port>")  ------>    gcs_server, raylet, agents, workers: session S

Loopback: Ray turns a node address of 127.0.0.1 into the machine's network address unless Ray
clusters are disabled on this host (RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0, Ray's single-node switch
for macOS/Windows, honoured on Linux too). With it, the node address stays 127.0.0.1 and every Ray
server binds it: GCS, raylet (node and object manager), worker gRPC ports, the runtime-env agent.
No autoscaler monitor is started (`--no-monitor`: a fixed local node has nothing to scale). The driver reads the switch
when `ray` is imported, so `start` sets it before importing ray, and refuses to go on if ray was imported earlier
without it.

Auth: a fresh 256-bit token in a 0600 file in a 0700 directory (RAY_AUTH_MODE=token,
RAY_AUTH_TOKEN_PATH); the directory, which also holds Ray's temp dir (sessions, logs, sockets), is
removed by `stop`. Nothing is written to ~/.ray or Ray's shared default temp dir, so other Ray users on the
host neither see this instance nor find it with address "auto".

Signals: a SIGTERM sent to tandem's process group (systemd, a shell entrypoint) does not reach
Ray's processes, which live in session S; tandem drains its requests, then `stop` ends session S
(its raylet first, then the rest: SIGTERM, then SIGKILL after `grace_s`). `stop` never uses
`ray stop`: that kills every Ray process on the host, other users' included.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger("tandem.serve")

STOP_GRACE_S = 5.0
"""How long a local Ray instance's processes get to exit on SIGTERM before SIGKILL. They usually exit
at once, but on loaded CI hosts a GCS has outlived shorter graces (never a raylet;
docs/results.md#start-up). A GCS killed so loses nothing: its state is in the session's directory,
removed next. Waiting ends as soon as they are gone."""

LOOPBACK = "127.0.0.1"
_SINGLE_NODE_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
_WORKER_NICENESS_ENV = "RAY_worker_niceness"
"""Ray's raylet starts worker processes at nice 15 unless told otherwise; tandem's workers are the
serving processes, so they run at the gateway's priority (a process cannot lower its own nice value
back without privileges, so the raylet must start them so)."""


class LocalRayError(RuntimeError):
    """The local Ray instance could not be started as asked."""


@dataclass
class LocalRay:
    """A running instance: its GCS `address`, the OS `session_id` of its processes, its private `workdir`."""

    address: str
    session_id: int
    workdir: Path
    saved_env: dict[str, str | None] = field(repr=False)
    """The driver environment's values before `start` (None: unset), put back by `stop`."""

    @classmethod
    def start(cls, num_cpus: int, num_gpus: int | None, resources: Mapping[str, float] | None = None,
              timeout_s: float = 120.0) -> LocalRay:
        """Start the head node and point this process's Ray driver at it (call `ray.init(address)` next).
        `resources`: Ray custom resources it advertises (`ray start --resources`).

        On any failure, whatever was started is stopped before the error propagates.
        """
        workdir = Path(tempfile.mkdtemp(prefix="tandem-ray-"))  # 0700
        token_path = workdir / "auth_token"
        with os.fdopen(os.open(token_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as token_file:
            token_file.write(secrets.token_hex(32))  # what `ray get-auth-token --generate` makes
        saved_env = _apply_env({"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token_path),
                                _SINGLE_NODE_ENV: "0", "RAY_AUTH_TOKEN": None, "RAY_ADDRESS": None,
                                _WORKER_NICENESS_ENV: "0"})
        session_id = None
        try:
            session_id, address = _start_head(workdir, num_cpus, num_gpus, dict(resources or {}), timeout_s)
            _check_driver_on_loopback()
        except BaseException:
            _clean_up(session_id, workdir, saved_env)
            raise
        log.info("started a local Ray instance at %s (%d CPUs; loopback only, token auth; OS session %d)",
                 address, num_cpus, session_id)
        return cls(address, session_id, workdir, saved_env)

    def stop(self, grace_s: float = STOP_GRACE_S) -> dict[int, str]:
        """End every process of the session, remove the token and Ray's files, restore the environment.
        Disconnect the driver (`ray.shutdown()`) first. Idempotent. Returns the processes that had to
        be killed (SIGKILL: they outlived SIGTERM by `grace_s`), pid -> command name."""
        killed = _clean_up(self.session_id, self.workdir, self.saved_env, grace_s)
        log.info("stopped the local Ray instance%s", f" ({len(killed)} processes killed)" if killed else "")
        return killed


def _clean_up(session_id: int | None, workdir: Path, saved_env: dict[str, str | None],
              grace_s: float = 0.0) -> dict[int, str]:
    killed = end_session(session_id, grace_s) if session_id is not None else {}
    shutil.rmtree(workdir, ignore_errors=True)
    _apply_env(saved_env)
    return killed


def _apply_env(env: dict[str, str | None]) -> dict[str, str | None]:
    """Set (None: unset) each variable; returns the previous values in the same form."""
    previous = {name: os.environ.get(name) for name in env}
    for name, value in env.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    return previous


def _start_head(workdir: Path, num_cpus: int, num_gpus: int | None, resources: dict[str, float],
                timeout_s: float) -> tuple[int, str]:
    """Run `ray start --head` in a new session; returns (session id, GCS address)."""
    temp_dir = workdir / "ray"
    cmd = [sys.executable, "-m", "ray.scripts.scripts", "start", "--head", f"--node-ip-address={LOOPBACK}",
           "--port=0", f"--num-cpus={num_cpus}", "--include-dashboard=false", "--disable-usage-stats",
           "--no-monitor", f"--temp-dir={temp_dir}"]  # no autoscaler on a fixed local node: less memory
    if num_gpus is not None:
        cmd.append(f"--num-gpus={num_gpus}")
    if resources:
        cmd.append(f"--resources={json.dumps(resources)}")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            start_new_session=True, text=True)
    try:
        importlib.import_module("ray")  # the driver's own import (it takes a while), while the head starts
        output, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        end_session(proc.pid, 0.0)
        proc.wait()
        raise LocalRayError(f"`ray start --head` did not finish within {timeout_s:.0f}s") from None
    except BaseException:  # a signal during start-up: the caller stops the session
        proc.kill()
        proc.wait()
        end_session(proc.pid, 0.0)
        raise
    address_file = temp_dir / "ray_current_cluster"
    if proc.returncode != 0 or not address_file.exists():
        end_session(proc.pid, 0.0)
        tail = "\n".join(output.strip().splitlines()[-15:])
        raise LocalRayError(f"`ray start --head` failed (exit {proc.returncode}):\n{tail}")
    return proc.pid, address_file.read_text().strip()


def _check_driver_on_loopback() -> None:
    import ray

    node_ip = ray.util.get_node_ip_address()  # before ray.init: what this driver would advertise
    if node_ip != LOOPBACK:
        raise LocalRayError(f"this process's Ray driver would use {node_ip}, not {LOOPBACK}: ray was imported "
                            f"before tandem set {_SINGLE_NODE_ENV}=0 (start tandem serve in a fresh process, or "
                            "set that variable in its environment)")


def session_members(session_id: int) -> list[int]:
    """Live processes whose OS session is `session_id` (from /proc/<pid>/stat: field 6, state 3)."""
    members = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:  # exited since the listing
            continue
        fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) ": state, ppid, pgrp, session, ...
        if int(fields[3]) == session_id and fields[0] != "Z":
            members.append(int(entry))
    return members


def end_session(session_id: int, grace_s: float) -> dict[int, str]:
    """SIGTERM the session's raylets, then every process of it, SIGKILL what is left after `grace_s`
    each time; wait for them. Returns the processes it had to SIGKILL (pid -> command name). A raylet exits at once on a
    SIGTERM of its own (and takes its agents and workers along), but not while the GCS it reports to is
    shutting down too; a GCS, the dashboard and the log monitor exit at once when no raylet is left.
    All signalled together, every one of them waited out the whole grace period for SIGKILL."""
    raylets = [pid for pid in session_members(session_id) if _comm(pid) == "raylet"]
    if raylets:
        _signal_and_wait(session_id, raylets, signal.SIGTERM, grace_s)
    killed: dict[int, str] = {}
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
        pids = session_members(session_id)
        if not pids:
            break
        if sig == signal.SIGKILL:
            killed = {pid: _comm(pid) or "exited" for pid in pids}
            log.warning("Ray processes outlived SIGTERM by %.1f s, killed: %s", grace_s,
                        ", ".join(f"{pid} ({name})" for pid, name in killed.items()))
        _signal_and_wait(session_id, pids, sig, wait_s)
    left = session_members(session_id)
    if left:
        log.warning("Ray processes %s of session %d survived SIGKILL", left, session_id)
    return killed


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:  # exited
        return ""


def _signal_and_wait(session_id: int, pids: list[int], sig: signal.Signals, wait_s: float) -> None:
    """Send `sig` to `pids`; wait up to `wait_s` until none of them is still a member of the session."""
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + wait_s
    while set(pids) & set(session_members(session_id)) and time.monotonic() < deadline:
        time.sleep(0.02)
