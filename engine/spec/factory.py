"""Which speculator an engine runs (`engine.speculative`): `NullSpeculator` when off, else an
`EagleSpeculator` over a draft head that is loaded (`load_draft_head`) and checked against the config
(`check_draft_head`) before anything is allocated for it."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch

from common.config import ConfigError, EngineConfig
from engine.request import Request
from engine.spec.policy import AdaptivePolicy, FixedPolicy
from engine.spec.speculator import Committed, DraftSlots, EagleSpeculator
from kernels.kv_layout import KVCacheTensors
from kernels.model.arch import LlamaArch
from kernels.model.eagle import DraftStyle, EagleDraftHead, load_eagle_checkpoint
from kernels.model.llama import LlamaForCausalLM

if TYPE_CHECKING:
    from engine.graphs.runner import GraphRunner
    from engine.tp import LeadHead


class NullSpeculator:
    """Speculation off: nothing is drafted, every decode row scores one token."""

    counters = None

    def begin_step(self) -> None:
        pass

    def export_feature(self, request_id: str) -> bytes:
        return b""

    def draft_arrived(self, arrived: list[Request], running: list[Request], reserve: DraftSlots,
                      max_request_tokens: int) -> None:
        pass

    def verify(self, req: Request, logits: torch.Tensor) -> list[int]:
        raise AssertionError(f"request {req.request_id} carries drafts, but speculation is off")

    def emitted_rows(self, req: Request, num_emitted: int) -> list[int]:
        raise AssertionError(f"request {req.request_id} verified drafts, but speculation is off")

    def catch_up(self, committed: list[Committed], hidden: torch.Tensor, aux: torch.Tensor | None,
                 num_running: int) -> None:
        pass

    def draft(self, running: list[Request], reserve: DraftSlots, max_request_tokens: int) -> None:
        pass


def make_speculator(config: EngineConfig, head: EagleDraftHead | LeadHead | None, device: torch.device,
                    kv: KVCacheTensors | None = None, target_kv: KVCacheTensors | None = None,
                    runner: GraphRunner | None = None) -> EagleSpeculator | NullSpeculator:
    """The speculator `config.speculative` names; `head` is the draft head when it is `eagle` (see
    `EagleSpeculator` for the rest)."""
    if config.speculative == "none":
        return NullSpeculator()
    head = check_draft_head(config, head)
    policy = AdaptivePolicy() if config.speculative_adaptive else FixedPolicy()
    return EagleSpeculator(head, config.page_size, device, config.num_draft_tokens, config.speculative_max_batch,
                           policy, config.speculative_topk, config.speculative_tree_nodes, kv, target_kv, runner)


def check_draft_head(config: EngineConfig, head: EagleDraftHead | LeadHead | None) -> EagleDraftHead | LeadHead:
    """`head`, or ConfigError when it cannot draft as `config` asks (before anything is allocated for it)."""
    assert head is not None, "speculative eagle needs a draft head (engine.draft_model)"
    backend = head.self_attn.backend
    if config.speculative_topk > 1 and not backend.supports_tree_mask:
        raise ConfigError(f"speculative_topk {config.speculative_topk} (tree drafting) needs the torch or triton "
                          f"attention backend; {backend.name} takes no tree mask (set attention_backend, or topk 1)")
    return head


def draft_aux_layers(head: EagleDraftHead | None) -> tuple[int, ...]:
    """The target layers whose input hidden states the head reads (EAGLE-3; none otherwise)."""
    if head is None or head.arch.style is not DraftStyle.EAGLE3:
        return ()
    return head.arch.aux_layer_ids


def load_draft_head(config: EngineConfig, model: LlamaForCausalLM, arch: LlamaArch) -> EagleDraftHead:
    """The head in `config.draft_model` for `model` (sharing its embedding and lm_head), or ConfigError."""
    path = Path(config.draft_model) if config.draft_model else None
    if path is None or not (path / "config.json").is_file():
        raise ConfigError(f"speculative {config.speculative} needs engine.draft_model: a draft head directory with "
                          f"config.json (got {config.draft_model!r}; `tandem train-eagle` makes one for a model)")
    tp = getattr(model, "tp", None)  # a rank's shard of the target: the head's shard (full shapes: `full_arch`)
    return load_eagle_checkpoint(path, model.full_arch if tp is not None else arch, model.model.embed_tokens,
                                 model.lm_head, model.backend, tp)
