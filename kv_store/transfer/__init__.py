"""Transfer engine (DESIGN §7): the `Transport` interface and its backends.

`LocalTransport` copies between in-process endpoints (colocated mode, unit tests);
`MooncakeTransport` uses mooncake-transfer-engine (imported only when one is built).

The names below load on first use: `kv_store.transfer.config` is read by the gateway and the
controller, which must not pay for torch (the interface's tensors).
"""

import importlib

_HOMES = {
    "BandwidthResult": "bandwidth", "measure_write_bandwidth": "bandwidth",
    "MemoryRegion": "base", "PeerUnreachable": "base", "RegistrationError": "base", "Transport": "base",
    "TransferError": "base", "TransferFailed": "base", "TransferHandle": "base", "TransferStatus": "base",
    "WriteOp": "base", "coalesce": "base",
    "LocalTransport": "local", "MooncakeTransport": "mooncake",
}
__all__ = sorted(_HOMES)


def __getattr__(name: str):
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{home}"), name)
