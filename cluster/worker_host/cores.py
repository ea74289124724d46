"""Cores that follow the work: the CPU workers on one node lend their idle threads to the busy ones.

Each worker is given `torch_threads` (its share of the node). A prefill worker and a decode worker
are seldom both computing: one waits for a prompt while the other decodes, or for a transfer while
the other prefills. Left alone, the idle one's core sits unused (on a 2-core machine a lone decode
stream then runs on one core, at half the memory bandwidth). So before each step a worker that has
compute to do takes its own share plus the shares of the workers on its node that have none:

    node: prefill (share 1), decode (share 1)
    prefill idle,  decode busy  ->  decode steps on 2 threads
    both busy                   ->  1 thread each (never more threads than the node's shares)

The workers agree through one small file in shared memory per serve run and node (`CoreShareSpec`):
a byte per worker slot, its share with the top bit set while it has compute to do, 0 once it has
left. A worker reads the others' bytes before each step (no lock: a byte is written whole), so a
change of who is busy costs the borrower at most one step with one thread too many; the threads
follow on its next step. Simply giving every worker all the node's threads is far worse: OpenMP's
spinning threads then fight over the cores (two 2-thread processes on 2 cores: a decode pass several
times slower while a prefill runs beside it; docs/results.md#cpu-threads).
"""

from __future__ import annotations

import mmap
import os
import tempfile
from collections import Counter
from dataclasses import dataclass

MAX_SLOTS = 256
"""Workers one file can hold (slot indices 0 .. MAX_SLOTS - 1)."""
_BUSY = 0x80
_MAX_SHARE = 0x7F


@dataclass(frozen=True)
class CoreShareSpec:
    """Where a worker finds its node's core-share file, and its slot in it (picklable: in `WorkerSpec`)."""

    path: str
    slot: int

    def __post_init__(self):
        if not 0 <= self.slot < MAX_SLOTS:
            raise ValueError(f"core-share slot must be in [0, {MAX_SLOTS}), got {self.slot}")


def core_share_path(run_id: str) -> str:
    """The file of one serve run on every node: in /dev/shm where there is one (memory, never disk)."""
    root = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    return os.path.join(root, f"tandem-cores-{run_id}")


class CoreShare:
    """One worker's view of its node's core-share file. `threads(busy)` before each step."""

    def __init__(self, spec: CoreShareSpec, share: int):
        if not 1 <= share <= _MAX_SHARE:
            raise ValueError(f"a worker's thread share must be in [1, {_MAX_SHARE}], got {share}")
        self.spec, self.share = spec, share
        fd = os.open(spec.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            if os.fstat(fd).st_size < MAX_SLOTS:
                os.ftruncate(fd, MAX_SLOTS)  # zero-filled: every other slot absent
            self._mem = mmap.mmap(fd, MAX_SLOTS)
        finally:
            os.close(fd)
        self._mark(False)

    def threads(self, busy: bool, holds_a_core: bool = False) -> int:
        """Record whether this worker has compute to do; the threads its next step may use: its
        share, plus every idle worker's on this node when it is busy. `holds_a_core`: work beside its
        steps (a compile) keeps one of its cores busy: it lends its share to no one (marked busy) and
        borrows none either, so no OpenMP region spans a core that thread also runs on."""
        held = busy or holds_a_core
        if held != bool(self._mem[self.spec.slot] & _BUSY):
            self._mark(held)
        if not busy or holds_a_core:
            return self.share
        lent = sum(b for i, b in enumerate(self._mem[:]) if b and not b & _BUSY and i != self.spec.slot)
        return self.share + lent

    def close(self) -> None:
        """Leave the node's pool (slot 0: absent); the last worker out removes the file."""
        if self._mem.closed:
            return
        self._mem[self.spec.slot] = 0
        last = not any(self._mem[:])
        self._mem.close()
        if last:
            try:
                os.unlink(self.spec.path)
            except FileNotFoundError:
                pass

    def _mark(self, busy: bool) -> None:
        self._mem[self.spec.slot] = self.share | (_BUSY if busy else 0)


class ThreadFollower:
    """Sets torch's intra-op threads to what `CoreShare.threads` says before each step (only when
    that changes), and counts the steps run on each thread count."""

    def __init__(self, share: CoreShare):
        import torch

        self.share, self._torch = share, torch
        self.steps: Counter[int] = Counter()

    def before(self, busy: bool, holds_a_core: bool = False) -> int:
        """Call with True right before a step that computes (counted), False before waiting;
        `holds_a_core` as `CoreShare.threads` takes it."""
        n = self.share.threads(busy, holds_a_core)
        if busy:
            if n != self._torch.get_num_threads():
                self._torch.set_num_threads(n)
            self.steps[n] += 1
        return self._torch.get_num_threads()

    def step_threads(self) -> tuple[tuple[int, int], ...]:
        """(threads, steps run on that many), by threads: `WorkerStats.step_threads`."""
        return tuple(sorted(self.steps.items()))
