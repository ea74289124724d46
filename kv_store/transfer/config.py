"""The KV transport's configuration (the `transport:` section of a cluster YAML)."""

from __future__ import annotations

from dataclasses import dataclass

from common.config import require
from kv_store.transfer.session import TransferDeadlines

PROTOCOLS = ("tcp", "rdma")


@dataclass(frozen=True)
class TransportConfig(TransferDeadlines):
    """How KV moves from prefill to decode workers (docs/design.md §7): the transfer engine's protocol
    and address, and the per-state deadlines of every transfer (`TransferDeadlines`' fields)."""

    protocol: str = "tcp"
    """Transfer-engine protocol: "tcp" (anywhere) or "rdma" (clusters with RDMA NICs)."""
    hostname: str = "127.0.0.1"
    """Address each worker's transfer engine binds and advertises to its peers; "auto": each worker
    takes its own Ray node's address (multi-node clusters). The engine has no authentication: anyone
    who reaches its ports can read and write KV memory, so use loopback or a private network."""

    def __post_init__(self) -> None:
        super().__post_init__()
        require(self.protocol in PROTOCOLS, f"protocol must be one of {PROTOCOLS}, got {self.protocol!r}")
        require(self.hostname != "", "hostname must be non-empty")
