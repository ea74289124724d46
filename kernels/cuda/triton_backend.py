"""The Triton attention backend: launches the kernels of ``triton_kernels`` for one layer.

A step whose sequences all have query_len == 1 runs the split-K decode kernels; any other step
(prefill, extend over a cached prefix, mixed) runs the extend kernel for every sequence. A sliding
window and a soft cap are compile-time variants of the same kernels (`_ScoreRule`). Launch
grids and tile sizes come from ``meta.*_cpu`` and tensor shapes only: nothing here reads a device
value back to the host.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

import kernels.cuda.triton_kernels as tk
from kernels.attention.base import AttentionBackend, check_new_kv
from kernels.attention.metadata import AttnMetadata

WRITE_KV_TILE_ELEMS = 4096  # elements of one write_kv tile: tokens x (kv heads x head_dim, padded)
MAX_KV_SPLITS = 16  # decode splits per sequence; the combine kernel's BLOCK_S
TARGET_DECODE_PROGRAMS = 256  # ~2 waves of an H100's 132 SMs


@dataclass(frozen=True)
class TileSizes:
    """Tile sizes (tokens) of the kernels; every field a power of two >= 16 (tl.dot's minimum)."""

    decode_block_n: int  # KV positions per decode iteration
    extend_block_m: int  # query rows per extend program
    extend_block_n: int  # KV positions per extend iteration
    num_warps: int = 4
    tree_block_m: int = 16
    """Query rows per program of a tree-masked extend (verify rows, a few per sequence): the mask's
    loads on top of a 32- or 64-row tile spill up to ~1.2 KB a thread on sm_80/sm_90, 16 rows none
    (`kernels/cuda/triton_aot.py` builds both targets on the CPU)."""

    def __post_init__(self) -> None:
        for name in ("decode_block_n", "extend_block_m", "extend_block_n", "tree_block_m"):
            value = getattr(self, name)
            assert value >= 16 and value & (value - 1) == 0, f"{name}={value} must be a power of two >= 16"


def default_tiles(head_dim: int, dtype: torch.dtype, interpreted: bool | None = None) -> TileSizes:
    """Tiles per head_dim and dtype, picked so the sm_90 build spills (next to) nothing; fp32 tiles
    are smaller because ieee fp32 matmuls run on FMA units out of registers. Under the interpreter
    (``None``: as the kernels were built) small tiles, so short test sequences still cross tile and
    split boundaries."""
    if tk.INTERPRETED if interpreted is None else interpreted:
        return TileSizes(decode_block_n=16, extend_block_m=16, extend_block_n=16)
    assert head_dim <= 256, f"head_dim {head_dim} > 256 has no tuned tiles"
    warps = 4 if head_dim <= 64 else 8
    if dtype == torch.float32:
        block = 32 if head_dim <= 128 else 16
        return TileSizes(decode_block_n=64 if head_dim <= 64 else block, extend_block_m=block,
                         extend_block_n=block, num_warps=warps)
    block = 64 if head_dim <= 128 else 32
    return TileSizes(decode_block_n=block, extend_block_m=block, extend_block_n=block, num_warps=warps)


@dataclass(frozen=True)
class _ScoreRule:
    """How one layer turns q.k into log2-domain scores and which positions it sees, as the kernels'
    ``qk_scale, softcap_log2, window`` arguments and ``HAS_WINDOW`` / ``HAS_SOFTCAP`` flags
    (`triton_kernels` module docstring). An argument whose flag is off is passed as 0 and never read."""

    scale: float
    window: int | None  # None: every earlier position is visible
    softcap: float | None  # None: scores are not capped

    def __post_init__(self) -> None:
        assert self.window is None or self.window >= 1, f"window={self.window} must be >= 1 (None: no window)"
        assert self.softcap is None or self.softcap > 0, f"softcap={self.softcap} must be > 0 (None: no soft cap)"

    @property
    def args(self) -> tuple[float, float, int]:
        if self.softcap is None:
            return self.scale * tk.LOG2E, 0.0, self.window or 0
        return 2 * tk.LOG2E * self.scale / self.softcap, self.softcap * tk.LOG2E, self.window or 0

    @property
    def flags(self) -> dict[str, bool]:
        return {"HAS_WINDOW": self.window is not None, "HAS_SOFTCAP": self.softcap is not None}


def num_kv_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int, block_n: int) -> int:
    """Splits per sequence so a small batch still fills the GPU; any value is correct (the
    kernel reads seq_len on the device), this one only sets the parallelism."""
    blocks = triton.cdiv(max_seq_len, block_n)
    wanted = triton.cdiv(TARGET_DECODE_PROGRAMS, max(1, num_seqs * num_kv_heads))
    return max(1, min(blocks, wanted, MAX_KV_SPLITS))


