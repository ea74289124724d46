"""Which `Host` and `Origin` headers the gateway answers: its defense against DNS rebinding and
cross-site requests from browsers.

Any web page can make a browser send requests to http://127.0.0.1:8000 (a cross-site POST with a
`text/plain` body needs no CORS preflight), and DNS rebinding points a page's own name at 127.0.0.1
so that it can also read the answers. Neither can choose the headers the browser sends: `Host` names
the page's server, `Origin` the page. So a request is served only when

    Host    names this server: an allowed host name, with the port the connection arrived on or none;
    Origin  is absent (non-browser clients), or names an allowed host the same way.

The allowed host names are `gateway.allowed_hosts` when set ("*": any host, no check at all), else
derived from the bind address:

    bind address                    allowed host names
    loopback (127.x, ::1, localhost)  127.0.0.1, localhost, ::1 (written [::1] in a Host header),
                                      and the bind address itself
    wildcard (0.0.0.0, ::)            any: the operator opened the server to the network (a warning
                                      at start-up asks for gateway.allowed_hosts)
    any other address or name         that address or name

Everything else gets 403 in the error shape. Checked by `HostGuard` before any route runs.
"""

from __future__ import annotations

import ipaddress
import logging
from collections.abc import Iterable
from dataclasses import dataclass
from urllib.parse import urlsplit

from starlette.types import ASGIApp, Receive, Scope, Send

from router.gateway.errors import APIError

log = logging.getLogger(__name__)

ANY_HOST = "*"
LOOPBACK_NAMES = frozenset({"127.0.0.1", "localhost", "::1"})
WILDCARD_BINDS = frozenset({"", "0.0.0.0", "::"})


@dataclass(frozen=True)
class HostPolicy:
    """Allowed host names (lower case, IPv6 without brackets); None: every host is allowed."""

    names: frozenset[str] | None

    @classmethod
    def for_bind(cls, bind_host: str, allowed_hosts: Iterable[str] | None) -> HostPolicy:
        if allowed_hosts is not None:
            names = frozenset(_normal_name(h) for h in allowed_hosts)
            return cls(None if ANY_HOST in names else names)
        if bind_host in WILDCARD_BINDS:
            log.warning("the gateway listens on every interface (%r) and answers any Host header: set "
                        "gateway.allowed_hosts to the names clients use, to refuse DNS-rebinding requests",
                        bind_host)
            return cls(None)
        if _is_loopback(bind_host):
            return cls(LOOPBACK_NAMES | {_normal_name(bind_host)})  # 127.0.0.2 is loopback too
        return cls(frozenset({_normal_name(bind_host)}))

    def check(self, scope: Scope) -> APIError | None:
        """None when the request may be served, else the 403 to answer."""
        if self.names is None:
            return None
        headers = {k: v for k, v in scope.get("headers", ()) if k in (b"host", b"origin")}
        server = scope.get("server")
        port = server[1] if server and len(server) > 1 else None
        host = headers.get(b"host", b"").decode("latin-1")
        if not self._allows(host, port):
            return APIError(403, f"the Host header {host!r} does not name this server (allowed: "
                                 f"{', '.join(sorted(self.names))}; see gateway.allowed_hosts)",
                            code="forbidden_host", param="Host")
        origin = headers.get(b"origin")
        if origin is not None and not self._allows_origin(origin.decode("latin-1"), port):
            return APIError(403, f"cross-site requests are refused (Origin {origin.decode('latin-1')!r})",
                            code="forbidden_origin", param="Origin")
        return None

    def _allows(self, host: str, port: int | None) -> bool:
        name, host_port = _split_host(host)
        return self.names is None or (name in self.names
                                      and (host_port is None or port is None or host_port == port))

    def _allows_origin(self, origin: str, port: int | None) -> bool:
        try:
            parts = urlsplit(origin)
            return parts.scheme in ("http", "https") and self._allows(parts.netloc, port)
        except ValueError:  # "null", a malformed port, ...
            return False


class HostGuard:
    """ASGI middleware: answers 403 to HTTP requests that `policy` refuses."""

    def __init__(self, app: ASGIApp, policy: HostPolicy):
        self.app, self.policy = app, policy

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            refused = self.policy.check(scope)
            if refused is not None:
                await refused.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _split_host(host: str) -> tuple[str, int | None]:
    """("name", port or None) of a Host header value; ("", None) when it is malformed."""
    host = host.strip()
    if host.startswith("["):  # [v6] or [v6]:port
        name, bracket, rest = host[1:].partition("]")
        port_text = rest[1:] if rest.startswith(":") else None
        if not bracket or (rest and port_text is None):
            return "", None
    else:
        name, sep, port_text = host.rpartition(":")
        if not sep:
            name, port_text = host, None
    if port_text is not None and not (port_text.isdigit() and len(port_text) <= 5):
        return "", None
    return _normal_name(name), int(port_text) if port_text is not None else None


def _normal_name(name: str) -> str:
    return name.strip().strip("[]").rstrip(".").lower()


def _is_loopback(host: str) -> bool:
    if _normal_name(host) == "localhost":
        return True
    try:
        return ipaddress.ip_address(_normal_name(host)).is_loopback
    except ValueError:
        return False
