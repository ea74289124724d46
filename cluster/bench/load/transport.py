"""The HTTP side of the load client: POST a JSON body, yield the `data:` payloads of its SSE stream.

One interface, two adapters chosen by name: `AiohttpTransport` when aiohttp is importable (it is not a
tandem dependency, but where it is installed it costs the client about a third of httpx's CPU per
request, which is what bounds the rate one client can drive), else `HttpxTransport`. Error policy, the
same for both: a status other than 200 raises `HTTPStatusError` (status and the start of the body);
connection failures raise what the library raises; the caller turns either into a failed request.
Both read every stream to its end, so the connection goes back to the keep-alive pool.

Servers close idle keep-alive connections whenever they like (llama.cpp's `llama-server` even closes
each one right after a streamed response, without saying `Connection: close`), so a request can meet
a pooled connection that the server has just closed. The rule, the same for both adapters — a request
is sent again, once, on a fresh connection (never a pooled one), when all three hold:

    1. its connection was reused: taken from the pool, it had carried an earlier request;
    2. the failure is that connection's end: closed, reset or broken while the request was written or
       its answer awaited (not a timeout, not an HTTP status, not a malformed answer);
    3. no response had begun: not even its status line had arrived (the smallest unit either library
       reports; a connection that ends after a partial status line looks the same).

Why that never sends twice a request the server processed: a server closes a keep-alive connection
only while it is idle, between requests, and drops what arrives on it unread, so a request that met
such a close was never read. A server that reads a request answers its status line first; a streamed
completion's comes before its first token (tandem, llama-server, vLLM). What the rule cannot tell
apart is a server that reads a request and dies before any status line: that request may run twice
on the server (a completion has no effect but its compute) and is counted once here. A request on a
fresh connection, or one whose response had begun, is never sent again: it fails as it is.
`num_retries` counts the requests sent again.

Beside the retry, pooled connections expire after `KEEPALIVE_EXPIRY_S` on the client's side, below
the 5 s idle timeout of uvicorn (tandem, vLLM) and of llama-server's cpp-httplib, the shortest common
defaults, so the client itself drops most connections before a server would.
"""

from __future__ import annotations

import importlib.util
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import aiohttp
    import httpx

BODY_SNIPPET_BYTES = 300
KEEPALIVE_EXPIRY_S = 3.0  # a pooled connection idle this long is closed by the client


class HTTPStatusError(RuntimeError):
    def __init__(self, status: int, body: bytes):
        super().__init__(f"HTTP {status}: {body[:BODY_SNIPPET_BYTES].decode(errors='replace')}")
        self.status = status


def _sse_payload(line: str) -> str | None:
    """The payload of a `data:` line; None for blank separators, comments (": ping") and other fields."""
    return line[5:].strip() if line.startswith("data:") else None


class _Attempt:
    """What one try of a request saw of its connection, set by the library's trace hooks."""

    def __init__(self):
        self.reused = False  # aiohttp: the connector handed it a pooled connection
        self.connected = False  # httpx: it opened a new connection

    async def on_httpcore_event(self, event: str, info: dict) -> None:
        if event == "connection.connect_tcp.started":
            self.connected = True


class AiohttpTransport:
    """aiohttp session with at most `max_connections` (None: unbounded) keep-alive connections, and a
    second one that opens a fresh connection for every request sent again (module docstring)."""

    name = "aiohttp"

    def __init__(self, base_url: str, max_connections: int | None):
        self.base_url, self.max_connections = base_url.rstrip("/"), max_connections
        self.session: aiohttp.ClientSession | None = None  # made by `async with`, as is the fresh one
        self.fresh_session: aiohttp.ClientSession | None = None
        self.num_retries = 0

    def _sessions(self) -> tuple[aiohttp.ClientSession, aiohttp.ClientSession]:
        """(pooled, fresh), made by `__aenter__`."""
        assert self.session is not None and self.fresh_session is not None, "a transport used outside `async with`"
        return self.session, self.fresh_session

    async def __aenter__(self) -> AiohttpTransport:
        import aiohttp

        limit = self.max_connections or 0  # aiohttp: 0 is unbounded
        trace = aiohttp.TraceConfig()
        trace.on_connection_reuseconn.append(_on_aiohttp_reuse)
        timeout = aiohttp.ClientTimeout(total=None)
        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=limit, limit_per_host=limit, keepalive_timeout=KEEPALIVE_EXPIRY_S),
            timeout=timeout, trace_configs=[trace])
        self.fresh_session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=limit, force_close=True),
                                                   timeout=timeout)
        return self

    async def __aexit__(self, *exc_info) -> None:
        session, fresh = self._sessions()
        await session.close()
        await fresh.close()

    async def _post(self, path: str, body: dict, headers: dict):
        """The response, its status line and headers read; sent again once by the module's rule."""
        import aiohttp

        session, fresh = self._sessions()
        attempt = _Attempt()
        try:
            return await session.post(self.base_url + path, json=body, headers=headers, trace_request_ctx=attempt)
        except (aiohttp.ClientOSError, aiohttp.ServerDisconnectedError, _connection_reset_error(aiohttp)) as exc:
            # ServerDisconnectedError carries what the parser made of a partial response, else a string
            nothing_parsed = not isinstance(exc, aiohttp.ServerDisconnectedError) or isinstance(exc.message, str)
            if not attempt.reused or isinstance(exc, aiohttp.ClientConnectorError) or not nothing_parsed:
                raise
        self.num_retries += 1
        return await fresh.post(self.base_url + path, json=body, headers=headers)

    async def sse_data(self, path: str, body: dict, headers: dict) -> AsyncIterator[str]:
        async with await self._post(path, body, headers) as resp:
            if resp.status != 200:
                raise HTTPStatusError(resp.status, await resp.read())
            async for raw in resp.content:  # one line per item
                payload = _sse_payload(raw.decode("utf-8", errors="replace"))
                if payload is not None:
                    yield payload


