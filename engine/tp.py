"""A tensor-parallel engine: one process a rank, the scheduler, the KV manager and every decision on
rank 0, every rank running the same forward on its shard of the model (`kernels/model/tp.py`).

Rank 0 is an ordinary `EngineCore` whose runners and model are leads (`LeadRunner`, `LeadGraphRunner`,
`LeadModel`): before each forward, each graph replay (its bucket: rank 0's gates decide) and each
head-only pass (prompt logprobs) they send what it runs to the other ranks over a control group (gloo,
on every device), then run it themselves. Every rank builds the same graph buckets, capturing them
(CUDA) in the same order, so the collectives inside meet. The others
(`follow`) hold a KV cache of the same pages for their own heads and run what they are sent: the page
tables are rank 0's, so their pages hold the same tokens. The model's collectives then meet.

A worker role may add calls of its own on the other ranks (`follow`'s `calls`: a prefill worker's
writes, a decode worker's landing loads); a call's answer comes back through `ControlGroup.gather`.

The host tier and L3 are per rank, rank 0 deciding (`engine/tp_tiers.py`).

EAGLE's head is sharded as a decoder layer is and runs on every rank (`LeadHead`): each pass and each
move of a verified tree's K/V is sent like a forward.

Not yet under tensor parallelism: the CPU's compiled and C decode layers (its replays run the eager
layers over the static buffers), graphs of the EAGLE head (its calls run eagerly). `prepare` turns off
what is on by default and refuses what was asked for.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from common.config import EngineConfig
from engine.graphs.runner import GraphRunner
from engine.runner import ForwardOut, ForwardRow, ModelRunner
from kernels.attention.metadata import AttnMetadata
from kernels.kv_layout import KVCacheTensors
from kernels.model.eagle import EagleDraftHead
from kernels.model.llama import LlamaForCausalLM

if TYPE_CHECKING:
    from engine.spec.draft_tree import SlotMove

CONTROL_TIMEOUT = datetime.timedelta(days=7)
"""How long a rank waits for rank 0's next call: an idle server sends none for as long as it idles.
A rank that dies is seen sooner: its peers' sockets close."""
START_TIMEOUT = datetime.timedelta(minutes=5)
"""How long the ranks wait for each other to join the group."""


def prepare(config: EngineConfig) -> EngineConfig:
    """`config` for a tensor-parallel engine: no CPU compile or C layers."""
    return dataclasses.replace(config, cpu_compile=False, cpu_native_decode=False)


class ControlGroup:
    """Rank 0's calls to the other ranks: pickled objects broadcast over a gloo group."""

    def __init__(self) -> None:
        self.group = torch.distributed.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)

    def send(self, call: tuple) -> None:
        torch.distributed.broadcast_object_list([call], src=0, group=self.group)

    def receive(self) -> tuple:
        box: list[Any] = [None]
        torch.distributed.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def gather(self, obj: Any) -> list | None:
        """Every rank's `obj` on rank 0 (in rank order; None on the others): a rank's answer to a call."""
        rank0 = torch.distributed.get_rank() == 0
        out = [None] * torch.distributed.get_world_size() if rank0 else None
        torch.distributed.gather_object(obj, out, dst=0, group=self.group)
        return out


class LeadRunner(ModelRunner):
    """Rank 0's model runner: each forward (and the probe) is sent to the other ranks first."""

    def __init__(self, control: ControlGroup, model: LlamaForCausalLM, kv_cache: KVCacheTensors, page_size: int,
                 device: torch.device | str, aux_layer_ids: tuple[int, ...] = ()) -> None:
        super().__init__(model, kv_cache, page_size, device, aux_layer_ids)
        self.control = control

    def forward(self, rows: list[ForwardRow]) -> ForwardOut:
        self.control.send(("forward", rows))
        return super().forward(rows)

    def probe(self) -> None:
        self.control.send(("probe",))
        super().probe()


class LeadGraphRunner(GraphRunner):
    """Rank 0's graph runner: each replay (bucket and rows) is sent to the other ranks first; an eager
    step goes through its `LeadRunner`."""

    def __init__(self, control: ControlGroup, *args: Any, **kwargs: Any) -> None:  # then `GraphRunner`'s
        self.control = control
        super().__init__(*args, **kwargs)

    def _replay(self, rows: list[ForwardRow], bucket: int) -> ForwardOut:
        self.control.send(("replay", rows, bucket))
        return super()._replay(rows, bucket)

    def tree_replay(self, rows: list[ForwardRow], bucket: int) -> ForwardOut:
        self.control.send(("tree_replay", rows, bucket))
        return super().tree_replay(rows, bucket)


