"""The dispatcher's side of a disaggregated request's transfer phase (DESIGN §2 steps 3-4): from the
`Reserve` that asks its decode worker for a landing, sent once its prefill worker's window has room,
through the `Prefill` that hands the prompt to the prefill worker, to the end of the transfer, with
the messages between the two workers relayed meanwhile (`KVProgress`, `KVComplete`,
`TransferAborted` to decode; `AbortTransfer` to prefill).

A reservation the decode worker cannot land yet (its host tier is full) backs off for
`reserve_retry_s` and is routed afresh (to the front of its lane), until `landing_timeout_s` after
its first try. Until it has its landing its prefill lane is held for it: nothing younger enters
the window, so nothing younger takes the landing room it waits for (a long prompt was refused again
and again while shorter ones filled the room it freed: 30 s of a 41 s first token on a trace
slice). The hold lapses `HOLD_SLACK_S` past the retry, so a flight that ends or a decode worker
that does not answer cannot stall the lane.

`TransferPhase` is mixed into `router.dispatcher.Dispatcher` and works on its state: it alone moves
the `Transfer` records (`router.flights`); a flight's routing and endings stay the dispatcher's.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from common import protocol as p
from router.backend import BackendError, ErrorKind
from router.flights import Flight, Phase, Transfer
from router.state import RouterState
from router.workers import LiveWorker


HOLD_SLACK_S = 1.0
"""Seconds a lane stays held for a flight past its retry time (module docstring)."""


class TransferPhase:
    """Reservation, prefill hand-off and relay of one prefill -> decode transfer per routed request.

    The dispatcher provides the attributes below (set in its `__init__`) and the methods
    `_route(flight, admit=False)` (raises `BackendError` when no route exists), `_unroute(flight)` and
    `_finish_error(flight, kind, why)`. `_transfers` holds a record from `_pump` (a `Reserve` sent)
    until `_transfer_over` (the prefill worker is done with it, or one of the two workers is gone);
    while it lives it holds its share of the prefill worker's window. Not thread-safe: the
    dispatcher's one asyncio loop calls every method.
    """

    _transfers: dict[str, Transfer]  # by wire id
    _by_wire: dict[str, Flight]  # every routed flight, by wire id
    flights: dict[str, Flight]  # every flight in flight, by request id
    state: RouterState
    clock: Callable[[], float]
    reserve_retry_s: float
    landing_timeout_s: float

    def _pump(self, prefill: LiveWorker) -> None:
        """Reserve landings for the queued requests that fit the prefill worker's window now."""
        if prefill.gone:
            return
        for flight, num_tokens in prefill.lane.take_ready(only=self._holder(prefill)):
            flight.move(Phase.RESERVING)
            if flight.reserve_started_at is None:
                flight.reserve_started_at = self.clock()
            self._transfers[flight.wire_id] = Transfer(prefill, flight.decode, num_tokens)
            flight.decode.send(p.Reserve(flight.wire_id, tuple(flight.prompt), flight.params, prefill.peer_id))

    def _holder(self, prefill: LiveWorker) -> Flight | None:
        """The flight `prefill`'s lane is held for (module docstring), or None; a lapsed hold is dropped."""
        hold = prefill.lane.hold
        if hold is None:
            return None
        flight, until = hold
        if (flight.phase in (Phase.BACKOFF, Phase.QUEUED, Phase.RESERVING) and self.clock() < until
                and flight.prefill is prefill and self.flights.get(flight.request_id) is flight):
            return flight
        prefill.lane.hold = None
        return None

    def _on_reserved(self, msg: p.Reserved) -> None:
        flight = self._by_wire.get(msg.request_id)
        transfer = self._transfers.get(msg.request_id)
        if msg.error:
            self._transfer_over(msg.request_id)
            if flight is not None:
                self._finish_error(flight, ErrorKind.REJECTED, msg.error)
        elif msg.landing is None:  # host tier full: the decode worker holds nothing for it
            if flight is not None:
                self._unroute(flight)
                flight.move(Phase.BACKOFF)
                if transfer is not None:  # before the transfer's end pumps the lane
                    transfer.prefill.lane.hold = (flight, self.clock() + self.reserve_retry_s + HOLD_SLACK_S)
                asyncio.get_running_loop().call_later(self.reserve_retry_s, self._retry_reserve, flight)
            self._transfer_over(msg.request_id)
        elif transfer is None or transfer.prefill.gone:
            if transfer is not None:  # its prefill worker died meanwhile: the decode side frees it
                transfer.decode.send(p.PeerDead(transfer.prefill.peer_id))
        elif flight is None:  # aborted while reserving: the decode worker's Abort already ends it
            pass
        else:
            flight.move(Phase.PREFILLING)
            flight.landing_bytes = len(msg.landing.page_ids) * msg.landing.layout.page_bytes
            transfer.prefill_sent = True
            transfer.prefill.lane.rate.started(self.clock(), transfer.prompt_len)
            transfer.prefill.send(p.Prefill(msg.request_id, tuple(flight.prompt), flight.params, msg.landing))
            if transfer.prefill.lane.hold is not None and transfer.prefill.lane.hold[0] is flight:
                transfer.prefill.lane.hold = None  # landed: the requests behind it go on
                self._pump(transfer.prefill)

    def _retry_reserve(self, flight: Flight) -> None:
        held = flight.prefill  # the lane it holds, if it still does
        try:
            if flight.phase is not Phase.BACKOFF or self.flights.get(flight.request_id) is not flight:
                return
            if self.clock() - flight.reserve_started_at > self.landing_timeout_s:  # host tiers stay full
                self._finish_error(flight, ErrorKind.UNAVAILABLE,
                                   f"no decode worker had room to land the prompt within {self.landing_timeout_s}s")
                return
            try:
                self._route(flight, admit=False)
            except BackendError as exc:
                self._finish_error(flight, exc.kind, exc.message)
        finally:
            if held is not None:
                self._pump(held)  # its hold is over: the lane goes on (a no-op if `_route` pumped it)

    def _relay_transfer(self, msg) -> None:
        """Pass a transfer's message to its other worker: `AbortTransfer` (from the decode worker) to
        the prefill worker, the rest (from the prefill worker) to the decode worker."""
        transfer = self._transfers.get(msg.request_id)
        if transfer is None:
            return
        if isinstance(msg, p.AbortTransfer):
            transfer.prefill.send(msg)
            return
        if not transfer.decode.gone:
            transfer.decode.send(msg)
        if isinstance(msg, p.KVComplete):
            self._transfer_over(msg.request_id, delivered=True)
        elif isinstance(msg, p.TransferAborted):
            self._transfer_over(msg.request_id)

    def _transfer_over(self, wire_id: str, delivered: bool = False) -> None:
        """The prefill worker is done with it (or gone): its window share goes to the next in queue."""
        transfer = self._transfers.pop(wire_id, None)
        if transfer is None:
            return
        flight = self._by_wire.get(wire_id)
        if delivered and flight is not None:
            self.state.record_prefilled(flight.prompt)
        lane = transfer.prefill.lane
        lane.leave_window(transfer.prompt_len)
        if transfer.prefill_sent:
            lane.rate.finished(self.clock(), transfer.prompt_len, delivered)
        self._pump(transfer.prefill)

    def _transfers_gone_with(self, live: LiveWorker) -> None:
        """`live` is gone: every transfer it was one end of is over."""
        for wire, transfer in list(self._transfers.items()):
            if live in (transfer.prefill, transfer.decode):
                self._transfer_over(wire)
