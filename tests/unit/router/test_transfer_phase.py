"""The transfer phase alone, with no dispatcher: its records, windows, holds and relays, driven by
hand-made messages; what it sends is read from each worker's outbound queue."""

from __future__ import annotations

import pytest

from common import protocol as p
from common.config import ConfigError, SamplingParams
from common.protocol import WorkerRole
from router.admission import AdmissionParams
from router.dispatcher_config import DispatcherConfig
from router.flights import Flight, Phase
from router.transfer_phase import HOLD_SLACK_S, Landing, TransferPhase
from router.workers import LiveWorker, WorkerInfo

LAYOUT = p.KVLayout(num_layers=1, page_size=16, num_kv_heads=1, head_dim=4, dtype="float32", element_bytes=4)
RETRY_S = 0.5


class Clock:
    def __init__(self) -> None:
        self.now_s = 100.0

    def __call__(self) -> float:
        return self.now_s


def make_worker(worker_id: str, role: WorkerRole, window_tokens: int = 20) -> LiveWorker:
    info = WorkerInfo(worker_id, role, 1, True, f"session-{worker_id}", None, 0, link=None)
    return LiveWorker.admitting(info, AdmissionParams(prefill_window_tokens=window_tokens))


def make_flights(prefill: LiveWorker, decode: LiveWorker, *num_tokens: int, first: int = 0) -> list[Flight]:
    """Routed flights queued on `prefill`'s lane in order, one per prompt length, ids r<first>, ..."""
    flights = []
    for i, n in enumerate(num_tokens, start=first):
        flight = Flight(f"r{i}", list(range(1, n + 1)), SamplingParams(max_tokens=4), prefill=prefill, decode=decode)
        prefill.lane.enqueue(flight, n)
        flights.append(flight)
    return flights


def sent(live: LiveWorker, kind: type) -> list[str]:
    """The request ids (a `PeerDead`'s peer) of the `kind` messages queued for `live`, in order; they
    are taken off its queue."""
    ids = [getattr(m, "request_id", None) or m.peer for m in live.outq if isinstance(m, kind)]
    live.outq[:] = [m for m in live.outq if not isinstance(m, kind)]
    return ids


def landed(wire_id: str, num_pages: int = 2) -> p.Reserved:
    landing = p.Landing(wire_id, "session-decode-0", tuple(range(1, num_pages + 1)), (0,), (0,), LAYOUT, 60.0)
    return p.Reserved(wire_id, landing, "")


@pytest.fixture
def setup():
    clock = Clock()
    prefill, decode = make_worker("prefill-0", WorkerRole.PREFILL), make_worker("decode-0", WorkerRole.DECODE)
    return TransferPhase(clock, RETRY_S), prefill, decode, clock


def test_reserve_hand_off_relay_and_the_window_passing_on(setup):
    phase, prefill, decode, _ = setup
    r0, r1, r2 = make_flights(prefill, decode, 10, 10, 10)
    phase.pump(prefill)  # a window of 20 tokens: two fit
    assert sent(decode, p.Reserve) == ["r0.0", "r1.0"] and [f.phase for f in (r0, r1, r2)] == [
        Phase.RESERVING, Phase.RESERVING, Phase.QUEUED]
    assert phase.on_reserved(landed("r0.0"), r0) is None
    assert sent(prefill, p.Prefill) == ["r0.0"] and r0.phase is Phase.PREFILLING
    assert r0.landing_bytes == 2 * LAYOUT.page_bytes
    assert phase.relay(p.KVProgress("r0.0", 1)) is False and sent(decode, p.KVProgress) == ["r0.0"]
    assert prefill.lane.window_tokens == 20
    assert phase.relay(p.KVComplete("r0.0", 7)) is True  # delivered: its window share goes to r2
    assert sent(decode, p.KVComplete) == ["r0.0"] and sent(decode, p.Reserve) == ["r2.0"]
    assert prefill.lane.window_tokens == 20 and prefill.lane.num_queued == 0
    assert phase.relay(p.KVComplete("r0.0", 7)) is False and not decode.outq  # over: nothing to relay


def test_a_refused_landing_backs_off_and_holds_the_lane_until_the_hold_lapses(setup):
    phase, prefill, decode, clock = setup
    r0, r1 = make_flights(prefill, decode, 15, 10)
    phase.pump(prefill)
    assert sent(decode, p.Reserve) == ["r0.0"]  # r1 does not fit beside it
    assert phase.on_reserved(p.Reserved("r0.0", None, ""), r0) is Landing.REFUSED
    assert r0.phase is Phase.BACKOFF and prefill.lane.window_tokens == 0
    assert prefill.lane.hold == (r0, clock.now_s + RETRY_S + HOLD_SLACK_S)
    assert not decode.outq and r1.phase is Phase.QUEUED  # the window freed, but held for r0
    clock.now_s += RETRY_S + HOLD_SLACK_S  # r0 never came back: the hold lapses
    phase.pump(prefill)
    assert sent(decode, p.Reserve) == ["r1.0"] and prefill.lane.hold is None


