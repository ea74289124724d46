"""Admission control: take a request now, or refuse it at once (429 + Retry-After) because it
could not be served promptly. Decided at arrival, never later (DESIGN §8).

Each prefill worker has a `PrefillLane`, the dispatcher's share of that worker:

    arrival --admitted--> queue ----------window has room----------> window --transfer over--> out
                          FIFO in the dispatcher;                    landing reserved, prompt at
                          holds nothing on any worker                the worker, KV on its way

A request enters the window, and only then reserves its decode landing, when the prompt tokens in
the window leave room for it (`prefill_window_tokens`; one request larger than that goes alone).
So the transfer deadlines start when its prefill can start: queue time is the dispatcher's,
bounded by admission, and never spent from a transfer deadline.

A lane admits while the predicted wait of a new request, the prompt tokens ahead of it (queued +
in the window) over the lane's measured rate, is within the bound. Before its first measurement,
only the queue depth bounds it. A decode (or colocated) worker admits while it holds fewer than
`max_requests_per_worker` requests, counted from arrival, so no admitted request waits for a
batch slot.

Pure: no I/O, no asyncio; time is passed in (`now`, monotonic seconds) so tests drive the clock.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from cluster.config import ConfigError
from router.policy import WorkerRole, WorkerView

FALLBACK_RETRY_AFTER_S = 1.0  # no measurement to estimate from: the smallest Retry-After HTTP can say


@dataclass(frozen=True)
class AdmissionParams:
    """When the dispatcher refuses a request at arrival instead of queueing it."""

    max_queue_delay_s: float | None = None
    """Predicted wait (prompt tokens ahead / measured rate) a new request may face on a prefill
    worker (> 0). None: that worker's measured time to first token of requests that found it idle
    (before any, its mean prefill time), so admitted requests' TTFT stays within ~2x the unloaded one."""
    max_queued_requests: int = 8
    """Admitted requests waiting in the dispatcher per prefill worker, at most (>= 0); before the
    worker's first completed prefill it is the only bound."""
    prefill_window_tokens: int = 1024
    """Prompt tokens handed to one prefill worker and not yet delivered, at most (>= 1). Size it
    above the prefill chunk size so the worker's batches stay full."""
    max_requests_per_worker: int = 64
    """Requests one decode or colocated worker holds at once, from arrival to end (>= 1): its
    batch size, so no admitted request waits for a decode slot."""
    rate_smoothing: float = 0.2
    """Weight of the newest completion in the measured prefill rate, in (0, 1]."""

    def __post_init__(self):
        _require(self.max_queue_delay_s is None or self.max_queue_delay_s > 0,
                 f"max_queue_delay_s must be > 0 or None, got {self.max_queue_delay_s}")
        _require(self.max_queued_requests >= 0, f"max_queued_requests must be >= 0, got {self.max_queued_requests}")
        _require(self.prefill_window_tokens >= 1,
                 f"prefill_window_tokens must be >= 1, got {self.prefill_window_tokens}")
        _require(self.max_requests_per_worker >= 1,
                 f"max_requests_per_worker must be >= 1, got {self.max_requests_per_worker}")
        _require(0 < self.rate_smoothing <= 1, f"rate_smoothing must be in (0, 1], got {self.rate_smoothing}")


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


@dataclass(frozen=True)
class Refusal:
    """Why a worker cannot take one more request now, and when trying again makes sense."""

    reason: str
    retry_after_s: float


class Overloaded(Exception):
    """No worker of a needed role ("prefill" | "decode") can take the request; `refusal` is the
    most hopeful one's (the soonest retry)."""

    def __init__(self, role: str, refusal: Refusal):
        super().__init__(f"{role}: {refusal.reason}")
        self.role, self.refusal = role, refusal


class PrefillRate:
    """Prompt tokens per second one prefill worker turns into delivered KV, measured on completions.

    Busy time runs while at least one prefill is at the worker; each completion closes the busy
    interval since the previous mark. Decayed sums of tokens, busy seconds and completions (the
    newest weighs `smoothing`) give the rate and the mean service time; prefills that complete in
    the same step share one interval, so batching counts as the throughput it gives.
    """

    def __init__(self, smoothing: float):
        self.smoothing = smoothing
        self.in_service = 0
        self._mark_s = 0.0
        self._tokens = self._busy_s = self._completions = 0.0

    def started(self, now: float) -> None:
        if self.in_service == 0:  # idle time between busy periods is not service time
            self._mark_s = now
        self.in_service += 1

    def finished(self, now: float, num_tokens: int | None) -> None:
        """A prefill left the worker: delivered `num_tokens` prompt tokens, or None when it ended
        without delivering (aborted: no sample; its time falls to the next completion)."""
        assert self.in_service > 0, "prefill finished that never started: finished() called twice?"
        self.in_service -= 1
        if num_tokens is None:
            return
        keep = 1.0 - self.smoothing
        self._tokens = keep * self._tokens + num_tokens
        self._busy_s = keep * self._busy_s + max(0.0, now - self._mark_s)
        self._completions = keep * self._completions + 1.0
        self._mark_s = now

    @property
    def tokens_per_s(self) -> float | None:
        """None until a completion took measurable time."""
        return self._tokens / self._busy_s if self._busy_s > 0 else None

    @property
    def mean_service_s(self) -> float | None:
        return self._busy_s / self._completions if self._busy_s > 0 else None

    def busy_for_s(self, now: float) -> float:
        """Service time the prefills at the worker have had since the last completion (0 when idle)."""
        return max(0.0, now - self._mark_s) if self.in_service else 0.0


