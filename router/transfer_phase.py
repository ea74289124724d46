"""The dispatcher's side of a disaggregated request's transfer phase (DESIGN §2 steps 3-4): from the
`Reserve` that asks its decode worker for a landing, sent once its prefill worker's window has room,
through the `Prefill` that hands the prompt to the prefill worker, to the end of the transfer, with
the messages between the two workers relayed meanwhile (`KVProgress`, `KVComplete`,
`TransferAborted` to decode; `AbortTransfer` to prefill).

A reservation the decode worker cannot land yet (its landing pool is full) backs off for
`reserve_retry_s` and is routed afresh (to the front of its lane), until `landing_timeout_s` after
its first try. Until it has its landing its prefill lane is held for it: nothing younger enters
the window, so nothing younger takes the landing room it waits for (a long prompt was refused again
and again while shorter ones filled the room it freed: most of its first token's wait on a trace
slice, docs/results.md#transfer). The hold lapses `HOLD_SLACK_S` past the retry, so a flight that
ends or a decode worker that does not answer cannot stall the lane.

`TransferPhase` owns the `Transfer` records (`router.flights`) and the lanes' windows and holds; it
never routes, re-routes or ends a request. The dispatcher hands it the flight a message is about
and applies what it answers (`Landing`): the routing, the retry after a backoff and every ending
stay the dispatcher's.
"""

from __future__ import annotations

import enum
from collections.abc import Callable

from common import protocol as p
from router.flights import Flight, Phase, Transfer
from router.workers import LiveWorker

HOLD_SLACK_S = 1.0
"""Seconds a lane stays held for a flight past its retry time (module docstring)."""

TRANSFER_MESSAGES = (p.KVProgress, p.KVComplete, p.TransferAborted, p.AbortTransfer)
"""The messages `TransferPhase.relay` passes between a transfer's two workers."""


class Landing(enum.Enum):
    """What the dispatcher does with a flight after its decode worker answered its `Reserve`
    (`TransferPhase.on_reserved`); None: nothing, the transfer phase did it all."""

    REFUSED = "refused"  # no room to land it now: it is in BACKOFF; un-route it, route it afresh after the retry time
    REJECTED = "rejected"  # the decode worker refused the request itself: end it with that error (400)


