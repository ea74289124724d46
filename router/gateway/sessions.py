"""The gateway's streaming sessions: each open session's conversation so far, so that a turn's body
carries only what is new, while the backend keeps the history's KV pinned on one worker.

    POST /v1/sessions          backend.open_session -> registered here (429 past MAX_SESSIONS)
    a turn (`session_id`)      begin_turn (409 while another turn of it runs); the whole conversation
                               (history + the body's prompt or messages) goes to the backend with
                               `session_id`; when the turn ends by its own rules, its output joins
                               the history; a failed or aborted turn leaves the history unchanged
    DELETE /v1/sessions/{id}   forgotten here, then backend.close_session
    idle past idle_timeout_s   forgotten here (404 afterwards) and closed on the backend, at the
                               next session request. The worker reaps its side on its own, a little
                               earlier (its idle time starts before the gateway hears the turn end):
                               a turn arriving in between is refused by it (400, "not open")

History by endpoint, fixed by the session's first successful turn (a turn on the other endpoint: 400):

    /v1/completions        token ids: every prompt and every output, in order
    /v1/chat/completions   messages: every message and every assistant reply, in order; the whole
                           conversation is rendered with the chat template at each turn

Runs on the app's event loop; between a lookup and `begin_turn` nothing awaits, so two turns of
one session can never both start.
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from router.backend import BackendError
from router.gateway.errors import APIError, from_backend_error, invalid
from router.gateway.schema import Endpoint, GenerateRequest, ModelLimits, SessionRequest, session_id_of
from router.gateway.streaming import Finished

log = logging.getLogger(__name__)

MAX_SESSIONS = 4096  # open at once per gateway: each keeps its history in memory here


class TurnState(enum.Enum):
    IDLE = "idle"
    IN_TURN = "in_turn"


@dataclass(eq=False)
class GatewaySession:
    id: str
    capacity_tokens: int
    idle_timeout_s: float
    last_used: float  # gateway clock: opened, or its last turn ended
    endpoint: Endpoint | None = None  # whose history it keeps; fixed by its first successful turn
    token_ids: list[int] = field(default_factory=list)  # completions: every prompt and output so far
    messages: list[dict[str, str]] = field(default_factory=list)  # chat: every message and reply so far
    state: TurnState = TurnState.IDLE
    turn: str = ""  # the request id of the running turn

    def history(self, endpoint: Endpoint) -> Sequence[Any]:
        """What the parser puts before this turn's prompt; 400 when the session is the other endpoint's."""
        if self.endpoint is not None and self.endpoint is not endpoint:
            other = "/v1/completions" if self.endpoint is Endpoint.COMPLETION else "/v1/chat/completions"
            raise invalid(f"session {self.id!r} holds a {self.endpoint.value} history: continue it on {other}",
                          param="session_id")
        return self.token_ids if endpoint is Endpoint.COMPLETION else self.messages

    def limits(self, model: ModelLimits) -> ModelLimits:
        """The model's limits, with the context cut to the session's capacity."""
        return replace(model, max_model_len=min(model.max_model_len, self.capacity_tokens))

    def body(self) -> dict:
        return {"id": self.id, "object": "session", "capacity_tokens": self.capacity_tokens,
                "idle_timeout_s": self.idle_timeout_s}


class SessionTurn:
    """One running turn of `session`; `end` (idempotent) returns the session to idle."""

    def __init__(self, registry: GatewaySessions, session: GatewaySession, request: GenerateRequest):
        self._registry, self.session, self.request = registry, session, request
        self._ended = False

    def end(self, outcome: Finished | APIError | None) -> None:
        """`Finished`: the output joins the history. An `APIError` 404 (the backend lost the
        session): it is forgotten. Anything else: the history stays as it was."""
        if self._ended:
            return
        self._ended = True
        self._registry.end_turn(self, outcome)


class GatewaySessions:
    """The sessions of one app, and their open/close calls to the backend."""

    def __init__(self, backend: Any, clock: Callable[[], float] = time.monotonic, max_sessions: int = MAX_SESSIONS):
        self.backend, self.clock, self.max_sessions = backend, clock, max_sessions
        self.sessions: dict[str, GatewaySession] = {}

    async def open(self, spec: SessionRequest) -> GatewaySession:
        await self.sweep()
        if len(self.sessions) >= self.max_sessions:
            raise APIError(429, f"{len(self.sessions)} sessions are open; close one or retry later",
                           code="too_many_sessions", retry_after_s=1.0)
        try:
            session_id = await self.backend.open_session(spec.capacity_tokens, spec.idle_timeout_s)
        except BackendError as exc:
            raise from_backend_error(exc) from None
        session = GatewaySession(session_id, spec.capacity_tokens, spec.idle_timeout_s, self.clock())
        self.sessions[session_id] = session
        return session

    async def delete(self, session_id: str) -> None:
        """Forget it and close it on the backend; 404 when it is not open (a running turn ends as a
        plain request, its output kept nowhere)."""
        await self.sweep()
        if self.sessions.pop(session_id, None) is None:
            raise _not_found(session_id)
        await self._close_on_backend(session_id)

    async def for_turn(self, payload: dict) -> GatewaySession | None:
        """The session a generation body names (None: a plain request); 404 when it is not open."""
        session_id = session_id_of(payload)
        if not session_id:
            return None
        await self.sweep()
        session = self.sessions.get(session_id)
        if session is None:
            raise _not_found(session_id)
        return session

    def begin_turn(self, session: GatewaySession, request_id: str, request: GenerateRequest) -> SessionTurn:
        """`request` (parsed against this session's history) becomes its running turn; 409 when one
        runs, 404 when the session was closed since it was looked up."""
        if self.sessions.get(session.id) is not session:
            raise _not_found(session.id)
        if session.state is TurnState.IN_TURN:
            raise APIError(409, f"session {session.id!r} is running turn {session.turn!r}: one turn at a time; "
                                "retry once it has finished", code="session_busy", param="session_id")
        session.state, session.turn = TurnState.IN_TURN, request_id
        return SessionTurn(self, session, request)

    def end_turn(self, turn: SessionTurn, outcome: Finished | APIError | None) -> None:
        session = turn.session
        if session.state is not TurnState.IN_TURN:
            raise AssertionError(f"session {session.id!r}: turn ended twice, or ended without starting")
        session.state, session.turn, session.last_used = TurnState.IDLE, "", self.clock()
        if self.sessions.get(session.id) is not session:  # deleted during the turn
            return
        if isinstance(outcome, Finished):
            _append(session, turn.request, outcome)
        elif isinstance(outcome, APIError) and outcome.status == 404:
            del self.sessions[session.id]

    async def sweep(self) -> None:
        """Forget the sessions idle past their timeout and close them on the backend."""
        now = self.clock()
        expired = [s.id for s in self.sessions.values()
                   if s.state is TurnState.IDLE and now - s.last_used >= s.idle_timeout_s]
        for session_id in expired:
            del self.sessions[session_id]
        for session_id in expired:
            await self._close_on_backend(session_id)

    async def _close_on_backend(self, session_id: str) -> None:
        try:
            await self.backend.close_session(session_id)
        except Exception:  # forgotten here either way; the worker reaps it when idle
            log.exception("closing session %s on the backend failed", session_id)


def parse_turn(parse: Callable[..., GenerateRequest], payload: dict, tokenizer: Any, model: ModelLimits,
               session: GatewaySession, endpoint: Endpoint) -> GenerateRequest:
    """`parse` (parse_completion / parse_chat) of a turn: after the session's history, within its capacity."""
    try:
        return parse(payload, tokenizer, session.limits(model), session.history(endpoint))
    except APIError as err:
        if err.code != "context_length_exceeded":
            raise
        raise invalid(f"session {session.id!r} holds at most capacity_tokens={session.capacity_tokens} tokens, "
                      f"its history included, so here {err.message}", param=err.param, code=err.code) from None


def _append(session: GatewaySession, request: GenerateRequest, finished: Finished) -> None:
    """The turn's whole conversation plus its output becomes the history."""
    session.endpoint = request.endpoint
    if request.endpoint is Endpoint.COMPLETION:
        session.token_ids = [*request.prompt_token_ids, *finished.output_token_ids]
    else:
        session.messages = [*request.messages, {"role": "assistant", "content": finished.text}]


def _not_found(session_id: str) -> APIError:
    return APIError(404, f"session {session_id!r} does not exist (deleted, expired after its idle_timeout_s, "
                         "or never opened)", code="session_not_found", param="session_id")
