"""The `kv_store:` section of a cluster YAML: tiers below the host cache (docs/design.md §5).

    kv_store:
      l3: {backend: redis, url: "redis://:password@10.0.0.5:6379/0", prefetch_policy: timeout}

Device (L1) and host (L2) sizes are engine fields (`num_pages`, `host_cache_ratio`), per worker group.
"""

from __future__ import annotations

from dataclasses import dataclass

from kv_store.l3.config import L3Config


@dataclass(frozen=True)
class KVStoreConfig:
    l3: L3Config | None = None
    """The shared L3 store every worker reads and writes; None (the default): no L3."""
