"""`router.timeline`: phases and their seconds from a request's moves, the workers' spans from their
own timestamps, the one-line summary, the per-phase sums; and the gateway's request log (slowest
first, the slow-request line)."""

from __future__ import annotations

import logging

from router.backend import GenerationChunk
from router.gateway.request_log import RequestLog
from router.timeline import describe, phase_seconds, summary

EVENTS = [("queued", 10.5, "prefill-0"), ("reserving", 14.5, "decode-0"), ("prefilling", 14.75, "prefill-0"),
          ("queued", 15.0, "prefill-1"), ("reserving", 15.5, "decode-0"), ("prefilling", 15.75, "prefill-1"),
          ("streaming", 16.0, "decode-0"), ("done", 18.0, "")]
WORKER = {"prefill_submitted": 100.0, "compute_done": 100.25, "first_write": 100.125, "transfer_done": 100.375,
          "load_start": 7.0, "load_done": 7.5, "reserved": 3.0}


def test_phases_last_until_the_next_and_spans_come_from_one_workers_clock():
    t = describe(10.0, EVENTS, WORKER)
    assert [(p["phase"], p["at_s"], p["s"], p["worker"]) for p in t["phases"][:3]] == [
        ("queued", 0.5, 4.0, "prefill-0"), ("reserving", 4.5, 0.25, "decode-0"),
        ("prefilling", 4.75, 0.25, "prefill-0")]
    assert t["phases"][-1] == {"phase": "done", "at_s": 8.0, "s": 0.0, "worker": ""}
    assert t["first_token_s"] == 6.0
    assert t["worker_s"] == {"prefill": 0.25, "transfer": 0.25, "transfer_after_compute": 0.125, "load": 0.5}
    assert phase_seconds(t) == {"queued": 4.5, "reserving": 0.5, "prefilling": 0.5}
    assert summary(t).startswith("queued 4.000 s (prefill-0) > reserving 0.250 s (decode-0) > prefilling")
    assert "streaming" not in summary(t) and "workers: prefill 0.250 s" in summary(t)


def test_the_engines_own_marks_split_the_prefill_or_the_local_prompt():
    """A prefill worker's engine marks (renamed on the decode side: `prefill_marks`) split its span into
    queue, tier load and compute; a prompt computed on the decode worker gets queue, tier_load and
    compute from that engine's marks, which a disaggregated request's decode-side marks never give."""
    from engine.request import prefill_marks

    prefill = prefill_marks({"received": 1.0, "prefill_submitted": 1.0, "tier_load_start": 1.5, "tier_load_done": 2.0,
                             "admitted": 2.5, "first_token": 3.9, "compute_done": 4.0})
    assert prefill["prefill_admitted"] == 2.5 and "admitted" not in prefill
    decode_side = {**prefill, "received": 50.0, "admitted": 60.0, "first_token": 61.0}
    spans = describe(0.0, [], decode_side)["worker_s"]
    assert (spans["prefill_queue"], spans["prefill_tier_load"], spans["prefill_compute"], spans["prefill"]) == \
        (1.5, 0.5, 1.5, 3.0)
    assert not {"queue", "tier_load", "compute"} & set(spans)
    local = describe(0.0, [], {"received": 5.0, "tier_load_start": 5.5, "tier_load_done": 6.0, "admitted": 6.5,
                               "first_token": 7.0})["worker_s"]
    assert local == {"queue": 1.5, "tier_load": 0.5, "compute": 0.5}


def test_a_request_with_no_first_token_has_none():
    t = describe(0.0, [("queued", 0.0, "prefill-0"), ("done", 2.0, "")], {})
    assert t["first_token_s"] is None and t["worker_s"] == {} and phase_seconds(t) == {"queued": 2.0}


def test_the_request_log_keeps_the_latest_lists_the_slowest_and_logs_the_slow(caplog):
    log = RequestLog(slow_s=5.0, capacity=3)
    for i, first in enumerate([1.0, 9.0, 2.0, 3.0]):
        timeline = describe(0.0, [("local", 0.0, "decode-0"), ("streaming", first, "decode-0")], {})
        with caplog.at_level(logging.WARNING, logger="tandem.gateway"):
            log.record(f"r{i}", 10, GenerationChunk((), "length", decode_worker="decode-0", timeline=timeline))
    assert [e["id"] for e in log.entries(10)] == ["r3", "r2", "r1"]  # r0 forgotten: capacity 3
    assert [e["id"] for e in log.entries(2, "slowest")] == ["r1", "r3"]
    [line] = [r.getMessage() for r in caplog.records]
    assert line.startswith("slow request r1: first token after 9.00 s") and "local 9.000 s (decode-0)" in line