def _block_d(head_dim: int) -> int:
    """head_dim padded to a power of two, and to 16 for tl.dot."""
    return max(16, triton.next_power_of_2(head_dim))


def _check_caches(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    assert k_cache.shape == v_cache.shape and k_cache.stride() == v_cache.stride(), (
        f"K cache {tuple(k_cache.shape)}/{k_cache.stride()} and V cache {tuple(v_cache.shape)}/{v_cache.stride()} "
        "differ: caches of two different layers passed?"
    )
    assert k_cache.stride(-1) == 1, f"cache head_dim stride {k_cache.stride(-1)} != 1: a transposed cache view?"


class TritonAttentionBackend(AttentionBackend):
    """Paged attention in Triton kernels; compiled on CUDA, or interpreted where ``TRITON_INTERPRET=1``."""

    name = "triton"
    supports_window = True
    supports_softcap = True

    def __init__(self, tiles: TileSizes | None = None) -> None:
        self._tiles = tiles  # None: default_tiles(head_dim, dtype) per call

    def write_kv(
        self,
        k_cache: torch.Tensor,  # [num_pages, page_size, kvh, hd]
        v_cache: torch.Tensor,
        k: torch.Tensor,  # [T, kvh, hd]
        v: torch.Tensor,
        slot_mapping: torch.Tensor,  # [T] int64
    ) -> None:
        check_new_kv(k_cache, k, v)
        _check_caches(k_cache, v_cache)
        num_tokens, num_kv_heads, head_dim = k.shape
        if num_tokens == 0:
            return
        k, v = _last_dim_contiguous(k), _last_dim_contiguous(v)
        block_kvh, block_d = triton.next_power_of_2(num_kv_heads), triton.next_power_of_2(head_dim)
        block_t = max(1, WRITE_KV_TILE_ELEMS // (block_kvh * block_d))
        tk.write_kv_kernel[(triton.cdiv(num_tokens, block_t),)](
            k, v, k_cache, v_cache, slot_mapping, num_tokens,
            k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, BLOCK_KVH=block_kvh, BLOCK_D=block_d,
            PAGE_SIZE=k_cache.shape[1], BLOCK_T=block_t,
        )

    def attention(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttnMetadata, scale: float,
        window: int | None = None, softcap: float | None = None,
    ) -> torch.Tensor:
        num_heads, num_kv_heads = q.shape[1], k_cache.shape[2]
        assert num_heads % num_kv_heads == 0, f"{num_heads} query heads not a multiple of {num_kv_heads} kv heads"
        assert k_cache.shape[1] == meta.page_size, f"cache page_size {k_cache.shape[1]} != metadata's {meta.page_size}"
        assert q.shape[2] == k_cache.shape[3], f"q head_dim {q.shape[2]} != cache head_dim {k_cache.shape[3]}"
        assert q.dtype == k_cache.dtype, f"q is {q.dtype} but the cache is {k_cache.dtype}: model and KV dtypes differ?"
        assert meta.page_table.stride(-1) == 1, "page_table rows must be contiguous (a transposed view?)"
        _check_caches(k_cache, v_cache)
        if window is not None and meta.tree_mask is not None:
            raise NotImplementedError(
                "triton attention with a sliding window and a tree mask: a tree node's window over slots is "
                "undefined; speculative tree drafting is refused for sliding-window models")
        rule = _ScoreRule(scale, window, softcap)
        q = _last_dim_contiguous(q)
        out = torch.empty_like(q)  # [T, H, hd]
        if meta.num_tokens == 0 or meta.num_seqs == 0:
            return out
        tiles = self._tiles or default_tiles(q.shape[2], q.dtype)
        if meta.decode_only:
            self._decode(q, k_cache, v_cache, meta, rule, out, tiles)
        else:
            self._extend(q, k_cache, v_cache, meta, rule, out, tiles)
        return out

    @staticmethod
    def _decode(q, k_cache, v_cache, meta: AttnMetadata, rule: _ScoreRule, out: torch.Tensor,
                tiles: TileSizes) -> None:
        """Row b of q is sequence b (one token each); a windowed one reads at most `window` positions."""
        num_seqs, (num_heads, head_dim), num_kv_heads = meta.num_seqs, q.shape[1:], k_cache.shape[2]
        group = num_heads // num_kv_heads
        kv_len = meta.max_seq_len if rule.window is None else min(meta.max_seq_len, rule.window)
        splits = num_kv_splits(num_seqs, num_kv_heads, kv_len, tiles.decode_block_n)
        mid_o = torch.empty(num_seqs, num_heads, splits, head_dim, dtype=torch.float32, device=q.device)
        mid_lse = torch.empty(num_seqs, num_heads, splits, dtype=torch.float32, device=q.device)
        block_d = _block_d(head_dim)
        tk.decode_split_kernel[(num_seqs, num_kv_heads, splits)](
            q, k_cache, v_cache, meta.page_table, meta.seq_lens, mid_o, mid_lse,
            *rule.args, splits,
            q.stride(0), q.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            meta.page_table.stride(0),
            mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0), mid_lse.stride(1),
            HEAD_DIM=head_dim, BLOCK_D=block_d, GROUP=group, BLOCK_H=max(16, triton.next_power_of_2(group)),
            PAGE_SIZE=meta.page_size, BLOCK_N=tiles.decode_block_n, DOT_DTYPE=_dot_dtype(k_cache.dtype),
            **rule.flags, num_warps=tiles.num_warps,
        )
        tk.decode_combine_kernel[(num_seqs, num_heads)](
            mid_o, mid_lse, out, splits,
            mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0), mid_lse.stride(1),
            out.stride(0), out.stride(1),
            HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_S=MAX_KV_SPLITS,
        )

    @staticmethod
    def _extend(q, k_cache, v_cache, meta: AttnMetadata, rule: _ScoreRule, out: torch.Tensor,
                tiles: TileSizes) -> None:
        num_heads, head_dim = q.shape[1:]
        has_tree = meta.tree_mask is not None
        block_m = tiles.tree_block_m if has_tree else tiles.extend_block_m
        m_blocks = triton.cdiv(max(meta.query_lens_cpu), block_m)
        tree = (meta.tree_mask, meta.tree_mask_start, meta.tree_widths) if has_tree else (meta.seq_lens,) * 3
        tk.extend_kernel[(m_blocks, meta.num_seqs, num_heads)](
            q, k_cache, v_cache, out, meta.page_table, meta.query_start_loc, meta.seq_lens, *tree,
            *rule.args,
            q.stride(0), q.stride(1), out.stride(0), out.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            meta.page_table.stride(0),
            HEAD_DIM=head_dim, BLOCK_D=_block_d(head_dim), GROUP=num_heads // k_cache.shape[2],
            PAGE_SIZE=meta.page_size, BLOCK_M=block_m, BLOCK_N=tiles.extend_block_n,
            DOT_DTYPE=_dot_dtype(k_cache.dtype), HAS_TREE=has_tree, **rule.flags, num_warps=tiles.num_warps,
        )


_TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


def _dot_dtype(cache_dtype: torch.dtype) -> tl.dtype:
    """Matmul operand dtype: the cache's, except under the interpreter (no bf16 matmul there)."""
    assert cache_dtype in _TL_DTYPES, f"KV cache dtype {cache_dtype} unsupported: fp32, bf16 or fp16"
    return tl.float32 if tk.INTERPRETED else _TL_DTYPES[cache_dtype]


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()
