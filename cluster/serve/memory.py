"""The memory budget of `tandem serve`: one figure per node, the RAM every process tandem starts
there may hold (Ray's daemons, the controller, the gateway, the workers), from which the KV pools
are sized after the weights, like vLLM's `--gpu-memory-utilization` or llama.cpp's context size.

    budget (memory.budget_gib; auto: a quarter of physical RAM, at most AUTO_BUDGET_MAX_GIB)
      - NODE_OVERHEAD: Ray's daemons and agents, the controller actor, the gateway process
      - per worker: WORKER_OVERHEAD (torch, tokenizer, transfer engine, allocator slack)
                    + its weights (+ the oneDNN-packed copy where `cpu_prepack` is on: decode workers)
      = KV, shared out:   a decode worker's landing buffer (what its prefill workers' windows can
                          have in flight, twice), then device pools by weight: prefill 1, decode and
                          colocated DECODE_SHARE (they hold every running request's whole context)

CPU workers' pools live in the budgeted RAM. A CUDA worker's pool is device memory, sized from its
share of the GPU (`cluster/serve/gpu_plan.py`); what it holds in RAM is planned here: its process,
a decode worker's landing, a prefill worker's staging (`STAGING_CHUNKS` chunks of pages) and its
host tier, which takes `DEFAULT_HOST_CACHE_RATIO` device pages at most and what the budget leaves
(shared by the CUDA workers; off when CPU pools take that share). On a CPU the host tier is off unless asked for
(`host_cache_ratio` or `host_cache_pages` set): it is the same RAM as the device pool; with L3 it is a staging area of
`L3_STAGING_HOST_RATIO` (L3's pages land in host pages before they load). A size set by hand (`num_pages`,
`kv_memory_gib`, `decode.host_pages`) is kept and counted. With `--address`, every worker is planned
as if on the gateway's node (set the sizes per group for a multi-node cluster).

Pure: the caller reads the model's shapes (`ModelShape.read`) and the node's RAM.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path

from cluster.serve.gpu_plan import DEFAULT_GPU_MEMORY_UTILIZATION, GpuWorkerPlan, plan_gpus, served_context
from common.config import DEFAULT_HOST_CACHE_RATIO, STAGING_CHUNKS, ConfigError, EngineConfig, require
from common.protocol import KVLayout

GIB = 2**30
AUTO_BUDGET_SHARE = 0.25
AUTO_BUDGET_MAX_GIB = 8.0
# The processes' RSS measured on a default `tandem serve` after a load, with some slack
# (docs/results.md#memory): the node's for Ray's daemons and agents, the controller and the gateway;
# the worker's beyond its weights and pools (a decode worker's graph buffers, the transfer engine's
# registrations).
NODE_OVERHEAD_BYTES = int(0.75 * GIB)
WORKER_OVERHEAD_BYTES = int(0.65 * GIB)
L3_STAGING_HOST_RATIO = 0.5  # host pages per device page on a CPU with L3 and no host tier asked for
DECODE_SHARE = 2.0  # a decode or colocated pool's share of the KV against a prefill worker's 1
MIN_KV_BYTES_PER_WORKER = 32 * 2**20
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
_SAFETENSORS_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
                            "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}


@dataclass(frozen=True)
class MemoryConfig:
    """What tandem may hold in RAM (the `memory:` section of a cluster YAML)."""

    budget_gib: float | None = None
    """RAM every process tandem starts on a node may hold together, GiB (> 0): the KV pools of its
    CPU workers are what is left after the processes' own overhead and the weights. None (auto): a
    quarter of the node's physical memory, at most 8 GiB. The start-up log prints the plan."""
    gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION
    """Fraction of each GPU's memory tandem's CUDA workers on it may hold together, in (0, 1]: their
    KV pools are what it leaves after the weights (`cluster/serve/gpu_plan.py`)."""

    def __post_init__(self):
        require(self.budget_gib is None or (isinstance(self.budget_gib, (int, float)) and self.budget_gib > 0),
                f"memory.budget_gib must be > 0 or null, got {self.budget_gib!r}")
        u = self.gpu_memory_utilization
        require(isinstance(u, (int, float)) and not isinstance(u, bool) and 0 < u <= 1,
                f"memory.gpu_memory_utilization must be in (0, 1], got {u!r}")


