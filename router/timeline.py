"""A request's timeline: where its time went, from the dispatcher's phase moves (`Flight.events`) and
the workers' own timestamps (`TokenOutput.timings`), as the last chunk carries it to the gateway
(`/debug/requests`, the slow-request log line, `tandem bench serve`'s phase split).

    {"phases": [{"phase": "queued", "at_s": 0.0, "s": 4.1, "worker": "prefill-0"},   # in the prefill lane
                {"phase": "reserving", "at_s": 4.1, "s": 0.01, "worker": "decode-0"},  # landing asked for
                {"phase": "prefilling", ...}, {"phase": "streaming", ...}, ...],
     "first_token_s": 5.3,                       # arrival -> the first token, as the dispatcher saw it
     "worker_s": {"prefill": 1.0, "transfer": 0.2, "transfer_after_compute": 0.1, "load": 0.05}}

Phases (`router.flights.Phase`): queued (waiting in its prefill worker's lane: nothing held yet),
reserving (its landing asked of the decode worker), backoff (the landing pool was full), prefilling
(the prefill worker computes the prompt and ships its KV, until the first token), local (the decode
worker prefills it itself), streaming, migrating (its worker died or drains: waiting for another),
done. Each phase lasts until the next one starts; a phase entered twice (a re-route) appears twice.
`worker_s` are durations between one worker's own timestamps (each process's clock is its own):
prefill = compute_done - prefill_submitted (queue and compute on the prefill worker), split into
prefill_queue (its engine's queue), prefill_tier_load (its prefix loaded back from the host tier or
L3) and prefill_compute (admitted -> computed); transfer = transfer_done - first_write,
transfer_after_compute = transfer_done - compute_done (what the transfer added after the prompt was
computed), load = load_done - load_start (the landing, host -> device, on the decode worker). A
prompt the decode worker computes itself has queue, tier_load and compute (admitted -> its first
token: chunks interleaved with decode steps included) instead.
"""

from __future__ import annotations

_SPANS = {"prefill": ("prefill_submitted", "compute_done"), "transfer": ("first_write", "transfer_done"),
          "transfer_after_compute": ("compute_done", "transfer_done"), "load": ("load_start", "load_done"),
          "prefill_queue": ("prefill_received", "prefill_admitted"),
          "prefill_tier_load": ("prefill_tier_load_start", "prefill_tier_load_done"),
          "prefill_compute": ("prefill_admitted", "compute_done")}
_LOCAL_SPANS = {"queue": ("received", "admitted"), "tier_load": ("tier_load_start", "tier_load_done"),
                "compute": ("admitted", "first_token")}
"""A prompt computed on the decode worker itself (no prefill worker's marks): its engine's spans."""


def describe(arrived: float, events: list[tuple[str, float, str]], worker_timings: dict[str, float],
             now: float | None = None) -> dict:
    """The timeline of a request that arrived at `arrived` (monotonic) and moved through `events`
    (phase, monotonic time, worker); the last phase lasts until `now` (default: its own start)."""
    phases = []
    for i, (phase, at, worker) in enumerate(events):
        end = events[i + 1][1] if i + 1 < len(events) else (at if now is None else now)
        phases.append({"phase": phase, "at_s": round(at - arrived, 4), "s": round(end - at, 4), "worker": worker})
    first = next((at for phase, at, _ in events if phase == "streaming"), None)
    pairs = {**_SPANS, **({} if "prefill_submitted" in worker_timings else _LOCAL_SPANS)}
    spans = {name: round(worker_timings[b] - worker_timings[a], 4) for name, (a, b) in pairs.items()
             if a in worker_timings and b in worker_timings}
    return {"phases": phases, "first_token_s": None if first is None else round(first - arrived, 4), "worker_s": spans}


def summary(timeline: dict) -> str:
    """One line: each phase before the first token with its seconds and worker, then the worker spans."""
    parts = []
    for ph in timeline.get("phases", []):
        if ph["phase"] in ("streaming", "done"):
            break
        parts.append(f"{ph['phase']} {ph['s']:.3f} s" + (f" ({ph['worker']})" if ph["worker"] else ""))
    spans = ", ".join(f"{name} {s:.3f} s" for name, s in timeline.get("worker_s", {}).items())
    return " > ".join(parts) + (f"; workers: {spans}" if spans else "")


def phase_seconds(timeline: dict) -> dict[str, float]:
    """Seconds spent in each phase before the first token, summed over re-entries."""
    out: dict[str, float] = {}
    for ph in timeline.get("phases", []):
        if ph["phase"] in ("streaming", "done"):
            break
        out[ph["phase"]] = round(out.get(ph["phase"], 0.0) + ph["s"], 4)
    return out
