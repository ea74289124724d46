"""The parts of the worker contract (`common.protocol.Worker`) that every worker answers from its
engine alone; the roles add `handle`, `fail`, `step` and `stats`."""

from __future__ import annotations

import os

from engine.core import EngineCore
from kernels.kv_layout import populate_in_background

POLL_S = 0.002
"""Busy without compute (writes or loads in flight): the loop steps this often to poll them, and
no more often, so it does not spin a core the transport or the other workers need."""


class EngineWorker:
    def __init__(self, engine: EngineCore):
        self.engine = engine

    def start(self) -> None:
        # A served CPU worker that borrows its node's idle cores steps on up to all of them. Its KV pool's
        # memory, zeroed lazily by the OS, is mapped in while it is idle, after the compile: beside it the
        # compile took longer (SmolLM2's decode worker, 2-core AVX2 CPU, alternating starts: compiled
        # 8.9 / 11.2 / 11.8 s after ready, then mapped in in 4-6 s; beside it 15.9-17.0 s).
        kv = self.engine.kv_cache.k + self.engine.kv_cache.v
        self.engine.runner.start_compile(thread_counts=(len(os.sched_getaffinity(0)),),
                                         then=lambda: populate_in_background(kv, busy=self.has_compute))

    def busy(self) -> bool:
        return self.engine.busy()

    def has_compute(self) -> bool:
        return self.engine.scheduler.has_work()

    def holds_a_core(self) -> bool:
        return self.engine.runner.compiling()

    def wait_s(self) -> float:
        return POLL_S

    def max_request_tokens(self) -> int:
        return self.engine.max_request_tokens()

    def check_integrity(self) -> None:
        self.engine.check_integrity()

    def close(self) -> None:
        self.engine.close()
