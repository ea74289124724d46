"""Runs the model over one ragged step: any mix of prefill chunks, extends and decodes.

The runner knows nothing about requests: a step is a list of `ForwardRow`s (new token ids, the
sequence length after them, the page table). Prefill and decode workers both drive it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.attention.metadata import build_attn_metadata
from kernels.kv_layout import KVCacheTensors


@dataclass(frozen=True)
class ForwardRow:
    """One sequence's share of a step: KV positions [seq_len - len(token_ids), seq_len) are new."""

    token_ids: list[int]
    seq_len: int
    pages: list[int]
    wants_logits: bool


class ModelRunner:
    """Owns nothing but the step: the model and KV tensors are passed in and shared."""

    def __init__(self, model: torch.nn.Module, kv_cache: KVCacheTensors, page_size: int, device: torch.device | str):
        self.model = model
        self.kv_cache = kv_cache
        self.page_size = page_size
        self.device = torch.device(device)

    @torch.inference_mode()
    def forward(self, rows: list[ForwardRow]) -> torch.Tensor:
        """Writes the new tokens' K/V into their pages; returns logits [num_wanting_rows, vocab]
        float32, in row order, for the last token of every row with `wants_logits`."""
        query_lens = [len(r.token_ids) for r in rows]
        logits_rows, end = [], 0
        for r, q in zip(rows, query_lens):
            end += q
            if r.wants_logits:
                logits_rows.append(end - 1)
        meta, positions = build_attn_metadata(
            self.page_size, query_lens, [r.seq_len for r in rows], [r.pages for r in rows], logits_rows, self.device)
        input_ids = torch.tensor([t for r in rows for t in r.token_ids], dtype=torch.int64, device=self.device)
        _, logits = self.model(input_ids, positions, meta, self.kv_cache)
        return logits

    @torch.inference_mode()
    def probe(self) -> None:
        """One token through the model on scratch page 0 (which holds no request's KV). Raises when the
        model or device cannot run a forward pass at all: then no request is to blame for a failed step."""
        meta, positions = build_attn_metadata(self.page_size, [1], [1], [[0]], [0], self.device,
                                              allow_scratch_page=True)
        self.model(torch.zeros(1, dtype=torch.int64, device=self.device), positions, meta, self.kv_cache)
