"""A `redis-server` process of our own: a free loopback port, its own work dir, no persistence.

`tandem bench hicache` starts one for its L3 phase when given no `--l3-url`; the tests start their
own (tests/redis_server.py re-exports this module).

    server = RedisServer(work_dir).start()    # waits until it answers PING
    server.url                                # redis://127.0.0.1:<port>/0 (with the password if any)
    server.kill(); server.start()             # a crash and a restart on the same port (empty again)
    server.pause(); server.resume()           # SIGSTOP / SIGCONT: calls to it time out meanwhile
    server.stop()

`tls=True` serves TLS only, with a self-signed certificate made by the `openssl` CLI; `url` is then
`rediss://...` with that certificate as the CA to verify against.

The binary comes from the Debian package redis-server (`scripts/setup.sh test` installs it);
`redis_server_path()` says whether it is there, `start()` raises RuntimeError when it is not.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Any
from urllib.parse import quote

import redis

START_TIMEOUT_S = 10.0


def redis_server_path() -> str | None:
    """The `redis-server` binary on PATH, or None when it is not installed."""
    return shutil.which("redis-server")


def redis_server_binary() -> str:
    path = redis_server_path()
    if path is None:
        raise RuntimeError("redis-server is not installed: run `bash scripts/setup.sh test` "
                           "(it installs the Debian package redis-server)")
    return path


def free_loopback_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """One redis-server process owned by its starter; `stop()` it (fixtures and the bench do) or it
    outlives the process that started it."""

    def __init__(self, workdir: Path, password: str | None = None, extra_args: tuple[str, ...] = (),
                 tls: bool = False):
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.password = password
        self.tls = tls
        self.extra_args = tuple(extra_args)
        self.port = free_loopback_port()
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password is not None else ""
        if self.tls:
            return (f"rediss://{auth}127.0.0.1:{self.port}/0"
                    f"?ssl_cert_reqs=required&ssl_ca_certs={quote(str(self.cert_file))}")
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    @property
    def cert_file(self) -> Path:
        return self.workdir / "cert.pem"

    def client(self) -> redis.Redis:
        """A plain client for the owner's own reads (tests: and tampering)."""
        tls: dict[str, Any] = {"ssl": True, "ssl_ca_certs": str(self.cert_file)} if self.tls else {}
        return redis.Redis(host="127.0.0.1", port=self.port, password=self.password, socket_timeout=5, **tls)

    def start(self) -> RedisServer:
        assert self.proc is None or self.proc.poll() is not None, "redis-server already running"
        args = [redis_server_binary(), "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.workdir),
                "--save", "", "--appendonly", "no", "--daemonize", "no", "--logfile", "redis.log"]
        if self.password is not None:
            args += ["--requirepass", self.password]
        if self.tls:
            args[args.index("--port") + 1] = "0"
            args += ["--tls-port", str(self.port), "--tls-auth-clients", "no", "--tls-cert-file", str(self.cert_file),
                     "--tls-key-file", str(self._make_certificate()), "--tls-ca-cert-file", str(self.cert_file)]
        self.proc = subprocess.Popen(args + list(self.extra_args), cwd=self.workdir,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self._wait_ready()
        return self

    def kill(self) -> None:
        """SIGKILL, as a crash: no shutdown, connections reset."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)

    @property
    def pid(self) -> int:
        assert self.proc is not None, "redis-server has no process: start() it first"
        return self.proc.pid

    def pause(self) -> None:
        os.kill(self.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.kill(self.pid, signal.SIGCONT)

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        os.kill(self.proc.pid, signal.SIGCONT)  # a paused server cannot act on SIGTERM
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)

    def _make_certificate(self) -> Path:
        """A self-signed certificate for 127.0.0.1 (made once); returns its key file."""
        key = self.workdir / "key.pem"
        if not key.exists():
            if shutil.which("openssl") is None:
                raise RuntimeError("the TLS tests need the openssl command (Debian package openssl)")
            subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                            "-nodes", "-days", "2", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
                            "-keyout", str(key), "-out", str(self.cert_file)], check=True, capture_output=True)
        return key

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        client, proc = self.client(), self.proc
        assert proc is not None, "redis-server awaited before it was started"
        try:
            while True:
                if proc.poll() is not None:
                    log = (self.workdir / "redis.log").read_text(errors="replace")[-2000:]
                    raise RuntimeError(f"redis-server exited with {proc.returncode}:\n{log}")
                try:
                    if client.ping():
                        return
                except redis.ConnectionError:
                    pass
                if time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"redis-server on port {self.port} not ready after {START_TIMEOUT_S} s")
                time.sleep(0.02)
        finally:
            client.close()