@dataclass(frozen=True)
class ModelShape:
    """What the plan needs of the model: its parameters and its KV shape."""

    num_params: int
    num_linear_params: int  # in matmul weights (the lm_head included): what a packed copy duplicates
    num_layers: int
    num_kv_heads: int
    head_dim: int
    max_context: int = 2048  # the model's max_position_embeddings

    @classmethod
    def read(cls, model_dir: Path) -> ModelShape:
        """From config.json and the safetensors headers (no weight is read)."""
        config = json.loads((Path(model_dir) / "config.json").read_text())
        num_params = num_linear = 0
        embed = 0
        for shard in sorted(Path(model_dir).glob("*.safetensors")):
            for name, info in _safetensors_header(shard).items():
                if name == "__metadata__":
                    continue
                count = math.prod(info["shape"])
                num_params += count
                if name.endswith("embed_tokens.weight"):
                    embed = count
                elif len(info["shape"]) == 2:
                    num_linear += count
        if config.get("tie_word_embeddings", False):  # the lm_head is the embedding: held once, packed once
            num_linear += embed
        heads = config["num_attention_heads"]
        return cls(num_params, num_linear, config["num_hidden_layers"], config.get("num_key_value_heads", heads),
                   config.get("head_dim") or config["hidden_size"] // heads,
                   config.get("max_position_embeddings", 2048))

    def page_bytes(self, engine: EngineConfig) -> int:
        extra = 1 if engine.speculative != "none" else 0  # the draft head's KV layer
        return KVLayout(num_layers=self.num_layers + extra, page_size=engine.page_size, num_kv_heads=self.num_kv_heads,
                        head_dim=self.head_dim, dtype=engine.dtype, element_bytes=DTYPE_BYTES[engine.dtype]).page_bytes

    def weight_bytes(self, engine: EngineConfig, prepacked: bool) -> int:
        size = DTYPE_BYTES[engine.dtype]
        return (self.num_params + (self.num_linear_params if prepacked else 0)) * size


def _safetensors_header(path: Path) -> dict:
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(length))


@dataclass(frozen=True)
class WorkerPlan:
    """One worker group's share: page counts are per worker and include each pool's scratch page."""

    role: str
    count: int
    on_cpu: bool  # its weights and device pool are in RAM (else on a GPU, outside the budget)
    weight_bytes: int  # the weights' bytes (twice the matmul weights where packed)
    kv_pages: int
    landing_pages: int
    host_pages: int
    page_bytes: int
    page_size: int
    staging_pages: int = 0  # a CUDA prefill worker's host staging
    ranks: int = 1  # its tensor-parallel ranks, a process each (their weights and pages add up to one model's)

    @property
    def ram_bytes(self) -> int:
        """What one worker of the group holds in RAM by this plan."""
        device = self.weight_bytes + self.kv_pages * self.page_bytes if self.on_cpu else 0
        return (WORKER_OVERHEAD_BYTES * self.ranks + device
                + (self.landing_pages + self.host_pages + self.staging_pages) * self.page_bytes)


@dataclass(frozen=True)
class MemoryPlan:
    budget_bytes: int
    budget_source: str
    workers: tuple[WorkerPlan, ...]
    gpu_workers: tuple[GpuWorkerPlan, ...] = ()
    max_model_len: int = 0  # the longest request served (`gpu_plan.served_context`)

    @property
    def total_bytes(self) -> int:
        return NODE_OVERHEAD_BYTES + sum(w.count * w.ram_bytes for w in self.workers)

    def describe(self) -> list[str]:
        """The start-up log's lines."""
        over = (" -- MORE than the budget: sizes set by hand (num_pages, kv_memory_gib, host_cache_*, "
                "decode.host_pages) exceed it" if self.total_bytes > self.budget_bytes else "")
        lines = [f"memory budget {self.budget_bytes / GIB:.1f} GiB on this node ({self.budget_source}); "
                 f"planned {self.total_bytes / GIB:.2f} GiB{over}: Ray, controller and gateway "
                 f"~{NODE_OVERHEAD_BYTES / GIB:.1f} GiB"]
        for w in self.workers:
            kv = (f"weights {w.weight_bytes / GIB:.2f} GiB, KV {w.kv_pages * w.page_bytes / GIB:.2f} GiB = "
                  f"{(w.kv_pages - 1) * w.page_size:,} tokens" if w.on_cpu else "weights and KV on the GPU (below)")
            extra = f", landing {w.landing_pages * w.page_bytes / GIB:.2f} GiB" if w.landing_pages else ""
            extra += f", staging {w.staging_pages * w.page_bytes / GIB:.2f} GiB" if w.staging_pages else ""
            host = (f"host tier {w.host_pages * w.page_bytes / GIB:.2f} GiB = "
                    f"{(w.host_pages - 1) * w.page_size:,} tokens" if w.host_pages else "host tier off")
            procs = f"{w.ranks} processes (tensor-parallel ranks)" if w.ranks > 1 else "process"
            lines.append(f"  {w.role} x{w.count}: each ~{w.ram_bytes / GIB:.2f} GiB in RAM: {procs} "
                         f"~{WORKER_OVERHEAD_BYTES * w.ranks / GIB:.1f} GiB, {kv}{extra}, {host}")
        lines += [w.describe() for w in self.gpu_workers]
        if self.max_model_len:
            lines.append(f"  max model length {self.max_model_len:,} tokens")
        return lines


