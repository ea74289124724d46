"""Admission control's pure pieces: the measured prefill rate, a lane's queue and window, refusals."""

from __future__ import annotations

import pytest

from common.config import ConfigError
from common.protocol import WorkerRole
from router.admission import (
    FALLBACK_RETRY_AFTER_S,
    PLAN_SHARE,
    AdmissionParams,
    DecodeLimit,
    Overloaded,
    PrefillLane,
    PrefillRate,
    Refusal,
    admissible,
)
from router.policy_types import WorkerView


def lane(window_tokens: int = 100, smoothing: float = 1.0) -> PrefillLane:
    return PrefillLane(window_tokens, smoothing)


def measured(rate_tokens_per_s: float, window_tokens: int = 1000) -> PrefillLane:
    """A lane whose rate has one sample: `rate_tokens_per_s` * 1 s of service (after a cold one)."""
    ln = lane(window_tokens)
    ln.rate.started(-10.0, 1)
    ln.rate.finished(-1.0, 1, delivered=True)  # a cold worker's first prefill: 1 token in 9 s, not a sample
    assert ln.rate.tokens_per_s is None
    half = int(rate_tokens_per_s) // 2
    ln.rate.started(0.0, half)
    ln.rate.started(0.0, half)  # two at once: a loaded period, whose completions are samples
    ln.rate.finished(0.5, half, delivered=True)
    ln.rate.finished(1.0, half, delivered=True)
    return ln


def test_rate_counts_busy_time_only_and_shares_a_step_between_batched_completions():
    rate = PrefillRate(smoothing=0.5, cold_samples=0)
    assert rate.tokens_per_s is None
    rate.started(10.0, 100)
    rate.started(10.0, 100)  # batched with the first
    assert (rate.in_service, rate.in_service_tokens) == (2, 200)
    rate.finished(12.0, 100, delivered=True)  # 100 tokens in 2 s
    rate.finished(12.0, 100, delivered=True)  # +100 tokens in 0 s: decayed sums 150 tokens / 1 s
    assert rate.tokens_per_s == pytest.approx(150.0)
    rate.started(100.0, 50)  # idle from 12 to 100 s: not service time
    rate.finished(101.0, 50, delivered=True)  # alone the whole period: no sample
    assert rate.tokens_per_s == pytest.approx(150.0) and rate.in_service == 0
    rate.started(200.0, 50)
    rate.started(200.5, 50)  # company: a loaded period
    rate.finished(201.5, 50, delivered=True)
    rate.finished(202.0, 50, delivered=True)  # alone at the end, but in a loaded period: a sample
    assert rate.tokens_per_s == pytest.approx((0.25 * 150 + 0.5 * 50 + 50) / (0.25 * 1 + 0.5 * 1.5 + 0.5))


def test_rate_skips_the_cold_first_completion():
    rate = PrefillRate(smoothing=1.0)  # default: one cold sample
    rate.started(0.0, 100)
    rate.started(0.0, 100)
    rate.finished(8.0, 100, delivered=True)  # first-call costs: 12.5 tokens/s, not what the worker does
    assert rate.tokens_per_s is None and rate.cold_left == 0
    rate.finished(8.5, 100, delivered=True)
    assert rate.tokens_per_s == pytest.approx(200.0)


def test_rate_ignores_aborted_prefills_and_rejects_a_double_finish():
    rate = PrefillRate(smoothing=1.0, cold_samples=0)
    rate.started(0.0, 40)
    rate.started(0.0, 30)
    rate.finished(1.0, 30, delivered=False)  # aborted: no sample
    assert rate.tokens_per_s is None and rate.busy_for_s(1.5) == 1.5
    rate.finished(2.0, 40, delivered=True)  # the aborted one's time falls to this completion
    assert rate.tokens_per_s == pytest.approx(20.0)
    assert rate.busy_for_s(3.0) == 0.0  # idle
    with pytest.raises(AssertionError, match="twice"):
        rate.finished(3.0, 1, delivered=True)


