"""A worker on a thread (`WorkerHost`) and the controller's verdict on its heartbeat."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest

from cluster.serve import controller as controller_mod
from cluster.serve.config_load import load_serve_config
from cluster.serve.controller import Controller, RestartBudget, SlotState, _Slot, custom_resources, worker_bundle
from cluster.worker_host.build import WorkerSpec, make_worker
from cluster.worker_host.thread import HostBeat, WorkerHost, WorkerStopped
from common import protocol as p
from common.config import ConfigError, EngineConfig, SamplingParams
from kv_store.transfer.config import TransportConfig
from tests.debug_worker import Stall, build_debug_worker


def _served(host: WorkerHost, request_id: str, ids: list[int], params: SamplingParams) -> tuple[list[int], object]:
    host.deliver([p.Generate(request_id, tuple(ids), params)])
    tokens, finish = [], None
    deadline = time.monotonic() + 60
    while finish is None and time.monotonic() < deadline:
        for msg in host.collect(0.5):
            assert isinstance(msg, p.TokenOutput) and msg.request_id == request_id and not msg.error
            tokens += msg.new_token_ids
            finish = msg.finish_reason
    return tokens, finish


@pytest.mark.slow
def test_host_serves_compiles_beside_serving_reports_a_long_step_and_stops(tmp_path):
    """A served worker reports ready before its CPU decode step is compiled: its loop starts the
    compile, requests before and after it give transformers' greedy tokens (a tiny seeded Qwen3
    checkpoint: the compile is of its graph, not SmolLM2's 30 layers)."""
    import shutil

    import torch

    from kernels.model.convert import resolve_model_dir
    from tests.helpers import hf_greedy
    from tests.unit.engine.test_model_families import reference

    # one layer: the compile is what is tested; SmolLM2's tokenizer beside it
    model = reference("qwen3", vocab_size=49152, max_position_embeddings=512, num_hidden_layers=1)
    model.save_pretrained(tmp_path)
    for file in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(resolve_model_dir("smollm2") / file, tmp_path / file)
    config = EngineConfig(model=str(tmp_path), num_pages=64, max_model_len=256, cpu_compile=True,
                          cpu_native_decode=False)
    host = WorkerHost(WorkerSpec("colocated", config, heartbeat_interval_s=0.1), "colocated-0",
                      build=build_debug_worker)
    try:
        ids = list(range(5, 37))
        params = SamplingParams(max_tokens=8, ignore_eos=True)
        with torch.no_grad():
            expected = hf_greedy(model, ids, 8)
        assert _served(host, "r0", ids, params) == (expected, p.FinishReason.LENGTH)
        runner = host.worker.engine.runner
        assert runner.wait_compiled(180) and set(runner._cpu_replays) == {1}  # the loop started it
        assert _served(host, "r1", ids, params) == (expected, p.FinishReason.LENGTH)

        host.deliver([Stall(2.0)])  # one step that takes 2 s
        time.sleep(1.5)
        assert host.heartbeat().loop_silent_s >= 1.0  # answered off the loop thread, mid-step
        time.sleep(1.5)
        beat = host.heartbeat()
        assert beat.loop_silent_s < 1.0 and beat.stats is not None and not beat.crashed
        assert beat.stats.device.private == 0 and beat.stats.integrity_error == ""
    finally:
        assert host.shutdown(10.0)
    with pytest.raises(WorkerStopped):
        host.collect(0.1)


class _FakeActor:
    """Stands in for a worker actor handle: `heartbeat.remote()` gives an awaitable."""

    def __init__(self, beat=None, error: Exception | None = None, hang: bool = False):
        async def answer():
            if hang:
                await asyncio.sleep(3600)
            if error is not None:
                raise error
            return beat

        self.heartbeat = SimpleNamespace(remote=answer)


@pytest.fixture
def killed(monkeypatch):
    out = []
    monkeypatch.setattr(controller_mod.ray, "kill", lambda handle, no_restart=True: out.append(handle))
    return out


def _verdict(handle, step_timeout_s=5.0, heartbeat_timeout_s=1.0) -> SlotState:
    config = load_serve_config(overrides={"cluster.step_timeout_s": step_timeout_s,
                                          "cluster.heartbeat_timeout_s": heartbeat_timeout_s})
    slot = _Slot("decode-0", "decode", config.decode, pg=None, bundle_index=0, state=SlotState.ALIVE, handle=handle,
                 budget=RestartBudget(5, 600.0))
    asyncio.run(Controller(config)._beat(slot, heartbeat_timeout_s))
    return slot.state


