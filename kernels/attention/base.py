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
    supports_tree_mask: bool = True
    """Whether `attention` honours `AttnMetadata`'s tree masks (speculative tree drafting)."""
    supports_window: bool = False
    """Whether `attention` takes a `window` (sliding-window layers)."""
    supports_softcap: bool = False
    """Whether `attention` takes a `softcap` (soft-capped scores)."""

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
        window: int | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor:
        """Causal attention of each new token over its own sequence's positions ``[0, pos]``, or
        with a tree mask (``meta.tree_mask``) over what its mask row names in the tree window.

        ``H`` must be a multiple of ``kvh`` (GQA: query head h reads KV head ``h // (H // kvh)``).
        ``window`` (a sliding-window layer: Mistral, Gemma's local layers): the token at position
        ``pos`` sees only positions ``(pos - window, pos]``, its last ``window`` (itself included),
        as transformers masks them. ``softcap`` (Gemma 2): each score ``s`` (after ``scale``)
        becomes ``softcap * tanh(s / softcap)`` before the softmax. A backend that cannot honour
        either says so (`supports_window`, `supports_softcap` False): the engine then chooses another.
        Returns ``[T, H, hd]`` in q's dtype.
        """

    def prepare_graph_decode(self, meta: AttnMetadata) -> None:  # noqa: B027 - a no-op unless overridden
        """Called outside any CUDA-graph capture, before a decode bucket is captured (``meta`` with the
        capacity lengths) and before each replay (``meta`` over the same static buffers, real lengths).
        Backends that plan on the host (flashinfer) plan here; the others read everything from the
        device tensors inside the graph and need nothing."""


def check_new_kv(k_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """New K/V ``[T, kvh, hd]`` fit a cache ``[num_pages, page_size, kvh, hd]``."""
    assert k.shape[1:] == k_cache.shape[2:] and v.shape == k.shape, (
        f"new K {tuple(k.shape)} / V {tuple(v.shape)} do not fit cache {tuple(k_cache.shape)}: "
        "kv heads / head_dim mismatch?"
    )


def index_write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   slot_mapping: torch.Tensor) -> None:
    """``write_kv`` as two ``index_copy_`` over the flattened slots (any device, no kernel of its own)."""
    check_new_kv(k_cache, k, v)
    num_slots = k_cache.shape[0] * k_cache.shape[1]
    k_cache.view(num_slots, *k_cache.shape[2:]).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(num_slots, *v_cache.shape[2:]).index_copy_(0, slot_mapping, v.to(v_cache.dtype))
