"""Admission control: take a request now, or refuse it at once (429 + Retry-After) because it
could not be served within the TTFT budget. Decided at arrival, never later (DESIGN §8).

Each prefill worker has a `PrefillLane`, the dispatcher's share of that worker:

    arrival --admitted--> queue ----------window has room----------> window --transfer over--> out
                          FIFO in the dispatcher;                    landing reserved, prompt at
                          holds nothing on any worker                the worker, KV on its way

A request enters the window, and only then reserves its decode landing, when the prompt tokens in
the window leave room for it (`prefill_window_tokens`; one request larger than that goes alone).
So the transfer deadlines start when its prefill can start: queue time is the dispatcher's,
bounded by admission, and never spent from a transfer deadline.

The promise to an admitted request: its first token within the TTFT budget (`max_queue_delay_s`,
30 s by default: an absolute figure a chat user tolerates, not a multiple of the unloaded TTFT,
so ordinary load queues instead of being refused). Two checks keep to it:

  prefill  a lane admits while the request's predicted first token, the prompt tokens ahead of it
           (queued + in the window) and its own over the lane's measured rate, is within
           `PLAN_SHARE` of the budget (the rest absorbs what it cannot foresee: a prompt's real
           cost, decode steps in the way, the transfer; under overload the slowest first tokens
           came well past the plan's prediction, as the growing decode batch took CPU from the
           prefill worker, and with a larger share they missed the budget:
           docs/results.md#admission). The rate is measured under load only
           (`PrefillRate`). Before a measurement, and whenever the lane is idle, only the queue
           depth (`max_queued_requests`, a memory bound) limits it.
  decode   a decode (or colocated) worker admits while it holds fewer requests, counted from
           arrival, than its `DecodeLimit`: at most `max_requests_per_worker` (so none waits for a
           batch slot), lowered only while first tokens come later than the budget, and never
           below `LIMIT_FLOOR_SHARE` of the maximum.

Pure: no I/O, no asyncio; time is passed in (`now`, monotonic seconds) so tests drive the clock.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from common.config import require
from common.protocol import WorkerRole
from router.policy_types import WorkerView

ItemT = TypeVar("ItemT")  # what a `PrefillLane` queues: the dispatcher's flights

FALLBACK_RETRY_AFTER_S = 1.0  # no measurement to estimate from: the smallest Retry-After HTTP can say
DEFAULT_TTFT_BUDGET_S = 30.0  # what a chat user tolerates before giving up on a first token
PLAN_SHARE = 0.6  # of the TTFT budget that a predicted prefill wait + own prefill may use (measured: below)
LIMIT_FLOOR_SHARE = 0.5  # of max_requests_per_worker: the adaptive decode limit never cuts below it
COLD_SAMPLES = 1  # first completions of a prefill worker whose time is not a rate sample (first-call costs)


@dataclass(frozen=True)
class AdmissionParams:
    """When the dispatcher refuses a request at arrival instead of queueing it."""

    max_queue_delay_s: float = DEFAULT_TTFT_BUDGET_S
    """The TTFT budget: an admitted request's first token comes within this many seconds of its
    arrival (> 0). Admission plans a new request's predicted first token within `PLAN_SHARE` of it,
    and the decode workers' limits are cut only while first tokens come later than it."""
    max_queued_requests: int = 256
    """Admitted requests waiting in the dispatcher per prefill worker, at most (>= 0): a memory bound
    (a waiting request holds its prompt's token ids, nothing on a worker); before the worker's first
    measured prefill it is the only bound."""
    prefill_window_tokens: int = 1024
    """Prompt tokens handed to one prefill worker and not yet delivered, at most (>= 1). Size it
    above the prefill chunk size so the worker's batches stay full."""
    max_requests_per_worker: int = 64
    """Requests one decode or colocated worker holds at once, from arrival to end (>= 1), at most:
    its batch size, so no admitted request waits for a decode slot. The adaptive limit stays below."""
    rate_smoothing: float = 0.2
    """Weight of the newest sample in every smoothed measurement (prefill rate, recent TTFT), in (0, 1]."""

    def __post_init__(self):
        require(self.max_queue_delay_s > 0, f"max_queue_delay_s must be > 0, got {self.max_queue_delay_s}")
        require(self.max_queued_requests >= 0, f"max_queued_requests must be >= 0, got {self.max_queued_requests}")
        require(self.prefill_window_tokens >= 1,
                 f"prefill_window_tokens must be >= 1, got {self.prefill_window_tokens}")
        require(self.max_requests_per_worker >= 1,
                 f"max_requests_per_worker must be >= 1, got {self.max_requests_per_worker}")
        require(0 < self.rate_smoothing <= 1, f"rate_smoothing must be in (0, 1], got {self.rate_smoothing}")

    @property
    def planned_ttft_s(self) -> float:
        """The predicted first token a prefill lane admits up to."""
        return PLAN_SHARE * self.max_queue_delay_s


