"""The HTTP side of the load client: POST a JSON body, yield the `data:` payloads of its SSE stream.

One interface, two adapters chosen by name: `AiohttpTransport` when aiohttp is importable (it is not a
tandem dependency, but where it is installed it costs the client about a third of httpx's CPU per
request, which is what bounds the rate one client can drive), else `HttpxTransport`. Error policy, the
same for both: a status other than 200 raises `HTTPStatusError` (status and the start of the body);
connection failures raise what the library raises; the caller turns either into a failed request.
Both read every stream to its end, so the connection goes back to the keep-alive pool.
"""

from __future__ import annotations

import importlib.util
from collections.abc import AsyncIterator

BODY_SNIPPET_BYTES = 300


class HTTPStatusError(RuntimeError):
    def __init__(self, status: int, body: bytes):
        super().__init__(f"HTTP {status}: {body[:BODY_SNIPPET_BYTES].decode(errors='replace')}")
        self.status = status


def _sse_payload(line: str) -> str | None:
    """The payload of a `data:` line; None for blank separators, comments (": ping") and other fields."""
    return line[5:].strip() if line.startswith("data:") else None


class AiohttpTransport:
    """aiohttp session with at most `max_connections` (None: unbounded) keep-alive connections."""

    name = "aiohttp"

    def __init__(self, base_url: str, max_connections: int | None):
        self.base_url, self.max_connections = base_url.rstrip("/"), max_connections
        self.session = None

    async def __aenter__(self) -> AiohttpTransport:
        import aiohttp

        limit = self.max_connections or 0  # aiohttp: 0 is unbounded
        self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=limit, limit_per_host=limit),
                                             timeout=aiohttp.ClientTimeout(total=None))
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.session.close()

    async def sse_data(self, path: str, body: dict, headers: dict) -> AsyncIterator[str]:
        async with self.session.post(self.base_url + path, json=body, headers=headers) as resp:
            if resp.status != 200:
                raise HTTPStatusError(resp.status, await resp.read())
            async for raw in resp.content:  # one line per item
                payload = _sse_payload(raw.decode("utf-8", errors="replace"))
                if payload is not None:
                    yield payload


class HttpxTransport:
    """httpx (a tandem dependency) with at most `max_connections` (None: unbounded) connections."""

    name = "httpx"

    def __init__(self, base_url: str, max_connections: int | None):
        self.base_url, self.max_connections = base_url.rstrip("/"), max_connections
        self.client = None

    async def __aenter__(self) -> HttpxTransport:
        import httpx

        limits = httpx.Limits(max_connections=self.max_connections, max_keepalive_connections=self.max_connections)
        self.client = httpx.AsyncClient(base_url=self.base_url, timeout=httpx.Timeout(None), limits=limits)
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.client.aclose()

    async def sse_data(self, path: str, body: dict, headers: dict) -> AsyncIterator[str]:
        async with self.client.stream("POST", path, json=body, headers=headers) as resp:
            if resp.status_code != 200:
                raise HTTPStatusError(resp.status_code, await resp.aread())
            async for line in resp.aiter_lines():
                payload = _sse_payload(line)
                if payload is not None:
                    yield payload


def make_transport(base_url: str, max_connections: int | None, prefer: str = "auto"):
    """`prefer`: "auto" (aiohttp when importable), "aiohttp" or "httpx"."""
    use_aiohttp = prefer == "aiohttp" or (prefer == "auto" and importlib.util.find_spec("aiohttp") is not None)
    return (AiohttpTransport if use_aiohttp else HttpxTransport)(base_url, max_connections)
