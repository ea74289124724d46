"""GPU memory of `tandem serve`'s CUDA workers: their KV pools sized from the GPU, like vLLM's
`--gpu-memory-utilization`, and the context length the plan can hold.

    a worker's share of its GPU = min(num_gpus, 1) x memory.gpu_memory_utilization x the GPU's memory
      - its weights (engine.dtype: bfloat16 by default on CUDA)
      - GPU_RESERVE_BYTES (CUDA context, a prefill chunk's activations, graph pools, allocator slack)
      = its KV pool (sizes set by hand, num_pages or kv_memory_gib, are kept and counted)

A worker over `engine.tensor_parallel_size` ranks drives one GPU a rank (its `num_gpus` at least that
many, one placement-group bundle, so one node): each rank holds its shard of the weights and its heads'
share of every page, so the plan is made for one rank's share (`tp_needed` says how many ranks a model
would need). Host memory of a CUDA worker (its host tier, a decode worker's landing, a prefill worker's
staging) is RAM, planned with the budget in `cluster/serve/memory.py`.

The served context (`max_model_len`) is the model's, capped by `engine.max_model_len` and by the
smallest pool of a worker that holds a whole request. Pure: the caller reads the GPU's memory
(`node_gpu_memory_bytes`, without torch) and passes it in.
"""

from __future__ import annotations

import dataclasses
import shutil
import subprocess
from dataclasses import dataclass

from common.config import ConfigError

GIB = 2**30
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9
GPU_RESERVE_BYTES = 2 * GIB
MIN_GPU_KV_BYTES = GIB // 4
GROUPS = ("prefill", "decode", "colocated")


@dataclass(frozen=True)
class GpuWorkerPlan:
    """One CUDA worker group's device memory, per worker."""

    role: str
    count: int
    gpu_fraction: float  # of one GPU
    share_bytes: int  # what it may hold on its GPU
    weight_bytes: int
    kv_pages: int  # scratch page included
    page_bytes: int
    page_size: int
    ranks: int = 1  # tensor-parallel: a GPU each, every figure but the tokens per rank

    def describe(self) -> str:
        kv = self.kv_pages * self.page_bytes
        where = (f"{self.ranks} GPUs (tensor-parallel ranks), each" if self.ranks > 1
                 else f"each {self.gpu_fraction:g} of a GPU")
        return (f"  {self.role} x{self.count} on the GPU: {where}, "
                f"{self.share_bytes / GIB:.1f} GiB: weights {self.weight_bytes / GIB:.2f} GiB, reserve "
                f"{GPU_RESERVE_BYTES / GIB:.1f} GiB, KV {kv / GIB:.2f} GiB = "
                f"{(self.kv_pages - 1) * self.page_size:,} tokens")


