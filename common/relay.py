"""The token relay: a worker's messages to the gateway over one TCP connection it opens itself.

Without it, the dispatcher long-polls each worker through a Ray call (`collect`), one call per
scheduler step; at one token per step, that call is most of what serving a token costs besides the
step itself (Ray's threads in the gateway and the worker, per token, taken from the cores the step
computes on: docs/results.md#transfer). Over the relay, a step's messages are one length-prefixed
pickle written by the worker's loop thread and read by the gateway's event loop.

    dispatcher --RelayTo(host, port, hello)--> worker loop: connects, sends `hello`
    worker loop --[4-byte length][pickle of a list of messages]--> RelayServer --> on_messages

`hello` is the dispatcher's secret (fresh per start) followed by the worker's peer id; the server
unpickles nothing before the secret matched, and closes a connection whose hello is wrong or late.
The collect long-poll stays: it still carries what the worker sent before the relay opened, a
crash report, and the worker's death (a failed call). When a send fails, the worker goes back to the
long-poll with that batch and every later one. A batch TCP accepted just before the gateway's end
closed is lost with it; the gateway closes a relay only when it shuts down (or, a bug, on a frame it
cannot read), so a worker's own failure never loses a message.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import pickle
import secrets
import socket
import struct
from collections.abc import Callable

log = logging.getLogger("tandem.relay")

HEADER = struct.Struct("!I")
SECRET_BYTES = 32
MAX_HELLO_BYTES = SECRET_BYTES + 512
MAX_FRAME_BYTES = 64 * 2**20
HELLO_TIMEOUT_S = 5.0
CONNECT_TIMEOUT_S = 5.0
SEND_TIMEOUT_S = 30.0
"""A send blocked this long (the gateway stopped reading) fails: the worker goes back to the long-poll."""


def new_secret() -> bytes:
    return secrets.token_bytes(SECRET_BYTES)


def hello(secret: bytes, peer_id: str) -> bytes:
    return secret + peer_id.encode()


class RelaySender:
    """The worker's end: a blocking socket its loop thread writes each batch of messages to."""

    def __init__(self, host: str, port: int, hello_bytes: bytes) -> None:
        self.sock = socket.create_connection((host, port), timeout=CONNECT_TIMEOUT_S)
        try:
            self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self.sock.settimeout(SEND_TIMEOUT_S)
            self.sock.sendall(HEADER.pack(len(hello_bytes)) + hello_bytes)
        except OSError:
            self.sock.close()
            raise

    def send(self, msgs: list) -> None:
        """Raises OSError when the connection is gone or the gateway stopped reading."""
        payload = pickle.dumps(msgs, protocol=pickle.HIGHEST_PROTOCOL)
        self.sock.sendall(HEADER.pack(len(payload)) + payload)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()


Sink = tuple[Callable[[list], None], Callable[[str], None]]
"""(on_messages, on_closed) for one accepted worker."""


class RelayServer:
    """The gateway's end: accepts workers' connections on `host` (a free port), checks each hello
    with `accept(peer_id)` (None: refused), then hands every frame's messages to the sink."""

    def __init__(self, host: str, secret: bytes, accept: Callable[[str], Sink | None]) -> None:
        self.host, self._secret, self._accept = host, secret, accept
        self._server: asyncio.base_events.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self.port = 0

    async def start(self) -> int:
        self._server = await asyncio.start_server(self._serve, self.host, 0, limit=2**16)
        self.port = self._server.sockets[0].getsockname()[1]
        return self.port

    async def close(self) -> None:
        if self._server is None:
            return
        self._server.close()
        for writer in list(self._writers):
            writer.close()
        with contextlib.suppress(Exception):
            await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.add(writer)
        try:
            try:
                first = await asyncio.wait_for(_read_frame(reader, MAX_HELLO_BYTES), HELLO_TIMEOUT_S)
            except (asyncio.TimeoutError, asyncio.IncompleteReadError, ValueError, OSError) as exc:
                log.warning("relay: a connection sent no valid hello (%s); closed", type(exc).__name__)
                return
            given, peer_id = first[:SECRET_BYTES], first[SECRET_BYTES:].decode(errors="replace")
            sink = self._accept(peer_id) if hmac.compare_digest(given, self._secret) else None
            if sink is None:
                log.warning("relay: refused a connection (a wrong secret, or no live worker %r)", peer_id)
                return
            on_messages, on_closed = sink
            why = "closed by the worker"
            try:
                while True:
                    on_messages(pickle.loads(await _read_frame(reader, MAX_FRAME_BYTES)))
            except asyncio.IncompleteReadError:
                pass
            except (ValueError, OSError, pickle.UnpicklingError) as exc:
                why = f"{type(exc).__name__}: {exc}"
            on_closed(why)
        finally:
            self._writers.discard(writer)
            writer.close()


async def _read_frame(reader: asyncio.StreamReader, max_bytes: int) -> bytes:
    (size,) = HEADER.unpack(await reader.readexactly(HEADER.size))
    if size > max_bytes:
        raise ValueError(f"a frame of {size} bytes (at most {max_bytes})")
    return await reader.readexactly(size)