class PrefillLane:
    """One prefill worker's queue and window (see the module docstring). Items are the caller's
    (the dispatcher's flights); each carries a token count fixed when it is queued."""

    def __init__(self, window_tokens: int, rate_smoothing: float):
        self.max_window_tokens = window_tokens
        self.rate = PrefillRate(rate_smoothing)
        self._queue: deque[tuple[object, int]] = deque()
        self.queued_tokens = 0
        self.window_tokens = 0
        self.idle_ttft_s: float | None = None  # smoothed; see observe_idle_ttft

    @property
    def num_queued(self) -> int:
        return len(self._queue)

    @property
    def ahead_tokens(self) -> int:
        """Prompt tokens a request arriving now would wait behind."""
        return self.queued_tokens + self.window_tokens

    def enqueue(self, item: object, num_tokens: int, *, front: bool = False) -> None:
        """`front`: it was admitted before (re-routed, or back from a full host tier); it goes first."""
        assert num_tokens >= 1, f"queued an empty prompt ({num_tokens} tokens)"
        (self._queue.appendleft if front else self._queue.append)((item, num_tokens))
        self.queued_tokens += num_tokens

    def discard(self, item: object) -> bool:
        """Take `item` out of the queue (aborted, or its worker died). False when not queued."""
        for entry in self._queue:
            if entry[0] is item:
                self._queue.remove(entry)
                self.queued_tokens -= entry[1]
                return True
        return False

    def take_ready(self) -> list[tuple[object, int]]:
        """Move queued items into the window, in order, while they fit; returns them."""
        ready = []
        while self._queue:
            item, num_tokens = self._queue[0]
            if self.window_tokens and self.window_tokens + num_tokens > self.max_window_tokens:
                break
            self._queue.popleft()
            self.queued_tokens -= num_tokens
            self.window_tokens += num_tokens
            ready.append((item, num_tokens))
        return ready

    def leave_window(self, num_tokens: int) -> None:
        self.window_tokens -= num_tokens
        assert self.window_tokens >= 0, f"window below zero ({self.window_tokens}): a transfer ended twice?"

    def drain(self) -> list[object]:
        """Empty the queue (its worker is gone); returns the items in order."""
        items = [item for item, _ in self._queue]
        self._queue.clear()
        self.queued_tokens = 0
        return items

    def observe_idle_ttft(self, ttft_s: float) -> None:
        """Time to first token of a request that found this lane empty: the unloaded figure that
        the automatic queue-delay bound keeps admitted requests within twice of."""
        old = self.idle_ttft_s
        self.idle_ttft_s = ttft_s if old is None else old + self.rate.smoothing * (ttft_s - old)

    def predicted_wait_s(self, now: float) -> float | None:
        """Seconds until a request arriving now would start: queued tokens at the measured rate, plus
        what is left of the window's (its service started at the rate's last mark). None: no rate yet."""
        rate = self.rate.tokens_per_s
        if rate is None:
            return None
        in_window_s = self.window_tokens / rate
        if self.rate.in_service:
            in_window_s = max(0.0, in_window_s - self.rate.busy_for_s(now))
        return self.queued_tokens / rate + in_window_s

    def refusal(self, params: AdmissionParams, now: float) -> Refusal | None:
        """Why this lane cannot admit one more request now; None when it can."""
        if self.num_queued >= params.max_queued_requests and not self._has_room_now():
            return Refusal(f"{self.num_queued} requests already queued for this prefill worker",
                           FALLBACK_RETRY_AFTER_S)
        wait_s = self.predicted_wait_s(now)
        if wait_s is None:
            return None
        bound_s = params.max_queue_delay_s or self.idle_ttft_s or self.rate.mean_service_s
        if wait_s <= bound_s:
            return None
        return Refusal(f"predicted prefill queue wait {wait_s:.2f}s exceeds {bound_s:.2f}s "
                       f"({self.ahead_tokens} prompt tokens ahead)", wait_s - bound_s)

    def _has_room_now(self) -> bool:
        return not self._queue and self.window_tokens < self.max_window_tokens


def decode_refusal(num_active: int, params: AdmissionParams) -> Refusal | None:
    """Why a decode or colocated worker holding `num_active` requests cannot take one more."""
    if num_active < params.max_requests_per_worker:
        return None
    return Refusal(f"{num_active} requests already on this worker (router.max_requests_per_worker)",
                   FALLBACK_RETRY_AFTER_S)


_NEEDED_ROLES = (("prefill", (WorkerRole.PREFILL,)), ("decode", (WorkerRole.DECODE, WorkerRole.COLOCATED)))


def admissible(workers: Sequence[WorkerView], refusals: Mapping[str, Refusal]) -> list[WorkerView]:
    """The workers the policy may choose from for a new request: those not refused. Raises
    `Overloaded` when every alive prefill worker, or every alive decode-capable worker, refused:
    the request is not moved to another route shape (a decode worker prefilling locally) by load."""
    alive = [w for w in workers if w.alive]
    for name, roles in _NEEDED_ROLES:
        group = [w for w in alive if w.role in roles]
        if group and all(w.worker_id in refusals for w in group):
            raise Overloaded(name, min((refusals[w.worker_id] for w in group), key=lambda r: r.retry_after_s))
    return [w for w in workers if w.worker_id not in refusals]