@pytest.mark.parametrize("handle, alive", [
    (_FakeActor(HostBeat("decode-0", None, "", loop_silent_s=4.0)), True),  # a long step, still in bounds
    (_FakeActor(HostBeat("decode-0", None, "", loop_silent_s=6.0)), False),  # stuck in one step: hung
    (_FakeActor(HostBeat("decode-0", None, "Traceback ...", loop_silent_s=0.1)), False),  # its loop crashed
    (_FakeActor(error=RuntimeError("actor died")), False),  # the process is gone
    (_FakeActor(hang=True), False),  # no answer within heartbeat_timeout_s
])
def test_controller_declares_dead_exactly_the_failed_hung_and_silent(killed, handle, alive):
    state = _verdict(handle)
    assert state is (SlotState.ALIVE if alive else SlotState.DEAD)
    assert killed == ([] if alive else [handle])


@pytest.mark.parametrize("outcome", [RuntimeError("actor died"),  # the stopped process is gone
                                     HostBeat("decode-0", None, "Traceback ...", loop_silent_s=0.1)])  # a late answer
@pytest.mark.parametrize("relaunched", [True, False])
def test_a_heartbeat_out_while_a_drain_restart_replaces_the_worker_kills_nothing(killed, outcome, relaunched):
    """A drain-restart stops the worker (and launches its next incarnation) while a heartbeat call to the
    old one is still out; that call then fails or answers as a crashed loop. It kills nothing and leaves
    the slot as the restart left it (it used to kill the new incarnation, or raise on the missing one)."""
    config = load_serve_config(overrides={"cluster.heartbeat_timeout_s": 5.0})
    new = _FakeActor(HostBeat("decode-0", None, "", loop_silent_s=0.1))

    async def run() -> _Slot:
        gate = asyncio.Event()

        async def answer():
            await gate.wait()
            if isinstance(outcome, Exception):
                raise outcome
            return outcome

        old = SimpleNamespace(heartbeat=SimpleNamespace(remote=answer))
        slot = _Slot("decode-0", "decode", config.decode, pg=None, bundle_index=0, state=SlotState.ALIVE, handle=old,
                     budget=RestartBudget(5, 600.0), incarnation=1)
        beat = asyncio.create_task(Controller(config)._beat(slot, 5.0))
        await asyncio.sleep(0.01)  # the call is out
        slot.handle, slot.state = None, SlotState.STOPPED  # what `_stop` leaves
        if relaunched:  # and `_launch`
            slot.handle, slot.state, slot.incarnation = new, SlotState.ALIVE, 2
        gate.set()
        await beat
        return slot

    slot = asyncio.run(run())
    assert killed == []
    assert (slot.state, slot.handle) == ((SlotState.ALIVE, new) if relaunched else (SlotState.STOPPED, None))


@pytest.mark.slow
def test_actor_with_hostname_auto_advertises_its_node_address(monkeypatch):
    import ray

    from cluster.serve.actors import WorkerActor

    monkeypatch.setattr(ray.util, "get_node_ip_address", lambda: "127.0.0.1")  # this node, loopback only
    actor = WorkerActor(WorkerSpec("prefill", EngineConfig(num_pages=64), transport=TransportConfig(hostname="auto")),
                        "prefill-0")
    try:
        session, max_request_tokens, pid = actor.ready()
        assert session.startswith("127.0.0.1:") and int(session.rsplit(":", 1)[1]) > 0
        assert max_request_tokens > 0 and pid > 0
    finally:
        assert actor.shutdown(10.0)


def test_restart_budget_refills_as_restarts_age_out():
    now = [0.0]
    budget = RestartBudget(max_restarts=2, window_s=60.0, clock=lambda: now[0])
    assert budget.try_spend()
    now[0] = 10.0
    assert budget.try_spend()
    assert not budget.try_spend() and budget.wait_s() == 50.0
    now[0] = 59.0
    assert not budget.try_spend() and budget.wait_s() == 1.0
    now[0] = 60.0  # the restart at 0 left the window; the one at 10 has not
    assert budget.try_spend() and not budget.try_spend() and budget.wait_s() == 10.0
    now[0] = 1000.0
    assert budget.try_spend() and budget.try_spend() and not budget.try_spend()
    never = RestartBudget(max_restarts=0, window_s=60.0)
    assert not never.try_spend() and never.wait_s() == float("inf")


