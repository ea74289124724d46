"""Operator endpoints (API key as /v1; not in the OpenAPI document: clients and fuzzers never call them).

    GET  /debug/requests  the timelines of the requests that ended last (`router.timeline`): `?limit=N`
                          (default 100, at most 4096), `&order=latest` (newest first) or `slowest` (to
                          their first token)
    POST /admin/restart   a rolling restart: each named worker (default: all, prefill first), one at a
                          time, drained (routed nothing new, its streams moved to a peer that decodes),
                          stopped and started again; answers once done, with what happened to each

Body (JSON object, every field optional): `workers` (list of worker ids), `drain_timeout_s` (>= 0; how
long a worker with streams left runs on before it stops: those then resume as after a death; default
the cluster's `drain_timeout_s`). One restart at a time: another while one runs gets 409.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from router.gateway.errors import APIError
from router.gateway.json_body import check_json_content_type, parse_json_object
from router.gateway.request_log import CAPACITY

RestartWorkers = Callable[[list[str] | None, float | None], Awaitable[list[dict]]]
"""(worker ids or None for all, drain timeout or None for the default) -> one report per worker."""


def add_admin_routes(app: FastAPI, gateway, restart_workers: RestartWorkers | None) -> None:
    lock = asyncio.Lock()

    @app.get("/debug/requests", include_in_schema=False)
    async def requests(request: Request) -> Response:
        gateway.check_api_key(request)
        limit, order = request.query_params.get("limit", "100"), request.query_params.get("order", "latest")
        if not limit.isdigit() or not 1 <= int(limit) <= CAPACITY:
            raise APIError(400, f"limit must be an integer in [1, {CAPACITY}], got {limit!r}", param="limit")
        if order not in ("latest", "slowest"):
            raise APIError(400, f"order must be latest or slowest, got {order!r}", param="order")
        return JSONResponse({"requests": gateway.metrics.requests.entries(int(limit), order)})

    @app.post("/admin/restart", include_in_schema=False)
    async def restart(request: Request) -> Response:
        gateway.check_api_key(request)
        if restart_workers is None:
            raise APIError(404, "this server cannot restart its workers (no controller)", code="not_found")
        check_json_content_type(request)
        body = parse_json_object(await request.body() or b"{}")
        workers, timeout_s = _parse(body, _known_workers(gateway))
        if lock.locked():
            raise APIError(409, "a rolling restart is already running", code="conflict")
        async with lock:
            return JSONResponse({"restarted": await restart_workers(workers, timeout_s)})


def _known_workers(gateway) -> list[str]:
    details = getattr(gateway.backend, "worker_details", None)
    return [d["worker_id"] for d in details()] if details is not None else []


def _parse(body: dict, known: list[str]) -> tuple[list[str] | None, float | None]:
    unknown_fields = set(body) - {"workers", "drain_timeout_s"}
    if unknown_fields:
        raise APIError(400, f"unknown field(s): {', '.join(sorted(unknown_fields))}", param=sorted(unknown_fields)[0])
    workers = body.get("workers")
    if workers is not None:
        if not isinstance(workers, list) or not workers or not all(isinstance(w, str) for w in workers):
            raise APIError(400, "workers must be a non-empty list of worker ids", param="workers")
        if missing := [w for w in workers if w not in known]:
            raise APIError(400, f"no such worker: {', '.join(missing)} (workers: {', '.join(known)})", param="workers")
    timeout_s = body.get("drain_timeout_s")
    if timeout_s is not None and (isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float))
                                  or not 0 <= timeout_s <= 3600):
        raise APIError(400, "drain_timeout_s must be a number of seconds in [0, 3600]", param="drain_timeout_s")
    return workers, None if timeout_s is None else float(timeout_s)
