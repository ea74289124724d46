"""Reference attention over paged KV in plain torch (any device).

One step is split once into a plan (memoised on the metadata object, so the 30-odd layers of a
forward share it):

- decode rows (query_len == 1) of all sequences go through ONE batched SDPA call per layer: their
  pages are gathered to a padded ``[B_dec, L, kvh, hd]`` and masked by seq_len;
- extend rows (query_len > 1) go one sequence at a time. On CPU no mask is ever built: a fresh
  prompt is one causal SDPA call (CPU flash kernel, GQA without copies), and a prompt after a cached
  prefix is flash-style (below). Off CPU one SDPA call per sequence, causal for a fresh prompt, else
  with a causal mask shifted by the prefix length.

Flash-style extend on CPU, sequence of ``s`` positions, ``p = s - q`` of them cached before this step::

    keys      | prefix chunk 0 | chunk 1 | ... | chunk n-1 |  new tokens (causal)  |
              0                C        2C              p                        s
    part      |  non-causal: every new token sees all   |   causal among the q   |

A short extend over a short sequence (a speculative verify row, a tree's head level: at most
``SHORT_EXTEND_ROWS`` new rows, at most ``C`` positions in all) is instead ONE flash call over the
whole sequence with an additive mask (causal with an offset, or the tree window's): one gather and
one kernel call per layer instead of two calls, two gathers and a merge (measured:
docs/results.md#cpu-decode).

Each part is one call of the CPU flash kernel, which returns its output and log-sum-exp per query;
the parts merge by log-sum-exp in fp32. A sequence with a tree mask (metadata.TreeMask) is the
same with its window in place of the new tokens: the window part takes the mask (additive, 0 or
-inf) instead of the causal flag, and everything before the window is the non-causal prefix. The kernel tiles queries
and keys itself, so no score tensor is ever ``O(q * s)``; chunking the prefix bounds the gathered K/V copy to ``C``
positions.

Sliding-window and soft-capped layers take their own path (`kernels/attention/windowed.py`).

Nothing here reads a device value back to the host; all sizes come from ``meta.*_cpu``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels.attention.base import AttentionBackend, index_write_kv
from kernels.attention.metadata import AttnMetadata
from kernels.attention.windowed import attend_windowed


@dataclass(frozen=True)
class _DecodePlan:
    """Decode rows of one step, batched. ``L = num_pages * page_size`` padded KV positions."""

    rows: torch.Tensor  # [B_dec] int64, rows of T holding the decode tokens
    page_table: torch.Tensor  # [B_dec, num_pages] int64
    mask: torch.Tensor  # [B_dec, 1, 1, L] bool, True where position < seq_len
    seq_lens: torch.Tensor  # [B_dec] int64
    every_row: bool  # the step is decode rows only: rows is 0..T-1


SHORT_EXTEND_ROWS = 32
"""Extends of at most this many new rows over at most ``prefix_chunk_tokens`` positions take one masked
flash call on CPU (module docstring)."""


@dataclass(frozen=True)
class _ExtendSeq:
    """One sequence with several new tokens: rows ``[row_start, row_end)`` of T."""

    row_start: int
    row_end: int
    seq_len: int
    page_table: torch.Tensor  # [num_pages] int64, enough pages to cover seq_len
    mask: torch.Tensor | None  # [q_len, seq_len] bool causal-with-offset; only off CPU with a prefix or a tree
    tree: torch.Tensor | None = None  # [q_len, width] bool: its tree window's mask (None: causal)
    bias: torch.Tensor | None = None  # [1, 1, q_len, seq_len] float32 additive (0 / -inf): a short CPU extend

    @property
    def prefix_len(self) -> int:
        """Positions ``[0, prefix_len)`` are seen by every new row: those before the new tokens, or
        before the tree window."""
        return self.seq_len - (self.row_end - self.row_start if self.tree is None else self.tree.shape[1])


@dataclass(frozen=True)
class _Plan:
    decode: _DecodePlan | None
    extends: tuple[_ExtendSeq, ...]


def _num_pages(num_tokens: int, page_size: int) -> int:
    return -(-num_tokens // page_size)


def _plan_decode_no_sync(meta: AttnMetadata, seqs: list[int] | None) -> _DecodePlan:
    """Decode rows of sequences `seqs` (None: every sequence, a decode-only step). A decode-only step
    builds its plan from the device tensors and `meta.max_seq_len` alone (no host -> device copy, no
    per-row host value), so a CUDA graph can capture it and a compiled CPU step is not specialised
    to the batch size: a replay recomputes it from the static buffers."""
    device = meta.page_table.device
    every_row = seqs is None
    if seqs is None:
        max_len = meta.max_seq_len
        rows, page_table, seq_lens = meta.query_start_loc[:-1], meta.page_table, meta.seq_lens
    else:
        max_len = max(meta.seq_lens_cpu[b] for b in seqs)
        qsl = meta.query_start_loc_cpu
        seq_idx = torch.tensor(seqs, dtype=torch.int64, device=device)
        rows = torch.tensor([qsl[b] for b in seqs], dtype=torch.int64, device=device)
        page_table, seq_lens = meta.page_table.index_select(0, seq_idx), meta.seq_lens[seq_idx]
    num_pages = _num_pages(max_len, meta.page_size)
    kv_pos = torch.arange(num_pages * meta.page_size, device=device)  # [L]
    mask = kv_pos[None, :] < seq_lens[:, None]  # [B_dec, L]
    return _DecodePlan(rows=rows, page_table=page_table[:, :num_pages], mask=mask[:, None, None, :],
                       seq_lens=seq_lens, every_row=every_row)


def _uses_cpu_flash(device: torch.device) -> bool:
    """Whether extends on ``device`` take the mask-free flash-style path (a test may patch this)."""
    return device.type == "cpu"


def _plan_extend(meta: AttnMetadata, b: int, prefix_chunk_tokens: int) -> _ExtendSeq:
    device = meta.page_table.device
    q_len, seq_len = meta.query_lens_cpu[b], meta.seq_lens_cpu[b]
    row_start = meta.query_start_loc_cpu[b]
    tree = meta.tree_mask_of(b)
    has_prefix = seq_len > q_len
    mask = bias = None
    if not _uses_cpu_flash(device):
        if tree is not None or has_prefix:
            mask = _visible(q_len, seq_len, tree, device)
    elif has_prefix and q_len <= SHORT_EXTEND_ROWS and seq_len <= prefix_chunk_tokens:
        bias = _additive(_visible(q_len, seq_len, tree, device), torch.float32)[None, None]
    page_table = meta.page_table[b, : _num_pages(seq_len, meta.page_size)]
    return _ExtendSeq(row_start, row_start + q_len, seq_len, page_table, mask, tree, bias)


def _visible(q_len: int, seq_len: int, tree: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    """``[q_len, seq_len]`` bool: which positions each new row sees. Every position before the new
    rows (or before the tree window) and, after it, causal or the window's mask."""
    if tree is None:
        q_pos = torch.arange(seq_len - q_len, seq_len, device=device)  # [q_len]
        return torch.arange(seq_len, device=device)[None, :] <= q_pos[:, None]
    before = torch.ones(q_len, seq_len - tree.shape[1], dtype=torch.bool, device=device)
    return torch.cat([before, tree], dim=1)