def _connection_reset_error(aiohttp) -> type[Exception]:
    """A write to a closing transport: aiohttp >= 3.10 raises its own type, older ones ClientOSError."""
    return getattr(aiohttp, "ClientConnectionResetError", aiohttp.ClientOSError)


async def _on_aiohttp_reuse(session, context, params) -> None:
    if isinstance(context.trace_request_ctx, _Attempt):
        context.trace_request_ctx.reused = True


class HttpxTransport:
    """httpx (a tandem dependency) with at most `max_connections` (None: unbounded) connections, and a
    second client that keeps none alive, for the requests sent again (module docstring)."""

    name = "httpx"

    def __init__(self, base_url: str, max_connections: int | None):
        self.base_url, self.max_connections = base_url.rstrip("/"), max_connections
        self.client: httpx.AsyncClient | None = None  # made by `async with`, as is the fresh one
        self.fresh_client: httpx.AsyncClient | None = None
        self.num_retries = 0

    def _clients(self) -> tuple[httpx.AsyncClient, httpx.AsyncClient]:
        """(pooled, fresh), made by `__aenter__`."""
        assert self.client is not None and self.fresh_client is not None, "a transport used outside `async with`"
        return self.client, self.fresh_client

    async def __aenter__(self) -> HttpxTransport:
        import httpx

        limits = httpx.Limits(max_connections=self.max_connections, max_keepalive_connections=self.max_connections,
                              keepalive_expiry=KEEPALIVE_EXPIRY_S)
        self.client = httpx.AsyncClient(base_url=self.base_url, timeout=httpx.Timeout(None), limits=limits)
        self.fresh_client = httpx.AsyncClient(
            base_url=self.base_url, timeout=httpx.Timeout(None),
            limits=httpx.Limits(max_connections=self.max_connections, max_keepalive_connections=0))
        return self

    async def __aexit__(self, *exc_info) -> None:
        client, fresh = self._clients()
        await client.aclose()
        await fresh.aclose()

    async def _send(self, path: str, body: dict, headers: dict):
        """The response, its status line and headers read; sent again once by the module's rule."""
        import httpx

        client, fresh = self._clients()
        attempt = _Attempt()
        request = client.build_request("POST", path, json=body, headers=headers,
                                            extensions={"trace": attempt.on_httpcore_event})
        try:
            return await client.send(request, stream=True)
        except (httpx.ReadError, httpx.WriteError, httpx.RemoteProtocolError) as exc:
            # httpcore's words for an end of stream before any response; other protocol errors parsed bytes
            nothing_parsed = not isinstance(exc, httpx.RemoteProtocolError) or "without sending a response" in str(exc)
            if attempt.connected or not nothing_parsed:
                raise
        self.num_retries += 1
        return await fresh.send(fresh.build_request("POST", path, json=body, headers=headers), stream=True)

    async def sse_data(self, path: str, body: dict, headers: dict) -> AsyncIterator[str]:
        resp = await self._send(path, body, headers)
        try:
            if resp.status_code != 200:
                raise HTTPStatusError(resp.status_code, await resp.aread())
            async for line in resp.aiter_lines():
                payload = _sse_payload(line)
                if payload is not None:
                    yield payload
        finally:
            await resp.aclose()


def make_transport(base_url: str, max_connections: int | None, prefer: str = "auto"):
    """`prefer`: "auto" (aiohttp when importable), "aiohttp" or "httpx"."""
    use_aiohttp = prefer == "aiohttp" or (prefer == "auto" and importlib.util.find_spec("aiohttp") is not None)
    return (AiohttpTransport if use_aiohttp else HttpxTransport)(base_url, max_connections)
