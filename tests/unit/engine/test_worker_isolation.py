"""A fault caused by one request fails that request, never its batch or the worker loop.

Faults are injected explicitly: a model that raises on a poison token (passed in as the model), a
temperature value that raises when the sampler looks at it, a malformed message."""

from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace

import pytest
import torch

from cluster.worker_host.build import WorkerSpec, make_worker
from cluster.worker_host.thread import HostLink, WorkerHost
from common import protocol as p
from common.config import GREEDY_TEMPERATURE_BELOW, EngineConfig, SamplingParams
from decode_worker.worker import ColocatedWorker
from engine import build_engine
from engine.request import FinishReason
from kv_store.transfer.local import LocalTransport
from tests.helpers import assert_pool_at_rest, greedy, make_engine, make_prompts, tiny_models, why_not_at_rest
from tests.step_pair import StepPair

POISON = 253  # no prompt of make_prompts(vocab=250) holds it, and no clean output below does
CONFIG = EngineConfig(page_size=4, num_pages=256, chunk_size=64, debug_kv=True)


class PoisonModel(torch.nn.Module):
    """The tiny Llama, except that a forward pass over POISON raises (or every one, when `broken`)."""

    def __init__(self, broken: bool = False):
        super().__init__()
        self.inner, self.broken = tiny_models()[0], broken

    def forward(self, input_ids, positions, meta, kv_cache):
        if self.broken or bool((input_ids == POISON).any()):
            raise RuntimeError("injected forward fault")
        return self.inner(input_ids, positions, meta, kv_cache)


class FailingTemperature(float):
    """Greedy (0.0) until the sampler's `fail_from`-th look at it, which raises, and so does every
    later one: a stand-in for any value of one request that breaks the sampler mid-generation."""

    def __new__(cls, fail_from: int):
        value = super().__new__(cls, 0.0)
        value.fail_from, value.looks = fail_from, 0
        return value

    def _look(self) -> None:
        self.looks += 1
        if self.looks >= self.fail_from:
            raise RuntimeError("injected sampler fault")

    def __ge__(self, other):
        if other == GREEDY_TEMPERATURE_BELOW:  # the sampler's greedy test (validation compares with 0)
            self._look()
        return float(self) >= other

    def __gt__(self, other):
        if other == 0:
            self._look()
        return float(self) > other


def good_prompts(n: int = 4) -> list[list[int]]:
    return make_prompts(n, seed=31, vocab=250)


@pytest.fixture(scope="module")
def clean():
    """Greedy outputs of the good prompts alone in a clean engine."""
    out = [r.output_token_ids for r in make_engine().generate(good_prompts(), greedy(max_tokens=12))]
    assert all(POISON not in ids for ids in out)
    return out


def assert_internal_error(error: str) -> None:
    assert error.startswith("internal error in the worker") and "error id" in error
    assert "/" not in error and "Traceback" not in error, "the client must not see source paths"


def test_a_request_that_breaks_the_sampler_fails_alone(clean):
    engine = make_engine()
    good = [engine.add_request(ids, greedy(max_tokens=12)) for ids in good_prompts()]
    bad = engine.add_request(good_prompts(5)[4], SamplingParams(max_tokens=12, temperature=FailingTemperature(4)))
    outputs = []
    while engine.busy():
        outputs += engine.step()
    assert [r.output_token_ids for r in good] == clean
    assert bad.finish_reason is FinishReason.ABORT and len(bad.output_token_ids) == 3
    [last] = [o for o in outputs if o.request_id == bad.request_id and o.finish_reason is not None]
    assert last.failure is p.Failure.INTERNAL and last.new_token_ids == []
    assert_internal_error(last.error)
    assert_pool_at_rest(engine)