def test_lane_moves_queued_requests_into_the_window_in_order_while_they_fit():
    ln = lane(window_tokens=100)
    for name, n in (("a", 60), ("b", 30), ("c", 20), ("d", 500)):
        ln.enqueue(name, n)
    assert [item for item, _ in ln.take_ready()] == ["a", "b"]  # c would overflow the window
    assert (ln.window_tokens, ln.queued_tokens, ln.ahead_tokens, ln.num_queued) == (90, 520, 610, 2)
    ln.leave_window(60)
    assert [item for item, _ in ln.take_ready()] == ["c"]  # FIFO: d waits behind c even where it cannot fit
    ln.leave_window(30)
    ln.leave_window(20)
    assert ln.take_ready() == [("d", 500)]  # larger than the window: goes alone
    ln.enqueue("e", 5)
    ln.enqueue("f", 5, front=True)  # admitted before: first in line
    assert ln.take_ready() == [] and ln.discard("e") and not ln.discard("e")
    assert ln.drain() == ["f"] and (ln.queued_tokens, ln.num_queued) == (0, 0)
    ln.leave_window(500)
    with pytest.raises(AssertionError, match="twice"):
        ln.leave_window(1)


def test_lane_without_a_measurement_bounds_the_queue_depth_only():
    params = AdmissionParams(max_queued_requests=2)
    ln = lane(window_tokens=10)
    assert ln.refusal(params, 0.0, 10) is None
    ln.enqueue("a", 10)
    ln.take_ready()
    ln.enqueue("b", 10)
    assert ln.refusal(params, 0.0, 10) is None
    ln.enqueue("c", 10)
    refusal = ln.refusal(params, 0.0, 10)
    assert refusal == Refusal("2 requests already queued for this prefill worker (router.max_queued_requests)",
                              FALLBACK_RETRY_AFTER_S)
    # A queue bound of 0 still lets a request straight into an open window.
    assert lane(window_tokens=10).refusal(AdmissionParams(max_queued_requests=0), 0.0, 10) is None


def test_lane_refuses_when_the_predicted_first_token_exceeds_the_plan():
    params = AdmissionParams(max_queue_delay_s=2.5)  # plans for 1.5 s
    assert params.planned_ttft_s == pytest.approx(PLAN_SHARE * 2.5) == pytest.approx(1.5)
    ln = measured(100.0)  # 100 tokens/s
    assert ln.refusal(params, 5.0, 400) is None  # idle: even a prompt longer than the plan goes
    ln.enqueue("a", 80)
    ln.take_ready()
    ln.rate.started(5.0, 80)
    assert ln.predicted_wait_s(5.0) == pytest.approx(0.8)
    assert ln.refusal(params, 5.0, 70) is None  # 0.8 s behind a + 0.7 s its own = 1.5 s
    refusal = ln.refusal(params, 5.0, 80)  # 0.8 + 0.8 s
    assert refusal is not None and refusal.retry_after_s == pytest.approx(0.1)
    assert "done in 1.60s, past the 1.50s" in refusal.reason
    assert "router.max_queue_delay_s 2.5s; 80 prompt tokens ahead" in refusal.reason
    ln.enqueue("b", 80)  # queued behind a
    assert ln.refusal(params, 5.0, 1) is not None  # 1.6 s + 0.01 s
    # a has been served for 0.7 s: 0.1 s of it is left, plus b's 0.8 s, plus 0.5 s its own.
    assert ln.predicted_wait_s(5.7) == pytest.approx(0.9) and ln.refusal(params, 5.7, 50) is None
    assert [item for item, _ in ln.take_ready()] == ["b"]  # in the window, its landing being reserved
    # a takes longer than the rate says: b, not yet at the worker, still counts in full.
    assert ln.predicted_wait_s(6.5) == pytest.approx(0.8)


def test_the_default_budget_queues_ordinary_load():
    """30 s, not a multiple of an unloaded TTFT: many users' short prompts queue behind each other."""
    params = AdmissionParams()
    assert params.max_queue_delay_s == 30.0 and params.max_queued_requests >= 256
    ln = measured(100.0)
    for i in range(20):  # up to 19 x 64 tokens ahead at 100 tokens/s: 12.2 s + 0.64 s
        assert ln.refusal(params, 2.0, 64) is None, i
        ln.enqueue(i, 64)
    ln.enqueue("x", 500)  # 17.8 s ahead now: a 64-token prompt would be done at 18.4 s > 18 s
    assert ln.refusal(params, 2.0, 64) is not None