class TransferPhase:
    """Reservation, prefill hand-off and relay of one prefill -> decode transfer per routed request.

    Owns `_transfers` (by wire id): a record lives from `pump` (a `Reserve` sent) until the prefill
    worker is done with it (its terminal message relayed) or one of its two workers is gone
    (`gone_with`); while it lives it holds its share of the prefill worker's window. Every method
    that ends one pumps its lane. Mutates the flights it is handed only by `Flight.move` (to
    RESERVING, BACKOFF, PREFILLING) and their landing fields. Not thread-safe: the dispatcher's one
    asyncio loop calls every method.
    """

    def __init__(self, clock: Callable[[], float], reserve_retry_s: float) -> None:
        """`clock`: the dispatcher's; `reserve_retry_s`: how long a refused reservation backs off
        (the lane is held for it that long, plus `HOLD_SLACK_S`)."""
        self.clock, self.reserve_retry_s = clock, reserve_retry_s
        self._transfers: dict[str, Transfer] = {}

    def pump(self, prefill: LiveWorker[Flight]) -> None:
        """Reserve landings for the queued requests that fit the prefill worker's window now."""
        if prefill.gone:
            return
        for flight, num_tokens in prefill.lane.take_ready(only=self._holder(prefill)):
            flight.move(Phase.RESERVING)
            if flight.reserve_started_at is None:
                flight.reserve_started_at = self.clock()
            decode = flight.routed_decode()
            self._transfers[flight.wire_id] = Transfer(prefill, decode, num_tokens)
            decode.send(p.Reserve(flight.wire_id, tuple(flight.prompt), flight.params, prefill.peer_id))

    def _holder(self, prefill: LiveWorker[Flight]) -> Flight | None:
        """The flight `prefill`'s lane is held for (module docstring), or None; a lapsed hold is dropped.
        A flight that ended is DONE, one waiting to resume MIGRATING: neither holds its lane."""
        hold = prefill.lane.hold
        if hold is None:
            return None
        flight, until = hold
        if flight.phase in (Phase.BACKOFF, Phase.QUEUED, Phase.RESERVING) and self.clock() < until \
                and flight.prefill is prefill:
            return flight
        prefill.lane.hold = None
        return None

    def on_reserved(self, msg: p.Reserved, flight: Flight | None) -> Landing | None:
        """The decode worker answered the `Reserve` of `flight` (None: no flight is routed under that
        wire id any more). On a landing the prompt goes to the prefill worker; else the transfer is
        over, and the answer says what the dispatcher does with `flight` (never None then)."""
        transfer = self._transfers.get(msg.request_id)
        if msg.error:
            self._over(msg.request_id)
            return None if flight is None else Landing.REJECTED
        if msg.landing is None:  # landing pool full: the decode worker holds nothing for it
            if flight is not None:
                flight.move(Phase.BACKOFF)
                if transfer is not None:  # before the transfer's end pumps the lane
                    transfer.prefill.lane.hold = (flight, self.clock() + self.reserve_retry_s + HOLD_SLACK_S)
            self._over(msg.request_id)
            return None if flight is None else Landing.REFUSED
        if transfer is None or transfer.prefill.gone:
            if transfer is not None:  # its prefill worker died meanwhile: the decode side frees it
                transfer.decode.send(p.PeerDead(transfer.prefill.peer_id))
        elif flight is not None:  # (None: aborted while reserving; the decode worker's Abort ends it)
            self._hand_off(flight, transfer, msg.request_id, msg.landing)
        return None

    def _hand_off(self, flight: Flight, transfer: Transfer, wire_id: str, landing: p.Landing) -> None:
        """`flight` has its landing: its prompt goes to the prefill worker, and a lane held for it goes on."""
        flight.move(Phase.PREFILLING)
        flight.landing_bytes = len(landing.page_ids) * landing.layout.page_bytes
        transfer.prefill_sent = True
        transfer.prefill.lane.rate.started(self.clock(), transfer.prompt_len)
        transfer.prefill.send(p.Prefill(wire_id, tuple(flight.prompt), flight.params, landing))
        if transfer.prefill.lane.hold is not None and transfer.prefill.lane.hold[0] is flight:
            transfer.prefill.lane.hold = None  # landed: the requests behind it go on
            self.pump(transfer.prefill)

    def relay(self, msg) -> bool:
        """Pass a transfer's message (`TRANSFER_MESSAGES`) to its other worker: `AbortTransfer` (from the
        decode worker) to the prefill worker, the rest (from the prefill worker) to the decode worker.
        True when it was the `KVComplete` that delivered the prompt (the dispatcher notes it cached)."""
        transfer = self._transfers.get(msg.request_id)
        if transfer is None:
            return False
        if isinstance(msg, p.AbortTransfer):
            transfer.prefill.send(msg)
            return False
        if not transfer.decode.gone:
            transfer.decode.send(msg)
        if isinstance(msg, (p.KVComplete, p.TransferAborted)):
            self._over(msg.request_id, delivered=isinstance(msg, p.KVComplete))
        return isinstance(msg, p.KVComplete)

    def gone_with(self, live: LiveWorker[Flight]) -> None:
        """`live` is gone: every transfer it was one end of is over."""
        for wire, transfer in list(self._transfers.items()):
            if live in (transfer.prefill, transfer.decode):
                self._over(wire)

    def _over(self, wire_id: str, delivered: bool = False) -> None:
        """The prefill worker is done with it (or gone): its window share goes to the next in queue."""
        transfer = self._transfers.pop(wire_id, None)
        if transfer is None:
            return
        lane = transfer.prefill.lane
        lane.leave_window(transfer.prompt_len)
        if transfer.prefill_sent:
            lane.rate.finished(self.clock(), transfer.prompt_len, delivered)
        self.pump(transfer.prefill)