class _LaunchCounter(Controller):
    """The controller's restart policy, with launches that succeed at once and a placement that is
    `unplaced` says (no Ray)."""

    launches = 0
    unplaced = ""

    async def _launch(self, slot: _Slot) -> None:
        self.launches += 1
        slot.incarnation += 1
        slot.state = SlotState.ALIVE

    def _unplaced(self, slot: _Slot) -> str:
        return self.unplaced


def _crash_and_tick(controller: Controller, slot: _Slot) -> SlotState:
    if slot.state is SlotState.ALIVE:
        slot.state = SlotState.DEAD  # what `_declare_dead` leaves
    asyncio.run(controller._restart(slot))
    return slot.state


def test_a_crash_loop_waits_for_the_budget_instead_of_staying_dead_forever():
    # the numbers: six crashes in 75 s with max_restarts 5
    now = [0.0]
    config = load_serve_config(overrides={"cluster.max_restarts": 5, "cluster.restart_window_s": 600.0})
    controller = _LaunchCounter(config)
    slot = _Slot("decode-0", "decode", config.decode, pg=None, bundle_index=0, state=SlotState.DEAD,
                 budget=RestartBudget(5, 600.0, clock=lambda: now[0]))
    states = []
    for i in range(6):
        now[0] = 15.0 * i
        states.append(_crash_and_tick(controller, slot))
    assert states == [SlotState.ALIVE] * 5 + [SlotState.DEAD] and controller.launches == 5
    now[0] = 599.0
    assert _crash_and_tick(controller, slot) is SlotState.DEAD and controller.launches == 5
    now[0] = 600.0  # the first restart aged out: the worker comes back
    assert _crash_and_tick(controller, slot) is SlotState.ALIVE and controller.launches == 6 and slot.restarts == 6
    off = _LaunchCounter(load_serve_config(overrides={"cluster.max_restarts": 0}))
    dead = _Slot("decode-0", "decode", config.decode, pg=None, bundle_index=0, state=SlotState.DEAD,
                 budget=RestartBudget(0, 600.0))
    assert _crash_and_tick(off, dead) is SlotState.GIVEN_UP and off.launches == 0


def test_a_sigterm_beat_drains_the_worker_until_two_idle_beats_then_restarts_it_but_not_while_shutting_down(killed):
    """A heartbeat saying SIGTERM starts a drain: the slot reads `draining` in the views, is stopped
    once two beats in a row find it holding nothing, and comes back as a new incarnation with no
    restart spent; a drain that ends while the cluster shuts down starts nothing."""
    from common.protocol import PoolStats, WorkerStats

    config = load_serve_config(overrides={"cluster.heartbeat_interval_s": 0.05})
    stats = WorkerStats("decode", PoolStats(8, 8, 0, 0, 0), None, 0, 0, 0, "")

    async def scenario(stopping: bool) -> tuple[_Slot, _LaunchCounter, dict]:
        controller = _LaunchCounter(config)
        slot = _Slot("decode-0", "decode", config.decode, pg=None, bundle_index=0, state=SlotState.ALIVE,
                     handle=_FakeActor(HostBeat("decode-0", stats, "", 0.0, draining=True)),
                     budget=RestartBudget(5, 600.0), incarnation=1)
        controller.slots[slot.worker_id] = slot

        async def stop(slot, timeout_s):
            slot.state = SlotState.STOPPED
        controller._stop = stop
        await controller._beat(slot, 1.0)  # the SIGTERM beat: the drain starts
        await asyncio.sleep(0)
        assert slot.draining and (await controller.views())[0].draining and slot.beats_idle == 0
        controller._stopping = stopping
        for _ in range(2):  # two idle beats
            await controller._beat(slot, 1.0)
        return slot, controller, await asyncio.wait_for(slot.drain_task, 5)

    slot, controller, report = asyncio.run(scenario(False))
    assert report["restarted"] and controller.launches == 1 and slot.incarnation == 2 and slot.restarts == 0
    assert not slot.draining and slot.state is SlotState.ALIVE
    slot, controller, report = asyncio.run(scenario(True))
    assert not report["restarted"] and "shutting down" in report["why"] and controller.launches == 0


