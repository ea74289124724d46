"""`scripts/gpu-check.sh`'s serve step (the venv's python): `tandem serve` in its own session on a
free port, HF's greedy reference computed beside it while it starts, then

    /health/ready            seconds from start to a real one-token generation
    greedy check             PROMPTS through /v1/completions against that reference (gpu_check_greedy.py)
    tandem bench serve       --base-url the server, its result line into --out
    SIGTERM and a wait       the process group and the Ray session killed if it hangs

Writes `--out` (one JSON object) whatever happens; the server log, the bench log and the reference's
log and JSON lie beside --serve-log and --out.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import gpu_check_greedy as greedy
from gpu_check_common import REPO, interrupt_on_signals, last_json_line, write_json

STEPS = Path(__file__).resolve().with_name("gpu_check_steps.py")
REFERENCE_STOP_S = 10.0  # a reference still running when the step ends is killed after this


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get_status(url: str, timeout_s: float = 10.0) -> int | None:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            return resp.status
    except urllib.error.HTTPError as err:
        return err.code
    except (OSError, ValueError):
        return None


def project_sets(name: str) -> list[str]:
    """`--set` values `tandem bench serve` gives a server it starts (cluster/bench/serve.py), so the
    two stay the same; [] if the project no longer has them."""
    try:
        from cluster.bench import serve as bench_serve
    except ImportError:
        return []
    return list(getattr(bench_serve, name, []))


class Server:
    """`tandem serve` as a child in its own session; its output in `log_path`."""

    def __init__(self, py: str, serve_args: list[str], log_path: Path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.cmd = [py, "-m", "cluster.cli", "serve", "--port", str(self.port), *serve_args]
        print("serve: " + " ".join(self.cmd), flush=True)
        with open(log_path, "wb") as log:
            self.proc = subprocess.Popen(self.cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True,
                                         env={**os.environ, "PYTHONUNBUFFERED": "1"})

    def wait_ready(self, timeout_s: float) -> str:
        """"ready", "exited N" or "timeout" (polls /health/ready: a real one-token generation)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                return f"exited {self.proc.returncode}"
            if get_status(f"{self.url}/health/ready", max(1.0, min(10.0, deadline - time.monotonic()))) == 200:
                return "ready"
            time.sleep(0.5)
        return "timeout"

    def stop(self, timeout_s: float) -> dict:
        """SIGTERM (drain, stop the workers and Ray), wait; past `timeout_s` SIGKILL the process group
        and end the Ray session the log names."""
        started = time.monotonic()
        how = "exited before stop"
        if self.proc.poll() is None:
            how = "SIGTERM"
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                how = "SIGTERM, then SIGKILL of its process group"
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
                self._end_ray_session()
        return {"how": how, "rc": self.proc.returncode, "stop_s": round(time.monotonic() - started, 2)}

    def _end_ray_session(self) -> None:
        found = re.findall(r"OS session (\d+)", self.log_path.read_text(errors="replace"))
        if found:
            from cluster.serve.local_ray import end_session

            end_session(int(found[-1]), 2.0)


class Reference:
    """HF's greedy reference (`gpu_check_steps.py greedy-reference`) as a child, run while the server
    starts (both on the device: the server's plan leaves it its headroom)."""

    def __init__(self, serve_args: list[str], out: Path, log_path: Path):
        self.out = out
        cmd = [sys.executable, str(STEPS), "greedy-reference", "--out", str(out), "--", *serve_args]
        print("serve: " + " ".join(cmd), flush=True)
        with open(log_path, "wb") as log:
            self.proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True)

    def result(self, timeout_s: float) -> dict | str:
        """Its JSON, or why there is none ("exited N", "timeout")."""
        try:
            rc = self.proc.wait(max(0.1, timeout_s))
        except subprocess.TimeoutExpired:
            self.kill()
            return "timeout"
        if rc != 0 or not self.out.is_file():
            return f"exited {rc}"
        return json.loads(self.out.read_text())

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(REFERENCE_STOP_S)


def gpu_memory_used_mib() -> list[int] | None:
    try:
        done = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                              capture_output=True, text=True, timeout=10)
        return [int(x) for x in done.stdout.split()] if done.returncode == 0 else None
    except (OSError, ValueError, subprocess.TimeoutExpired):
        return None


