"""Where a request goes (docs/design.md §8): a new arrival's admission (refused at once, 429, when
no worker can take it promptly), the pure policy's choice over the live workers' views, and the
router's prefix trees that the choice reads and updates. The dispatcher applies the route it gets
back (a flight's workers, counts and messages); nothing here touches a flight."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from router.admission import AdmissionParams, Overloaded, admissible
from router.backend import BackendError, ErrorKind
from router.flights import Flight
from router.policy import NoWorkerAvailable, Policy, choose
from router.policy_types import PolicyParams, RequestView, WorkerView
from router.state import RouterState
from router.workers import LiveWorker


def refusals_counter():
    """Requests refused at arrival, by the role that had no worker to take them (429)."""
    from prometheus_client import Counter

    return Counter("tandem:requests_refused_total",
                   "Requests refused at arrival because the workers could not serve them promptly (429)",
                   ["role"], registry=None)


class RoutePicker:
    """Picks a request's decode worker and, disaggregated, its prefill worker. Owns the counter of
    refusals at arrival (`refusals`); mutates `state` (the route is recorded there as it is taken)."""

    def __init__(self, policy: Policy, params: PolicyParams, state: RouterState, clock: Callable[[], float]):
        self.policy, self.params, self.state, self.clock = policy, params, state, clock
        self.refusals = refusals_counter()

    def pick(self, flight: Flight, lives: Iterable[LiveWorker],
             admission: AdmissionParams | None) -> tuple[LiveWorker, LiveWorker | None]:
        """(decode worker, prefill worker or None: the decode worker prefills it) for `flight` among
        the `lives` not gone. `admission`: a new arrival's, which refuses it (QUEUE_FULL) when no
        worker can take it promptly; None: admitted before (re-routed, back from a full landing pool).
        Raises `BackendError` (UNAVAILABLE) when no worker can serve it at all."""
        by_id = {lv.worker_id: lv for lv in lives if not lv.gone}
        views = [lv.view() for lv in by_id.values()]
        if admission is not None:
            views = self._admissible(by_id.values(), views, len(flight.prompt), admission)
        request = RequestView(flight.request_id, tuple(flight.prompt), flight.params.max_tokens)
        try:
            route = choose(self.policy, request, views, self.state, self.params)
        except NoWorkerAvailable as exc:
            raise BackendError(ErrorKind.UNAVAILABLE, f"no worker can serve requests now: {exc}",
                               retry_after_s=5.0) from None
        prefiller = route.decode_id if route.prefill_id is None else route.prefill_id
        self.state.record(request, route, next((v for v in views if v.worker_id == prefiller), None))
        return by_id[route.decode_id], by_id[route.prefill_id] if route.prefill_id else None

    def _admissible(self, lives: Iterable[LiveWorker], views: list[WorkerView], num_tokens: int,
                    admission: AdmissionParams) -> list[WorkerView]:
        """The views of the workers that can take a new request of `num_tokens` prompt tokens now;
        raises QUEUE_FULL (429) when a needed role has none."""
        now = self.clock()
        refusals = {live.worker_id: r for live in lives if (r := live.refusal(admission, now, num_tokens))}
        try:
            return admissible(views, refusals)
        except Overloaded as exc:
            self.refusals.labels(role=exc.role).inc()
            raise BackendError(ErrorKind.QUEUE_FULL, f"the server is at capacity ({exc}); retry later",
                               retry_after_s=exc.refusal.retry_after_s) from None
