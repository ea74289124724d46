"""Start and stop `tandem serve` (and a Ray head) as real processes for integration tests."""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

REPO = Path(__file__).resolve().parents[2]
NAMESPACE = "tandem"
# A head started by `ray start` takes drivers from other processes only with token auth on both sides.
RAY_ENV = {"RAY_AUTH_MODE": "token"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ray_bin() -> str:
    return str(Path(sys.executable).with_name("ray"))


@dataclass
class RayHead:
    """A head started by `ray start --head` on 127.0.0.1 with its own auth token (a 0600 file under
    the test's directory, never ~/.ray): `env` is what a process joining it needs."""

    address: str
    token_path: Path

    @classmethod
    def start(cls, num_cpus: int, workdir: Path) -> RayHead:
        token_path = workdir / "ray_auth_token"
        token_path.touch(mode=0o600)
        token_path.write_text(secrets.token_hex(32))
        port = free_port()
        head = cls(f"127.0.0.1:{port}", token_path)
        subprocess.run([_ray_bin(), "start", "--head", f"--port={port}", f"--num-cpus={num_cpus}",
                        "--include-dashboard=false", "--disable-usage-stats", "--node-ip-address=127.0.0.1"],
                       check=True, capture_output=True, timeout=120, env={**os.environ, **head.env})
        return head

    @property
    def env(self) -> dict[str, str]:
        return {**RAY_ENV, "RAY_AUTH_TOKEN_PATH": str(self.token_path)}

    def stop(self) -> None:
        subprocess.run([_ray_bin(), "stop", "--force"], capture_output=True, timeout=120)


@dataclass
class Server:
    proc: subprocess.Popen
    port: int
    log_path: Path
    api_key: str | None
    ray_address: str | None = None  # set when it joined a cluster started by the test
    ray_env: dict[str, str] | None = None  # and what a process joining that cluster needs

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def log_tail(self, num_chars: int = 6000) -> str:
        return self.log_path.read_text(errors="replace")[-num_chars:]

    def wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"tandem serve exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if httpx.get(f"{self.base_url}/health/ready", timeout=30).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1.0)
        raise TimeoutError(f"tandem serve not ready within {timeout_s}s:\n{self.log_tail()}")

    def wait_warm(self, timeout_s: float) -> None:
        """Until no worker still compiles its CPU decode step (a served worker is ready before it)."""
        eventually(lambda: all(w["stats"] and not w["stats"]["graphs"]["compiling"] for w in self.workers()),
                   "every worker's decode step compiled", timeout_s)

    def metrics(self) -> dict[tuple[str, tuple], float]:
        """Every sample of /metrics keyed by (name, sorted labels)."""
        text = httpx.get(f"{self.base_url}/metrics", headers=self.headers(), timeout=30).text  # key-guarded
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for fam in text_string_to_metric_families(text) for s in fam.samples}

    def workers(self) -> list[dict]:
        return httpx.get(f"{self.base_url}/debug/workers", headers=self.headers(), timeout=30).json()["workers"]

    def sessions(self) -> set[int]:
        """OS sessions of every process this server started: its own (the harness starts it as a session
        leader), and that of its Ray workers (where the Ray instance it started runs, if it started one)."""
        return {os.getsid(self.proc.pid), *(os.getsid(w["pid"]) for w in self.workers())}

    def terminate(self, timeout_s: float = 120, whole_group: bool = False) -> int:
        """SIGTERM to the server (or, `whole_group`, to its process group, as systemd does); SIGKILL to the
        group if it has not exited within `timeout_s`. Returns the exit code."""
        if self.proc.poll() is None:
            if whole_group:
                os.killpg(self.proc.pid, signal.SIGTERM)
            else:
                self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(30)
        return self.proc.returncode


def start_server(tmp_path: Path, args: list[str], api_key: str | None = None, ready_timeout_s: float = 300,
                 env: dict[str, str] | None = None, warm: bool = True) -> Server:
    """`tandem serve` in its own session, this process's environment updated with `env` (e.g. a
    Ray head's token); ready and, if `warm`, warm (no worker still compiles its decode step beside
    serving, so timing-bound tests meet the steady state: ~10 s more a start), or raises."""
    port = free_port()
    log_path = tmp_path / f"serve-{port}.log"
    base = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "TANDEM_API_KEY")}
    env = {**base, "PYTHONUNBUFFERED": "1", **RAY_ENV, **(env or {})}
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "cluster.cli", "serve", "--port", str(port), *args,
                                 *(["--api-key", api_key] if api_key else [])],
                                cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    server = Server(proc, port, log_path, api_key)
    try:
        server.wait_ready(ready_timeout_s)
        if warm:
            server.wait_warm(ready_timeout_s)
    except BaseException:
        server.terminate(30)
        raise
    return server