def test_a_request_whose_forward_pass_raises_fails_alone(clean):
    engine = build_engine(CONFIG, PoisonModel(), tiny_models()[2])
    good = [engine.add_request(ids, greedy(max_tokens=12)) for ids in good_prompts()[:2]]
    engine.step()  # the good ones are decoding when the poison arrives
    bad = engine.add_request([5, 6, POISON, 7], greedy(max_tokens=12))
    good += [engine.add_request(ids, greedy(max_tokens=12)) for ids in good_prompts()[2:]]
    while engine.busy():
        engine.step()
    assert [r.output_token_ids for r in good] == clean
    assert bad.finish_reason is FinishReason.ABORT and bad.output_token_ids == []
    assert_internal_error(bad.error)
    assert_pool_at_rest(engine)


def test_a_model_that_cannot_run_at_all_ends_the_loop():
    engine = build_engine(CONFIG, PoisonModel(broken=True), tiny_models()[2])
    req = engine.add_request(good_prompts()[0], greedy(max_tokens=4))
    with pytest.raises(RuntimeError, match="injected forward fault"):
        engine.step()  # no request is to blame: the worker must stop and be restarted
    assert req.finish_reason is FinishReason.ABORT
    assert_pool_at_rest(engine)


def test_a_fault_on_the_prefill_worker_fails_only_its_transfer(clean):
    _, _, arch = tiny_models()
    prefill = make_worker("prefill", CONFIG, PoisonModel(), arch, LocalTransport())
    decode = make_worker("decode", CONFIG, tiny_models()[0], arch, LocalTransport(), host_pages=256)
    assert_only_the_last_fails(prefill, decode, good_prompts() + [[5, 6, POISON, 7]], clean)


def assert_only_the_last_fails(prefill, decode, prompts: list[list[int]], clean: list[list[int]]) -> None:
    """Serve `prompts` through the pair: all but the last give their clean output, the last ends with
    an internal error (never re-routed); both workers end at rest, then are closed."""
    results = StepPair(prefill, decode).generate(prompts, greedy(max_tokens=12))
    assert [r.token_ids for r in results[:-1]] == clean
    assert results[-1].finish_reason is FinishReason.ABORT and results[-1].failure is p.Failure.INTERNAL
    assert_internal_error(results[-1].error)
    for worker in (prefill, decode):
        assert why_not_at_rest(worker) == ""
        assert_pool_at_rest(worker.engine)
        worker.close()
    prefill.sender.transport.close(), decode.receiver.transport.close()


def _pair_with_faulty_step(monkeypatch, target: str, method: str):
    """A prefill + decode pair on the tiny Llama whose `target` ("sender" or "receiver") raises in
    `method` for the request "req-4" only (the fifth prompt)."""
    _, _, arch = tiny_models()
    prefill = make_worker("prefill", CONFIG, tiny_models()[0], arch, LocalTransport())
    decode = make_worker("decode", CONFIG, tiny_models()[0], arch, LocalTransport(), host_pages=256)
    connector = prefill.sender if target == "sender" else decode.receiver
    original = getattr(connector, method)

    def faulty(*args):
        request_ids = [getattr(a, "request_id", None) or getattr(getattr(a, "request", None), "request_id", None)
                       for a in args]
        if "req-4" in request_ids:
            raise RuntimeError("injected connector fault")
        return original(*args)

    monkeypatch.setattr(connector, method, faulty)
    return prefill, decode


@pytest.mark.parametrize("target, method", [("sender", "_ship"), ("receiver", "_start_load"),
                                            ("receiver", "_loaded"), ("receiver", "_check_deadline")])
def test_a_fault_in_a_transfer_transition_fails_only_its_request(clean, monkeypatch, target, method):
    prefill, decode = _pair_with_faulty_step(monkeypatch, target, method)
    assert_only_the_last_fails(prefill, decode, good_prompts() + [good_prompts(5)[4]], clean)


def build_tiny(spec: WorkerSpec):
    """`WorkerHost`'s build for a colocated worker on the tiny Llama, whose model fails on POISON."""
    return ColocatedWorker(build_engine(spec.engine, PoisonModel(), tiny_models()[2])), LocalTransport()