@dataclass(frozen=True)
class Refusal:
    """Why a worker cannot take one more request now, and when trying again makes sense."""

    reason: str
    retry_after_s: float


class Overloaded(Exception):
    """No worker of a needed role (prefill, or decode: any decode-capable worker) can take the request; `refusal` is the
    most hopeful one's (the soonest retry)."""

    def __init__(self, role: WorkerRole, refusal: Refusal):
        super().__init__(f"{role}: {refusal.reason}")
        self.role, self.refusal = role, refusal


class PrefillRate:
    """Prompt tokens per second one prefill worker turns into delivered KV under load, measured on
    completions.

    Busy time runs while at least one prefill is at the worker; each completion closes the busy
    interval since the previous mark. Decayed sums of tokens and busy seconds (the newest weighs
    `smoothing`) give the rate; prefills that complete in the same step share one interval, so
    batching counts as the throughput it gives. Only busy periods (from idle to idle) in which two
    or more prefills were at the worker at once give samples: a lone prefill's time is mostly fixed
    costs (round trips, the transfer's set-up) that overlap under load, so a rate from a few lone
    chat prompts would refuse what the loaded worker serves in time, and a prediction only matters
    under load. (A lone completion always ends its period, so none is held for later.) The first `cold_samples`
    completions are no samples either: a fresh worker's first prefill pays first-call costs (allocator growth, lazy
    tables).
    """

    def __init__(self, smoothing: float, cold_samples: int = COLD_SAMPLES):
        self.smoothing = smoothing
        self.in_service = 0  # prefills at the worker
        self.in_service_tokens = 0  # their prompt tokens
        self.cold_left = cold_samples  # delivered completions still to skip
        self._mark_s = 0.0
        self._loaded = False  # the current busy period has had two or more prefills at once
        self._tokens = self._busy_s = 0.0

    def started(self, now: float, num_tokens: int) -> None:
        """A prompt of `num_tokens` reached the worker."""
        if self.in_service == 0:  # idle time between busy periods is not service time
            self._mark_s, self._loaded = now, False
        self.in_service += 1
        self.in_service_tokens += num_tokens
        self._loaded = self._loaded or self.in_service >= 2

    def finished(self, now: float, num_tokens: int, delivered: bool) -> None:
        """A prefill left the worker, its KV delivered, or not (aborted: no sample; its time falls
        to the next completion)."""
        assert self.in_service > 0, "prefill finished that never started: finished() called twice?"
        self.in_service -= 1
        self.in_service_tokens -= num_tokens
        if not delivered:
            return
        busy_s, self._mark_s = max(0.0, now - self._mark_s), now
        if self.cold_left:
            self.cold_left -= 1
        elif self._loaded:
            keep = 1.0 - self.smoothing
            self._tokens = keep * self._tokens + num_tokens
            self._busy_s = keep * self._busy_s + busy_s

    @property
    def tokens_per_s(self) -> float | None:
        """None until a loaded completion took measurable time."""
        return self._tokens / self._busy_s if self._busy_s > 0 else None

    def busy_for_s(self, now: float) -> float:
        """Service time the prefills at the worker have had since the last completion (0 when idle)."""
        return max(0.0, now - self._mark_s) if self.in_service else 0.0