@contextlib.contextmanager
def serving(tmp_path_factory, name: str, args: list[str], env: dict[str, str] | None = None,
            warm: bool = True) -> Iterator[Server]:
    """A module's one server: started ready (and `warm`), stopped cleanly (exit code 0) when the module is done."""
    server = start_server(tmp_path_factory.mktemp(name), args, env=env, warm=warm)
    try:
        yield server
    finally:
        assert server.terminate() == 0, server.log_tail()


def metric(samples: dict, name: str, **labels) -> float:
    """Sum of the samples of `name` whose labels include `labels`."""
    return sum(v for (n, lbls), v in samples.items() if n == name and labels.items() <= dict(lbls).items())


def eventually(check, what: str, timeout_s: float = 20) -> None:
    """Wait until `check()` holds: a worker's counters reach /metrics with its next heartbeat."""
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"not within {timeout_s} s: {what}"
        time.sleep(0.5)


def streams_across_a_fault(base_url: str, api_key: str, n: int, fault, timeout_s: float) -> list[str]:
    """`n` greedy 200-token streams ("List i fruits:"); once one has streamed a chunk, `fault()` runs
    (blocking, in a thread); returns each stream's finish reason or "error: <message>", all of which
    must come within `timeout_s` after the fault (no stream hangs)."""
    import openai

    async def run() -> list[str]:
        client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key=api_key, max_retries=0, timeout=300)
        started = asyncio.Event()

        async def one(i: int) -> str:
            try:
                stream = await client.completions.create(model="smollm2", prompt=f"List {i} fruits:", max_tokens=200,
                                                         temperature=0, stream=True, extra_body={"ignore_eos": True})
                async for chunk in stream:
                    started.set()
                    if chunk.choices and chunk.choices[0].finish_reason:
                        return chunk.choices[0].finish_reason
                return "ended without a finish reason"
            except openai.APIError as exc:
                return f"error: {exc.message}"

        tasks = [asyncio.create_task(one(i)) for i in range(n)]
        try:
            await asyncio.wait_for(started.wait(), 120)
            await asyncio.to_thread(fault)
            return await asyncio.wait_for(asyncio.gather(*tasks), timeout_s)
        finally:
            await client.close()

    return asyncio.run(run())


def seeded_streams(base_url: str, api_key: str, n: int, fault=None, timeout_s: float = 180,
                   max_tokens: int = 32, temperature: float = 0.8) -> list[tuple[str, int, float]]:
    """`n` concurrent seeded streams ("List i fruits:", seed i, `max_tokens`, EOS ignored), each
    as (its text, or "error: <message>"; completion tokens from its usage; its longest gap between
    chunks, seconds). With `fault`, once every stream has streamed a chunk, `fault()` runs (blocking,
    in a thread). Every stream must end within `timeout_s`."""
    import openai

    async def run() -> list[tuple[str, int, float]]:
        client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key=api_key, max_retries=0, timeout=300)
        started = [asyncio.Event() for _ in range(n)]

        async def one(i: int) -> tuple[str, int, float]:
            text, tokens, gap, last = [], 0, 0.0, None
            try:
                stream = await client.completions.create(
                    model="smollm2", prompt=f"List {i} fruits:", max_tokens=max_tokens, temperature=temperature, seed=i,
                    stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
                async for chunk in stream:
                    now = time.monotonic()
                    gap, last = max(gap, now - last) if last is not None else 0.0, now
                    if chunk.choices:
                        text.append(chunk.choices[0].text)
                        started[i].set()
                    if chunk.usage is not None:
                        tokens = chunk.usage.completion_tokens
                return "".join(text), tokens, gap
            except openai.APIError as exc:
                started[i].set()
                return f"error: {exc.message}", tokens, gap

        tasks = [asyncio.create_task(one(i)) for i in range(n)]
        try:
            if fault is not None:
                await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 120)
                await asyncio.to_thread(fault)
            return await asyncio.wait_for(asyncio.gather(*tasks), timeout_s)
        finally:
            await client.close()

    return asyncio.run(run())
