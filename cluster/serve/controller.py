"""The controller: a named Ray actor that starts the workers, watches them, and restarts the dead.

Each worker group gets one placement group (one bundle per worker, the group's strategy): a bundle
holds the worker's CPUs, GPUs and the group's custom `resources` (which the actor asks for too), so
`{tandem_prefill: 1}` keeps a group on the nodes that advertise it. A worker slot keeps its bundle
across restarts; when the bundle's node leaves, Ray reschedules the bundle, and while no node has
room the slot waits, DEAD, spending no restart (said once in the log).

Every `heartbeat_interval_s` the controller calls each live worker's `heartbeat()`; a call that
raises (the actor died), reports a crashed loop, or does not answer within `heartbeat_timeout_s`
marks the worker dead: the actor is killed, the dispatcher sees `alive=False` in the next `views()`,
and a new incarnation is started in the same bundle (at most `max_restarts` times in any
`restart_window_s`: a slot whose budget is spent waits, DEAD, until its oldest restart ages out).
The heartbeat is answered off the loop thread, so a long step does not look like death; a loop
stuck in one step past `step_timeout_s` does.

A slot's life:   STARTING --ready--> ALIVE --beat fails--> DEAD --restart--> STARTING ...
                                       |                |   (bundle placed, budget left)
                                       |                `-- max_restarts 0 --> GIVEN_UP
                                       `-- drain (asked, or the worker got SIGTERM) --> STOPPED --> STARTING
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import enum
import logging
import os
import time
import uuid
from dataclasses import dataclass, field
from typing import cast

import ray
from ray.actor import ActorHandle
from ray.util.placement_group import PlacementGroup, placement_group, placement_group_table, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from cluster.serve.actors import ACTOR_CONCURRENCY, WorkerActor
from cluster.serve.config import ServeConfig, WorkerGroupConfig
from cluster.serve.restart_budget import RestartBudget
from cluster.worker_host.build import WorkerSpec
from cluster.worker_host.cores import CoreShareSpec, core_share_path
from cluster.worker_host.liveness import death_cause
from common import protocol as p

log = logging.getLogger("tandem.controller")

CONTROLLER_NAME = "tandem-controller"
PLACEMENT_CHECK_S = 2.0
"""While a worker loads, how often the controller checks that its bundle still has a node."""


def custom_resources(group: WorkerGroupConfig) -> dict[str, float]:
    """The group's Ray custom resources per worker, less those of amount 0 (not asked for)."""
    return {name: amount for name, amount in group.resources.items() if amount > 0}


def worker_bundle(group: WorkerGroupConfig) -> dict[str, float]:
    """One worker's placement-group bundle: its CPUs, its GPUs (when it has any), its custom resources."""
    return {"CPU": group.num_cpus, **({"GPU": group.num_gpus} if group.num_gpus else {}), **custom_resources(group)}


class NoRoom(RuntimeError):
    """A worker's bundle has no live node: it left, and Ray has found no other with room yet."""


class SlotState(enum.Enum):
    STARTING = "starting"
    ALIVE = "alive"
    DEAD = "dead"
    GIVEN_UP = "given_up"
    STOPPED = "stopped"


@dataclass(frozen=True)
class WorkerRecord:
    """What the controller publishes about one worker (picklable; `handle` is a Ray actor handle)."""

    worker_id: str
    role: p.WorkerRole
    incarnation: int
    alive: bool
    session: str
    stats: p.WorkerStats | None
    restarts: int
    handle: object | None
    max_request_tokens: int
    pid: int  # the worker process (0 before it first started)
    draining: bool = False  # being drained before a stop: routed nothing new, its streams moved off