class DecodeLimit:
    """How many requests one decode (or colocated) worker may hold, adapted to the TTFT they get.

    It starts at `max_limit` (nothing measured, no reason to refuse a burst) and moves on each
    admitted request's first token, against the TTFT budget (`budget_s`), like a congestion window:

        within the budget, the limit in use     grow by one per limit's worth of tokens
        past the budget, and so is the          cut to `BACKOFF` x the requests it holds,
          smoothed recent TTFT                    at most once per epoch
        otherwise                               hold

    Growth only while the limit binds (a worker below its limit says nothing about more); a cut
    from what the worker holds, not from a limit it never reached. Once per epoch: requests admitted
    under the limit a cut replaced were admitted too generously already; their late tokens say
    nothing new. The smoothing keeps one noisy token from cutting. Between `floor` (`LIMIT_FLOOR_SHARE`
    of the maximum: a worker that serves slowly still serves a full batch's worth of users, and the
    prefill lanes' predictions bound the rest) and `max_limit`. It catches what the prefill rate
    cannot show: a decode batch that delays first tokens, or slows a prefill worker sharing its CPU.
    """

    BACKOFF = 0.75

    def __init__(self, max_limit: int, smoothing: float):
        self.max_limit, self.smoothing = max_limit, smoothing
        self.floor = max(1.0, float(math.ceil(LIMIT_FLOOR_SHARE * max_limit)))
        self.limit = float(max_limit)
        self.epoch = 0  # cuts so far
        self.recent_ttft_s: float | None = None

    def observe(self, ttft_s: float, budget_s: float, admitted_epoch: int, num_active: int) -> None:
        """A first token came `ttft_s` after arrival, to a request admitted in `admitted_epoch`,
        while the worker holds `num_active` requests (that one included)."""
        old = self.recent_ttft_s
        self.recent_ttft_s = ttft_s if old is None else old + self.smoothing * (ttft_s - old)
        if ttft_s <= budget_s:
            if num_active >= self.limit - 1:
                self.limit = min(float(self.max_limit), self.limit + 1.0 / self.limit)
        elif admitted_epoch == self.epoch and self.recent_ttft_s > budget_s:
            self.limit = max(self.floor, min(self.limit, num_active) * self.BACKOFF)
            self.epoch += 1

    def refusal(self, num_active: int) -> Refusal | None:
        """Why a worker holding `num_active` requests cannot take one more."""
        if num_active < int(self.limit):
            return None
        why = ("router.max_requests_per_worker" if int(self.limit) >= self.max_limit
               else "its limit was cut while first tokens came later than router.max_queue_delay_s")
        return Refusal(f"{num_active} requests already on this worker ({why})", FALLBACK_RETRY_AFTER_S)