def node_ram_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def auto_budget(ram_bytes: int) -> tuple[int, str]:
    budget = min(AUTO_BUDGET_SHARE * ram_bytes, AUTO_BUDGET_MAX_GIB * GIB)
    return int(budget), f"auto: a quarter of {ram_bytes / GIB:.1f} GiB, at most {AUTO_BUDGET_MAX_GIB:g} GiB"


def plan_memory(config, shape: ModelShape, ram_bytes: int, gpu_bytes: int | None = None):
    """(`config` with every worker group's automatic sizes resolved, its `MemoryPlan`). `config` is a
    `ServeConfig`; `gpu_bytes` one GPU's memory (None: unknown, or no GPU). Raises ConfigError when
    the budget cannot hold the processes and the weights, or a GPU share its weights."""
    config, gpu_plans = plan_gpus(config, shape, gpu_bytes)
    if config.memory.budget_gib is not None:
        budget, source = int(config.memory.budget_gib * GIB), "memory.budget_gib"
    else:
        budget, source = auto_budget(ram_bytes)
    groups = {name: _with_host_tier(getattr(config, name), config.kv_store.l3 is not None)
              for name in ("prefill", "decode", "colocated") if getattr(config, name).count}
    fixed = {name: _fixed_part(name, group, shape, config) for name, group in groups.items()}
    left = budget - NODE_OVERHEAD_BYTES - sum(group.count * fixed[name][0] for name, group in groups.items())
    weights = {name: (1.0 if name == "prefill" else DECODE_SHARE) * group.count
               for name, group in groups.items() if _kv_planned(group.engine)}
    num_planned = sum(g.count for n, g in groups.items() if n in weights)
    if num_planned and left < MIN_KV_BYTES_PER_WORKER * num_planned:
        before_kv = (budget - left) / GIB
        raise ConfigError(f"the memory budget ({budget / GIB:.2f} GiB, {source}) cannot hold the processes and "
                          f"weights ({before_kv:.2f} GiB before any KV pool): set memory.budget_gib to at least "
                          f"{before_kv + 0.5:.1f}, or run fewer workers")
    cuda_hosts = sum(g.count for g in groups.values() if _cuda_auto_host(g.engine))
    resolved, plans = {}, []
    for name, group in groups.items():
        engine = group.engine
        page_bytes = shape.page_bytes(engine)
        _, landing_pages, prepacked = fixed[name]
        kv_pages = None
        if name in weights:
            share = left * (weights[name] / group.count) / sum(weights.values())
            kv_pages = max(2, min(int(share // (page_bytes * (1 + _planned_host_ratio(engine)))),
                                  engine.useful_pages(min(engine.max_model_len or shape.max_context,
                                                          shape.max_context))))
            engine = dataclasses.replace(engine, num_pages=kv_pages)
        if _cuda_auto_host(engine):  # RAM the budget leaves, none where CPU pools took it
            host_bytes = 0 if weights else max(0, left) // cuda_hosts
            pages = min(int(engine.resolve(page_bytes, 1 << 30).num_pages * DEFAULT_HOST_CACHE_RATIO),
                        host_bytes // page_bytes)
            engine = dataclasses.replace(engine, host_cache_pages=pages if pages >= 2 else 0)
        sized = engine.resolve(page_bytes, 1 << 30)
        plans.append(WorkerPlan(name, group.count, engine.device == "cpu", shape.weight_bytes(engine, prepacked),
                                sized.num_pages, landing_pages, sized.host_cache_pages, page_bytes, engine.page_size,
                                _staging_pages(name, engine), engine.tensor_parallel_size))
        resolved[name] = dataclasses.replace(group, engine=engine,
                                             host_pages=landing_pages if name == "decode" else group.host_pages)
    config = dataclasses.replace(config, **resolved)
    return config, MemoryPlan(budget, source, tuple(plans), gpu_plans, served_context(config, shape))


def _cuda_auto_host(engine: EngineConfig) -> bool:
    """A CUDA worker's host tier not sized by hand: the plan sizes it from the RAM budget."""
    return engine.device != "cpu" and engine.host_cache_pages is None and engine.host_cache_ratio is None


def _staging_pages(name: str, engine: EngineConfig) -> int:
    """A CUDA prefill worker's host staging (`prefill_worker/staging.py`), planned as if used."""
    if name != "prefill" or engine.device == "cpu":
        return 0
    return STAGING_CHUNKS * -(-engine.chunk_size // engine.page_size)


def _with_host_tier(group, with_l3: bool):
    """`group` with its CPU engine's host tier decided when not asked for: off, or with L3 a staging
    area of `L3_STAGING_HOST_RATIO` (pages fetched from L3 land in host pages first). A CUDA engine's is
    planned from the RAM left (`_cuda_auto_host`); under tensor parallelism each rank holds its heads'
    share of every host page (rank 0 deciding: `engine/tp_tiers.py`), the same RAM in all."""
    engine = group.engine
    if engine.host_cache_ratio is not None or engine.host_cache_pages is not None or engine.device != "cpu":
        return group
    ratio = L3_STAGING_HOST_RATIO if with_l3 else 0.0
    return dataclasses.replace(group, engine=dataclasses.replace(engine, host_cache_ratio=ratio))


def _planned_host_ratio(engine: EngineConfig) -> float:
    """Host pages per device page that come out of a planned pool's share (a ratio asked for)."""
    return engine.host_cache_ratio if engine.host_cache_pages is None and engine.host_cache_ratio else 0.0


def _kv_planned(engine: EngineConfig) -> bool:
    return engine.device == "cpu" and engine.num_pages is None and engine.kv_memory_gib is None


def _fixed_part(name: str, group, shape: ModelShape, config) -> tuple[int, int, bool]:
    """(bytes one worker holds before its planned pool, its landing pages, whether its weights are
    packed twice)."""
    engine = group.engine
    prepacked = engine.device == "cpu" and engine.dtype == "float32" and (
        engine.cpu_prepack if engine.cpu_prepack is not None else name != "prefill")
    page_bytes = shape.page_bytes(engine)
    landing = 0
    if name == "decode":
        landing = group.host_pages or _landing_pages(config, engine)
    fixed = WORKER_OVERHEAD_BYTES * engine.tensor_parallel_size + landing * page_bytes
    sized = engine.resolve(page_bytes, 1 << 30)  # sizes set by hand (or the defaults off the budget)
    if engine.device == "cpu":
        fixed += shape.weight_bytes(engine, prepacked)
        if not _kv_planned(engine):
            fixed += sized.num_pages * page_bytes
        if engine.host_cache_pages is not None or (engine.host_cache_ratio is not None and not _kv_planned(engine)):
            fixed += sized.host_cache_pages * page_bytes  # asked for on a CPU (a ratio of a planned pool: its share)
    else:  # a CUDA worker's host tier (set by hand; else planned from what is left) and staging are RAM
        fixed += (0 if _cuda_auto_host(engine) else sized.host_cache_pages * page_bytes)
        fixed += _staging_pages(name, engine) * page_bytes
    return fixed, landing, prepacked


def _landing_pages(config, engine: EngineConfig) -> int:
    """Twice what the prefill workers' windows can have in flight to one decode worker (+ page 0)."""
    window = config.router.prefill_window_tokens or 2 * config.prefill.engine.chunk_size
    tokens = 2 * window * max(1, config.prefill.count) / max(1, config.decode.count)
    return int(math.ceil(tokens / engine.page_size)) + 1