@dataclass(eq=False)
class _Slot:
    worker_id: str
    role: p.WorkerRole
    group: WorkerGroupConfig
    pg: PlacementGroup
    bundle_index: int
    state: SlotState = SlotState.STARTING
    handle: ActorHandle | None = None  # set by `_launch` (STARTING), None once it is stopped or found dead
    incarnation: int = 0
    session: str = ""
    stats: p.WorkerStats | None = None
    restarts: int = 0  # in all; the budget counts those in its window
    budget: RestartBudget = field(kw_only=True)
    max_request_tokens: int = 0
    pid: int = 0
    last_beat: float = field(default_factory=time.monotonic)
    task: asyncio.Task | None = None
    waiting_for: str = ""  # why it last stayed down ("": it did not), so each wait is logged once
    draining: bool = False  # `restart_worker` runs on it (asked for, or the worker got SIGTERM)
    beats_idle: int = 0  # heartbeats in a row, while draining, that found it holding no request
    drain_task: asyncio.Task | None = None  # a drain the worker asked for (SIGTERM)


def _held(stats: p.WorkerStats | None) -> int:
    """Requests a worker holds by its last stats (-1: none reported yet)."""
    return -1 if stats is None else stats.num_running + stats.num_waiting + stats.num_transfers


def last_line(exc: BaseException) -> str:
    """The last line of an error's text: for a Ray-wrapped worker error, the worker's own
    `Type: message` rather than Ray's traceback around it."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return lines[-1] if lines else type(exc).__name__


class Controller:
    """Wrapped with `ray.remote(num_cpus=0)` by the launcher and created as a named actor."""

    def __init__(self, config: ServeConfig) -> None:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s controller %(message)s")
        self.config = config
        self.slots: dict[str, _Slot] = {}
        self._pgs: list = []
        self._stopping = False
        self._cores_path = core_share_path(uuid.uuid4().hex[:12])  # this run's, on every node

    # ---- lifecycle ---------------------------------------------------------------------------------
    async def start(self) -> list[WorkerRecord]:
        """Reserve resources and start every worker; raises RuntimeError naming the worker that
        failed to start (the others are stopped first)."""
        for role in p.WorkerRole:
            group: WorkerGroupConfig = getattr(self.config, role.value)
            if group.count == 0:
                continue
            bundle = worker_bundle(group)
            pg = placement_group([bundle] * group.count, strategy=self.config.cluster.placement_strategy)
            self._pgs.append(pg)
            try:
                await asyncio.wait_for(pg.ready(), self.config.cluster.worker_start_timeout_s)
            except asyncio.TimeoutError:
                await self.shutdown()
                raise RuntimeError(f"the cluster cannot host {group.count} {role} workers of {bundle} each "
                                   f"(placement group not ready in {self.config.cluster.worker_start_timeout_s}s): "
                                   f"available {ray.available_resources()}") from None
            for i in range(group.count):
                budget = RestartBudget(self.config.cluster.max_restarts, self.config.cluster.restart_window_s)
                self.slots[f"{role}-{i}"] = _Slot(f"{role}-{i}", role, group, pg, i, budget=budget)
        results = await asyncio.gather(*(self._launch(slot) for slot in self.slots.values()), return_exceptions=True)
        failed = [(slot, err) for slot, err in zip(self.slots.values(), results) if err is not None]
        if failed:
            await self.shutdown()
            slot, err = failed[0]
            raise RuntimeError(f"worker {slot.worker_id} failed to start: {last_line(err)}")
        for slot in self.slots.values():
            slot.task = asyncio.create_task(self._watch(slot))
        return await self.views()

    async def views(self) -> list[WorkerRecord]:
        return [WorkerRecord(s.worker_id, s.role, s.incarnation, s.state is SlotState.ALIVE, s.session, s.stats,
                             s.restarts, s.handle if s.state is SlotState.ALIVE else None, s.max_request_tokens, s.pid,
                             s.draining)
                for s in self.slots.values()]

    async def restart_worker(self, worker_id: str, drain_timeout_s: float | None = None) -> dict:
        """Drain the worker, stop it, start a new incarnation in its bundle (no restart budget spent): the
        dispatcher routes it nothing new and moves its streams to a peer (`router.migration`; none: they run
        on); after two idle heartbeats, or `drain_timeout_s`, it stops; what it held resumes as after a death."""
        slot = self.slots[worker_id]
        timeout_s = self.config.cluster.drain_timeout_s if drain_timeout_s is None else drain_timeout_s
        if slot.draining or slot.state is not SlotState.ALIVE:
            return {"worker_id": worker_id, "restarted": False,
                    "why": "already draining" if slot.draining else f"not alive ({slot.state.value})"}
        slot.draining, slot.beats_idle = True, 0
        log.warning("%s incarnation %d: draining (at most %.0fs), then restart", worker_id, slot.incarnation, timeout_s)
        started = time.monotonic()
        while slot.state is SlotState.ALIVE and slot.beats_idle < 2 and time.monotonic() - started < timeout_s:
            await asyncio.sleep(min(0.1, self.config.cluster.heartbeat_interval_s))
        drained_s, held = round(time.monotonic() - started, 2), _held(slot.stats)
        if slot.state is SlotState.ALIVE:
            await self._stop(slot, self.config.cluster.heartbeat_timeout_s)
        slot.draining = False
        try:
            if self._stopping:  # the cluster is shutting down meanwhile: no new incarnation
                raise RuntimeError("the cluster is shutting down")
            await self._launch(slot)
        except Exception as exc:  # noqa: BLE001 - the watch restarts it as after a crash
            log.error("%s: restart after drain failed: %s", worker_id, last_line(exc))
            return {"worker_id": worker_id, "restarted": False, "why": last_line(exc), "drained_s": drained_s}
        return {"worker_id": worker_id, "restarted": True, "incarnation": slot.incarnation,
                "drained_s": drained_s, "requests_left_at_stop": held}

    async def rolling_restart(self, worker_ids: list[str] | None = None,
                              drain_timeout_s: float | None = None) -> list[dict]:
        """`restart_worker` on each (default: all, prefill first), one at a time, each once the last is back."""
        order = worker_ids or sorted(self.slots, key=lambda w: (self.slots[w].role is not p.WorkerRole.PREFILL, w))
        if unknown := [w for w in order if w not in self.slots]:
            raise ValueError(f"no such worker: {', '.join(unknown)} (workers: {', '.join(self.slots)})")
        return [await self.restart_worker(w, drain_timeout_s) for w in order]

    async def kill_worker(self, worker_id: str) -> None:
        """Ops/test hook: kill the worker's process now, as a crash would (no goodbye)."""
        if (handle := self.slots[worker_id].handle) is not None:
            ray.kill(handle, no_restart=True)

    async def shutdown(self, timeout_s: float = 10.0) -> None:
        """Stop every worker (loop, transport, process) and release the placement groups."""
        self._stopping = True
        for slot in self.slots.values():
            for task in filter(None, (slot.task, slot.drain_task)):
                task.cancel()
        await asyncio.gather(*(self._stop(slot, timeout_s) for slot in self.slots.values()), return_exceptions=True)
        for pg in self._pgs:
            remove_placement_group(pg)
        self._pgs.clear()
        with contextlib.suppress(FileNotFoundError):  # a killed worker leaves its node's file behind
            os.unlink(self._cores_path)

    # ---- internals ---------------------------------------------------------------------------------
    async def _launch(self, slot: _Slot) -> None:
        cfg = self.config
        engine = slot.group.engine
        if engine.cpu_compile is None:  # served decode steps compile on a CPU unless told not to (EngineConfig)
            engine = dataclasses.replace(engine, cpu_compile=slot.role is not p.WorkerRole.PREFILL)
        spec = WorkerSpec(slot.role, engine, host_pages=slot.group.host_pages or 0,  # decode's: resolved by the plan
                          transport=cfg.transport, heartbeat_interval_s=cfg.cluster.heartbeat_interval_s,
                          torch_threads=slot.group.torch_threads, l3=cfg.kv_store.l3, core_share=self._core_share(slot),
                          inject_faults=cfg.cluster.inject_faults)
        actor = ray.remote(WorkerActor).options(
            num_cpus=slot.group.num_cpus, num_gpus=slot.group.num_gpus, resources=custom_resources(slot.group),
            max_concurrency=ACTOR_CONCURRENCY, max_restarts=0,
            scheduling_strategy=PlacementGroupSchedulingStrategy(slot.pg, slot.bundle_index))
        slot.state, slot.incarnation = SlotState.STARTING, slot.incarnation + 1
        # Ray types what `.remote()` makes as `ActorHandle[T] | type[T]` (so that `@ray.method`s type-check): a handle
        slot.handle = handle = cast(ActorHandle, actor.remote(spec, slot.worker_id))
        try:
            slot.session, slot.max_request_tokens, slot.pid = await self._await_ready(slot, handle)
        except BaseException:
            ray.kill(slot.handle, no_restart=True)
            slot.handle, slot.state = None, SlotState.DEAD
            raise
        slot.state, slot.last_beat, slot.stats = SlotState.ALIVE, time.monotonic(), None
        log.info("%s incarnation %d ready (session %s)", slot.worker_id, slot.incarnation, slot.session)

    def _core_share(self, slot: _Slot) -> CoreShareSpec | None:
        """The slot's place in its node's core-share file (its index among all slots: the same on
        every incarnation), for CPU workers when `cluster.lend_idle_cores` is on."""
        if not self.config.cluster.lend_idle_cores or slot.group.engine.device != "cpu":
            return None
        return CoreShareSpec(self._cores_path, list(self.slots).index(slot.worker_id))

    async def _await_ready(self, slot: _Slot, handle: ActorHandle) -> tuple[str, int, int]:
        """The new incarnation's `ready()` answer (its error, if it failed to start). Raises TimeoutError
        past `worker_start_timeout_s`, and NoRoom as soon as its bundle has no node: a node that leaves
        while the model loads would otherwise hold the slot for the whole timeout."""
        timeout_s = self.config.cluster.worker_start_timeout_s
        ready = handle.ready.remote().as_future()
        deadline = time.monotonic() + timeout_s
        try:
            while not ready.done():
                left_s = deadline - time.monotonic()
                if left_s <= 0:
                    raise TimeoutError(f"not ready within worker_start_timeout_s ({timeout_s:.0f}s)")
                await asyncio.wait({ready}, timeout=min(left_s, PLACEMENT_CHECK_S))
                unplaced = "" if ready.done() else self._unplaced(slot)
                if unplaced:
                    raise NoRoom(unplaced)
            return ready.result()
        finally:
            ready.cancel()

    def _unplaced(self, slot: _Slot) -> str:
        """Why the slot's bundle has no live node now ("" when it has one). Two GCS reads."""
        try:
            table = placement_group_table(slot.pg)
            if table["state"] != "CREATED":  # its node left: Ray reschedules it once some node has room
                bundle, state = worker_bundle(slot.group), table["state"]
                return f"no node has room for its bundle {bundle} (placement group {state})"
            node_id = table["bundles_to_node_id"].get(slot.bundle_index)
            if node_id not in {node["NodeID"] for node in ray.nodes() if node["Alive"]}:
                return f"its bundle's node {node_id} left the cluster"
        except Exception as exc:  # noqa: BLE001 - unknown is not "no room": the launch itself will tell
            log.warning("%s: cannot read where its bundle is: %s", slot.worker_id, last_line(exc))
        return ""

    async def _watch(self, slot: _Slot) -> None:
        interval, timeout = self.config.cluster.heartbeat_interval_s, self.config.cluster.heartbeat_timeout_s
        while not self._stopping:
            await asyncio.sleep(interval)
            if slot.state is SlotState.ALIVE:
                await self._beat(slot, timeout)
            elif slot.state is SlotState.DEAD:
                await self._restart(slot)

    async def _beat(self, slot: _Slot, timeout_s: float) -> None:
        """One heartbeat of the slot's incarnation. Its answer (or failure) counts only while that incarnation
        is still the slot's: a drain-restart may stop it and launch the next while the call is out."""
        handle, incarnation = slot.handle, slot.incarnation
        assert handle is not None, f"{slot.worker_id} beaten without an actor: only an ALIVE slot is (`_watch`)"
        try:
            beat = await asyncio.wait_for(handle.heartbeat.remote(), timeout_s)
        except asyncio.TimeoutError:
            self._declare_dead(slot, handle, f"no heartbeat answer within {timeout_s}s")
            return
        except Exception as exc:  # noqa: BLE001 - RayActorError and friends: the process is gone
            self._declare_dead(slot, handle, f"{type(exc).__name__}: {exc}")
            return
        if slot.handle is not handle or slot.incarnation != incarnation:
            return  # stopped or replaced meanwhile: the answer is of an incarnation that is over
        why = death_cause(crashed=beat.crashed, step_age_s=beat.loop_silent_s,
                          step_timeout_s=self.config.cluster.step_timeout_s)
        if why:  # the heartbeat's own silence is the wait_for above
            self._declare_dead(slot, handle, why)
            return
        slot.last_beat = time.monotonic()
        if beat.stats is not None:
            slot.stats = beat.stats
        slot.beats_idle = slot.beats_idle + 1 if slot.draining and _held(beat.stats) == 0 else 0
        if beat.draining and not slot.draining and not self._stopping:  # it got SIGTERM: drain, then restart
            slot.drain_task = asyncio.create_task(self.restart_worker(slot.worker_id))

    def _declare_dead(self, slot: _Slot, handle: ActorHandle, why: str) -> None:
        """Kill the incarnation of `handle` and leave the slot DEAD for `_watch` to restart; nothing when
        the slot no longer holds it (a drain-restart stopped it while its heartbeat was out, and may have
        launched the next incarnation, which must not be killed for the old one's silence)."""
        if self._stopping:
            return
        if slot.handle is not handle:
            log.info("%s: a heartbeat of a stopped incarnation failed (%s); ignored", slot.worker_id, why)
            return
        log.error("%s incarnation %d is dead: %s", slot.worker_id, slot.incarnation, why)
        ray.kill(handle, no_restart=True)
        slot.handle, slot.state = None, SlotState.DEAD

    async def _restart(self, slot: _Slot) -> None:
        if slot.budget.max_restarts == 0:
            slot.state = SlotState.GIVEN_UP
            log.error("%s: restarts are off (cluster.max_restarts 0); it stays down", slot.worker_id)
            return
        unplaced = self._unplaced(slot)  # before the budget: waiting for room spends no restart
        if unplaced:
            self._stay_down(slot, unplaced, "%s cannot be restarted: %s; it stays down until a node has room",
                            slot.worker_id, unplaced)
            return
        if not slot.budget.try_spend():  # try again on a later tick, once the oldest restart aged out
            self._stay_down(slot, "budget", "%s: %d restarts within %.0fs spent; it stays down for %.0fs more",
                            slot.worker_id, slot.budget.max_restarts, slot.budget.window_s, slot.budget.wait_s())
            return
        slot.waiting_for = ""
        slot.restarts += 1
        try:
            await self._launch(slot)
        except Exception as exc:  # noqa: BLE001 - try again on the next tick, until restarts are spent
            log.error("%s restart %d failed: %s", slot.worker_id, slot.restarts, last_line(exc))

    @staticmethod
    def _stay_down(slot: _Slot, why: str, message: str, *args) -> None:
        """Log why the slot stays down, once per reason (the tick comes every heartbeat interval)."""
        if slot.waiting_for != why:
            log.error(message, *args)
        slot.waiting_for = why

    async def _stop(self, slot: _Slot, timeout_s: float) -> None:
        handle, slot.handle, slot.state = slot.handle, None, SlotState.STOPPED
        if handle is None:
            return
        try:
            await asyncio.wait_for(handle.shutdown.remote(timeout_s), timeout_s + 5)
        except Exception as exc:  # noqa: BLE001 - it is killed below either way
            log.warning("%s did not stop cleanly: %s", slot.worker_id, exc)
        ray.kill(handle, no_restart=True)
