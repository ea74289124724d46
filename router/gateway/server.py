"""Running a gateway app under uvicorn, programmatically: bind (port 0 allowed), serve, drain, stop.

    server = GatewayServer(app, config)
    port = server.start_in_thread()      # or: await server.serve(on_started=...) in your own loop
    ...
    server.stop()                        # thread-safe; then server.join()

Shutdown is graceful: `stop()` sets `app.state.draining` (new /v1 requests on open connections get
503 + Retry-After), uvicorn stops accepting connections, waits up to `graceful_timeout_s` for the
requests in flight (streams included) and then cancels them, which aborts their backend requests;
finally the app's lifespan shutdown runs `build_app(on_shutdown=...)`.

Connections are bounded by the config: `max_connections` open at most (beyond it a request gets a
JSON 503 in the API's error shape and its connection closes), a request head must arrive within
`header_timeout_s` (uvicorn has no such deadline; this module's protocol adds it), an idle keep-alive
connection closes after `keep_alive_timeout_s`; the body's deadline is the app's (`body_timeout_s`).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import socket
import threading
from collections.abc import Callable

import uvicorn
from fastapi import FastAPI
from uvicorn.protocols.http.h11_impl import H11Protocol, RequestResponseCycle

from router.gateway.config import GatewayConfig
from router.gateway.errors import APIError

log = logging.getLogger(__name__)

STARTUP_POLL_S = 0.01


class HeadTimeoutH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a deadline on each request head (request line and headers).

    A connection that opened, or finished its previous response, and has not sent a whole head within
    `head_timeout_s` is closed. Without it an idle or slow-header connection (slowloris) would hold,
    forever, a place that `limit_concurrency` counts. Subclass with the deadline set, see `_protocol`.
    """

    head_timeout_s = 10.0
    max_connections = 1024

    # narrower than asyncio's BaseTransport, as uvicorn's own override is: a stream protocol is handed a Transport
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.app = functools.partial(_within_connection_limit, self.app, self)
        self._head_timer: asyncio.TimerHandle | None = None
        self._cycle_awaited_after: RequestResponseCycle | None = None  # the cycle before the head being awaited
        self._arm_head_timer()

    def handle_events(self) -> None:
        super().handle_events()
        if self._head_timer is not None and self.cycle is not self._cycle_awaited_after:
            self._cancel_head_timer()  # a new request's head arrived: its body has a deadline of its own

    def on_response_complete(self) -> None:
        self._arm_head_timer()  # before super(): it may start a pipelined request, which disarms it
        super().on_response_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head_timer()
        super().connection_lost(exc)

    def _arm_head_timer(self) -> None:
        self._cancel_head_timer()
        self._cycle_awaited_after = self.cycle
        self._head_timer = self.loop.call_later(self.head_timeout_s, self._on_head_timeout)

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _on_head_timeout(self) -> None:
        self._head_timer = None
        if not self.transport.is_closing():
            log.info("closing a connection that sent no complete request head within %s s", self.head_timeout_s)
            self.transport.close()


async def _within_connection_limit(app, protocol: HeadTimeoutH11Protocol, scope, receive, send) -> None:
    """`app`, unless the server holds more than `max_connections` connections (this one counted) or
    requests: then a JSON 503 in the API's error shape, and the connection closes. uvicorn's own
    `limit_concurrency` would answer in plain text."""
    limit = protocol.max_connections
    if scope["type"] == "http" and (len(protocol.connections) > limit or len(protocol.tasks) > limit):
        error = APIError(503, f"too many open connections (gateway.max_connections = {limit})", code="unavailable",
                         close_connection=True)
        await error.response()(scope, receive, send)
        return
    await app(scope, receive, send)


def _protocol(head_timeout_s: float, max_connections: int) -> type[HeadTimeoutH11Protocol]:
    return type("HeadTimeoutH11Protocol", (HeadTimeoutH11Protocol,),
                {"head_timeout_s": head_timeout_s, "max_connections": max_connections})