def serve(args: argparse.Namespace) -> int:
    """Start the server and the reference, wait for ready, the greedy check, `bench serve` (its output
    in --bench-log), stop; writes --out."""
    cut = args.rest.index("::") if "::" in args.rest else len(args.rest)
    serve_args, bench_args = args.rest[:cut], args.rest[cut + 1:]
    for name in args.project_sets:
        serve_args += [f for s in project_sets(name) for f in ("--set", s)]
    deadline = time.monotonic() + args.deadline_s
    interrupt_on_signals()  # `timeout`: stop the server below, do not orphan it
    started = time.monotonic()
    server = Server(sys.executable, serve_args, Path(args.serve_log))
    out_dir, log_dir = Path(args.out).parent, Path(args.serve_log).parent
    reference = Reference(serve_args, out_dir / "serve-reference.json", log_dir / "serve-reference.log")
    result: dict = {"serve_command": " ".join(server.cmd), "url": server.url}
    rc = 1
    try:
        state = server.wait_ready(min(args.ready_timeout_s, deadline - time.monotonic() - args.stop_timeout_s))
        result |= {"ready": state, "start_to_ready_s": round(time.monotonic() - started, 2)}
        if state == "ready":
            result["gpu_memory_used_mib"] = gpu_memory_used_mib()
            result["greedy"] = greedy_check(server, reference, args.greedy_timeout_s)
            rc = run_bench(args, server, bench_args, deadline, result)
    except KeyboardInterrupt:
        result["interrupted"] = True
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second signal must not cut the stop short
        reference.kill()
        result["stop"] = server.stop(args.stop_timeout_s)
        write_json(args.out, result)
        print(json.dumps(result, indent=1), flush=True)
    return rc if result["stop"]["rc"] == 0 else 1


def greedy_check(server: Server, reference: Reference, timeout_s: float) -> dict:
    """The served greedy tokens of `greedy.PROMPTS` and, once the reference is done, their verdicts."""
    started = time.monotonic()
    served = greedy.complete_all(server.url, greedy.PROMPTS, greedy.MAX_TOKENS, timeout_s)
    out: dict = {"max_tokens": greedy.MAX_TOKENS, "near_tie": greedy.NEAR_TIE,
                 "served_s": round(time.monotonic() - started, 2)}
    ref = reference.result(timeout_s - (time.monotonic() - started))
    if isinstance(ref, str):
        return {**out, "reference": ref, "served": served}
    out["reference"] = {k: ref.get(k) for k in ("model", "device", "dtype", "wall_s")}
    out["prompts"] = greedy.compare(served, ref)
    for p in out["prompts"]:
        print(f"serve: greedy {p['prompt']!r}: {p['verdict']}", flush=True)
    return out


def run_bench(args: argparse.Namespace, server: Server, bench_args: list[str], deadline: float, result: dict) -> int:
    cmd = [sys.executable, "-m", "cluster.cli", "bench", "serve", "--base-url", server.url, *bench_args]
    result["bench_command"] = " ".join(cmd)
    print("serve: " + result["bench_command"], flush=True)
    started = time.monotonic()
    with open(args.bench_log, "wb") as log:
        try:
            done = subprocess.run(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                  timeout=max(5.0, deadline - time.monotonic() - args.stop_timeout_s))
            result["bench_rc"] = done.returncode
        except subprocess.TimeoutExpired:
            result["bench_rc"] = "timeout"
    result["bench_wall_s"] = round(time.monotonic() - started, 2)
    output = Path(args.bench_log).read_text(errors="replace")
    print(output[-6000:], flush=True)  # into this step's log too: the errors, the result block
    result["bench"] = last_json_line(output)
    return 0 if result["bench_rc"] == 0 else 1


def add_serve_args(v: argparse.ArgumentParser) -> None:
    v.description = "ARGS: `tandem serve` flags, a lone ::, `tandem bench serve` flags"
    v.add_argument("--out", required=True)
    v.add_argument("--serve-log", required=True)
    v.add_argument("--bench-log", required=True)
    v.add_argument("--deadline-s", type=float, required=True, help="all of it, the stop included")
    v.add_argument("--ready-timeout-s", type=float, default=120.0)
    v.add_argument("--stop-timeout-s", type=float, default=20.0)
    v.add_argument("--greedy-timeout-s", type=float, default=60.0,
                   help="the greedy check's requests and the wait for the reference, together")
    v.add_argument("--project-sets", action="append", default=[], metavar="NAME",
                   help="add cluster.bench.serve's NAME list of --set values (QUEUE_ALL_SETS, LAPTOP_SETS)")
    v.add_argument("rest", nargs=argparse.REMAINDER)
