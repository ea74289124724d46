"""The OpenAI-compatible HTTP gateway (the only package that imports fastapi, starlette, uvicorn).

    app = build_app(backend, GatewayConfig(...), on_shutdown=...)   # router.gateway.app
    server = GatewayServer(app, config); port = server.start_in_thread()   # or: run_gateway(app, config)
    server.stop()   # drain: new /v1 requests get 503, in-flight ones finish, then on_shutdown runs
"""

from router.gateway.app import build_app
from router.gateway.server import GatewayServer, run_gateway

__all__ = ["GatewayServer", "build_app", "run_gateway"]
