"""The base of every role's worker: the parts of the worker contract (`common.protocol.Worker`) that
it answers from its engine alone, and the dispatch of a message to its role's handler by its kind.

A role names the kinds it takes in `HANDLERS` ({message class: method}, one table a class, built with
the class); a message kind it does not take raises TypeError. When handling a message about one request
raised, `fail` ends that request: by `fail_request`, or for a kind in `FAULTS` that kind's own way. A
role adds `step` and `stats`.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

from common import protocol as p
from engine.core import EngineCore

POLL_S = 0.002
"""Busy without compute (writes or loads in flight): the loop steps this often to poll them, and
no more often, so it does not spin a core the transport or the other workers need."""

Handler = Callable[[Any, Any], list]
"""A role's method for one message kind: (the worker, the message) -> its immediate replies."""
Fault = Callable[[Any, Any, str], list]
"""A role's method for a fault while handling one message kind: (the worker, the message, the error)
-> the replies."""


class EngineWorker:
    role: ClassVar[p.WorkerRole]
    HANDLERS: ClassVar[Mapping[type, Handler]] = {}
    """The message kinds this role takes -> the method that handles each (exact classes: the wire's
    messages are final dataclasses)."""
    FAULTS: ClassVar[Mapping[type, Fault]] = {}
    """The message kinds whose fault is answered their own way -> how (the others: `fail_request`)."""

    def __init__(self, engine: EngineCore):
        self.engine = engine

    def handle(self, msg: p.ToWorker) -> list[p.FromWorker]:
        handler = self.HANDLERS.get(type(msg))
        if handler is None:
            raise TypeError(f"a {self.role.value} worker cannot handle {type(msg).__name__}")
        return handler(self, msg)

    def fail(self, msg: p.AboutRequest, error: str) -> list[p.FromWorker]:
        """`handle(msg)` raised: end the request `msg` is about, release what it holds; the replies."""
        fault = self.FAULTS.get(type(msg))
        return fault(self, msg, error) if fault is not None else self.fail_request(msg, error)

    def fail_request(self, msg: p.AboutRequest, error: str) -> list[p.FromWorker]:
        """How the role ends a request whose message it failed to handle (`fail`)."""
        raise NotImplementedError(f"a {self.role.value} worker names how it fails a request")

    def start(self) -> None:
        # A served CPU worker that borrows its node's idle cores steps on up to all of them. Its KV pool's
        # memory, zeroed lazily by the OS, is mapped in while it is idle, after the compile: beside it the
        # compile took longer (docs/results.md#start-up).
        self.engine.start_compile(thread_counts=(len(os.sched_getaffinity(0)),), then=self.engine.map_kv_in)

    def busy(self) -> bool:
        return self.engine.busy()

    def has_compute(self) -> bool:
        return self.engine.has_compute()

    def holds_a_core(self) -> bool:
        return self.engine.compiling()

    def wait_s(self) -> float:
        return POLL_S

    def max_request_tokens(self) -> int:
        return self.engine.max_request_tokens()

    def check_integrity(self) -> None:
        self.engine.check_integrity()

    def close(self) -> None:
        self.engine.close()