def test_decode_limit_backs_off_from_what_it_holds_once_per_epoch_and_grows_only_in_use():
    limit = DecodeLimit(max_limit=16, smoothing=0.5)
    assert limit.limit == 16 and limit.floor == 8 and limit.refusal(15) is None  # a burst passes unmeasured
    assert "router.max_requests_per_worker" in limit.refusal(16).reason
    limit.observe(1.0, budget_s=1.5, admitted_epoch=0, num_active=16)
    assert limit.limit == 16  # never above the maximum
    limit.observe(2.0, 1.5, admitted_epoch=0, num_active=14)  # one token past the budget, recent 1.5 s: hold
    assert (limit.limit, limit.epoch, limit.recent_ttft_s) == (16, 0, 1.5)
    limit.observe(2.5, 1.5, admitted_epoch=0, num_active=12)  # the recent TTFT (2 s) is past it too: cut
    assert (limit.limit, limit.epoch) == (9.0, 1)  # from the 12 it held, not from 16
    refusal = limit.refusal(9)
    assert "cut while first tokens came later" in refusal.reason and refusal.retry_after_s == FALLBACK_RETRY_AFTER_S
    limit.observe(3.0, 1.5, admitted_epoch=0, num_active=11)  # admitted before the cut: no second cut
    assert (limit.limit, limit.epoch) == (9.0, 1)
    limit.observe(3.0, 1.5, admitted_epoch=1, num_active=9)  # admitted under the cut limit, still late: cut
    assert (limit.limit, limit.epoch) == (8.0, 2)  # 6.75, held at the floor
    limit.observe(1.0, 1.5, admitted_epoch=2, num_active=1)  # in time, but the limit was not in use: hold
    assert limit.limit == 8.0
    limit.observe(0.1, 1.5, admitted_epoch=2, num_active=8)  # in time at the limit: one per limit's worth
    assert limit.limit == pytest.approx(8 + 1 / 8)
    for epoch in range(2, 20):  # late again and again: never below half the maximum
        limit.observe(9.0, 1.5, admitted_epoch=epoch, num_active=1)
    assert limit.limit == 8.0 and limit.refusal(7) is None and limit.refusal(8) is not None
    assert DecodeLimit(max_limit=1, smoothing=0.5).floor == 1.0


def view(wid: str, role: WorkerRole, alive: bool = True) -> WorkerView:
    return WorkerView(wid, role, alive, num_running=0, num_waiting=0, kv_usage=0.0)


def test_admissible_filters_refused_workers_and_never_changes_the_route_shape():
    busy, later = Refusal("busy", 3.0), Refusal("busy", 0.5)
    workers = [view("p0", WorkerRole.PREFILL), view("p1", WorkerRole.PREFILL), view("p2", WorkerRole.PREFILL, False),
               view("d0", WorkerRole.DECODE), view("d1", WorkerRole.DECODE)]
    assert [w.worker_id for w in admissible(workers, {"p0": busy, "d1": busy})] == ["p1", "p2", "d0"]
    # Every alive prefill worker refused: no falling back to a decode worker prefilling locally.
    with pytest.raises(Overloaded) as full:
        admissible(workers, {"p0": busy, "p1": later})
    assert full.value.role == "prefill" and full.value.refusal is later
    with pytest.raises(Overloaded) as full:
        admissible(workers, {"d0": busy, "d1": busy})
    assert full.value.role == "decode"
    # A colocated worker with room still serves when every decode worker is full.
    colocated = workers + [view("c0", WorkerRole.COLOCATED)]
    assert "c0" in [w.worker_id for w in admissible(colocated, {"d0": busy, "d1": busy})]


@pytest.mark.parametrize("bad", [dict(max_queue_delay_s=0.0), dict(max_queued_requests=-1),
                                 dict(prefill_window_tokens=0), dict(max_requests_per_worker=0),
                                 dict(rate_smoothing=0.0), dict(rate_smoothing=1.5)])
def test_params_are_bounded(bad):
    with pytest.raises(ConfigError, match=next(iter(bad))):
        AdmissionParams(**bad)


def test_router_config_resolves_the_automatic_admission_knobs():
    from cluster.serve.config import RouterConfig
    from cluster.serve.config_load import load_serve_config

    auto = RouterConfig().admission(prefill_chunk_size=512, decode_max_running=64)
    assert auto == AdmissionParams(max_queue_delay_s=30.0, max_queued_requests=256, prefill_window_tokens=1024,
                                   max_requests_per_worker=64)
    config = load_serve_config(None, {"router.max_queue_delay_s": 1, "router.prefill_window_tokens": 300,
                                      "router.max_requests_per_worker": 5, "router.max_queued_requests": 0})
    assert config.router.admission(512, 64) == AdmissionParams(1.0, 0, 300, 5)
    for key, value in (("max_queue_delay_s", 0), ("max_queued_requests", -1), ("prefill_window_tokens", 0),
                       ("max_requests_per_worker", 0)):
        with pytest.raises(ConfigError, match=f"router.{key}"):
            load_serve_config(None, {f"router.{key}": value})
