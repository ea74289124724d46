"""Streaming sessions: a conversation's KV kept on device between its turns (docs/design.md §5).

A session pins the page-aligned prefix of its history in the prefix tree (`KVManager.pin_prefix`),
so the next turn's prompt — the history plus the new tokens — matches it and prefills only what is
new. At the end of each turn the request's unaligned tail is freed (`free_tail`), its whole pages
go into the tree through the one release path, and the pin moves to the new history:

    | pinned: history of earlier turns | this turn: prompt rest + output | tail |
    0                           pinned_tokens                      aligned   committed

Budget and admission: the sessions of one engine may reserve at most `session_kv_fraction` of the
device pool (`capacity_tokens` each, reserved at open); a turn whose prompt plus `max_tokens` would
exceed its session's capacity is refused. A session idle past its `idle_timeout_s` is reaped: its pin
is dropped, so its KV follows the tree's eviction into the host tier (and L3) like any cached prefix.

Offload (a worker with a host tier): when the scheduler cannot find device pages for a request, the
idle session used least recently is offloaded first (`offload_idle`): its pin stops holding the
device (`KVManager.offload_prefix`), so eviction writes its history to the host tier, which keeps it
while the session is open. Its next turn matches the history there and loads it back like any L2
hit; at that turn's end the new history is pinned on device again.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from dataclasses import dataclass

from kv_store.kv_manager import KVManager, ReleaseReason
from kv_store.radix_cache import RadixPrefixCache


class SessionError(ValueError):
    """A session request that cannot be served (unknown session, busy, over capacity or budget)."""


class SessionBusy(SessionError):
    """No room for the session here now (the session KV budget is full): a later retry may succeed."""


class SessionState(enum.Enum):
    IDLE = "idle"  # between turns: history pinned
    IN_TURN = "in_turn"  # a turn is running (one at a time)


@dataclass(eq=False)
class Session:
    id: str
    capacity_tokens: int
    idle_timeout_s: float
    last_used: float
    state: SessionState = SessionState.IDLE
    turn: str = ""  # the request id of the running turn
    pinned_tokens: int = 0  # page-aligned history, pinned (on device, or offloaded: in the tree, any tier)


class SessionManager:
    """Sessions of one engine. Not thread-safe: the engine's thread owns it."""

    def __init__(self, kvm: KVManager, budget_tokens: int, clock: Callable[[], float] = time.monotonic,
                 offload: bool = False):
        self.kvm, self.budget_tokens, self.clock = kvm, budget_tokens, clock
        self.offload = offload  # a host tier keeps offloaded histories; without one there is nowhere to go
        self.sessions: dict[str, Session] = {}
        self.num_offloaded = 0  # offloads so far
        self.refused: dict[str, str] = {}  # session -> why its open was refused for room (the latest 256)

    @property
    def reserved_tokens(self) -> int:
        return sum(s.capacity_tokens for s in self.sessions.values())

    def open(self, session_id: str, capacity_tokens: int, idle_timeout_s: float) -> Session:
        if session_id in self.sessions:
            raise SessionError(f"session {session_id!r} is already open")
        if capacity_tokens < 1 or idle_timeout_s <= 0:
            raise SessionError(f"capacity_tokens must be >= 1 and idle_timeout_s > 0, got {capacity_tokens}, "
                               f"{idle_timeout_s}")
        if self.reserved_tokens + capacity_tokens > self.budget_tokens:
            why = (f"session KV budget full: {self.reserved_tokens} of {self.budget_tokens} tokens "
                   f"reserved by {len(self.sessions)} open sessions; close one or ask for less")
            self.refused[session_id] = why  # its turn, sent right behind the open, is told the same
            if len(self.refused) > 256:
                del self.refused[next(iter(self.refused))]
            raise SessionBusy(why)
        self.refused.pop(session_id, None)
        session = Session(session_id, capacity_tokens, idle_timeout_s, self.clock())
        self.sessions[session_id] = session
        return session

    def close(self, session_id: str) -> bool:
        """Drop the session and its pin (a running turn finishes as a plain request). False: not open."""
        session = self.sessions.pop(session_id, None)
        if session is None:
            return False
        if session.pinned_tokens:
            self.kvm.unpin_prefix(session_id)
        return True

    def start_turn(self, session_id: str, request_id: str, num_tokens_max: int) -> None:
        """`request_id` becomes the session's running turn; raises SessionError when it cannot."""
        session = self.sessions.get(session_id)
        if session is None and session_id in self.refused:  # opened again here after its worker died: no room
            raise SessionBusy(f"session {session_id!r} could not be opened here ({self.refused[session_id]}); "
                              "retry later")
        if session is None:
            raise SessionError(f"session {session_id!r} is not open (closed, reaped after its idle timeout, "
                               "or opened on another worker)")
        if session.state is SessionState.IN_TURN:
            raise SessionError(f"session {session_id!r} is running turn {session.turn!r}: one turn at a time")
        if num_tokens_max > session.capacity_tokens:
            raise SessionError(f"session {session_id!r}: prompt + max_tokens = {num_tokens_max} tokens exceeds its "
                               f"capacity_tokens {session.capacity_tokens}")
        session.state, session.turn = SessionState.IN_TURN, request_id

    def turn_released(self, session_id: str, request_id: str, reason: ReleaseReason, history: list[int]) -> None:
        """A turn's KV went into the tree (`Scheduler._release`: its page-aligned `history`, the tail
        freed): the session is idle again unless the turn was retracted, and a finished turn of a
        still open session pins the new history."""
        session = self.sessions.get(session_id)
        if session is None or session.turn != request_id:
            return
        if reason is not ReleaseReason.RETRACTED:  # a retracted turn resumes: still the running turn
            session.state, session.turn, session.last_used = SessionState.IDLE, "", self.clock()
        if reason is ReleaseReason.FINISHED:
            self._repin(session, history)

    def abandon_turn(self, session_id: str, request_id: str) -> None:
        """The turn ended before it held KV (aborted while queued): the session is idle again, unchanged."""
        session = self.sessions.get(session_id)
        if session is not None and session.turn == request_id:
            session.state, session.turn, session.last_used = SessionState.IDLE, "", self.clock()

    def reap(self) -> list[str]:
        """Close every idle session past its idle timeout; returns their ids."""
        now = self.clock()
        due = [s.id for s in self.sessions.values()
               if s.state is SessionState.IDLE and now - s.last_used >= s.idle_timeout_s]
        for session_id in due:
            self.close(session_id)
        return due

    def offload_idle(self) -> bool:
        """Offload the idle session used least recently whose history holds device pages; False when
        none does (or there is no host tier)."""
        idle = [s for s in self.sessions.values()
                if s.state is SessionState.IDLE and s.pinned_tokens and not self.is_offloaded(s.id)]
        if not self.offload or not idle:
            return False
        session = min(idle, key=lambda s: s.last_used)
        self.kvm.offload_prefix(session.id)
        self.num_offloaded += 1
        return True

    def is_offloaded(self, session_id: str) -> bool:
        """Whether the session's history is free to leave the device (`offload_idle`, until its next turn ends)."""
        return session_id in self.kvm.offloaded_pins

    def next_deadline(self) -> float | None:
        idle = [s.last_used + s.idle_timeout_s for s in self.sessions.values() if s.state is SessionState.IDLE]
        return min(idle, default=None)

    def reap_due(self) -> bool:
        """Whether some idle session is past its timeout (by this manager's clock)."""
        deadline = self.next_deadline()
        return deadline is not None and self.clock() >= deadline

    def pinned_pages(self) -> int:
        """Device pages session pins hold (offloaded histories hold none)."""
        return sum(s.pinned_tokens for s in self.sessions.values() if not self.is_offloaded(s.id)) // self.kvm.page_size

    def _repin(self, session: Session, history: list[int]) -> None:
        """Pin the part of `history` the tree holds on device (all of it, unless a load was in flight)."""
        tree = self.kvm.prefix_cache
        assert isinstance(tree, RadixPrefixCache), "sessions need the prefix cache: engine.enable_prefix_cache off?"
        pos, path = tree.walk(history, len(history), lambda n: n.residency.on_device)
        if path:
            self.kvm.pin_prefix(session.id, path[-1])
        elif session.pinned_tokens:
            self.kvm.unpin_prefix(session.id)
        session.pinned_tokens = pos


class NullSessions:
    """Sessions off (prefix cache disabled): opening one is refused."""

    def __init__(self) -> None:
        self.sessions: dict[str, Session] = {}
        self.reserved_tokens = self.num_offloaded = 0

    def open(self, session_id: str, capacity_tokens: int, idle_timeout_s: float) -> Session:
        raise SessionError("sessions need the prefix cache (this worker runs with enable_prefix_cache off)")

    def close(self, session_id: str) -> bool:
        return False

    def start_turn(self, session_id: str, request_id: str, num_tokens_max: int) -> None:
        raise SessionError(f"session {session_id!r} is not open")

    def turn_released(self, session_id: str, request_id: str, reason: ReleaseReason, history: list[int]) -> None:
        raise AssertionError(f"a turn of session {session_id!r} on an engine without sessions")

    def abandon_turn(self, session_id: str, request_id: str) -> None:
        pass

    def reap(self) -> list[str]:
        return []

    def next_deadline(self) -> float | None:
        return None

    def reap_due(self) -> bool:
        return False

    def offload_idle(self) -> bool:
        return False

    def pinned_pages(self) -> int:
        return 0
