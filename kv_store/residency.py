"""Where a piece of KV is valid (DESIGN §5): an explicit state with checked moves.

Used for a tree node's pages (`tree_node.TreeNode`) and for a decode worker's inbound request
(`decode_worker/receiver.py`). "On device" means the device copy is valid and readable.

    DEVICE --backup--> WRITING --copied--> BOTH --L1 eviction--> HOST --load--> LOADING --copied--> BOTH
              (device -> host copy)          |                    ^                (host -> device copy)
    WRITING --copy failed--> DEVICE          +--L2 drops copy--> DEVICE           LOADING --failed--> HOST
    HOST --a request recomputed the same tokens on device--> BOTH
"""

from __future__ import annotations

import enum


class Residency(enum.Enum):
    HOST = "host"  # only the host tier holds it
    LOADING = "loading"  # host -> device copy in flight
    BOTH = "both"  # device pages valid, host copy valid
    DEVICE = "device"  # only the device holds it
    WRITING = "writing"  # device -> host copy in flight

    @property
    def on_device(self) -> bool:
        return self in (Residency.DEVICE, Residency.WRITING, Residency.BOTH)

    @property
    def on_host(self) -> bool:
        """The host copy is valid (a LOADING node's host pages are what the load reads)."""
        return self in (Residency.HOST, Residency.LOADING, Residency.BOTH)

    @property
    def in_transit(self) -> bool:
        return self in (Residency.WRITING, Residency.LOADING)


_RESIDENCY_MOVES = {
    Residency.HOST: {Residency.LOADING, Residency.BOTH},
    Residency.LOADING: {Residency.BOTH, Residency.HOST},  # HOST: the load failed or was cancelled
    Residency.BOTH: {Residency.DEVICE, Residency.HOST},
    Residency.DEVICE: {Residency.WRITING},
    Residency.WRITING: {Residency.BOTH, Residency.DEVICE},
}


class IllegalResidencyMove(RuntimeError):
    pass


def move_residency(current: Residency, new: Residency, what: str) -> Residency:
    """`new`, or IllegalResidencyMove naming `what` when the diagram above has no such move."""
    if new not in _RESIDENCY_MOVES[current]:
        raise IllegalResidencyMove(f"{what}: residency {current.value} -> {new.value} is illegal")
    return new
