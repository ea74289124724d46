"""Transfer engine (DESIGN §7): the `Transport` interface and its backends.

`LocalTransport` copies between in-process endpoints (colocated mode, unit tests);
`MooncakeTransport` uses mooncake-transfer-engine (imported only when one is built).

The names below load on first use: `kv_store.transfer.config` is read by the gateway and the
controller, which must not pay for torch (the interface's tensors).
"""

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # what mypy sees of the lazy names below
    from kv_store.transfer.bandwidth import BandwidthResult as BandwidthResult
    from kv_store.transfer.bandwidth import measure_write_bandwidth as measure_write_bandwidth
    from kv_store.transfer.base import MemoryRegion as MemoryRegion
    from kv_store.transfer.base import PeerUnreachable as PeerUnreachable
    from kv_store.transfer.base import RegistrationError as RegistrationError
    from kv_store.transfer.base import TransferError as TransferError
    from kv_store.transfer.base import TransferFailed as TransferFailed
    from kv_store.transfer.base import TransferHandle as TransferHandle
    from kv_store.transfer.base import TransferStatus as TransferStatus
    from kv_store.transfer.base import Transport as Transport
    from kv_store.transfer.base import WriteOp as WriteOp
    from kv_store.transfer.base import coalesce as coalesce
    from kv_store.transfer.local import LocalTransport as LocalTransport
    from kv_store.transfer.mooncake import MooncakeTransport as MooncakeTransport

_HOMES = {
    "BandwidthResult": "bandwidth", "measure_write_bandwidth": "bandwidth",
    "MemoryRegion": "base", "PeerUnreachable": "base", "RegistrationError": "base", "Transport": "base",
    "TransferError": "base", "TransferFailed": "base", "TransferHandle": "base", "TransferStatus": "base",
    "WriteOp": "base", "coalesce": "base",
    "LocalTransport": "local", "MooncakeTransport": "mooncake",
}
__all__ = sorted(_HOMES)


def __getattr__(name: str) -> object:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{home}"), name)
