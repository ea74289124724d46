"""The llama.cpp servers `tandem bench llamacpp` can run beside tandem, chosen by name (`--peer`).

    llama-server       llama.cpp's C++ OpenAI server (default): what a CPU user would run. `-np C` slots
                       (C = the bench's concurrency) with continuous batching over one shared KV of
                       `max(16384, C x tokens per sequence)` tokens (`--kv-unified`), fp32 weights and
                       KV (`-ctk f32 -ctv f32`), `-t`/`-tb` threads. It honours `ignore_eos`, so every
                       stream has its exact length. A prebuilt binary, never a tandem dependency: found
                       by `--llama-server PATH`, else `$TANDEM_LLAMA_SERVER`, else `llama-server` on PATH.
    llama-cpp-python   llama-cpp-python's Python server (`python -m llama_cpp.server`), only when asked:
                       one request at a time, no EOS override (streams may end early).

`make_peer` builds the one named, or raises `PeerUnavailable` saying what it lacks. A peer starts as
a child process on a free loopback port with its output in a temp log, answers `token_ids` (its
tokenizer endpoint: llama-server `/tokenize`, llama-cpp-python `/extras/tokenize`), and adds its own
fields to every request body (`extra_body`).
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

from cluster.bench.serve import STOP_TIMEOUT_S, SpawnedServer, wait_ready

log = logging.getLogger("tandem.bench")

LLAMA_SERVER_ENV = "TANDEM_LLAMA_SERVER"
LLAMA_SERVER_KV_TOKENS = 16384  # the shared KV of llama-server's slots, at least (a 16-user CPU server)
PYTHON_SERVER_MODULES = ("llama_cpp", "sse_starlette", "starlette_context", "pydantic_settings")
PYTHON_INSTALL_HINT = (
    "llama-cpp-python with its server extra is not installed in this environment; it is a bench-only tool, "
    "not a tandem dependency. Install it once (it builds llama.cpp from source, about 15 minutes on 2 cores):\n"
    "    CMAKE_ARGS=\"-DGGML_NATIVE=ON\" .venv/bin/pip install 'llama-cpp-python[server]'")


class PeerProcess(SpawnedServer):
    """A peer server as a child process of this one (its own session), on a free loopback port."""

    def __init__(self, name: str, cmd_before_port: list[str], cmd_after_port: list[str]):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.name, self.url = name, f"http://127.0.0.1:{port}"
        log_fd, self.log_path = tempfile.mkstemp(prefix=f"{name}-", suffix=".log")
        cmd = [*cmd_before_port, "--host", "127.0.0.1", "--port", str(port), *cmd_after_port]
        self.proc = subprocess.Popen(cmd, stdout=log_fd, stderr=subprocess.STDOUT, start_new_session=True,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1"})
        os.close(log_fd)
        log.info("started %s (pid %d) on port %d; its log: %s", name, self.proc.pid, port, self.log_path)

    def stop(self) -> int:
        """SIGTERM (SIGKILL to the group on timeout). Death by SIGTERM counts as a clean exit (0), as
        does 0 (uvicorn re-raises SIGTERM after a clean shutdown); the log is kept otherwise."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(30)
        if self.proc.returncode in (0, -signal.SIGTERM):
            os.unlink(self.log_path)
            return 0
        print(f"{self.name} exited with code {self.proc.returncode}; its log ends:\n{self.log_tail()}",
              file=sys.stderr)
        return self.proc.returncode


