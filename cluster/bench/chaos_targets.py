"""What a chaos run hurts (`cluster/bench/chaos.py`): a `ChaosTarget` is a served cluster, its URL
and the faults it can take. `LocalTarget`: a `tandem serve` and a Redis started on this machine;
`scripts/netns_cluster.py chaos` brings one across network hosts, whose links it also cuts.

Fault kinds (each target lists its own in `kinds`):

    kill_decode, kill_prefill     SIGKILL that worker's process (the controller restarts it)
    sigterm_decode                SIGTERM to the decode worker: drained (its streams move or run on),
                                  then stopped and restarted by the controller
    restart_decode                a rolling restart of the decode worker (POST /admin/restart, 5 s drain)
    kill_redis                    SIGKILL the L3 Redis; started again `REDIS_DOWN_S` later
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from typing import Protocol

log = logging.getLogger("tandem.bench")

REDIS_DOWN_S = 5.0
RESTART_DRAIN_S = 5.0
WORKER_FAULTS = ("kill_decode", "kill_prefill", "sigterm_decode", "restart_decode")


class ChaosTarget(Protocol):
    url: str
    kinds: tuple[str, ...]

    def inflict(self, kind: str) -> bool:
        """Hurt the cluster so (returns at once: what takes time runs on in the background); False
        when it cannot now (its victim is already down)."""


def hurt_worker(url: str, kind: str) -> bool:
    """One of WORKER_FAULTS on the first live worker of its role (found through /debug/workers)."""
    import httpx

    action, role = kind.split("_")
    workers = httpx.get(f"{url}/debug/workers", timeout=30).json()["workers"]
    victim = next((w for w in workers if w["role"] == role and w["alive"] and not w.get("draining")), None)
    if victim is None:
        return False
    if action == "restart":  # answers once the worker is back: not waited for here
        body = {"workers": [victim["worker_id"]], "drain_timeout_s": RESTART_DRAIN_S}
        threading.Thread(target=_post_restart, args=(url, body), daemon=True).start()
        return True
    try:
        os.kill(victim["pid"], signal.SIGKILL if action == "kill" else signal.SIGTERM)
    except ProcessLookupError:
        return False
    return True


def _post_restart(url: str, body: dict) -> None:
    import httpx

    try:
        resp = httpx.post(f"{url}/admin/restart", json=body, timeout=600)
        if resp.status_code != 200:
            log.warning("chaos: restart of %s answered %d: %s", body["workers"], resp.status_code, resp.text[:200])
    except httpx.HTTPError as exc:
        log.warning("chaos: restart of %s failed: %s", body["workers"], exc)


class LocalTarget:
    """`tandem serve` (`SpawnedServer`) and its L3 Redis (`RedisServer`), both on this machine."""

    kinds: tuple[str, ...] = (*WORKER_FAULTS, "kill_redis")

    def __init__(self, server, redis) -> None:
        self.server, self.redis, self.url = server, redis, server.url

    def inflict(self, kind: str) -> bool:
        if kind != "kill_redis":
            return hurt_worker(self.url, kind)
        if self.redis.proc is None or self.redis.proc.poll() is not None:
            return False  # still down from the last time
        self.redis.kill()
        restart = threading.Timer(REDIS_DOWN_S, self.redis.start)
        restart.daemon = True
        restart.start()
        return True
