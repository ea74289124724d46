"""Whether the service can serve: `/health` (cheap, from the backend's worker gauges) and
`/health/ready` (a real generation, cached).

    /health        200 while a worker that produces tokens is alive: a decode or a colocated one.
                   Prefill workers are optional (a decode worker prefills locally without one).
                   A backend that reports no workers at all (a test double) is healthy.
    /health/ready  200 when the last readiness probe, a one-token greedy generation, finished within
                   `ready_timeout_s`; 503 otherwise, and while draining or unhealthy.

Both are open (no API key) because orchestrators probe without one, so neither may cost much: a
probe generates at most once per `ready_interval_s`, every caller in between gets the cached result,
and callers that arrive while a probe runs await that same probe instead of starting their own.

    t:      0 ........ interval ........ 2 * interval ...
    probe:  [run]                         [run]
    caller: await run | cached | cached | await run | cached ...
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any

import anyio

from common.protocol import WorkerRole
from router.gateway.errors import APIError

log = logging.getLogger(__name__)

TOKEN_ROLES = frozenset({WorkerRole.DECODE, WorkerRole.COLOCATED})  # the roles whose workers produce tokens


def serving_workers_alive(gauges: Iterable[Any]) -> bool:
    """True when some decode or colocated worker is alive, or when the backend reports no workers."""
    gauges = list(gauges)
    return not gauges or any(g.alive and g.role in TOKEN_ROLES for g in gauges)


@dataclass(frozen=True)
class Readiness:
    ready: bool
    reason: str  # why not ready; "" when ready
    started_s: float  # time.monotonic() when the probe that found this began


class ReadinessProbe:
    """A cached, shared readiness check around `probe`, an async callable that returns when one
    generation succeeded and raises otherwise. Lives on one event loop at a time."""

    def __init__(self, probe: Callable[[], Awaitable[None]], interval_s: float, timeout_s: float):
        self._probe, self.interval_s, self.timeout_s = probe, interval_s, timeout_s
        self._last: Readiness | None = None
        self._running: asyncio.Task | None = None

    async def check(self) -> Readiness:
        """The latest result younger than `interval_s`, else the result of the probe in flight (one is
        started when none is). The probe is shielded: a caller that goes away does not cancel it."""
        last = self._last
        if last is not None and time.monotonic() - last.started_s < self.interval_s:
            return last
        running = self._running
        # a task of another loop (a test client's finished loop) can never be awaited here
        if running is None or running.done() or running.get_loop() is not asyncio.get_running_loop():
            running = self._running = asyncio.ensure_future(self._run())
        return await asyncio.shield(running)

    async def _run(self) -> Readiness:
        started_s = time.monotonic()
        try:
            with anyio.fail_after(self.timeout_s):
                await self._probe()
            result = Readiness(True, "", started_s)
        except TimeoutError:
            result = Readiness(False, f"no token within {self.timeout_s} s", started_s)
        except APIError as err:  # already logged under its id when it is a server error
            result = Readiness(False, "internal server error" if err.status == 500 else err.detail, started_s)
        except Exception as exc:  # whatever broke, the answer to "ready?" is no
            log.warning("readiness probe failed", exc_info=True)
            result = Readiness(False, f"the probe failed ({type(exc).__name__})", started_s)
        self._last = result
        return result
