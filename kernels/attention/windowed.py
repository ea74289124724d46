"""The torch backend's attention for sliding-window and soft-capped layers (any device).

A windowed layer's token at position ``pos`` sees positions ``(pos - window, pos]``; a soft-capped
layer's score ``s`` becomes ``cap * tanh(s / cap)`` before the softmax. Neither fits the fused SDPA
paths of `torch_backend` (the CPU flash kernel takes no window offset and no cap), so these layers
take their own, simpler path:

- a decode-only step: every row's pages gathered padded, as the torch backend's decode does, with
  the window's lower bound in the mask (no host value read: CUDA graphs and compiled steps take it);
- any other step: one sequence at a time, its queries in blocks of `QUERY_BLOCK` rows, each block
  over only the key positions some row of it can see (for a windowed layer at most
  ``window + QUERY_BLOCK`` positions, whatever the sequence's length), so the score tensor stays
  ``O(QUERY_BLOCK * (window + QUERY_BLOCK))``.

Without a cap the softmax is SDPA's with a bool mask; with one it is computed here in float32.
Tree masks are not taken with either (speculative tree drafting is refused for such models).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.attention.metadata import AttnMetadata

QUERY_BLOCK = 256
"""Query rows of one sequence attended together on the general path (module docstring)."""


def attend_windowed(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttnMetadata, scale: float,
                    window: int | None, softcap: float | None) -> torch.Tensor:
    """`AttentionBackend.attention` with `window` and/or `softcap` set: ``[T, H, hd]`` in q's dtype."""
    assert window is None or window >= 1, f"sliding window {window} must be >= 1"
    assert softcap is None or softcap > 0, f"softcap {softcap} must be positive"
    if meta.tree_widths_cpu and any(meta.tree_widths_cpu):
        raise NotImplementedError("tree masks are not taken by sliding-window or soft-capped attention "
                                  "(speculative tree drafting is refused for such models)")
    if meta.decode_only:
        return _decode_padded(q, k_cache, v_cache, meta, scale, window, softcap)
    out = torch.empty_like(q)
    qsl = meta.query_start_loc_cpu
    for b, (q_len, seq_len) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu)):
        for start in range(0, q_len, QUERY_BLOCK):
            end = min(start + QUERY_BLOCK, q_len)
            rows = slice(qsl[b] + start, qsl[b] + end)
            first_pos, last_pos = seq_len - q_len + start, seq_len - q_len + end - 1
            lo = 0 if window is None else max(0, first_pos - window + 1)
            out[rows] = _block(q[rows], k_cache, v_cache, meta.page_table[b], lo, first_pos, last_pos,
                               scale, window, softcap)
    return out


def _decode_padded(q, k_cache, v_cache, meta: AttnMetadata, scale: float, window: int | None,
                   softcap: float | None) -> torch.Tensor:
    """One query a sequence, every sequence's pages gathered to the longest one's, masked."""
    page_size, num_kv_heads, head_dim = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
    num_pages = -(-meta.max_seq_len // page_size)
    table = meta.page_table[:, :num_pages]
    batch = q.shape[0]
    k = _pages(k_cache, table).transpose(1, 2)  # [B, kvh, L, hd]
    v = _pages(v_cache, table).transpose(1, 2)
    kv_pos = torch.arange(num_pages * page_size, device=q.device)  # [L]
    seq_lens = meta.seq_lens[:, None]
    visible = kv_pos[None, :] < seq_lens  # [B, L]
    if window is not None:
        visible = visible & (kv_pos[None, :] >= seq_lens - window)
    q_grp = q.reshape(batch, num_kv_heads, -1, head_dim)  # [B, kvh, group, hd]
    o = _softmax_attend(q_grp, k, v, visible[:, None, None, :], scale, softcap)  # [B, kvh, group, hd]
    return o.reshape(batch, -1, head_dim)


def _block(q_rows, k_cache, v_cache, page_table, lo: int, first_pos: int, last_pos: int, scale: float,
           window: int | None, softcap: float | None) -> torch.Tensor:
    """Rows at positions ``[first_pos, last_pos]`` of one sequence over its keys ``[lo, last_pos]``."""
    page_size, num_kv_heads, head_dim = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
    first_page, end_page = lo // page_size, last_pos // page_size + 1
    pages = page_table[first_page:end_page]
    offset = lo - first_page * page_size
    n = last_pos + 1 - lo
    k = _pages(k_cache, pages)[offset:offset + n].transpose(0, 1)  # [kvh, n, hd]
    v = _pages(v_cache, pages)[offset:offset + n].transpose(0, 1)
    device = q_rows.device
    q_pos = torch.arange(first_pos, last_pos + 1, device=device)[:, None]  # [q, 1]
    kv_pos = torch.arange(lo, last_pos + 1, device=device)[None, :]  # [1, n]
    visible = kv_pos <= q_pos
    if window is not None:
        visible = visible & (kv_pos > q_pos - window)  # [q, n]
    q_grp = q_rows.reshape(-1, num_kv_heads, q_rows.shape[1] // num_kv_heads, head_dim).permute(1, 2, 0, 3)
    o = _softmax_attend(q_grp, k[:, None], v[:, None], visible, scale, softcap)  # [kvh, group, q, hd]
    return o.permute(2, 0, 1, 3).reshape(q_rows.shape)


def _pages(cache: torch.Tensor, page_table: torch.Tensor) -> torch.Tensor:
    """``[..., P]`` page ids -> ``[..., P * page_size, kvh, hd]`` (a copy)."""
    pages = cache.index_select(0, page_table.reshape(-1))
    return pages.view(*page_table.shape[:-1], page_table.shape[-1] * cache.shape[1], *cache.shape[2:])


def _softmax_attend(q, k, v, visible, scale: float, softcap: float | None) -> torch.Tensor:
    """``q [..., m, hd]`` over ``k, v [..., n, hd]`` (broadcast over the leading axes), ``visible``
    bool broadcast to ``[..., m, n]``; in q's dtype. Every row sees at least itself."""
    if softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=visible, scale=scale)
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~visible, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1), v.float()).to(q.dtype)
