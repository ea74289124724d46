"""What a finished request leaves for the next turn of its conversation (docs/design.md §8,
"Conversations"): its history in the router's tree of the worker that decoded it, and its answer
sent to its prefill worker to be prefilled there too (`PrefillAnswer`)."""

from __future__ import annotations

from common import protocol as p
from router.flights import Flight
from router.state import RouterState
from router.workers import LiveWorker


class Answers:
    def __init__(self, state: RouterState, enabled: bool) -> None:
        from prometheus_client import Counter

        self.state, self.enabled = state, enabled
        self.counter = Counter("tandem:answer_prefills_total",
                               "Finished answers sent to their prefill worker to be cached for the conversation's "
                               "next turn", registry=None)

    def finished(self, flight: Flight, decoder: LiveWorker) -> None:
        """`flight` finished on `decoder`, whose prefix cache took the prompt and the output's KV (all
        but the last token, which has none). Its prefill worker gets the answer too, so that a
        conversation's next turn, routed there, finds its whole history cached."""
        history = flight.prompt + flight.output[:-1]
        self.state.record_cached(decoder.view(), history)
        prefill = flight.prefill
        if not self.enabled or prefill is None or prefill.gone or len(flight.output) < 2:
            return
        prefill.send(p.PrefillAnswer(f"{flight.wire_id}:answer", tuple(history), len(flight.prompt)))
        self.state.record_cached(prefill.view(), history)
        self.counter.inc()