def node_gpu_memory_bytes() -> int | None:
    """One GPU's memory on this node (the first `nvidia-smi` lists), read without torch or a CUDA
    context; None without nvidia-smi or a GPU."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    try:
        out = subprocess.run([smi, "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=30).stdout.split()
        return int(float(out[0]) * 2**20) if out else None
    except (OSError, subprocess.SubprocessError, ValueError):
        return None


def plan_gpus(config, shape, gpu_bytes: int | None) -> tuple[object, tuple[GpuWorkerPlan, ...]]:
    """(`config` with its CUDA groups' KV pools sized, their plans). `config` is a `ServeConfig`,
    `shape` a `memory.ModelShape`, `gpu_bytes` one GPU's memory (None: unknown; then the pools keep
    `engine.kv_memory_gib`'s default). Raises ConfigError when a worker's share of its GPU cannot hold
    its weights, the reserve and a minimal pool."""
    utilization = config.memory.gpu_memory_utilization
    resolved, plans = {}, []
    for name in GROUPS:
        group = getattr(config, name)
        engine = group.engine
        if not group.count or not engine.device.startswith("cuda") or gpu_bytes is None:
            continue
        fraction = min(group.num_gpus, 1.0)
        share = int(fraction * utilization * gpu_bytes)
        ranks = engine.tensor_parallel_size  # a GPU each: each holds its shard and its heads' share of a page
        weights = shape.weight_bytes(engine, prepacked=False) // ranks
        page_bytes = shape.page_bytes(engine) * -(-shape.num_kv_heads // ranks) // shape.num_kv_heads
        if engine.num_pages is None and engine.kv_memory_gib is None:
            kv_bytes = share - weights - GPU_RESERVE_BYTES
            if kv_bytes < MIN_GPU_KV_BYTES:
                needed = tp_needed(shape, weights, gpu_bytes, utilization)
                tp = (f"; whole {gpu_bytes / GIB:.0f} GiB GPUs hold it only split over {needed} ranks "
                      f"({name}.engine.tensor_parallel_size={needed} with {name}.num_gpus={needed})"
                      if needed and needed > 1 else "; no tensor-parallel degree up to 64 fits it either" if not needed
                      else "")
                raise ConfigError(
                    f"{name}: {fraction:g} of a {gpu_bytes / GIB:.0f} GiB GPU at memory.gpu_memory_utilization "
                    f"{utilization:g} is {share / GIB:.1f} GiB, which cannot hold the weights "
                    f"({weights / GIB:.1f} GiB, {engine.dtype}), {GPU_RESERVE_BYTES / GIB:.0f} GiB of reserve and a KV "
                    f"pool{tp}: give the group more of a GPU (num_gpus), fewer workers per GPU, or a smaller dtype")
            engine = dataclasses.replace(engine, num_pages=max(2, kv_bytes // page_bytes))
        kv_pages = engine.resolve(page_bytes, 1 << 30).num_pages
        plans.append(GpuWorkerPlan(name, group.count, fraction, share, weights, kv_pages, page_bytes, engine.page_size,
                                   ranks))
        resolved[name] = dataclasses.replace(group, engine=engine)
    return dataclasses.replace(config, **resolved), tuple(plans)


TP_DEGREES = (1, 2, 4, 8, 16, 32, 64)
PLANNED_GPU_GIB = (24, 48, 80, 141)
"""GPU sizes `--plan-only` says the tensor-parallel degree of (L4/A10-class, L40S, A100/H100, H200)."""


def tp_needed(shape, weight_bytes: int, gpu_bytes: int, utilization: float) -> int | None:
    """The fewest ranks (whole GPUs of `gpu_bytes`) whose shares hold `weight_bytes` split evenly, the
    reserve and a minimal KV pool each, at a degree the model's KV heads split at (`kernels/model/tp.py`:
    a divisor of them, or a multiple); None: none up to 64."""
    share = utilization * gpu_bytes
    for degree in TP_DEGREES:
        heads_split = degree <= shape.num_kv_heads or degree % shape.num_kv_heads == 0
        if heads_split and weight_bytes / degree + GPU_RESERVE_BYTES + MIN_GPU_KV_BYTES <= share:
            return degree
    return None


def tp_advice(shape, weight_bytes: int, dtype: str, utilization: float) -> str:
    """One line: the tensor-parallel degree the model needs on GPUs of each of `PLANNED_GPU_GIB`."""
    degrees = [f"{gib} GiB: {tp_needed(shape, weight_bytes, gib * GIB, utilization) or '>64'}"
               for gib in PLANNED_GPU_GIB]
    return (f"  tensor parallelism for {weight_bytes / GIB:.1f} GiB of {dtype} weights, ranks (GPUs) a worker "
            f"needs at least: {', '.join(degrees)}")


def served_context(config, shape) -> int:
    """The longest request the cluster serves: the model's context, capped by each group's
    `engine.max_model_len` and by the smallest pool of its workers (a request's whole KV)."""
    limits = []
    for name in GROUPS:
        group = getattr(config, name)
        if not group.count:
            continue
        engine = group.engine
        limit = min(engine.max_model_len or shape.max_context, shape.max_context)
        if engine.num_pages is not None:
            limit = min(limit, (engine.num_pages - 1) * engine.page_size)
        limits.append(limit)
    return min(limits) if limits else shape.max_context