def _additive(visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A bool mask as the CPU flash kernel takes one: 0 where visible, -inf elsewhere."""
    return torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill_(~visible, float("-inf"))


def _is_decode_row(meta: AttnMetadata, b: int) -> bool:
    return meta.query_lens_cpu[b] == 1 and not (meta.tree_widths_cpu and meta.tree_widths_cpu[b])


def _make_plan(meta: AttnMetadata, prefix_chunk_tokens: int) -> _Plan:
    if meta.decode_only:
        return _Plan(decode=_plan_decode_no_sync(meta, None), extends=())
    decode_seqs = [b for b in range(meta.num_seqs) if _is_decode_row(meta, b)]
    extend_seqs = [b for b, q_len in enumerate(meta.query_lens_cpu) if q_len and not _is_decode_row(meta, b)]
    decode = _plan_decode_no_sync(meta, decode_seqs) if decode_seqs else None
    return _Plan(decode=decode, extends=tuple(_plan_extend(meta, b, prefix_chunk_tokens) for b in extend_seqs))


def _gather_pages(cache: torch.Tensor, page_table: torch.Tensor) -> torch.Tensor:
    """``[..., num_pages]`` page ids -> ``[..., num_pages * page_size, kvh, hd]`` (a copy)."""
    # index_select, not cache[page_table]: advanced indexing runs several times slower on CPU for
    # these large contiguous slices, and this gather is the biggest cost of a CPU decode step.
    pages = cache.index_select(0, page_table.reshape(-1))  # [prod(...) * num_pages, page_size, kvh, hd]
    return pages.view(*page_table.shape[:-1], page_table.shape[-1] * cache.shape[1], *cache.shape[2:])


def _gather_heads_first(cache: torch.Tensor, page_table: torch.Tensor, start: int, end: int) -> torch.Tensor:
    """Positions ``[start, end)`` of one sequence as ``[1, kvh, end - start, hd]`` (a copy of only
    the pages holding them; the result is a transposed view, which the CPU flash kernel takes)."""
    page_size = cache.shape[1]
    first_page = start // page_size
    pages = page_table[first_page : _num_pages(end, page_size)]
    offset = start - first_page * page_size
    return _gather_pages(cache, pages)[offset : offset + end - start].transpose(0, 1)[None]


def _flash_cpu(q, k, v, scale: float, is_causal: bool, attn_mask: torch.Tensor | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """CPU flash attention of ``q [1, H, q_len, hd]`` over ``k, v [1, kvh, n, hd]`` (GQA read in
    place): output ``[1, H, q_len, hd]`` in q's dtype and log-sum-exp ``[1, H, q_len]`` in fp32.
    ``attn_mask``: additive, ``[1, 1, q_len, n]`` in q's dtype."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, is_causal, attn_mask=attn_mask,
                                                                      scale=scale)


