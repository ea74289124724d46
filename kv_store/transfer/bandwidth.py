"""Raw write bandwidth of a transport, for `tandem bench transfer` (beside tandem's KV bandwidth).

The ops are laid out so that `coalesce` cannot merge them: op i reads `[src + i*op_bytes, ...)` and
writes the mirrored slot `dst + (num_ops-1-i)*op_bytes`. The result therefore reflects the
per-op cost at `op_bytes`, not one big copy.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from kv_store.transfer.base import Transport, WriteOp


@dataclass(frozen=True)
class BandwidthResult:
    """`bytes_per_s` over all timed repeats; `seconds` is their total wall time; `num_ops` per repeat."""

    bytes_per_s: float
    seconds: float
    num_ops: int


def measure_write_bandwidth(transport: Transport, peer: str, src_addr: int, dst_addr: int, num_bytes: int,
                            op_bytes: int, repeats: int, timeout_s: float = 120.0) -> BandwidthResult:
    """Write `[src_addr, src_addr + num_bytes)` to the peer `repeats` times in `op_bytes` ops.

    Both ranges must already be registered (locally and at the peer). One untimed warm-up write
    handshakes with the peer first. Each repeat is waited for before the next starts.
    """
    if op_bytes <= 0 or num_bytes <= 0 or num_bytes % op_bytes:
        raise ValueError(f"num_bytes={num_bytes} must be a positive multiple of op_bytes={op_bytes}")
    if repeats < 1:
        raise ValueError(f"repeats={repeats} must be >= 1")
    ops = _mirrored_ops(src_addr, dst_addr, num_bytes // op_bytes, op_bytes)
    _write_and_retire(transport, peer, ops[:1], timeout_s)
    start = time.perf_counter()
    for _ in range(repeats):
        _write_and_retire(transport, peer, ops, timeout_s)
    seconds = time.perf_counter() - start
    return BandwidthResult(num_bytes * repeats / seconds, seconds, len(ops))


def _mirrored_ops(src_addr: int, dst_addr: int, num_ops: int, op_bytes: int) -> list[WriteOp]:
    return [WriteOp(src_addr + i * op_bytes, dst_addr + (num_ops - 1 - i) * op_bytes, op_bytes)
            for i in range(num_ops)]


def _write_and_retire(transport: Transport, peer: str, ops: list[WriteOp], timeout_s: float) -> None:
    handle = transport.write(peer, ops)
    try:
        transport.wait(handle, timeout_s)
    finally:
        if transport.poll(handle).is_terminal:
            transport.retire(handle)
