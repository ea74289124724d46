"""Reference attention over paged KV in plain torch (any device).

One step is split once into a plan (memoised on the metadata object, so the 30-odd layers of a
forward share it):

- decode rows (query_len == 1) of all sequences go through ONE batched SDPA call per layer: their
  pages are gathered to a padded ``[B_dec, L, kvh, hd]`` and masked by seq_len;
- extend rows (query_len > 1) go through one SDPA call per sequence with a causal mask shifted by
  the prefix length already in the cache.

Nothing here reads a device value back to the host; all sizes come from ``meta.*_cpu``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels.attention.base import AttentionBackend
from kernels.attention.metadata import AttnMetadata


@dataclass(frozen=True)
class _DecodePlan:
    """Decode rows of one step, batched. ``L = num_pages * page_size`` padded KV positions."""

    rows: torch.Tensor  # [B_dec] int64, rows of T holding the decode tokens
    page_table: torch.Tensor  # [B_dec, num_pages] int64
    mask: torch.Tensor  # [B_dec, 1, 1, L] bool, True where position < seq_len


@dataclass(frozen=True)
class _ExtendSeq:
    """One sequence with several new tokens: rows ``[row_start, row_end)`` of T."""

    row_start: int
    row_end: int
    seq_len: int
    page_table: torch.Tensor  # [num_pages] int64, enough pages to cover seq_len
    mask: torch.Tensor | None  # [q_len, seq_len] bool causal-with-offset; None when no prefix


@dataclass(frozen=True)
class _Plan:
    decode: _DecodePlan | None
    extends: tuple[_ExtendSeq, ...]


def _num_pages(num_tokens: int, page_size: int) -> int:
    return -(-num_tokens // page_size)


def _plan_decode_no_sync(meta: AttnMetadata, seqs: list[int]) -> _DecodePlan:
    """A step of decode rows only builds its plan from the device tensors alone (no host -> device
    copy), so a CUDA graph can capture it: a replay recomputes it from the static buffers."""
    device = meta.page_table.device
    max_len = max(meta.seq_lens_cpu[b] for b in seqs)
    num_pages = _num_pages(max_len, meta.page_size)
    if len(seqs) == meta.num_seqs:
        rows, page_table, seq_lens = meta.query_start_loc[:-1], meta.page_table[:, :num_pages], meta.seq_lens
    else:
        qsl = meta.query_start_loc_cpu
        seq_idx = torch.tensor(seqs, dtype=torch.int64, device=device)
        rows = torch.tensor([qsl[b] for b in seqs], dtype=torch.int64, device=device)
        page_table, seq_lens = meta.page_table.index_select(0, seq_idx)[:, :num_pages], meta.seq_lens[seq_idx]
    kv_pos = torch.arange(num_pages * meta.page_size, device=device)  # [L]
    mask = kv_pos[None, :] < seq_lens[:, None]  # [B_dec, L]
    return _DecodePlan(rows=rows, page_table=page_table, mask=mask[:, None, None, :])


def _plan_extend(meta: AttnMetadata, b: int) -> _ExtendSeq:
    device = meta.page_table.device
    q_len, seq_len = meta.query_lens_cpu[b], meta.seq_lens_cpu[b]
    row_start = meta.query_start_loc_cpu[b]
    prefix_len = seq_len - q_len
    mask = None
    if prefix_len > 0:
        q_pos = torch.arange(prefix_len, seq_len, device=device)  # [q_len]
        mask = torch.arange(seq_len, device=device)[None, :] <= q_pos[:, None]  # [q_len, seq_len]
    page_table = meta.page_table[b, : _num_pages(seq_len, meta.page_size)]
    return _ExtendSeq(row_start, row_start + q_len, seq_len, page_table, mask)


def _make_plan(meta: AttnMetadata) -> _Plan:
    decode_seqs = [b for b, q_len in enumerate(meta.query_lens_cpu) if q_len == 1]
    extend_seqs = [b for b, q_len in enumerate(meta.query_lens_cpu) if q_len > 1]
    decode = _plan_decode_no_sync(meta, decode_seqs) if decode_seqs else None
    return _Plan(decode=decode, extends=tuple(_plan_extend(meta, b) for b in extend_seqs))


def _gather_pages(cache: torch.Tensor, page_table: torch.Tensor) -> torch.Tensor:
    """``[..., num_pages]`` page ids -> ``[..., num_pages * page_size, kvh, hd]`` (a copy)."""
    # index_select, not cache[page_table]: advanced indexing runs ~4x slower on CPU for these
    # large contiguous slices, and this gather is the biggest cost of a CPU decode step.
    pages = cache.index_select(0, page_table.reshape(-1))  # [prod(...) * num_pages, page_size, kvh, hd]
    return pages.view(*page_table.shape[:-1], page_table.shape[-1] * cache.shape[1], *cache.shape[2:])


class TorchAttentionBackend(AttentionBackend):
    """Reference backend; exact (up to SDPA rounding) on CPU and CUDA alike."""

    name = "torch"

    def __init__(self) -> None:
        self._memo: tuple[AttnMetadata, _Plan] | None = None

    def write_kv(
        self,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        num_slots = k_cache.shape[0] * k_cache.shape[1]
        assert k.shape[1:] == k_cache.shape[2:], (
            f"new K {tuple(k.shape)} does not fit cache {tuple(k_cache.shape)}: kv heads / head_dim mismatch?"
        )
        k_cache.view(num_slots, *k_cache.shape[2:]).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
        v_cache.view(num_slots, *v_cache.shape[2:]).index_copy_(0, slot_mapping, v.to(v_cache.dtype))

    def attention(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttnMetadata, scale: float
    ) -> torch.Tensor:
        num_heads, num_kv_heads = q.shape[1], k_cache.shape[2]
        assert num_heads % num_kv_heads == 0, f"{num_heads} query heads not a multiple of {num_kv_heads} kv heads"
        plan = self._plan_for(meta)
        out = torch.empty_like(q)  # [T, H, hd]; rows of empty sequences are never read
        if plan.decode is not None:
            out[plan.decode.rows] = self._decode(q, k_cache, v_cache, plan.decode, scale)
        for seq in plan.extends:
            out[seq.row_start : seq.row_end] = self._extend(q, k_cache, v_cache, seq, scale)
        return out

    def _plan_for(self, meta: AttnMetadata) -> _Plan:
        """The plan of this step, built on the first layer and reused by the rest."""
        if self._memo is None or self._memo[0] is not meta:
            self._memo = (meta, _make_plan(meta))
        return self._memo[1]

    @staticmethod
    def _decode(q, k_cache, v_cache, plan: _DecodePlan, scale: float) -> torch.Tensor:
        """One query per sequence, so the query heads of a GQA group ride along as the query axis."""
        num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
        q_dec = q[plan.rows]  # [B_dec, H, hd]
        batch = q_dec.shape[0]
        q_grp = q_dec.view(batch, num_kv_heads, -1, head_dim)  # [B_dec, kvh, group, hd]
        k = _gather_pages(k_cache, plan.page_table).transpose(1, 2)  # [B_dec, kvh, L, hd]
        v = _gather_pages(v_cache, plan.page_table).transpose(1, 2)  # [B_dec, kvh, L, hd]
        o = F.scaled_dot_product_attention(q_grp, k, v, attn_mask=plan.mask, scale=scale)
        return o.reshape(batch, -1, head_dim)  # [B_dec, H, hd]

    @staticmethod
    def _extend(q, k_cache, v_cache, seq: _ExtendSeq, scale: float) -> torch.Tensor:
        q_seq = q[seq.row_start : seq.row_end].transpose(0, 1)  # [H, q_len, hd]
        k = _gather_pages(k_cache, seq.page_table)[: seq.seq_len].transpose(0, 1)  # [kvh, seq_len, hd]
        v = _gather_pages(v_cache, seq.page_table)[: seq.seq_len].transpose(0, 1)  # [kvh, seq_len, hd]
        group = q_seq.shape[0] // k.shape[0]
        if group > 1:
            k = k.repeat_interleave(group, dim=0)  # [H, seq_len, hd]
            v = v.repeat_interleave(group, dim=0)
        o = F.scaled_dot_product_attention(
            q_seq, k, v, attn_mask=seq.mask, is_causal=seq.mask is None, scale=scale
        )  # [H, q_len, hd]
        return o.transpose(0, 1)  # [q_len, H, hd]