def _merge_into(out: torch.Tensor, lse: torch.Tensor, part: torch.Tensor, part_lse: torch.Tensor) -> None:
    """Fold attention over more keys into ``out [1, H, q_len, hd]`` fp32 and ``lse [1, H, q_len]``
    fp32 (in place). Both are softmax-weighted means over disjoint keys, so the merged mean is
    ``out + share * (part - out)`` with ``share = e^part_lse / (e^lse + e^part_lse)``, a sigmoid of
    the difference: it cannot overflow, and it takes fewer passes over ``out`` than rescaling both."""
    share = torch.sigmoid(part_lse - lse).unsqueeze(-1)  # [1, H, q_len, 1]
    out.lerp_(part.to(out.dtype), share)
    torch.logaddexp(lse, part_lse, out=lse)


class TorchAttentionBackend(AttentionBackend):
    """Reference backend; exact (up to SDPA rounding) on CPU and CUDA alike.

    ``prefix_chunk_tokens`` (``C`` in the module docstring) bounds how many cached prefix positions
    one flash call of a CPU extend reads, and so the K/V it gathers at a time.
    """

    name = "torch"
    supports_window = True
    supports_softcap = True

    def __init__(self, prefix_chunk_tokens: int = 2048) -> None:
        assert prefix_chunk_tokens >= 1, f"prefix_chunk_tokens={prefix_chunk_tokens} must be positive"
        self.prefix_chunk_tokens = prefix_chunk_tokens
        self._memo: tuple[AttnMetadata, _Plan] | None = None

    def write_kv(
        self,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        index_write_kv(k_cache, v_cache, k, v, slot_mapping)

    def attention(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttnMetadata, scale: float,
        window: int | None = None, softcap: float | None = None,
    ) -> torch.Tensor:
        num_heads, num_kv_heads = q.shape[1], k_cache.shape[2]
        assert num_heads % num_kv_heads == 0, f"{num_heads} query heads not a multiple of {num_kv_heads} kv heads"
        if window is not None or softcap is not None:
            return attend_windowed(q, k_cache, v_cache, meta, scale, window, softcap)
        plan = self._plan_for(meta)
        if plan.decode is not None and plan.decode.every_row:
            return self._decode(q, k_cache, v_cache, plan.decode, scale)
        out = torch.empty_like(q)  # [T, H, hd]; rows of empty sequences are never read
        if plan.decode is not None:
            out[plan.decode.rows] = self._decode(q, k_cache, v_cache, plan.decode, scale)
        for seq in plan.extends:
            extend = self._extend_flash_cpu if _uses_cpu_flash(q.device) else self._extend_sdpa
            out[seq.row_start : seq.row_end] = extend(q, k_cache, v_cache, seq, scale)
        return out

    def _plan_for(self, meta: AttnMetadata) -> _Plan:
        """The plan of this step, built on the first layer and reused by the rest."""
        if self._memo is None or self._memo[0] is not meta:
            self._memo = (meta, _make_plan(meta, self.prefix_chunk_tokens))
        return self._memo[1]

    @staticmethod
    def _decode(q, k_cache, v_cache, plan: _DecodePlan, scale: float) -> torch.Tensor:
        """One query per sequence, so the query heads of a GQA group ride along as the query axis."""
        num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
        q_dec = q if plan.every_row else q[plan.rows]  # [B_dec, H, hd]
        batch = q_dec.shape[0]
        q_grp = q_dec.reshape(batch, num_kv_heads, -1, head_dim)  # [B_dec, kvh, group, hd]
        k = _gather_pages(k_cache, plan.page_table).transpose(1, 2)  # [B_dec, kvh, L, hd]
        v = _gather_pages(v_cache, plan.page_table).transpose(1, 2)  # [B_dec, kvh, L, hd]
        o = F.scaled_dot_product_attention(q_grp, k, v, attn_mask=plan.mask, scale=scale)
        return o.reshape(batch, -1, head_dim)  # [B_dec, H, hd]

    def _extend_flash_cpu(self, q, k_cache, v_cache, seq: _ExtendSeq, scale: float) -> torch.Tensor:
        """A fresh prompt in one causal call; after a cached prefix (or with a tree window)
        flash-style, see the module docstring. Returns ``[q_len, H, hd]``."""
        q_seq = q[seq.row_start : seq.row_end].transpose(0, 1)[None]  # [1, H, q_len, hd]
        if seq.bias is not None:  # short: the whole sequence in one masked call
            k = _gather_heads_first(k_cache, seq.page_table, 0, seq.seq_len)  # [1, kvh, seq_len, hd]
            v = _gather_heads_first(v_cache, seq.page_table, 0, seq.seq_len)
            o, _ = _flash_cpu(q_seq, k, v, scale, is_causal=False, attn_mask=seq.bias.to(q.dtype))
            return o[0].transpose(0, 1)
        k_new = _gather_heads_first(k_cache, seq.page_table, seq.prefix_len, seq.seq_len)  # [1, kvh, q_len|w, hd]
        v_new = _gather_heads_first(v_cache, seq.page_table, seq.prefix_len, seq.seq_len)
        if seq.prefix_len == 0 and seq.tree is None:
            # 4-D inputs and no mask: the fused kernel (flash on CPU); 3-D inputs fall to the math path.
            o = F.scaled_dot_product_attention(q_seq, k_new, v_new, is_causal=True, scale=scale, enable_gqa=True)
            return o[0].transpose(0, 1)
        if seq.tree is None:
            o, lse = _flash_cpu(q_seq, k_new, v_new, scale, is_causal=True)
        else:
            o, lse = _flash_cpu(q_seq, k_new, v_new, scale, is_causal=False,
                                attn_mask=_additive(seq.tree, q.dtype)[None, None])
        out = o.float()  # [1, H, q_len, hd]; merged in fp32 so bf16 parts round once, at the end
        for start in range(0, seq.prefix_len, self.prefix_chunk_tokens):
            end = min(start + self.prefix_chunk_tokens, seq.prefix_len)
            k_part = _gather_heads_first(k_cache, seq.page_table, start, end)  # [1, kvh, end - start, hd]
            v_part = _gather_heads_first(v_cache, seq.page_table, start, end)
            part, part_lse = _flash_cpu(q_seq, k_part, v_part, scale, is_causal=False)
            _merge_into(out, lse, part, part_lse)
        return out[0].transpose(0, 1).to(q.dtype)

    @staticmethod
    def _extend_sdpa(q, k_cache, v_cache, seq: _ExtendSeq, scale: float) -> torch.Tensor:
        """Off CPU: one SDPA call, causal for a fresh prompt, else with the shifted causal mask (4-D,
        so CUDA may take a fused kernel; K/V repeated per query head, since not every CUDA kernel
        reads GQA in place). Returns ``[q_len, H, hd]``."""
        q_seq = q[seq.row_start : seq.row_end].transpose(0, 1)  # [H, q_len, hd]
        k = _gather_pages(k_cache, seq.page_table)[: seq.seq_len].transpose(0, 1)  # [kvh, seq_len, hd]
        v = _gather_pages(v_cache, seq.page_table)[: seq.seq_len].transpose(0, 1)  # [kvh, seq_len, hd]
        group = q_seq.shape[0] // k.shape[0]
        if group > 1:
            k = k.repeat_interleave(group, dim=0)  # [H, seq_len, hd]
            v = v.repeat_interleave(group, dim=0)
        o = F.scaled_dot_product_attention(
            q_seq[None], k[None], v[None], attn_mask=seq.mask, is_causal=seq.mask is None, scale=scale
        )  # [1, H, q_len, hd]
        return o[0].transpose(0, 1)  # [q_len, H, hd]
