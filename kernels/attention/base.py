"""The attention backend interface every implementation (torch, triton, flashinfer) provides."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from kernels.attention.metadata import AttnMetadata


class AttentionBackend(ABC):
    """Writes new K/V into paged caches and attends over them for one layer at a time.

    Contract shared by all backends:
    - Caches are ``[num_pages, page_size, num_kv_heads, head_dim]``; page 0 is scratch.
    - ``write_kv`` runs before ``attention`` in every layer, so a new token sees itself.
    - Neither call synchronises the device with the host; lengths come from ``meta.*_cpu``.
    - Only the cache slots named by ``slot_mapping`` are mutated.
    """

    name: str

    @abstractmethod
    def write_kv(
        self,
        k_cache: torch.Tensor,  # [num_pages, page_size, kvh, hd]
        v_cache: torch.Tensor,  # [num_pages, page_size, kvh, hd]
        k: torch.Tensor,  # [T, kvh, hd]
        v: torch.Tensor,  # [T, kvh, hd]
        slot_mapping: torch.Tensor,  # [T] int64
    ) -> None:
        """Store token t's K/V at flat slot ``slot_mapping[t]`` of the caches (in place)."""

    @abstractmethod
    def attention(
        self,
        q: torch.Tensor,  # [T, H, hd]
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttnMetadata,
        scale: float,
    ) -> torch.Tensor:
        """Causal attention of each new token over its own sequence's positions ``[0, pos]``.

        ``H`` must be a multiple of ``kvh`` (GQA: query head h reads KV head ``h // (H // kvh)``).
        Returns ``[T, H, hd]`` in q's dtype.
        """

    def prepare_graph_decode(self, meta: AttnMetadata) -> None:
        """Called outside any CUDA-graph capture, before a decode bucket is captured (``meta`` with the
        capacity lengths) and before each replay (``meta`` over the same static buffers, real lengths).
        Backends that plan on the host (flashinfer) plan here; the others read everything from the
        device tensors inside the graph and need nothing."""