class PrefillLane(Generic[ItemT]):
    """One prefill worker's queue and window (see the module docstring). Items are the caller's
    (the dispatcher's flights); each carries a token count fixed when it is queued."""

    def __init__(self, window_tokens: int, rate_smoothing: float):
        self.max_window_tokens = window_tokens
        self.rate = PrefillRate(rate_smoothing)
        self._queue: deque[tuple[ItemT, int]] = deque()
        self.queued_tokens = 0
        self.window_tokens = 0
        self.hold: tuple[ItemT, float] | None = None
        """(an item refused a landing and backing off, until when): the lane takes nothing meanwhile
        (`router/transfer_phase.py`: younger requests would take the room it waits for)."""

    @property
    def num_queued(self) -> int:
        return len(self._queue)

    @property
    def ahead_tokens(self) -> int:
        """Prompt tokens a request arriving now would wait behind."""
        return self.queued_tokens + self.window_tokens

    def enqueue(self, item: ItemT, num_tokens: int, *, front: bool = False) -> None:
        """`front`: it was admitted before (re-routed, or back from a full landing pool); it goes first."""
        assert num_tokens >= 1, f"queued an empty prompt ({num_tokens} tokens)"
        (self._queue.appendleft if front else self._queue.append)((item, num_tokens))
        self.queued_tokens += num_tokens

    def discard(self, item: ItemT) -> bool:
        """Take `item` out of the queue (aborted, or its worker died). False when not queued."""
        for entry in self._queue:
            if entry[0] is item:
                self._queue.remove(entry)
                self.queued_tokens -= entry[1]
                return True
        return False

    def take_ready(self, only: ItemT | None = None) -> list[tuple[ItemT, int]]:
        """Move queued items into the window, in order, while they fit; returns them. `only`: the lane
        is held for that item: it alone may go, when it is first."""
        ready: list[tuple[ItemT, int]] = []
        while self._queue:
            item, num_tokens = self._queue[0]
            if self.window_tokens and self.window_tokens + num_tokens > self.max_window_tokens:
                break
            if only is not None and (item is not only or ready):
                break
            self._queue.popleft()
            self.queued_tokens -= num_tokens
            self.window_tokens += num_tokens
            ready.append((item, num_tokens))
        return ready

    def leave_window(self, num_tokens: int) -> None:
        self.window_tokens -= num_tokens
        assert self.window_tokens >= 0, f"window below zero ({self.window_tokens}): a transfer ended twice?"

    def drain(self) -> list[ItemT]:
        """Empty the queue (its worker is gone); returns the items in order."""
        items = [item for item, _ in self._queue]
        self._queue.clear()
        self.queued_tokens = 0
        return items

    def predicted_wait_s(self, now: float) -> float | None:
        """Seconds until a request arriving now would start, at the measured rate: the prompts at the
        worker less the service they had since the rate's last mark, then every prompt not yet there
        (in the window, landing being reserved; or queued). None: no rate yet."""
        rate = self.rate.tokens_per_s
        if rate is None:
            return None
        at_worker_s = max(0.0, self.rate.in_service_tokens / rate - self.rate.busy_for_s(now))
        return at_worker_s + (self.ahead_tokens - self.rate.in_service_tokens) / rate

    def refusal(self, params: AdmissionParams, now: float, num_tokens: int) -> Refusal | None:
        """Why this lane cannot admit one more request of `num_tokens` prompt tokens now; None when
        it can: its predicted prefill end (the wait, then its own prompt) is within the plan."""
        if self.num_queued >= params.max_queued_requests and not self._has_room_now():
            return Refusal(f"{self.num_queued} requests already queued for this prefill worker "
                           "(router.max_queued_requests)", FALLBACK_RETRY_AFTER_S)
        wait_s, rate = self.predicted_wait_s(now), self.rate.tokens_per_s
        if wait_s is None or rate is None or not self.ahead_tokens:  # unmeasured, or idle: nothing to wait behind
            return None
        done_s = wait_s + num_tokens / rate
        if done_s <= params.planned_ttft_s:
            return None
        return Refusal(f"predicted prefill done in {done_s:.2f}s, past the {params.planned_ttft_s:.2f}s admission "
                       f"plans for (router.max_queue_delay_s {params.max_queue_delay_s:g}s; "
                       f"{self.ahead_tokens} prompt tokens ahead)", done_s - params.planned_ttft_s)

    def _has_room_now(self) -> bool:
        return not self._queue and self.window_tokens < self.max_window_tokens


_NEEDED_ROLES = ((WorkerRole.PREFILL, (WorkerRole.PREFILL,)),
                 (WorkerRole.DECODE, (WorkerRole.DECODE, WorkerRole.COLOCATED)))  # the group, named by its first role


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
