"""Frozen, validated configuration of a `tandem serve` cluster. Read from YAML, overrides and the
command line by `cluster/serve/config_load.py`.

Every field is documented and bounded; a bad value raises `ConfigError` naming the field.
The `engine:` section holds every worker's defaults; a group's own `engine:` overrides them for
that group only (so `--page-size` changes the default, and a file's `decode.engine.page_size` still wins).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from cluster.serve.memory import MemoryConfig
from common.config import ConfigError, EngineConfig, require, require_min
from kv_store.config import KVStoreConfig
from kv_store.transfer.config import TransportConfig
from router.config import RouterConfig
from router.gateway.config import API_KEY_ENV, GatewayConfig

__all__ = [
    "API_KEY_ENV", "ClusterConfig", "ConfigError", "GatewayConfig", "RouterConfig", "ServeConfig",
    "TransportConfig", "WorkerGroupConfig",
]

_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")
GROUP_NAMES = ("prefill", "decode", "colocated")
DEFAULT_COUNTS = {"prefill": 1, "decode": 1, "colocated": 0}

CPU_LOCAL_PREFILL_MAX_TOKENS = 256
"""`router.local_prefill_max_tokens` when it is left null and the decode workers run on a CPU: prompts
this short prefill on their decode worker, which then borrows the idle prefill worker's core
(`cluster.lend_idle_cores`). On a 2-core CPU that gives more output tokens per second and a far
shorter TTFT than sending every prompt to the prefill worker, for a longer p99 inter-token latency
(docs/results.md#prefill). With CUDA decode workers: 0 (always disaggregate)."""

CPU_DECODE_CHUNK_SIZE = 64
"""A CPU decode worker's `engine.chunk_size` unless a config sets one (top level or the group's): the
prompt tokens its local prefills add to one decode step. On a CPU a prompt token costs as much as a
decode row, so the chunk is the stall every running stream sees: a bigger chunk buys a little
throughput for a much longer p99 inter-token latency (docs/results.md#prefill)."""


@dataclass(frozen=True)
class WorkerGroupConfig:
    """One role's workers (prefill, decode or colocated): how many, their Ray resources, their engine.

    Messages name fields relative to the group ("count must be ..."); the loader prefixes the group.
    """

    count: int
    """Workers in the group (>= 0)."""
    num_cpus: float = 1.0
    """Ray CPUs per worker (>= 0); each worker is one placement-group bundle."""
    num_gpus: float = 0.0
    """Ray GPUs per worker (>= 0; fractions share a GPU). Loaded from YAML, it defaults to 1 on a cuda device."""
    torch_threads: int = 1
    """torch intra-op threads per worker (>= 1)."""
    engine: EngineConfig = field(default_factory=EngineConfig)
    """The group's engine: the top-level `engine` section merged with the group's own `engine:` overrides."""
    host_pages: int | None = None
    """Decode workers' host-tier landing pages (>= 2); ignored by other roles. None: twice what the
    prefill workers' windows can have in flight to one decode worker (cluster/serve/memory.py)."""
    resources: dict[str, float] = field(default_factory=dict)
    """Ray custom resources per worker, name -> amount (0, or >= 0.0001: Ray's precision; 0 is not asked for),
    added to its bundle and asked for by its actor: `{tandem_prefill: 1}` places the group only on nodes
    started with that resource (`ray start --resources`). A local Ray instance advertises what the groups ask."""

    def __post_init__(self):
        require(isinstance(self.resources, Mapping), f"resources must be a mapping, got {self.resources!r}")
        object.__setattr__(self, "resources", dict(self.resources))  # its own copy: the config is frozen
        for name, amount in self.resources.items():
            _check_resource(name, amount)
        require_min(self, "", 0, "count", "num_cpus", "num_gpus")
        require_min(self, "", 1, "torch_threads")
        require(self.host_pages is None or self.host_pages >= 2,
                f"host_pages must be >= 2 (scratch page + one usable) or null, got {self.host_pages}")
        require(self.num_cpus > 0 or self.num_gpus > 0,
                 "num_cpus and num_gpus are both 0: a placement-group bundle needs some resource")
        require(self.count == 0 or not self.engine.device.startswith("cuda") or self.engine.tensor_parallel_size == 1
                or self.num_gpus >= self.engine.tensor_parallel_size,
                f"num_gpus ({self.num_gpus:g}) must be at least engine.tensor_parallel_size "
                f"({self.engine.tensor_parallel_size}) on CUDA: one GPU a rank")
        require(self.count == 0 or self.num_gpus > 0 or not self.engine.device.startswith("cuda"),
                 f"num_gpus must be > 0 when engine.device is {self.engine.device!r} "
                 "(Ray hides every GPU from a worker that requests none)")


_BUILTIN_RESOURCES = {"CPU": "num_cpus", "GPU": "num_gpus", "memory": None, "object_store_memory": None}


def _check_resource(name: Any, amount: Any) -> None:
    require(isinstance(name, str) and name != "", f"resources: a name must be a non-empty string, got {name!r}")
    if name in _BUILTIN_RESOURCES:
        instead = _BUILTIN_RESOURCES[name]
        raise ConfigError(f"resources.{name} is one of Ray's own resources, not a custom one"
                          + (f": set {instead}" if instead else ""))
    real = isinstance(amount, (int, float)) and not isinstance(amount, bool) and math.isfinite(amount)
    require(real and amount >= 0, f"resources.{name} must be a number >= 0, got {amount!r}")
    require(amount == 0 or amount >= 1e-4,
            f"resources.{name} must be 0 or >= 0.0001 (Ray's resource precision), got {amount}")


@dataclass(frozen=True)
class ClusterConfig:
    """The Ray cluster the workers run in and how the controller watches them."""

    address: str | None = None
    """None: start a local, single-node Ray instance (loopback only, a private auth token, its own OS session)
    and stop it at shutdown; "auto", "ray://host:port" or "host:port": join one."""
    namespace: str = "tandem"
    """Ray namespace of the named actors (non-empty)."""
    num_cpus: int | None = None
    """CPUs of a local Ray instance (>= 1); None: Ray's default. Only with `address` null."""
    heartbeat_interval_s: float = 0.5
    """Seconds between the controller's worker heartbeats (> 0)."""
    heartbeat_timeout_s: float = 10.0
    """A worker silent this long is declared dead (> heartbeat_interval_s)."""
    worker_start_timeout_s: float = 300.0
    """Seconds a worker may take to load its model and report ready (> 0)."""
    step_timeout_s: float = 300.0
    """A worker whose loop has not come back from a step this long is hung: it is killed and
    restarted (> heartbeat_interval_s). Size it above the longest prefill chunk."""
    max_restarts: int = 5
    """Restarts of one worker within any `restart_window_s` (>= 0). Past that it stays down until the
    oldest of them ages out of the window, so a worker that crashes now and then is always restarted
    and one that crash-loops is retried at that pace. 0: never restarted."""
    restart_window_s: float = 600.0
    """The sliding window `max_restarts` counts in, seconds (in (0, 86400])."""
    drain_timeout_s: float = 30.0
    """Graceful shutdown: in-flight requests get this long to finish (>= 0)."""
    placement_strategy: str = "PACK"
    """Placement-group strategy of the worker bundles: PACK | SPREAD | STRICT_PACK | STRICT_SPREAD."""
    lend_idle_cores: bool = True
    """CPU workers on one node lend their torch threads to each other: a worker with compute to do
    steps on its own `torch_threads` plus those of the node's workers that have none (a lone decode
    stream on both cores while the prefill worker waits), never more than their sum
    (`cluster/worker_host/cores.py`). false: each worker keeps to its own."""
    token_relay: bool = True
    """Workers send their messages to the gateway (tokens, transfer progress) over one TCP connection
    each, which they open to the gateway (`common/relay.py`), instead of answering a Ray call per
    scheduler step. It listens where the transfer engine binds (`transport.hostname`: loopback by
    default; "auto": the gateway node's address) and takes only connections that present the
    secret the gateway made at start. false: Ray calls only."""
    inject_faults: str = ""
    """Chaos runs only (`tandem bench chaos`): the workers damage KV on purpose, "site=chance,..." with
    sites landing (a landed prompt page) and l2 (a host-tier page), so the checks that catch it are
    exercised (`common/chaos.py`). Empty (the default): nothing is injected."""

    def __post_init__(self):
        require(self.address is None or _valid_address(self.address),
                 f"cluster.address must be null, 'auto', 'ray://host:port' or 'host:port', got {self.address!r}")
        require(self.namespace != "", "cluster.namespace must be non-empty")
        _check_faults(self.inject_faults)
        require(self.num_cpus is None or self.num_cpus >= 1,
                f"cluster.num_cpus must be >= 1 or null, got {self.num_cpus}")
        require(self.num_cpus is None or self.address is None,
                 f"cluster.num_cpus sizes a local Ray instance; it cannot be set with cluster.address {self.address!r}")
        require_min(self, "cluster.", 0, "heartbeat_interval_s", "worker_start_timeout_s", strict=True)
        require_min(self, "cluster.", 0, "max_restarts", "drain_timeout_s")
        require(0 < self.restart_window_s <= 86400,
                 f"cluster.restart_window_s must be in (0, 86400], got {self.restart_window_s}")
        require(self.heartbeat_timeout_s > self.heartbeat_interval_s,
                 f"cluster.heartbeat_timeout_s must be > cluster.heartbeat_interval_s ({self.heartbeat_interval_s}), "
                 f"got {self.heartbeat_timeout_s}")
        require(self.step_timeout_s > self.heartbeat_interval_s,
                 f"cluster.step_timeout_s must be > cluster.heartbeat_interval_s ({self.heartbeat_interval_s}), "
                 f"got {self.step_timeout_s}")
        require(self.placement_strategy in _STRATEGIES,
                 f"cluster.placement_strategy must be one of {_STRATEGIES}, got {self.placement_strategy!r}")


def _valid_address(address: str) -> bool:
    if address == "auto":
        return True
    host, _, port = address.removeprefix("ray://").rpartition(":")
    return host != "" and port.isdigit()


@dataclass(frozen=True)
class ServeConfig:
    """A whole `tandem serve` cluster. The defaults are the laptop cluster: local Ray, one prefill and
    one decode worker on the CPU with SmolLM2, the gateway on 127.0.0.1:8000, cache-aware routing."""

    model: str = "smollm2"
    """`smollm2` (the bundled SmolLM2-135M-Instruct) or a local HF directory; every engine's `model`."""
    engine: EngineConfig = field(default_factory=EngineConfig)
    """Every worker's engine defaults (its `model` equals `model`); groups override fields in their own `engine`."""
    prefill: WorkerGroupConfig = field(default_factory=lambda: WorkerGroupConfig(count=1))
    """Prefill workers: build KV and hand it to a decode worker."""
    decode: WorkerGroupConfig = field(default_factory=lambda: WorkerGroupConfig(
        count=1, engine=EngineConfig(chunk_size=CPU_DECODE_CHUNK_SIZE)))
    """Decode workers: receive KV into their landing pool and decode."""
    colocated: WorkerGroupConfig = field(default_factory=lambda: WorkerGroupConfig(count=0))
    """Colocated workers: prefill and decode in one engine, no KV transfer."""
    transport: TransportConfig = field(default_factory=TransportConfig)
    """KV transfer between prefill and decode workers."""
    kv_store: KVStoreConfig = field(default_factory=KVStoreConfig)
    """Tiers below the host cache: the shared L3 store (`kv_store.l3`), off by default."""
    router: RouterConfig = field(default_factory=RouterConfig)
    """Routing policy (`local_prefill_max_tokens` null: resolved here by the decode workers' device)."""
    gateway: GatewayConfig = field(default_factory=GatewayConfig)
    """The HTTP front end."""
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    """Ray and worker supervision."""
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    """What tandem may hold in RAM per node; the KV pools are sized from it (cluster/serve/memory.py)."""

    def __post_init__(self):
        if self.router.local_prefill_max_tokens is None:
            local = CPU_LOCAL_PREFILL_MAX_TOKENS if self.decode.engine.device == "cpu" else 0
            object.__setattr__(self, "router", dataclasses.replace(self.router, local_prefill_max_tokens=local))
        engines = {"engine": self.engine, **{f"{g}.engine": getattr(self, g).engine for g in GROUP_NAMES
                                             if getattr(self, g).count}}  # an empty group's engine is inert
        for name, engine in engines.items():
            require(engine.model == self.model, f"{name}.model must equal model {self.model!r}, got {engine.model!r}")
        require(self.prefill.count == 0 or self.decode.count >= 1,
                 f"prefill.count={self.prefill.count} needs decode.count >= 1: "
                 "prefill workers hand their KV to decode workers")
        # With the check above, this implies at least one worker in total.
        require(self.decode.count + self.colocated.count >= 1,
                 "at least one decode or colocated worker is needed, got decode.count=0 and colocated.count=0")
        if self.prefill.count and self.decode.count:
            for name in ("page_size", "dtype"):
                ours, theirs = getattr(self.prefill.engine, name), getattr(self.decode.engine, name)
                require(ours == theirs, f"prefill.engine.{name} ({ours!r}) and decode.engine.{name} ({theirs!r}) "
                                         "must match: KV pages move between them as they are")

    def with_groups(self, groups: Mapping[str, WorkerGroupConfig]) -> ServeConfig:
        """This config with the worker groups named in `groups` (of `GROUP_NAMES`) replaced, the others kept."""
        assert set(groups) <= set(GROUP_NAMES), f"not worker groups: {sorted(set(groups) - set(GROUP_NAMES))}"
        return dataclasses.replace(self, prefill=groups.get("prefill", self.prefill),
                                   decode=groups.get("decode", self.decode),
                                   colocated=groups.get("colocated", self.colocated))

    def to_dict(self) -> dict[str, Any]:
        """Plain nested dict that `load_serve_config` reads back to an equal config.

        The top-level `engine` leaves out `model` (the top-level `model` sets it); a group's `engine`
        holds only the fields that differ from the top-level `engine`, and the decode group's
        `chunk_size` always (left out, a CPU decode group's would load as `CPU_DECODE_CHUNK_SIZE`).
        """
        top = dataclasses.asdict(self.engine)
        out: dict[str, Any] = {"model": self.model, "engine": {k: v for k, v in top.items() if k != "model"}}
        for name in GROUP_NAMES:
            group = dataclasses.asdict(getattr(self, name))
            group["engine"] = {k: v for k, v in group["engine"].items()
                               if v != top[k] or (name, k) == ("decode", "chunk_size")}
            out[name] = group
        for name in ("transport", "router", "gateway", "cluster", "memory"):
            out[name] = dataclasses.asdict(getattr(self, name))
        l3 = self.kv_store.l3
        out["kv_store"] = {"l3": dataclasses.asdict(l3) if l3 is not None else None}
        return out


def _check_faults(spec: str) -> None:
    from common.chaos import parse

    try:
        parse(spec)
    except ValueError as exc:
        raise ConfigError(f"cluster.{exc}") from None