class GatewayServer:
    """One uvicorn server for one app on `config.host:config.port`. Serve it once."""

    def __init__(self, app: FastAPI, config: GatewayConfig, *, graceful_timeout_s: float = 30.0,
                 log_level: str = "warning", access_log: bool = False):
        self.app, self.config = app, config
        self._uvicorn = uvicorn.Server(uvicorn.Config(
            app, host=config.host, port=config.port, lifespan="on", log_level=log_level, access_log=access_log,
            # uvicorn types these two seconds as int; it hands them to asyncio, which takes fractions
            timeout_graceful_shutdown=graceful_timeout_s,  # type: ignore[arg-type]
            http=_protocol(config.header_timeout_s, config.max_connections),
            timeout_keep_alive=config.keep_alive_timeout_s))  # type: ignore[arg-type]
        self._socket: socket.socket | None = None
        self._port: int | None = None  # kept: uvicorn closes the socket at shutdown
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    @property
    def port(self) -> int:
        """The bound TCP port (the real one when the config says 0). Binds on first use."""
        return self.bind()

    def bind(self) -> int:
        """Bind the listening socket now (idempotent); returns the port. Raises OSError (port in use)."""
        self._bind()
        assert self._port is not None, "_bind sets the port beside the socket"
        return self._port

    @property
    def started(self) -> bool:
        return self._uvicorn.started

    @property
    def uvicorn_server(self) -> uvicorn.Server:
        """The uvicorn server underneath, for code that drives uvicorn's own shutdown flags
        (`should_exit`, `force_exit`) as its signal handlers do."""
        return self._uvicorn

    async def serve(self, on_started: Callable[[int], None] | None = None) -> None:
        """Serve until `stop()` (or SIGINT/SIGTERM when run on the main thread). `on_started(port)` is
        called once the server accepts connections."""
        sock = self._bind()
        watcher = asyncio.ensure_future(self._announce(on_started or (lambda _: None)))
        try:
            await self._uvicorn.serve(sockets=[sock])
        finally:
            watcher.cancel()

    def stop(self) -> None:
        """Begin a graceful shutdown. Safe from any thread; returns at once (use `join` to wait)."""
        self.app.state.draining = True
        self._uvicorn.should_exit = True

    def start_in_thread(self, timeout_s: float = 30.0) -> int:
        """Serve from a daemon thread with its own event loop; returns the port once serving."""
        assert self._thread is None, "this server was already started"
        started = threading.Event()
        self._thread = threading.Thread(target=self._thread_main, args=(started,), name="tandem-gateway",
                                        daemon=True)
        self._thread.start()
        if not started.wait(timeout_s):
            self.stop()
            raise TimeoutError(f"the gateway did not start within {timeout_s} s")
        if self._error is not None:
            raise RuntimeError("the gateway failed to start") from self._error
        return self.port

    def join(self, timeout_s: float | None = None) -> bool:
        """Wait for a threaded server to finish; True when it did."""
        if self._thread is None:
            return True
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    # ---- helpers -------------------------------------------------------------------------------
    def _bind(self) -> socket.socket:
        """Bind the listening socket ourselves so the port is known before uvicorn starts."""
        if self._socket is None:
            family = socket.AF_INET6 if ":" in self.config.host else socket.AF_INET
            sock = socket.socket(family, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind((self.config.host, self.config.port))
            except OSError:
                sock.close()
                raise
            self._socket, self._port = sock, sock.getsockname()[1]
        return self._socket

    async def _announce(self, on_started: Callable[[int], None]) -> None:
        while not self._uvicorn.started:
            if self._uvicorn.should_exit:
                return
            await asyncio.sleep(STARTUP_POLL_S)
        log.info("gateway serving on http://%s:%d", self.config.host, self.port)
        on_started(self.port)

    def _thread_main(self, started: threading.Event) -> None:
        try:
            asyncio.run(self.serve(on_started=lambda _: started.set()))
        except BaseException as exc:  # noqa: BLE001 - surfaced by start_in_thread; a thread has nobody else to tell
            self._error = exc
        finally:
            started.set()


def run_gateway(app: FastAPI, config: GatewayConfig, *, on_started: Callable[[int], None] | None = None,
                graceful_timeout_s: float = 30.0, log_level: str = "info") -> None:
    """Serve `app` on the calling thread until SIGINT/SIGTERM (graceful, see the module docstring)."""
    server = GatewayServer(app, config, graceful_timeout_s=graceful_timeout_s, log_level=log_level,
                           access_log=True)
    asyncio.run(server.serve(on_started=on_started))
