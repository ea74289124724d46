"""Transfer engine (DESIGN §7): the `Transport` interface and its backends.

`LocalTransport` copies between in-process endpoints (colocated mode, unit tests);
`MooncakeTransport` uses mooncake-transfer-engine (imported only when one is built).
"""

from kv_store.transfer.bandwidth import BandwidthResult, measure_write_bandwidth
from kv_store.transfer.base import (
    MemoryRegion,
    PeerUnreachable,
    RegistrationError,
    Transport,
    TransferError,
    TransferFailed,
    TransferHandle,
    TransferStatus,
    WriteOp,
    coalesce,
)
from kv_store.transfer.local import LocalTransport
from kv_store.transfer.mooncake import MooncakeTransport

__all__ = [
    "BandwidthResult",
    "LocalTransport",
    "MemoryRegion",
    "MooncakeTransport",
    "PeerUnreachable",
    "RegistrationError",
    "Transport",
    "TransferError",
    "TransferFailed",
    "TransferHandle",
    "TransferStatus",
    "WriteOp",
    "coalesce",
    "measure_write_bandwidth",
]
