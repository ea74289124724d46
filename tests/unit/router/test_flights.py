"""A request's lifecycle in the dispatcher (`router/flights.py`): the moves `Flight.move` allows, and
what a failure reported by a worker leads to (`failure_outcome`), as tables."""

from __future__ import annotations

import pytest

from common import protocol as p
from common.config import SamplingParams
from router.backend import ErrorKind
from router.flights import Flight, Phase, PhaseError, failure_outcome

P = Phase
ALLOWED = {
    (P.QUEUED, P.RESERVING), (P.QUEUED, P.QUEUED), (P.QUEUED, P.LOCAL), (P.QUEUED, P.DONE),
    (P.RESERVING, P.PREFILLING), (P.RESERVING, P.BACKOFF), (P.RESERVING, P.QUEUED), (P.RESERVING, P.LOCAL),
    (P.RESERVING, P.DONE),
    (P.BACKOFF, P.QUEUED), (P.BACKOFF, P.LOCAL), (P.BACKOFF, P.DONE),
    (P.PREFILLING, P.STREAMING), (P.PREFILLING, P.QUEUED), (P.PREFILLING, P.LOCAL), (P.PREFILLING, P.DONE),
    (P.LOCAL, P.STREAMING), (P.LOCAL, P.QUEUED), (P.LOCAL, P.LOCAL), (P.LOCAL, P.DONE),
    (P.STREAMING, P.STREAMING), (P.STREAMING, P.DONE),
    (P.MIGRATING, P.LOCAL), (P.MIGRATING, P.DONE),
    *((src, P.MIGRATING) for src in set(P) - {P.MIGRATING, P.DONE}),  # its worker died: waits to resume
}


def _flight(phase: Phase) -> Flight:
    flight = Flight("r", [1, 2, 3], SamplingParams(max_tokens=4))
    flight.phase = phase
    return flight


@pytest.mark.parametrize("src", list(Phase))
@pytest.mark.parametrize("dst", list(Phase))
def test_a_flight_moves_only_along_the_diagram(src, dst):
    flight = _flight(src)
    if (src, dst) in ALLOWED:
        flight.move(dst)
        assert flight.phase is dst
    else:
        with pytest.raises(PhaseError, match=f"{src.value} -> {dst.value}"):
            flight.move(dst)
        assert flight.phase is src


@pytest.mark.parametrize("failure, tokens_sent, attempt, session, expected", [
    (p.Failure.TRANSFER, 0, 0, False, None),  # the one case worth another route
    (p.Failure.TRANSFER, 1, 0, False, ErrorKind.UNAVAILABLE),  # a token reached the client
    (p.Failure.TRANSFER, 0, 1, False, ErrorKind.UNAVAILABLE),  # retries spent (max 1)
    (p.Failure.TRANSFER, 0, 0, True, ErrorKind.UNAVAILABLE),  # a session's history lives on that worker
    (p.Failure.REJECTED, 0, 0, False, ErrorKind.REJECTED),
    (p.Failure.REJECTED, 3, 1, True, ErrorKind.REJECTED),
    (p.Failure.INTERNAL, 0, 0, False, ErrorKind.INTERNAL),  # a retry would meet the same fault
    (p.Failure.INTERNAL, 2, 0, True, ErrorKind.INTERNAL),
    (p.Failure.CORRUPT, 0, 1, False, None),  # damaged landed KV: computed again past the transfer retries
    (p.Failure.CORRUPT, 0, 3, False, None),
    (p.Failure.CORRUPT, 0, 4, False, ErrorKind.UNAVAILABLE),  # 1 + 3 re-routes spent
])
def test_only_a_failed_transfer_before_any_token_is_routed_again(failure, tokens_sent, attempt, session, expected):
    assert failure_outcome(failure, tokens_sent=tokens_sent, attempt=attempt, max_retries=1,
                           session=session) is expected
