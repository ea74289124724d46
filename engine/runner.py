"""Runs the model over one ragged step: any mix of prefill chunks, extends and decodes.

The runner knows nothing about requests: a step is a list of `ForwardRow`s (new token ids, the
sequence length after them, the page table). Prefill and decode workers both drive it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Protocol

import torch

from kernels.attention.metadata import AttnMetadata, build_attn_metadata
from kernels.kv_layout import KVCacheTensors
from kernels.model.llama import LlamaForCausalLM
from kernels.speculative import verify_tree_mask


@dataclass(frozen=True)
class ForwardRow:
    """One sequence's share of a step: KV positions [seq_len - len(token_ids), seq_len) are new."""

    token_ids: list[int]
    seq_len: int
    pages: list[int]
    wants_logits: bool
    num_draft_tokens: int = 0
    """A verify row (speculative decoding): its last `num_draft_tokens` tokens are drafts, and every
    one of its last `num_draft_tokens + 1` tokens gets logits."""
    draft_parents: tuple[int, ...] | None = None
    """A tree verify row: the row of each draft's parent (`kernels.speculative`); None: a chain."""

    @property
    def num_logits(self) -> int:
        return self.num_draft_tokens + 1 if self.wants_logits else 0


class ForwardOut(NamedTuple):
    """What one forward gives: logits of the rows that want them, and every token's features for a
    draft head (`hidden` always; `aux` only when the runner was asked for aux layers)."""

    logits: torch.Tensor  # [sum of rows' num_logits, vocab] float32, row order
    hidden: torch.Tensor  # [num_tokens, hidden] final-normed, row order
    aux: torch.Tensor | None  # [num_tokens, len(aux_layer_ids) * hidden] or None

    @staticmethod
    def cat(parts: list[ForwardOut]) -> ForwardOut:
        """Outputs of consecutive parts of one step, joined (the row-by-row retry)."""
        aux = [p.aux for p in parts if p.aux is not None]
        assert len(aux) in (0, len(parts)), "parts of one step with and without aux features: two runners?"
        return ForwardOut(torch.cat([p.logits for p in parts]), torch.cat([p.hidden for p in parts]),
                          torch.cat(aux) if aux else None)


class StepModel(Protocol):
    """What a forward runs: the model, or a CPU replay of its decode step (`kernels/cpu/compiled.py:
    CompiledLayers`, `kernels/cpu/decode_layer.py:NativeDecode`)."""

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttnMetadata,
                 kv_cache: KVCacheTensors) -> tuple[torch.Tensor, torch.Tensor]: ...

    def forward_with_aux(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttnMetadata,
                         kv_cache: KVCacheTensors, aux_layer_ids: tuple[int, ...],
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]: ...


class ModelRunner:
    """Owns nothing but the step: the model and KV tensors are passed in and shared. `aux_layer_ids`:
    the target layers whose input hidden states every forward returns too (an EAGLE-3 head's)."""

    def __init__(self, model: LlamaForCausalLM, kv_cache: KVCacheTensors, page_size: int, device: torch.device | str,
                 aux_layer_ids: tuple[int, ...] = ()):
        self.model = model
        self.kv_cache = kv_cache
        self.page_size = page_size
        self.device = torch.device(device)
        self.aux_layer_ids = aux_layer_ids
        self.kv_window = getattr(getattr(model, "arch", None), "kv_window", None)  # pages behind it may be freed

    @torch.inference_mode()
    def forward(self, rows: list[ForwardRow]) -> ForwardOut:
        """Writes the new tokens' K/V into their pages; returns logits float32, in row order, for the
        last `num_logits` tokens of every row (the last token of a plain row with `wants_logits`)."""
        query_lens = [len(r.token_ids) for r in rows]
        logits_rows: list[int] = []
        end = 0
        for r, q in zip(rows, query_lens):
            end += q
            logits_rows.extend(range(end - r.num_logits, end))
        masks = [None if r.draft_parents is None else verify_tree_mask(r.draft_parents) for r in rows]
        meta, positions = build_attn_metadata(self.page_size, query_lens, [r.seq_len for r in rows],
                                              [r.pages for r in rows], logits_rows, self.device, masks=masks,
                                              window=self.kv_window)
        input_ids = torch.tensor([t for r in rows for t in r.token_ids], dtype=torch.int64, device=self.device)
        return self.run_model(input_ids, positions, meta)

    def run_model(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttnMetadata,
                  model: StepModel | None = None) -> ForwardOut:
        model = self.model if model is None else model
        if self.aux_layer_ids:
            hidden, logits, aux = model.forward_with_aux(input_ids, positions, meta, self.kv_cache, self.aux_layer_ids)
            return ForwardOut(logits, hidden, aux)
        hidden, logits = model(input_ids, positions, meta, self.kv_cache)
        return ForwardOut(logits, hidden, None)

    @torch.inference_mode()
    def probe(self) -> None:
        """One token through the model on scratch page 0 (which holds no request's KV). Raises when the
        model or device cannot run a forward pass at all: then no request is to blame for a failed step."""
        meta, positions = build_attn_metadata(self.page_size, [1], [1], [[0]], [0], self.device,
                                              allow_scratch_page=True)
        self.model(torch.zeros(1, dtype=torch.int64, device=self.device), positions, meta, self.kv_cache)
