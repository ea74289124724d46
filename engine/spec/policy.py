"""Whether drafting pays at the current batch size, measured while serving (docs/design.md §6).

A speculative step costs more than a plain one (a verify of k + 1 tokens a request, the head's
calls); it pays only when the tokens it emits per step make up for that. Whether they do depends on
the head, the prompts, the hardware and the batch size, so `AdaptivePolicy` measures it: per batch
bucket (1, 2, 4, 8, ... running decode requests) it keeps the recent decode tokens per second of
steps that verified drafts and of plain steps, and drafts only while the first is at least the
second. Steps with prefill work are not counted (their cost is not the decode's).

    explore   a bucket drafts for its first `warmup` counted steps, then runs plain for `warmup`
    exploit   then it runs the faster mode (a tie drafts)
    re-probe  every `probe_every` counted steps of a bucket, `warmup // 2` steps of the other mode
              refresh its figure (acceptance and load change)

`FixedPolicy` always drafts (`engine.speculative_adaptive` off: tests, and the bench, which times
each mode alone). Either way drafting stops above `speculative_max_batch`. Deciding never changes
output: a step without drafts is a plain decode.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

EMA_WEIGHT = 0.2
"""Weight of a new step in a mode's tokens-per-second average."""


class FixedPolicy:
    """Draft whenever the batch allows (no measuring)."""

    def begin_step(self) -> None:
        pass

    def want_drafts(self, batch: int) -> bool:
        return True

    def end_step(self, batch: int, tokens: int, verified: bool) -> None:
        pass


@dataclass
class _Bucket:
    rate: dict[bool, float] = field(default_factory=dict)  # drafted? -> decode tokens/s (EMA)
    samples: dict[bool, int] = field(default_factory=lambda: {True: 0, False: 0})
    steps: int = 0
    probing: int = 0  # steps of the losing mode still to run

    def record(self, verified: bool, tokens_per_s: float) -> None:
        old = self.rate.get(verified)
        self.rate[verified] = tokens_per_s if old is None else (1 - EMA_WEIGHT) * old + EMA_WEIGHT * tokens_per_s
        self.samples[verified] += 1
        self.steps += 1

    @property
    def faster(self) -> bool:
        return self.rate[True] >= self.rate[False]


class AdaptivePolicy:
    """Measured per batch bucket (see the module docstring). `clock` is injectable for tests."""

    def __init__(self, warmup: int = 8, probe_every: int = 200, clock: Callable[[], float] = time.perf_counter):
        self.warmup, self.probe_every, self.clock = warmup, probe_every, clock
        self.buckets: dict[int, _Bucket] = {}
        self._start: float | None = None

    def begin_step(self) -> None:
        self._start = self.clock()

    def want_drafts(self, batch: int) -> bool:
        """Whether the next step of `batch` decoding requests should verify drafts."""
        b = self.buckets.setdefault(_bucket(batch), _Bucket())
        if b.samples[True] < self.warmup:
            return True
        if b.samples[False] < self.warmup:
            return False
        if b.probing:
            b.probing -= 1
            return not b.faster
        if b.steps % self.probe_every == 0:
            b.probing = self.warmup // 2
        return b.faster

    def end_step(self, batch: int, tokens: int, verified: bool) -> None:
        """A step of `batch` decode rows emitted `tokens`, with (`verified`) or without drafts; its time
        runs from `begin_step` to now."""
        start, self._start = self._start, None
        if start is None or batch == 0:
            return
        seconds = max(self.clock() - start, 1e-9)
        self.buckets.setdefault(_bucket(batch), _Bucket()).record(verified, tokens / seconds)

    def summary(self) -> dict[int, dict[str, float]]:
        """Bucket -> measured tokens/s of each mode seen (for logs and the bench)."""
        return {size: {("eagle" if v else "plain"): r for v, r in b.rate.items()}
                for size, b in sorted(self.buckets.items())}


def _bucket(batch: int) -> int:
    """1, 2, 4, 8, ...: the power of two at or above `batch`."""
    return 1 << max(0, batch - 1).bit_length()
