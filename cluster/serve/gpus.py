"""The GPUs a local Ray instance is told of, and how the worker groups share them.

A local instance (no `cluster.address`) is declared the node's real GPU count (`node_gpu_count`), never
what the groups ask for: Ray hands out device ids in [0, declared) without checking that they exist,
so a second whole-GPU worker on a one-GPU node would be given a device that is not there.

`share_gpus` decides, before Ray starts, how the CUDA workers fit (pure: the count is an argument):

    demand = sum(count x num_gpus) over CUDA groups
    demand <= GPUs                 -> as configured
    a worker over ranks (TP > 1)   -> ServeStartError: a rank drives a whole GPU (a worker asks one a rank)
    every CUDA worker asks 1 GPU   -> each asks 1 / ceil(workers / GPUs): on one GPU, prefill and decode
                                      0.5 each; 3 workers on 2 GPUs 0.5 each (Ray packs two on one)
    otherwise                      -> ServeStartError naming the demand and the GPUs

The count is read without torch or a CUDA context (the gateway's process has neither): the devices
`CUDA_VISIBLE_DEVICES` names where it is set, else the driver's `/proc/driver/nvidia/gpus` entries.
"""

from __future__ import annotations

import dataclasses
import math
import os
from pathlib import Path

from cluster.serve.config import ServeConfig, WorkerGroupConfig

NVIDIA_GPUS_DIR = Path("/proc/driver/nvidia/gpus")
GROUPS = ("prefill", "decode", "colocated")


class GPUPlacementError(RuntimeError):
    """The CUDA worker groups ask for more GPUs than the node has, in a way tandem does not share."""


def node_gpu_count() -> int:
    """GPUs this node's processes can use: `CUDA_VISIBLE_DEVICES`'s entries where it is set (empty,
    or starting with -1: none), else the NVIDIA driver's device entries (0 without the driver)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        ids = [part.strip() for part in visible.split(",")]
        count = 0
        for part in ids:
            if not part or part.startswith("-1"):
                break  # CUDA stops at the first invalid id
            count += 1
        return count
    try:
        return sum(1 for _ in NVIDIA_GPUS_DIR.iterdir())
    except OSError:
        return 0


def _cuda_groups(config: ServeConfig) -> dict[str, WorkerGroupConfig]:
    return {name: group for name in GROUPS if (group := getattr(config, name)).count
            and group.engine.device.startswith("cuda")}


def gpu_demand(config: ServeConfig) -> float:
    """GPUs the CUDA worker groups ask Ray for, together."""
    return sum(g.count * g.num_gpus for g in _cuda_groups(config).values())


def share_gpus(config: ServeConfig, node_gpus: int) -> ServeConfig:
    """`config` with its CUDA workers fitted onto `node_gpus` GPUs (module docstring): itself when they
    fit as configured. Raises GPUPlacementError when there are CUDA workers and no GPU, or when they ask
    for more than there is in a way other than one whole GPU each."""
    groups = _cuda_groups(config)
    if not groups:
        return config
    workers = sum(g.count for g in groups.values())
    if node_gpus == 0:
        raise GPUPlacementError(f"{workers} worker(s) run on engine.device cuda ({', '.join(groups)}) but this "
                                "node has no GPU the processes can see (CUDA_VISIBLE_DEVICES, NVIDIA driver)")
    demand = gpu_demand(config)
    if demand <= node_gpus + 1e-9:
        return config
    asks = ", ".join(f"{name}: {g.count} x {g.num_gpus:g}" for name, g in groups.items())
    ranked = {name: g.engine.tensor_parallel_size for name, g in groups.items() if g.engine.tensor_parallel_size > 1}
    if ranked:  # a rank drives a whole GPU: ranks of two workers are not packed onto one
        over = ", ".join(f"{name} at tensor_parallel_size {tp}" for name, tp in ranked.items())
        raise GPUPlacementError(f"the CUDA workers ask for {demand:g} GPUs ({asks}; {over}, a GPU a rank) and this "
                                f"node has {node_gpus}: serve one colocated worker over the GPUs (--num-prefill 0 "
                                "--num-decode 0 --num-colocated 1), or lower the counts or tensor_parallel_size")
    if any(g.num_gpus != 1.0 for g in groups.values()):
        raise GPUPlacementError(f"the CUDA workers ask for {demand:g} GPUs ({asks}) and this node has {node_gpus}: "
                                "lower the groups' num_gpus (fractions share a GPU) or their counts")
    share = 1.0 / math.ceil(workers / node_gpus)
    return config.with_groups({name: dataclasses.replace(g, num_gpus=share) for name, g in groups.items()})
