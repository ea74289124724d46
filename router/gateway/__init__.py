"""The OpenAI-compatible HTTP gateway (the only package that imports fastapi, starlette, uvicorn).

    app = build_app(backend, GatewayConfig(...), on_shutdown=...)   # router.gateway.app
    server = GatewayServer(app, config); port = server.start_in_thread()   # or: run_gateway(app, config)
    server.stop()   # drain: new /v1 requests get 503, in-flight ones finish, then on_shutdown runs

The names below load on first use, so `router.gateway.config` (read by every CLI command's config)
does not pull the web stack into commands that never serve.
"""

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # for readers and type checkers; at run time `__getattr__` below loads them on first use
    from router.gateway.app import build_app
    from router.gateway.server import GatewayServer, run_gateway

_EXPORTS = {"build_app": "router.gateway.app", "GatewayServer": "router.gateway.server",
            "run_gateway": "router.gateway.server"}

__all__ = ["GatewayServer", "build_app", "run_gateway"]


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