def find_llama_server(flag: str | None) -> Path:
    """The llama-server binary: `flag`, else `$TANDEM_LLAMA_SERVER`, else `llama-server` on PATH.
    Raises FileNotFoundError naming those three ways when none gives an executable file."""
    for given, origin in ((flag, "--llama-server"), (os.environ.get(LLAMA_SERVER_ENV), f"${LLAMA_SERVER_ENV}")):
        if given:
            path = Path(given).expanduser()
            if not (path.is_file() and os.access(path, os.X_OK)):
                raise FileNotFoundError(f"{origin} {given}: not an executable file")
            return path
    found = shutil.which("llama-server")
    if found is None:
        raise FileNotFoundError(
            "llama.cpp's llama-server was not found: pass --llama-server PATH, set $TANDEM_LLAMA_SERVER, or put "
            "llama-server on PATH (build it from llama.cpp with cmake -DGGML_NATIVE=ON; --peer llama-cpp-python "
            "runs llama-cpp-python's server instead)")
    return Path(found)


class PeerUnavailable(RuntimeError):
    """The peer asked for cannot run here; the message says how to get it."""


class LlamaServerPeer:
    name = "llama-server"
    extra_body = {"ignore_eos": True, "stream_options": {"include_usage": True}}
    ready_path = "/health"  # 503 while the model loads

    def __init__(self, binary: Path, extra_args: list[str]):
        self.binary, self.extra_args = binary, extra_args

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> LlamaServerPeer:
        try:
            return cls(find_llama_server(args.llama_server), args.llamacpp_arg)
        except FileNotFoundError as exc:
            raise PeerUnavailable(str(exc)) from None

    def start(self, gguf_path: Path, threads: int, num_slots: int, tokens_per_sequence: int) -> PeerProcess:
        kv_tokens = max(LLAMA_SERVER_KV_TOKENS, num_slots * tokens_per_sequence)
        return PeerProcess(self.name, [str(self.binary), "-m", str(gguf_path)],
                           ["-t", str(threads), "-tb", str(threads), "-np", str(num_slots), "-c", str(kv_tokens),
                            "--kv-unified", "-ctk", "f32", "-ctv", "f32", "--no-webui", *self.extra_args])

    @staticmethod
    def token_ids(url: str, text: str) -> list[int]:
        import httpx

        return httpx.post(f"{url}/tokenize", json={"content": text, "add_special": False}, timeout=60).json()["tokens"]


class LlamaCppPythonPeer:
    name = "llama-cpp-python"
    extra_body = {"repeat_penalty": 1.0}
    ready_path = "/v1/models"  # it loads the model before it listens

    def __init__(self, extra_args: list[str]):
        self.extra_args = extra_args

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> LlamaCppPythonPeer:
        missing = [name for name in PYTHON_SERVER_MODULES if importlib.util.find_spec(name) is None]
        if missing:
            raise PeerUnavailable(f"cannot import {', '.join(missing)}.\n{PYTHON_INSTALL_HINT}")
        return cls(args.llamacpp_arg)

    def start(self, gguf_path: Path, threads: int, num_slots: int, tokens_per_sequence: int) -> PeerProcess:
        # logits_all False: the server's default (True) computes the LM head over every prompt token
        # interrupt_requests False: its default cuts a running stream short when another request arrives
        return PeerProcess(self.name, [sys.executable, "-m", "llama_cpp.server", "--model", str(gguf_path)],
                           ["--n_threads", str(threads), "--n_threads_batch", str(threads),
                            "--n_ctx", str(max(2048, tokens_per_sequence)), "--logits_all", "false",
                            "--interrupt_requests", "false", "--verbose", "false", *self.extra_args])

    @staticmethod
    def token_ids(url: str, text: str) -> list[int]:
        import httpx

        return httpx.post(f"{url}/extras/tokenize", json={"input": text}, timeout=60).json()["tokens"]


PEERS = {peer.name: peer for peer in (LlamaServerPeer, LlamaCppPythonPeer)}


def make_peer(args: argparse.Namespace):
    """The peer `--peer` names, ready to start; raises PeerUnavailable when it cannot run here."""
    return PEERS[args.peer].from_args(args)


def wait_peer_ready(peer, server: PeerProcess, timeout_s: float) -> None:
    wait_ready(server, {}, timeout_s, path=peer.ready_path, name=peer.name)
