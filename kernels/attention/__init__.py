"""Attention backends behind one interface; ``get_backend(name)`` picks one by name."""

from __future__ import annotations

from kernels.attention.base import AttentionBackend
from kernels.attention.metadata import AttnMetadata, build_attn_metadata

__all__ = ["AttentionBackend", "AttnMetadata", "build_attn_metadata", "get_backend", "BACKEND_NAMES"]

BACKEND_NAMES: tuple[str, ...] = ("torch", "triton")


def get_backend(name: str) -> AttentionBackend:
    """A new backend instance for ``name`` (backends import lazily: triton only when asked for)."""
    if name == "torch":
        from kernels.attention.torch_backend import TorchAttentionBackend

        return TorchAttentionBackend()
    if name == "triton":
        from kernels.attention.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend()
    raise ValueError(f"unknown attention backend {name!r}; available: {', '.join(BACKEND_NAMES)}")
