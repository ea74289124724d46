"""Ray shells: the worker actor, and the dispatcher's links to workers and to the controller.

Everything that touches Ray for a worker is here; the worker itself is a `WorkerHost`. The actor
is threaded (`max_concurrency`): a `collect` long-poll, the controller's `heartbeat` and the
dispatcher's `deliver` are served concurrently while the loop thread computes.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal

from cluster.worker_host.build import WorkerSpec
from cluster.worker_host.thread import HostBeat, WorkerHost
from router.workers import WorkerInfo

ACTOR_CONCURRENCY = 8


class WorkerActor:
    """Decorated with `ray.remote` by the controller (resources differ per group)."""

    def __init__(self, spec: WorkerSpec, worker_id: str) -> None:
        logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {worker_id}[{os.getpid()}] %(message)s")
        if spec.transport.hostname == "auto":  # one config for every node: each worker advertises its own address
            import ray

            spec = dataclasses.replace(spec, transport=dataclasses.replace(
                spec.transport, hostname=ray.util.get_node_ip_address()))
        self.host = WorkerHost(spec, worker_id)
        try:  # SIGTERM (a node drained, a pod deleted): drained by the controller, then stopped by it
            signal.signal(signal.SIGTERM, self._on_sigterm)
        except ValueError:  # not the process's main thread: Ray's own handler stays (the process exits)
            logging.warning("%s: SIGTERM cannot be caught here; it ends the process undrained", worker_id)

    def _on_sigterm(self, signum, frame) -> None:
        if not self.host.draining:
            logging.warning("SIGTERM: draining (the controller moves my streams, then stops me)")
        self.host.draining = True

    def ready(self) -> tuple[str, int, int]:
        """(transport session id, max_request_tokens, pid) once the model is loaded and the loop runs."""
        return self.host.session, self.host.max_request_tokens, os.getpid()

    def deliver(self, msgs: list) -> None:
        self.host.deliver(msgs)

    def collect(self, timeout_s: float) -> list:
        return self.host.collect(timeout_s)

    def heartbeat(self) -> HostBeat:
        return self.host.heartbeat()

    def shutdown(self, timeout_s: float) -> bool:
        return self.host.shutdown(timeout_s)


class RayWorkerLink:
    """`router.dispatcher.WorkerLink` over an actor handle. A dead actor raises `RayActorError`."""

    relays = True  # the actor's `WorkerHost` opens the token relay when told (`common/relay.py`)

    def __init__(self, handle) -> None:
        self.handle = handle

    async def send(self, msgs: list) -> None:
        await self.handle.deliver.remote(msgs)

    async def collect(self, timeout_s: float) -> list:
        return await self.handle.collect.remote(timeout_s)


class ControllerViews:
    """`router.dispatcher.ViewSource` over the controller actor."""

    def __init__(self, controller) -> None:
        self.controller = controller
        self._links: dict[tuple[str, int], RayWorkerLink] = {}

    async def workers(self) -> list[WorkerInfo]:
        records = await self.controller.views.remote()
        return [WorkerInfo(r.worker_id, r.role, r.incarnation, r.alive, r.session, r.stats, r.restarts,
                           self._link(r), r.pid, r.draining) for r in records]

    def _link(self, record) -> RayWorkerLink | None:
        if record.handle is None:
            return None
        key = (record.worker_id, record.incarnation)
        if key not in self._links:
            self._links = {k: v for k, v in self._links.items() if k[0] != record.worker_id}
            self._links[key] = RayWorkerLink(record.handle)
        return self._links[key]