def test_a_flight_that_lands_after_a_backoff_releases_its_hold(setup):
    phase, prefill, decode, _ = setup
    (r0,) = make_flights(prefill, decode, 10)
    phase.pump(prefill)
    assert sent(decode, p.Reserve) == ["r0.0"]
    phase.on_reserved(p.Reserved("r0.0", None, ""), r0)
    (r1,) = make_flights(prefill, decode, 5, first=1)
    phase.pump(prefill)
    assert r1.phase is Phase.QUEUED and not decode.outq  # the window is free, but held for r0
    r0.move(Phase.QUEUED)  # the dispatcher routes it afresh, to the front
    prefill.lane.enqueue(r0, 10, front=True)
    phase.pump(prefill)
    assert sent(decode, p.Reserve) == ["r0.0"]  # it alone goes while it holds the lane
    phase.on_reserved(landed("r0.0"), r0)  # landed: the hold is over, r1 goes on
    assert prefill.lane.hold is None and sent(decode, p.Reserve) == ["r1.0"]


def test_a_rejected_request_ends_its_transfer_and_an_unrouted_one_gets_no_answer(setup):
    phase, prefill, decode, _ = setup
    r0, r1 = make_flights(prefill, decode, 20, 20)
    phase.pump(prefill)
    assert phase.on_reserved(p.Reserved("r0.0", None, "prompt too long"), r0) is Landing.REJECTED
    assert sent(decode, p.Reserve) == ["r0.0", "r1.0"]  # its window went to r1
    assert phase.on_reserved(p.Reserved("r1.0", None, ""), None) is None  # aborted meanwhile
    assert prefill.lane.window_tokens == 0 and prefill.lane.hold is None


def test_abort_transfer_goes_to_prefill_and_an_aborted_transfer_frees_the_window(setup):
    phase, prefill, decode, _ = setup
    (r0,) = make_flights(prefill, decode, 10)
    phase.pump(prefill)
    phase.on_reserved(landed("r0.0"), r0)
    sent(prefill, p.Prefill)
    assert phase.relay(p.AbortTransfer("r0.0", "deadline")) is False
    assert sent(prefill, p.AbortTransfer) == ["r0.0"] and prefill.lane.window_tokens == 10
    assert phase.relay(p.TransferAborted("r0.0", "deadline")) is False
    assert sent(decode, p.TransferAborted) == ["r0.0"] and prefill.lane.window_tokens == 0


def test_a_dead_prefill_worker_ends_its_transfers_and_its_late_landing_is_freed(setup):
    phase, prefill, decode, _ = setup
    r0, r1 = make_flights(prefill, decode, 10, 10)
    phase.pump(prefill)
    sent(decode, p.Reserve)
    prefill.gone = True
    phase.gone_with(prefill)
    assert prefill.lane.window_tokens == 0 and not decode.outq  # a gone lane reserves nothing more
    assert phase.on_reserved(landed("r0.0"), r0) is None and r0.phase is Phase.RESERVING
    assert sent(decode, p.PeerDead) == []  # its record went with the worker: the dispatcher's PeerDead frees it
    assert phase.relay(p.KVComplete("r1.0", 7)) is False


def test_a_landing_whose_prefill_worker_died_meanwhile_is_given_back(setup):
    phase, prefill, decode, _ = setup
    (r0,) = make_flights(prefill, decode, 10)
    phase.pump(prefill)
    prefill.gone = True  # not yet buried: its record still lives
    assert phase.on_reserved(landed("r0.0"), r0) is None
    assert sent(decode, p.PeerDead) == [prefill.peer_id] and r0.phase is Phase.RESERVING


@pytest.mark.parametrize("field, value", [("max_pending", 0), ("max_transfer_retries", -1), ("max_model_len", -1),
                                          ("reserve_retry_s", 0.0), ("landing_timeout_s", -1.0),
                                          ("collect_timeout_s", 0), ("policy", "cache_aware")])
def test_dispatcher_config_refuses_out_of_bounds_values(field, value):
    with pytest.raises(ConfigError, match=field):
        DispatcherConfig(**{"model_name": "m", "max_model_len": 16, field: value})
