"""Attention backends behind one interface; ``get_backend(name)`` builds one by name and
``resolve_backend(name, device, dtype)`` turns a configured name (``auto`` included) into the one to build."""

from __future__ import annotations

import functools
import importlib
import logging

import torch

from kernels.attention.base import AttentionBackend
from kernels.attention.metadata import AttnMetadata, build_attn_metadata

__all__ = [
    "AttentionBackend", "AttnMetadata", "build_attn_metadata", "get_backend", "resolve_backend",
    "unavailable_reason", "BACKEND_NAMES", "AUTO",
]

log = logging.getLogger("tandem.kernels")

BACKEND_NAMES: tuple[str, ...] = ("torch", "cpu", "triton", "flashinfer")
"""torch: the reference, any device. cpu: torch's with decode rows in C (`kernels/cpu/`). triton and
flashinfer: CUDA kernels (`kernels/cuda/`; triton also runs under the interpreter on a CPU)."""
AUTO = "auto"
"""Not a backend: the configured name `resolve_backend` replaces by the best one the device can run."""
AUTO_CUDA_ORDER: tuple[str, ...] = ("flashinfer", "triton")
"""What `auto` tries on a CUDA device, in order, before falling back to torch."""
AUTO_CPU_ORDER: tuple[str, ...] = ("cpu",)
"""What `auto` tries on a CPU, before falling back to torch."""
FLASHINFER_DTYPES = (torch.float16, torch.bfloat16)
FLASHINFER_PREBUILT = "flashinfer_jit_cache"
"""The module of FlashInfer's prebuilt kernels (the `flashinfer-jit-cache` distribution, built for one
CUDA version). Without it FlashInfer JIT-compiles each kernel with nvcc on first use (minutes, inside
start-up's graph capture; impossible without nvcc), so `auto` takes it only where it is installed."""


def get_backend(name: str) -> AttentionBackend:
    """A new backend instance for ``name`` (backends import lazily: triton or flashinfer only when
    asked for, so ImportError where that library is missing)."""
    if name == "torch":
        from kernels.attention.torch_backend import TorchAttentionBackend

        return TorchAttentionBackend()
    if name == "cpu":
        from kernels.cpu.attention_backend import CpuAttentionBackend

        return CpuAttentionBackend()
    if name == "triton":
        from kernels.cuda.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend()
    if name == "flashinfer":
        from kernels.cuda.flashinfer_backend import FlashInferAttentionBackend

        return FlashInferAttentionBackend()
    raise ValueError(f"unknown attention backend {name!r}; available: {', '.join(BACKEND_NAMES)}")


@functools.cache
def import_error(module: str) -> str | None:
    """Why ``module`` cannot be imported here (None: it can). Probed once per process."""
    try:
        importlib.import_module(module)
    except Exception as exc:  # noqa: BLE001 - a broken GPU install raises more than ImportError (CUDA libs, versions)
        return f"{type(exc).__name__}: {exc}"
    return None


def unavailable_reason(name: str, device: torch.device | str, dtype: torch.dtype | None = None) -> str | None:
    """Why backend ``name`` cannot serve a model in ``dtype`` on ``device`` (None: it can). ``dtype``
    None is not checked. Triton on a CPU is allowed: it runs there under ``TRITON_INTERPRET=1``."""
    device = torch.device(device)
    if name not in BACKEND_NAMES:
        return f"unknown attention backend {name!r}; available: {AUTO}, {', '.join(BACKEND_NAMES)}"
    if name == "flashinfer":
        if device.type != "cuda":
            return f"flashinfer runs on CUDA devices only, not {device}"
        if dtype is not None and dtype not in FLASHINFER_DTYPES:
            return f"flashinfer kernels take fp16/bf16, not {dtype}"
    if name == "cpu":
        if device.type != "cpu":
            return f"cpu runs on the CPU only, not {device}"
        from kernels.cpu import native

        return None if native.kernel() is not None else "its C kernels could not be built here (see the warning)"
    if name != "torch":
        why = import_error(name)
        if why is not None:
            return f"{name} cannot be imported: {why}"
    return None


def _jit_only(name: str) -> str | None:
    """Why `auto` passes over ``name`` although it could run: FlashInfer without prebuilt kernels."""
    if name == "flashinfer" and import_error(FLASHINFER_PREBUILT) is not None:
        return (f"no prebuilt kernels ({FLASHINFER_PREBUILT} not importable: install flashinfer-jit-cache), so "
                "its first use would JIT-compile for minutes (name it to use it anyway)")
    return None


def resolve_backend(name: str, device: torch.device | str, dtype: torch.dtype | None = None) -> str:
    """The backend to build for the configured ``name`` on ``device`` for a model in ``dtype``.

    ``auto``: on CUDA flashinfer where it is importable with its prebuilt kernels (`FLASHINFER_PREBUILT`)
    and ``dtype`` is fp16/bf16, else triton where it is importable; on a CPU cpu where its C kernels
    build; else torch. Any other name is returned as it is if it can serve the model, else
    ValueError saying why.
    """
    if name != AUTO:
        if name not in BACKEND_NAMES:
            raise ValueError(f"unknown attention backend {name!r}; available: {AUTO}, {', '.join(BACKEND_NAMES)}")
        why = unavailable_reason(name, device, dtype)
        if why is not None:
            raise ValueError(f"attention backend {name!r} cannot be used: {why}")
        return name
    skipped = []
    for candidate in {"cuda": AUTO_CUDA_ORDER, "cpu": AUTO_CPU_ORDER}.get(torch.device(device).type, ()):
        why = unavailable_reason(candidate, device, dtype) or _jit_only(candidate)
        if why is None:
            log.info("attention backend auto -> %s on %s", candidate, device)
            return candidate
        skipped.append(f"{candidate}: {why}")
    if skipped:
        log.info("attention backend auto -> torch on %s (%s)", device, "; ".join(skipped))
    return "torch"