class LeadHead:
    """Rank 0's EAGLE head, sharded as a decoder layer (`kernels/model/eagle.py`): each pass through
    it (a draft step, a catch-up's K/V writes, an arriving feature's logits) and each move of a
    verified tree's K/V (`lead_moves`) is sent to the other ranks first, then it is rank 0's. Its
    calls replay no graphs under tensor parallelism: they run as sent on every rank."""

    def __init__(self, head: EagleDraftHead, control: ControlGroup) -> None:
        self._head, self._control = head, control

    def __call__(self, input_ids: torch.Tensor, features: torch.Tensor, positions: torch.Tensor, meta: AttnMetadata,
                 kv_cache: KVCacheTensors) -> tuple[torch.Tensor, torch.Tensor]:
        self._control.send(("head", input_ids.cpu(), features.cpu(), positions.cpu(), meta_to(meta, "cpu")))
        return self._head(input_ids, features, positions, meta, kv_cache)

    def write_kv(self, input_ids: torch.Tensor, features: torch.Tensor, positions: torch.Tensor,
                 slot_mapping: torch.Tensor, kv_cache: KVCacheTensors) -> None:
        self._control.send(("head_kv", input_ids.cpu(), features.cpu(), positions.cpu(), slot_mapping.cpu()))
        self._head.write_kv(input_ids, features, positions, slot_mapping, kv_cache)

    def draft_logits(self, x: torch.Tensor) -> torch.Tensor:
        self._control.send(("head_logits", x.cpu()))
        return self._head.draft_logits(x)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._head, name)


def lead_moves(move: SlotMove, control: ControlGroup) -> SlotMove:
    """`move(src, dst)` (a speculator's K/V move) sent to the other ranks first."""
    def moved(src: torch.Tensor, dst: torch.Tensor) -> None:
        control.send(("move_kv", src.cpu(), dst.cpu()))
        move(src, dst)
    return moved


def head_calls(head: EagleDraftHead, draft_kv: KVCacheTensors, target_kv: KVCacheTensors,
               device: str) -> dict[str, Callable[..., None]]:
    """A rank's side of `LeadHead` and `lead_moves`: its shard of the head over its draft K/V layer,
    the moves over its target K/V."""
    from engine.spec.draft_tree import move_slots

    def run(input_ids: torch.Tensor, features: torch.Tensor, positions: torch.Tensor, meta: AttnMetadata) -> None:
        with torch.inference_mode():
            head(input_ids.to(device), features.to(device), positions.to(device), meta_to(meta, device), draft_kv)

    def write_kv(input_ids: torch.Tensor, features: torch.Tensor, positions: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
        with torch.inference_mode():
            head.write_kv(input_ids.to(device), features.to(device), positions.to(device), slot_mapping.to(device),
                          draft_kv)

    def logits(x: torch.Tensor) -> None:
        with torch.inference_mode():
            head.draft_logits(x.to(device))
    return {"head": run, "head_kv": write_kv, "head_logits": logits,
            "move_kv": lambda src, dst: move_slots(target_kv, src.to(device), dst.to(device))}


def meta_to(meta: AttnMetadata, device: str) -> AttnMetadata:
    """`meta` (an `AttnMetadata`) with its tensors on `device` (sent between ranks through the host)."""
    moved = {f.name: getattr(meta, f.name).to(device) for f in dataclasses.fields(meta)
             if f.init and isinstance(getattr(meta, f.name), torch.Tensor)}
    return dataclasses.replace(meta, **moved)


class LeadModel:
    """Rank 0's model as the engine sees it: a head-only pass (`compute_logits`) is sent to the other
    ranks first (their vocabulary slices are gathered); everything else is the model's."""

    def __init__(self, model: LlamaForCausalLM, control: ControlGroup) -> None:
        self._model, self._control = model, control

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        self._control.send(("logits", hidden.cpu()))
        return self._model.compute_logits(hidden)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)


def follow(control: ControlGroup, runner: GraphRunner, model: LlamaForCausalLM,
           calls: dict[str, Callable[..., None]] | None = None) -> None:
    """A rank other than 0: run rank 0's calls until it says stop (`calls`: its worker role's, by name)."""
    calls = calls or {}
    while True:
        call = control.receive()
        if call[0] in calls:
            calls[call[0]](*call[1:])
        elif call[0] == "forward":
            with torch.inference_mode():
                runner.forward(call[1])
        elif call[0] == "replay":
            runner.replay(call[1], call[2])
        elif call[0] == "tree_replay":
            runner.tree_replay(call[1], call[2])
        elif call[0] == "logits":
            with torch.inference_mode():
                model.compute_logits(call[1].to(runner.eager.device))
        elif call[0] == "probe":
            runner.probe()
        elif call[0] == "stop":
            return
        else:
            raise RuntimeError(f"unknown call from rank 0: {call[0]!r}")


def rank_device(config: EngineConfig, rank: int) -> str:
    """Rank `rank`'s device: `cuda:<rank>` where the engine is on CUDA (one GPU a rank), else the CPU."""
    return f"cuda:{rank}" if torch.device(config.device).type == "cuda" else config.device


def join(rank: int, size: int, init_method: str, device: str) -> None:
    """Join the group (NCCL on CUDA, gloo on the CPU) as `rank`. The ranks are on this host: gloo and
    NCCL's bootstrap listen on the loopback interface (unless GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME
    name another)."""
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")  # NCCL's bootstrap sockets (its data moves over NVLink/PCIe)
    backend = "nccl" if device.startswith("cuda") else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(device)
    torch.distributed.init_process_group(backend, init_method=init_method, rank=rank, world_size=size,
                                         timeout=START_TIMEOUT)
