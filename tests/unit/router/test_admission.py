"""Admission control's pure pieces: the measured prefill rate, a lane's queue and window, refusals."""

from __future__ import annotations

import pytest

from cluster.config import ConfigError
from router.admission import (FALLBACK_RETRY_AFTER_S, AdmissionParams, DecodeLimit, Overloaded, PrefillLane,
                              PrefillRate, Refusal, UnloadedTtft, admissible, ttft_aim_s, wait_budget_s)
from router.policy import WorkerView
from cluster.protocol import WorkerRole


def lane(window_tokens: int = 100, smoothing: float = 1.0) -> PrefillLane:
    return PrefillLane(window_tokens, smoothing)


def measured(rate_tokens_per_s: float, window_tokens: int = 1000) -> PrefillLane:
    """A lane whose rate has one completion: `rate_tokens_per_s` * 1 s of service."""
    ln = lane(window_tokens)
    ln.rate.started(0.0, int(rate_tokens_per_s))
    ln.rate.finished(1.0, int(rate_tokens_per_s), delivered=True)
    return ln


def test_rate_counts_busy_time_only_and_shares_a_step_between_batched_completions():
    rate = PrefillRate(smoothing=0.5)
    assert rate.tokens_per_s is None and rate.mean_service_s is None
    rate.started(10.0, 100)
    rate.started(10.0, 100)  # batched with the first
    assert (rate.in_service, rate.in_service_tokens) == (2, 200)
    rate.finished(12.0, 100, delivered=True)  # 100 tokens in 2 s
    rate.finished(12.0, 100, delivered=True)  # +100 tokens in 0 s: decayed sums 150 tokens / 1 s
    assert rate.tokens_per_s == pytest.approx(150.0)
    rate.started(100.0, 50)  # idle from 12 to 100 s: not service time
    rate.finished(101.0, 50, delivered=True)
    assert rate.tokens_per_s == pytest.approx((75 + 50) / (0.5 + 1.0))
    assert rate.in_service == 0


def test_rate_ignores_aborted_prefills_and_rejects_a_double_finish():
    rate = PrefillRate(smoothing=1.0)
    rate.started(0.0, 40)
    rate.started(0.0, 30)
    rate.finished(1.0, 30, delivered=False)  # aborted: no sample
    assert rate.tokens_per_s is None and rate.busy_for_s(1.5) == 1.5
    rate.finished(2.0, 40, delivered=True)  # the aborted one's time falls to this completion
    assert rate.tokens_per_s == pytest.approx(20.0) and rate.mean_service_s == pytest.approx(2.0)
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
    assert ln.refusal(params, 0.0, None) is None
    ln.enqueue("a", 10)
    ln.take_ready()
    ln.enqueue("b", 10)
    assert ln.refusal(params, 0.0, None) is None
    ln.enqueue("c", 10)
    refusal = ln.refusal(params, 0.0, None)
    assert refusal == Refusal("2 requests already queued for this prefill worker", FALLBACK_RETRY_AFTER_S)
    # A queue bound of 0 still lets a request straight into an open window.
    assert lane(window_tokens=10).refusal(AdmissionParams(max_queued_requests=0), 0.0, None) is None


def test_lane_refuses_when_the_predicted_wait_exceeds_the_bound():
    params = AdmissionParams(max_queue_delay_s=2.0)  # a wait budget of 1 s
    ln = measured(100.0)  # 100 tokens/s
    assert ln.refusal(params, 5.0, None) is None  # idle
    ln.enqueue("a", 80)
    ln.take_ready()
    ln.rate.started(5.0, 80)
    assert ln.predicted_wait_s(5.0) == pytest.approx(0.8)
    ln.enqueue("b", 80)  # queued behind a: 1.6 s
    refusal = ln.refusal(params, 5.0, None)
    assert refusal is not None and refusal.retry_after_s == pytest.approx(0.6)
    assert "wait 1.60s exceeds 1.00s" in refusal.reason
    assert "160 prompt tokens ahead" in refusal.reason
    # a has been served for 0.7 s: 0.1 s of it is left, plus b's 0.8 s.
    assert ln.predicted_wait_s(5.7) == pytest.approx(0.9) and ln.refusal(params, 5.7, None) is None
    assert [item for item, _ in ln.take_ready()] == ["b"]  # in the window, its landing being reserved
    # a takes longer than the rate says: b, not yet at the worker, still counts in full.
    assert ln.predicted_wait_s(6.5) == pytest.approx(0.8)