@pytest.mark.parametrize("window", [0, -1, 86401])
def test_restart_window_is_bounded(window):
    with pytest.raises(ConfigError, match=r"cluster.restart_window_s must be in \(0, 86400\]"):
        load_serve_config(overrides={"cluster.restart_window_s": window})


def test_a_worker_whose_bundle_has_no_node_waits_without_spending_restarts(caplog):
    config = load_serve_config(overrides={"cluster.max_restarts": 1})
    controller = _LaunchCounter(config)
    slot = _Slot("decode-0", "decode", config.decode, pg=None, bundle_index=0, state=SlotState.DEAD,
                 budget=RestartBudget(1, 600.0))
    controller.unplaced = "no node has room for its bundle {'CPU': 1.0} (placement group RESCHEDULING)"
    with caplog.at_level("ERROR", logger="tandem.controller"):
        states = [_crash_and_tick(controller, slot) for _ in range(3)]
    assert states == [SlotState.DEAD] * 3 and controller.launches == 0 and slot.restarts == 0
    said = [r.getMessage() for r in caplog.records]
    assert said == ["decode-0 cannot be restarted: no node has room for its bundle {'CPU': 1.0} (placement group "
                    "RESCHEDULING); it stays down until a node has room"]  # once, not every tick
    controller.unplaced = ""  # a node with room joined: the one restart in the budget is still there
    assert _crash_and_tick(controller, slot) is SlotState.ALIVE and controller.launches == 1 and slot.restarts == 1


def test_a_bundle_holds_the_groups_custom_resources_and_the_actor_asks_for_them():
    config = load_serve_config(overrides={"prefill.resources": {"tandem_prefill": 1, "ssd": 0},
                                          "decode.num_cpus": 2, "decode.resources": {"tandem_decode": 0.5}})
    assert worker_bundle(config.prefill) == {"CPU": 1.0, "tandem_prefill": 1.0}  # 0: not asked for
    assert custom_resources(config.prefill) == {"tandem_prefill": 1.0}
    assert worker_bundle(config.decode) == {"CPU": 2.0, "tandem_decode": 0.5}
    gpu = load_serve_config(overrides={"engine.device": "cuda"})
    assert worker_bundle(gpu.prefill) == {"CPU": 1.0, "GPU": 1.0} and custom_resources(gpu.prefill) == {}


def test_make_worker_assembles_each_role_and_names_a_wrong_one():
    """The one place a role is assembled: the engine gets the role's connector, the worker wraps it."""
    from decode_worker.receiver import KVReceiver
    from decode_worker.worker import ColocatedWorker, DecodeWorker
    from kv_store.transfer.local import LocalTransport
    from prefill_worker.sender import KVSender
    from prefill_worker.worker import PrefillWorker
    from tests.helpers import tiny_models

    ours, _, arch = tiny_models()
    config = EngineConfig(page_size=4, num_pages=32)
    built = []
    for role, worker_type, connector_type in (("prefill", PrefillWorker, KVSender),
                                              ("decode", DecodeWorker, KVReceiver),
                                              ("colocated", ColocatedWorker, type(None))):
        transport = LocalTransport()
        worker = make_worker(role, config, ours, arch, transport, host_pages=16)
        assert type(worker) is worker_type and worker.role.value == role
        assert role == "colocated" or (type(worker.engine.connector) is connector_type
                                       and worker.engine.connector.transport is transport)
        built.append((worker, transport))
    with pytest.raises(ValueError, match="unknown worker role 'router'"):
        make_worker("router", config, ours, arch)
    for worker, transport in built:
        worker.check_integrity()
        worker.close()
        transport.close()


def test_a_cancelled_collect_frees_its_thread_at_once_and_loses_no_message():
    """Closing an event loop waits for its threads: a cancelled long-poll must not hold it for its timeout
    (it held every `tandem run --mode disaggregated` 5 s), and a message that comes later is kept."""
    import multiprocessing as mp

    from cluster.worker_host.process import PipeLink

    parent, child = mp.Pipe()
    link = PipeLink(parent, "test")

    async def cancelled() -> None:
        task = asyncio.create_task(link.collect(30.0))
        await asyncio.sleep(0.1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    t0 = time.monotonic()
    asyncio.run(cancelled())
    assert time.monotonic() - t0 < 5.0
    child.send(p.Shutdown())
    assert asyncio.run(link.collect(5.0)) == [p.Shutdown()]
    child.close()