def collect_until_done(host: WorkerHost, request_ids: set[str], timeout_s: float = 60.0) -> dict[str, list]:
    by_id: dict[str, list] = {rid: [] for rid in request_ids}
    deadline = time.monotonic() + timeout_s
    while any(not msgs or msgs[-1].finish_reason is None for msgs in by_id.values()):
        assert time.monotonic() < deadline, f"unfinished: {[r for r, m in by_id.items() if not m]}"
        for msg in host.collect(0.2):
            if isinstance(msg, p.TokenOutput) and msg.request_id in by_id:
                by_id[msg.request_id].append(msg)
    return by_id


def test_worker_host_loop_survives_faulty_requests_and_messages(clean):
    spec = WorkerSpec("colocated", CONFIG, heartbeat_interval_s=0.05)
    host = WorkerHost(spec, "colocated-0", build=build_tiny)
    try:
        prompts = good_prompts()
        host.deliver([p.Generate(f"good-{i}", tuple(ids), greedy(max_tokens=12)) for i, ids in enumerate(prompts[:2])]
                     + [p.Generate("bad-sampler", tuple(prompts[0]),
                                   SamplingParams(max_tokens=12, temperature=FailingTemperature(3))),
                        p.Generate("bad-forward", (5, 6, POISON, 7), greedy(max_tokens=12)),
                        p.Generate("bad-message", ("not a token id",), greedy(max_tokens=12))]
                     + [p.Generate(f"good-{i}", tuple(ids), greedy(max_tokens=12))
                        for i, ids in enumerate(prompts[2:], 2)])
        by_id = collect_until_done(host,
                                   {f"good-{i}" for i in range(4)} | {"bad-sampler", "bad-forward", "bad-message"})
        for i in range(4):
            msgs = by_id[f"good-{i}"]
            assert [t for m in msgs for t in m.new_token_ids] == clean[i] and not msgs[-1].error
        for rid in ("bad-sampler", "bad-forward", "bad-message"):
            last = by_id[rid][-1]
            assert last.finish_reason is p.FinishReason.ABORT and last.failure is p.Failure.INTERNAL, (rid, last)
            assert_internal_error(last.error)
        host.deliver([p.Generate("after", tuple(prompts[1]), greedy(max_tokens=12))])  # the loop still serves
        assert [t for m in collect_until_done(host, {"after"})["after"] for t in m.new_token_ids] == clean[1]
        time.sleep(0.3)  # a stats beat taken at rest
        beat = host.heartbeat()
        assert beat.crashed == "" and beat.stats is not None and beat.stats.integrity_error == ""
        assert beat.stats.device.private == 0 and beat.stats.num_running == 0
        host.worker.check_integrity()
    finally:
        assert host.shutdown(10.0)


def test_the_client_of_a_faulty_request_gets_an_internal_error_and_no_retry(clean):
    from common.protocol import WorkerRole
    from router.backend import ErrorKind
    from router.dispatcher import Dispatcher, DispatcherConfig, WorkerInfo

    host = WorkerHost(WorkerSpec("colocated", CONFIG, heartbeat_interval_s=0.05), "colocated-0", build=build_tiny)
    link = HostLink(host)

    class OneWorker:
        async def workers(self) -> list[WorkerInfo]:
            return [WorkerInfo("colocated-0", WorkerRole.COLOCATED, 1, True, host.session, host.conn.stats, 0, link)]

    async def run(dispatcher: Dispatcher):
        await dispatcher.start()
        try:
            bad = [c async for c in dispatcher.generate("bad", [5, 6, POISON, 7], greedy(max_tokens=8))]
            good = [c async for c in dispatcher.generate("good", good_prompts()[0], greedy(max_tokens=12))]
        finally:
            await dispatcher.close()
        return bad, good

    dispatcher = Dispatcher.build(OneWorker(), DispatcherConfig(model_name="tiny", max_model_len=1024))
    try:
        bad, good = asyncio.run(run(dispatcher))
    finally:
        assert host.shutdown(10.0)
    assert bad[-1].error_kind is ErrorKind.INTERNAL and bad[-1].finish_reason == "abort"
    assert_internal_error(bad[-1].error)
    assert dispatcher.reroutes._value.get() == 0, "a request that fails the worker itself is not retried"
    assert [t for c in good for t in c.new_token_ids] == clean[0] and good[-1].error == ""


