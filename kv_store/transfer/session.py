"""Per-request transfer state machine with a deadline in every non-terminal state (DESIGN §7).

    BOOTSTRAPPING --> WAITING --> TRANSFERRING --> DONE
          |              |              |
          +--------------+--------------+--> FAILED(reason)

Entering a state starts that state's deadline; while TRANSFERRING, observed progress (a chunk
completed) restarts it, so a slow transfer that moves survives and a stalled one does not. Time is
passed in (`now`, monotonic seconds) so tests drive the clock.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from common.config import require_min


class TransferState(enum.Enum):
    BOOTSTRAPPING = "bootstrapping"  # peers being paired, landing being reserved
    WAITING = "waiting"  # landing known; no KV written yet
    TRANSFERRING = "transferring"  # chunks being written
    DONE = "done"  # every chunk written and retired; the receiver was told
    FAILED = "failed"


class FailureReason(enum.Enum):
    TIMEOUT = "timeout"
    PEER_DEAD = "peer_dead"
    TRANSPORT_ERROR = "transport_error"
    ABORTED = "aborted"


class IllegalTransferTransition(RuntimeError):
    pass


_ALLOWED = {
    TransferState.BOOTSTRAPPING: {TransferState.WAITING, TransferState.FAILED},
    TransferState.WAITING: {TransferState.TRANSFERRING, TransferState.FAILED},
    TransferState.TRANSFERRING: {TransferState.DONE, TransferState.FAILED},
    TransferState.DONE: set(),
    TransferState.FAILED: set(),
}


@dataclass(frozen=True)
class TransferDeadlines:
    """Seconds a transfer may stay in each non-terminal state (TRANSFERRING: without progress)."""

    bootstrapping_s: float = 30.0
    """Seconds a transfer may spend pairing peers and reserving the landing (> 0)."""
    waiting_s: float = 60.0
    """Seconds a transfer may wait, landing known, before its first KV write (> 0)."""
    transferring_s: float = 60.0
    """Seconds a transfer may go without progress while writing KV (> 0)."""

    def __post_init__(self) -> None:
        require_min(self, "", 0, "bootstrapping_s", "waiting_s", "transferring_s", strict=True)

    def for_state(self, state: TransferState) -> float:
        return {TransferState.BOOTSTRAPPING: self.bootstrapping_s, TransferState.WAITING: self.waiting_s,
                TransferState.TRANSFERRING: self.transferring_s}[state]


class TransferSession:
    """The transfer of one request's KV, as seen by one side."""

    def __init__(self, request_id: str, deadlines: TransferDeadlines, now: float):
        self.request_id = request_id
        self.deadlines = deadlines
        self.state = TransferState.BOOTSTRAPPING
        self.failure: FailureReason | None = None  # set exactly when FAILED
        self.failure_detail = ""
        self._deadline = now + deadlines.bootstrapping_s

    @property
    def terminal(self) -> bool:
        return self.state in (TransferState.DONE, TransferState.FAILED)

    @property
    def deadline(self) -> float:
        """Monotonic time at which the current state expires (meaningless once terminal)."""
        return self._deadline

    def advance(self, new_state: TransferState, now: float) -> None:
        if new_state is TransferState.FAILED:
            raise IllegalTransferTransition("use fail(reason) to enter FAILED")
        self._move(new_state)
        if not self.terminal:
            self._deadline = now + self.deadlines.for_state(new_state)

    def progress(self, now: float) -> None:
        """A chunk completed: restart the TRANSFERRING deadline."""
        if self.state is not TransferState.TRANSFERRING:
            raise IllegalTransferTransition(f"transfer {self.request_id}: progress while {self.state.value}")
        self._deadline = now + self.deadlines.transferring_s

    def fail(self, reason: FailureReason, detail: str = "") -> bool:
        """Enter FAILED. Returns False (and changes nothing) if already FAILED; raises after DONE."""
        if self.state is TransferState.FAILED:
            return False
        self._move(TransferState.FAILED)
        self.failure, self.failure_detail = reason, detail
        return True

    def check_deadline(self, now: float) -> bool:
        """Fail with TIMEOUT if the current state's deadline passed. Returns True if it just failed."""
        if self.terminal or now < self._deadline:
            return False
        return self.fail(FailureReason.TIMEOUT, f"{self.state.value} for longer than "
                                                f"{self.deadlines.for_state(self.state):.1f}s")

    def _move(self, new_state: TransferState) -> None:
        if new_state not in _ALLOWED[self.state]:
            raise IllegalTransferTransition(
                f"transfer {self.request_id}: {self.state.value} -> {new_state.value} is illegal")
        self.state = new_state
