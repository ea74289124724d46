"""A tiny random Llama built in-process, ours and transformers' with identical weights, for tests."""

from __future__ import annotations

from typing import Any

import torch

from kernels.model.arch import LlamaArch
from kernels.model.llama import LlamaForCausalLM

TINY_DEFAULTS: dict[str, Any] = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=1024,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)


def tiny_llama_config(seed: int = 0, **overrides: Any):
    """A ``transformers.LlamaConfig`` small enough for CPU unit tests; ``overrides`` win.

    ``seed`` is accepted for symmetry with ``make_tiny_llama`` and does not change the config.
    """
    from transformers import LlamaConfig

    del seed
    kwargs = {**TINY_DEFAULTS, **overrides}
    config = LlamaConfig(**kwargs)
    config._attn_implementation = "sdpa"
    return config


def make_tiny_llama(
    seed: int = 0, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32, **overrides: Any
) -> tuple[LlamaForCausalLM, Any]:
    """(ours, reference ``transformers.LlamaForCausalLM``), same random weights, both in eval mode.

    Weights come from ``torch.manual_seed(seed)`` plus HF's init; the global RNG is advanced.
    """
    from transformers import LlamaForCausalLM as HFLlamaForCausalLM

    config = tiny_llama_config(seed, **overrides)
    torch.manual_seed(seed)
    # transformers decorates `to` with @wraps(nn.Module.to), which its types read as the unbound method
    reference = HFLlamaForCausalLM(config).to(device=device, dtype=dtype).eval()  # type: ignore[call-arg]
    ours = LlamaForCausalLM(LlamaArch.from_hf_config(config)).to(device=device, dtype=dtype).eval()
    ours.load_hf_state_dict(reference.state_dict())
    return ours, reference
