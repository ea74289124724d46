"""`LlamaArch.from_hf_config` on config.json as checkpoints on the Hub state it (read as plain JSON, as
a worker reads it) equals what it makes of transformers' parsed config of the same file; and what
it refuses, it refuses by name."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from kernels.model.arch import LlamaArch

BASE = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=7, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=4096, rms_norm_eps=1e-6)
HUB_STYLE = {
    "gemma2": dict(model_type="gemma2", head_dim=16, hidden_act="gelu_pytorch_tanh",
                   hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=16, sliding_window=64,
                   attn_logit_softcapping=50.0, final_logit_softcapping=30.0, rope_theta=10000.0),
    "gemma3_text": dict(model_type="gemma3_text", head_dim=16, hidden_activation="gelu_pytorch_tanh",
                        query_pre_attn_scalar=16, sliding_window=64, sliding_window_pattern=3, rope_theta=1e6,
                        rope_local_base_freq=10000.0, rope_scaling={"factor": 8.0, "rope_type": "linear"}),
    "qwen3": dict(model_type="qwen3", head_dim=16, rope_theta=1e6, sliding_window=None, use_sliding_window=False,
                  rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024}),
    "qwen2": dict(model_type="qwen2", rope_theta=1e6, sliding_window=32, use_sliding_window=True,
                  max_window_layers=4),
    "mistral": dict(model_type="mistral", rope_theta=1e6, sliding_window=128),
    "phi3": dict(model_type="phi3", rope_theta=10000.0, sliding_window=2047, original_max_position_embeddings=4096),
    "mixtral": dict(model_type="mixtral", num_local_experts=8, num_experts_per_tok=2, rope_theta=1e6,
                    sliding_window=None),
    "qwen2_moe": dict(model_type="qwen2_moe", num_experts=6, num_experts_per_tok=2, moe_intermediate_size=32,
                      shared_expert_intermediate_size=64, decoder_sparse_step=2, mlp_only_layers=[5],
                      norm_topk_prob=False, rope_theta=1e6),
    "qwen3_moe": dict(model_type="qwen3_moe", num_experts=6, num_experts_per_tok=2, moe_intermediate_size=32,
                      norm_topk_prob=True, head_dim=16, rope_theta=1e6),
}


@pytest.mark.parametrize("family", list(HUB_STYLE))
def test_plain_json_resolves_as_transformers_parses_it(family, tmp_path):
    from transformers import AutoConfig

    raw = {**BASE, **HUB_STYLE[family]}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    from_json = LlamaArch.from_hf_config(SimpleNamespace(**raw))
    assert from_json == LlamaArch.from_hf_config(AutoConfig.from_pretrained(tmp_path))


def test_what_each_family_turns_on():
    arch = lambda family: LlamaArch.from_hf_config(SimpleNamespace(**BASE, **HUB_STYLE[family]))  # noqa: E731
    gemma3 = arch("gemma3_text")
    assert gemma3.layer_windows == (64, 64, None, 64, 64, None, 64) and gemma3.local_rope_theta == 10000.0
    assert gemma3.qk_norm and gemma3.sandwich_norms and gemma3.attn_softcap is None and gemma3.scale == 16**-0.5
    gemma2 = arch("gemma2")
    assert gemma2.layer_windows == (64, None, 64, None, 64, None, 64) and gemma2.final_softcap == 30.0
    assert arch("qwen2").layer_windows == (None,) * 4 + (32,) * 3
    assert arch("mistral").layer_windows == (128,) * 7 and arch("phi3").windowed
    assert arch("qwen3").rope_scaling.rope_type == "yarn" and not arch("qwen3").windowed
    assert arch("qwen2_moe").moe_layers == (False, True, False, True, False, False, False)
    assert arch("mixtral").moe_layers == (True,) * 7 and arch("mixtral").router_weights_float


@pytest.mark.parametrize("change, message", [
    (dict(model_type="falcon"), "model_type 'falcon' is not supported \\(supported: llama, mistral"),
    (dict(model_type="gemma3"), "multimodal checkpoint"),
    (dict(rope_scaling={"rope_type": "longrope", "factor": 4.0}), "rope type 'longrope' is not supported"),
    (dict(quantization_config={"quant_method": "awq", "bits": 4}), "the checkpoint is quantized \\(awq\\)"),
    (dict(hidden_act="relu"), "hidden_act 'relu' is not supported"),
    (dict(partial_rotary_factor=0.5), "partial_rotary_factor 0.5 is not supported"),
])
def test_refusals_name_what_was_found_and_what_is_supported(change, message):
    with pytest.raises(ValueError, match=message):
        LlamaArch.from_hf_config(SimpleNamespace(**{**BASE, "model_type": "llama", **change}))