def test_lane_waits_at_most_half_the_margin_by_default_the_unloaded_ttft():
    params = AdmissionParams()  # max_queue_delay_s None: the measured unloaded TTFT
    ln = measured(100.0)  # mean service 1 s
    ln.enqueue("a", 150)
    assert ln.refusal(params, 2.0, None).reason.endswith("exceeds 1.00s (150 prompt tokens ahead)")
    assert ln.refusal(params, 2.0, 3.0) is None  # 1.5 s <= half the unloaded TTFT
    refusal = ln.refusal(params, 2.0, 2.0)
    assert refusal is not None and refusal.retry_after_s == pytest.approx(0.5)
    assert ln.refusal(AdmissionParams(max_queue_delay_s=3.2), 2.0, 1.0) is None  # the explicit margin wins
    assert wait_budget_s(params, None) is None and wait_budget_s(params, 1.5) == 0.75
    assert ttft_aim_s(params, None) is None and ttft_aim_s(params, 1.5) == 2.25
    assert ttft_aim_s(AdmissionParams(max_queue_delay_s=0.5), 1.5) == 1.75


def test_unloaded_ttft_is_smoothed():
    unloaded = UnloadedTtft(smoothing=0.25)
    unloaded.observe(2.0)
    unloaded.observe(4.0)
    assert unloaded.value_s == pytest.approx(2.5)


def test_decode_limit_backs_off_from_what_it_holds_once_per_epoch_and_grows_only_in_use():
    limit = DecodeLimit(max_limit=16, smoothing=0.5)
    assert limit.limit == 16 and limit.refusal(15) is None  # a burst passes before anything is measured
    assert "router.max_requests_per_worker" in limit.refusal(16).reason
    limit.observe(1.0, aim_s=1.5, admitted_epoch=0, num_active=8)
    assert limit.limit == 16  # never above the maximum
    limit.observe(2.0, 1.5, admitted_epoch=0, num_active=8)  # one token past the aim, recent 1.5 s: noise, hold
    assert (limit.limit, limit.epoch, limit.recent_ttft_s) == (16, 0, 1.5)
    limit.observe(2.5, 1.5, admitted_epoch=0, num_active=8)  # the recent TTFT (2 s) is past the aim too: cut
    assert (limit.limit, limit.epoch) == (6.0, 1)  # from the 8 it held, not from 16 it never reached
    refusal = limit.refusal(6)
    assert "adapts" in refusal.reason and refusal.retry_after_s == FALLBACK_RETRY_AFTER_S
    limit.observe(3.0, 1.5, admitted_epoch=0, num_active=7)  # admitted before the cut: no second cut
    assert (limit.limit, limit.epoch) == (6.0, 1)
    limit.observe(3.0, 1.5, admitted_epoch=1, num_active=6)  # admitted under the cut limit, still late: cut
    assert (limit.limit, limit.epoch) == (4.5, 2)
    limit.observe(1.0, 1.5, admitted_epoch=2, num_active=1)  # in time, but the limit was not in use: hold
    assert limit.limit == 4.5
    limit.observe(0.1, 1.5, admitted_epoch=2, num_active=4)  # in time at the limit: one per limit's worth
    assert limit.limit == pytest.approx(4.5 + 1 / 4.5)
    for epoch in range(2, 20):  # late again and again: never below one
        limit.observe(9.0, 1.5, admitted_epoch=epoch, num_active=1)
    assert limit.limit == 1.0 and limit.refusal(0) is None and limit.refusal(1) is not None


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
    from cluster.serve.config import RouterConfig, load_serve_config

    auto = RouterConfig().admission(prefill_chunk_size=512, decode_max_running=64)
    assert auto == AdmissionParams(max_queue_delay_s=None, max_queued_requests=8, prefill_window_tokens=1024,
                                   max_requests_per_worker=64)
    config = load_serve_config(None, {"router.max_queue_delay_s": 1, "router.prefill_window_tokens": 300,
                                      "router.max_requests_per_worker": 5, "router.max_queued_requests": 0})
    assert config.router.admission(512, 64) == AdmissionParams(1.0, 0, 300, 5)
    for key, value in (("max_queue_delay_s", 0), ("max_queued_requests", -1), ("prefill_window_tokens", 0),
                       ("max_requests_per_worker", 0)):
        with pytest.raises(ConfigError, match=f"router.{key}"):
            load_serve_config(None, {f"router.{key}": value})