def test_an_inbound_request_moves_only_along_its_diagram():
    """A transition the receiver's diagram lacks raises (confined to its request by `_confined`)."""
    from decode_worker.receiver import InboundPhase, _Inbound

    ib = _Inbound(request=SimpleNamespace(request_id="r"), landing=None, peer="prefill-0", session=None)
    ib.move(InboundPhase.LOAD_PENDING)
    ib.move(InboundPhase.LOADING)
    with pytest.raises(RuntimeError, match=r"request r: inbound loading -> landing is not a legal move"):
        ib.move(InboundPhase.LANDING)
    with pytest.raises(RuntimeError, match=r"abandoning"):
        _Inbound(request=SimpleNamespace(request_id="q"), landing=None, peer="p", session=None,
                 phase=InboundPhase.ABANDONING).move(InboundPhase.LOAD_PENDING)


def test_worker_host_builds_on_its_loop_thread_and_raises_a_failed_build():
    """One thread of the process runs torch's CPU ops: the loop thread builds the model it steps
    (docs/design.md, "One compute thread per worker"); a build that fails raises in the constructor."""
    built_on = []

    def build_here(spec: WorkerSpec):
        built_on.append(threading.current_thread())
        return build_tiny(spec)

    host = WorkerHost(WorkerSpec("colocated", CONFIG, heartbeat_interval_s=0.05), "colocated-0", build=build_here)
    try:
        assert built_on == [host._thread] and host._thread is not threading.current_thread()
        host.deliver([p.Generate("r0", tuple(good_prompts()[0]), greedy(max_tokens=4))])
        assert collect_until_done(host, {"r0"})["r0"][-1].finish_reason is p.FinishReason.LENGTH
        host.worker.check_integrity()
    finally:
        assert host.shutdown(10.0)

    def build_fails(spec: WorkerSpec):
        raise ValueError("no such model")

    with pytest.raises(ValueError, match="no such model"):
        WorkerHost(WorkerSpec("colocated", CONFIG), "colocated-1", build=build_fails)


def test_a_decode_worker_with_only_landings_waits_for_messages_instead_of_polling(clean):
    """Landings move only on the peer's messages (which wake the loop) or a deadline: the loop waits
    up to LANDING_WAIT_S (never past the nearest deadline); anything to poll brings it back to POLL_S."""
    from decode_worker.worker import LANDING_WAIT_S
    from engine.worker_base import POLL_S

    _, _, arch = tiny_models()
    now = [100.0]
    prefill = make_worker("prefill", CONFIG, tiny_models()[0], arch, LocalTransport())
    decode = make_worker("decode", CONFIG, tiny_models()[0], arch, LocalTransport(), host_pages=256,
                         clock=lambda: now[0])
    pair = StepPair(prefill, decode)
    result = pair.submit("req-0", good_prompts(1)[0], greedy(max_tokens=4))
    assert decode.busy() and not decode.has_compute()
    assert decode.wait_s() == LANDING_WAIT_S
    [landing] = decode.receiver.inbound.values()
    now[0] = landing.session.deadline - 0.01
    assert decode.wait_s() == pytest.approx(0.01)  # its deadline comes first
    now[0] = landing.session.deadline - 0.0001
    assert decode.wait_s() == POLL_S  # never below the poll interval
    now[0] = 100.0
    while landing.phase.value == "landing":
        pair._to_decode(prefill.step())  # the prefill side runs; its KVComplete arrives
    assert decode.wait_s() == POLL_S  # a load to start: poll again
    while pair.busy():
        pair.step()
    assert result.token_ids == clean[0][:4]
    for worker in (prefill, decode):
        assert_pool_at_rest(worker.engine)
        worker.close()
