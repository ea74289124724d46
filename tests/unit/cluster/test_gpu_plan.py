"""CUDA workers' memory without a GPU (`cluster/serve/gpu_plan.py`, `tandem serve --plan-only`): real
model shapes (Llama-3-8B and -70B, Qwen2.5-7B, Llama-3.2-1B, Qwen3-30B-A3B, Gemma-3-27B) as header-only safetensors
written from HF's own model on the meta device, which ours loads strictly on meta too; a mocked 141 GiB or 80 GiB
GPU."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch

from cluster.cli.main import main
from cluster.serve.config_load import load_serve_config
from cluster.serve.gpu_plan import GPU_RESERVE_BYTES
from cluster.serve.launch import fit_gpus
from cluster.serve.memory import GIB, ModelShape, plan_memory
from common.config import STAGING_CHUNKS, ConfigError

SHAPES = {
    "llama-3-8b": dict(model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=128256, hidden_size=4096,
                       intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                       max_position_embeddings=8192, rope_theta=500000.0, tie_word_embeddings=False),
    "qwen2.5-7b": dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"], vocab_size=152064, hidden_size=3584,
                       intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                       max_position_embeddings=32768, rope_theta=1000000.0, tie_word_embeddings=False),
    "llama-3.2-1b": dict(model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=128256, hidden_size=2048,
                         intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                         max_position_embeddings=131072, rope_theta=500000.0, tie_word_embeddings=True,
                         rope_scaling={"rope_type": "llama3", "factor": 32.0, "high_freq_factor": 4.0,
                                       "low_freq_factor": 1.0, "original_max_position_embeddings": 8192}),
    "llama-3-70b": dict(model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=128256, hidden_size=8192,
                        intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8,
                        max_position_embeddings=8192, rope_theta=500000.0, tie_word_embeddings=False),
    "qwen3-30b-a3b": dict(model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], vocab_size=151936,
                          hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=48,
                          num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
                          num_experts_per_tok=8, norm_topk_prob=True, max_position_embeddings=40960,
                          rope_theta=1000000.0, tie_word_embeddings=False),
    "gemma-3-27b": dict(model_type="gemma3_text", architectures=["Gemma3ForCausalLM"], vocab_size=262208,
                        hidden_size=5376, intermediate_size=21504, num_hidden_layers=62, num_attention_heads=32,
                        num_key_value_heads=16, head_dim=128, query_pre_attn_scalar=168, sliding_window=1024,
                        max_position_embeddings=131072, rope_theta=1000000.0, rope_local_base_freq=10000.0,
                        rope_scaling={"rope_type": "linear", "factor": 8.0}, tie_word_embeddings=True),
}


def header_only_model(tmp_path: Path, name: str) -> tuple[Path, dict[str, torch.Tensor]]:
    """A model dir whose safetensors file is only a header (the shapes of HF's model, built on meta)
    and HF's state dict on meta."""
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = SHAPES[name]
    config = AutoConfig.for_model(fields["model_type"], **{k: v for k, v in fields.items() if k != "model_type"})
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    state = hf.state_dict()
    header, offset = {}, 0
    for key, t in state.items():
        if key == "lm_head.weight" and fields["tie_word_embeddings"]:
            continue
        size = t.numel() * 2
        header[key] = {"dtype": "BF16", "shape": list(t.shape), "data_offsets": [offset, offset + size]}
        offset += size
    model_dir = tmp_path / name
    model_dir.mkdir()
    raw = json.dumps(header).encode()
    (model_dir / "model.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw)
    (model_dir / "config.json").write_text(json.dumps({**config.to_dict(), "torch_dtype": "bfloat16"}))
    return model_dir, state


@pytest.mark.parametrize("name", list(SHAPES))
def test_real_shapes_load_on_meta_and_the_plan_counts_their_weights(tmp_path, name):
    """Our model takes HF's state dict of the shape strictly (names, packing, tied heads) on meta, and
    the plan's parameter count is our model's: the weights it budgets are what a worker will hold."""
    from transformers import AutoConfig

    from kernels.model.arch import LlamaArch
    from kernels.model.llama import LlamaForCausalLM

    model_dir, state = header_only_model(tmp_path, name)
    arch = LlamaArch.from_hf_config(AutoConfig.from_pretrained(model_dir))
    with torch.device("meta"):
        ours = LlamaForCausalLM(arch).to(torch.bfloat16)
    ours.load_hf_state_dict(state)
    held = sum(p.numel() for p in ours.parameters())  # a tied head is the embedding: counted once
    shape = ModelShape.read(model_dir)
    assert shape.num_params == held and shape.max_context == SHAPES[name]["max_position_embeddings"]


def plan_for(model_dir: Path, node_gpus: int, gpu_gib: float, **overrides):
    config = load_serve_config(None, {"model": str(model_dir), "engine.device": "cuda", **overrides})
    config = fit_gpus(config, node_gpus)
    return plan_memory(config, ModelShape.read(model_dir), ram_bytes=256 * GIB, gpu_bytes=int(gpu_gib * GIB))


def test_an_8b_model_on_one_141_gib_gpu_shares_it_and_serves_its_whole_context(tmp_path):
    model_dir, _ = header_only_model(tmp_path, "llama-3-8b")
    config, plan = plan_for(model_dir, 1, 141)
    assert config.prefill.engine.dtype == config.decode.engine.dtype == "bfloat16"  # CUDA's default
    assert config.prefill.num_gpus == config.decode.num_gpus == 0.5
    weights = ModelShape.read(model_dir).num_params * 2
    for w in plan.gpu_workers:  # each half of the GPU at 0.9: weights + reserve + KV within it
        assert w.gpu_fraction == 0.5 and w.share_bytes == int(0.5 * 0.9 * 141 * GIB) and w.weight_bytes == weights
        assert w.weight_bytes + GPU_RESERVE_BYTES + w.kv_pages * w.page_bytes <= w.share_bytes
        assert w.share_bytes - (w.weight_bytes + GPU_RESERVE_BYTES + w.kv_pages * w.page_bytes) < 2 * w.page_bytes
    assert plan.max_model_len == 8192
    prefill, decode = plan.workers
    assert prefill.staging_pages == STAGING_CHUNKS * 512 // 16 and decode.landing_pages > 0
    assert plan.total_bytes <= plan.budget_bytes  # staging, landing and host tiers within the RAM budget
    assert 0 < decode.host_pages <= 2 * decode.kv_pages


def test_a_share_that_cannot_hold_the_weights_is_refused_and_a_long_context_is_capped_by_the_pool(tmp_path):
    model_dir, _ = header_only_model(tmp_path, "qwen2.5-7b")
    with pytest.raises(ConfigError, match=r"0\.5 of a 24 GiB GPU .* cannot hold the weights \(14\.2 GiB, bfloat16\)"):
        plan_for(model_dir, 1, 24)
    _, plan = plan_for(model_dir, 1, 80, **{"engine.max_model_len": 32768})
    smallest_pool = min((w.kv_pages - 1) * w.page_size for w in plan.gpu_workers)
    assert plan.max_model_len == min(32768, smallest_pool)


def test_plan_only_prints_the_placement_and_starts_nothing(tmp_path, capsys):
    model_dir, _ = header_only_model(tmp_path, "llama-3-8b")
    assert main(["serve", "--plan-only", "--model", str(model_dir), "--device", "cuda", "--plan-gpus", "1",
                 "--plan-gpu-memory-gib", "141"]) == 0
    out = capsys.readouterr().out
    assert "Ray: a local instance told of 1 GPU(s) of 141 GiB" in out
    assert "prefill x1: 1 CPU, 0.5 GPU each, on cuda in bfloat16" in out
    assert "decode x1: 1 CPU, 0.5 GPU each, on cuda in bfloat16" in out
    assert "max model length 8,192 tokens" in out and "staging" in out and "0.5 of a GPU" in out
    assert main(["serve", "--plan-gpus", "1"]) == 2  # only with --plan-only


@pytest.mark.parametrize("name, degrees", [("llama-3-70b", {24: 8, 48: 4, 80: 2, 141: 2}),
                                           ("qwen3-30b-a3b", {24: 4, 48: 2, 80: 1, 141: 1}),
                                           ("gemma-3-27b", {24: 4, 48: 2, 80: 1, 141: 1})])
def test_the_plan_says_how_many_ranks_a_large_model_needs_on_each_gpu_size(tmp_path, capsys, name, degrees):
    from cluster.serve.gpu_plan import tp_needed

    model_dir, _ = header_only_model(tmp_path, name)
    shape = ModelShape.read(model_dir)
    weights = shape.num_params * 2  # bfloat16
    assert {gib: tp_needed(shape, weights, gib * GIB, 0.9) for gib in degrees} == degrees
    if degrees[141] > 1:  # a whole H200 cannot hold it: refused, naming the degree that would
        with pytest.raises(ConfigError, match=rf"only split over {degrees[141]} ranks "
                                              rf"\(prefill.engine.tensor_parallel_size={degrees[141]} "):
            plan_for(model_dir, 2, 141, **{"prefill.num_gpus": 1, "decode.num_gpus": 1})
        return
    assert main(["serve", "--plan-only", "--model", str(model_dir), "--device", "cuda", "--plan-gpus", "2",
                 "--plan-gpu-memory-gib", "141"]) == 0
    advice = "needs at least: " + ", ".join(f"{gib} GiB: {n}" for gib, n in degrees.items())
    assert advice in capsys.readouterr().out


def test_a_colocated_worker_over_two_gpus_holds_half_the_weights_and_its_heads_pages_on_each(tmp_path):
    """Llama-3-70B does not fit one 141 GiB GPU; a colocated worker at tensor_parallel_size 2 with two GPUs
    does: each rank's share holds half the weights and pages of half the KV heads. One GPU a rank."""
    model_dir, _ = header_only_model(tmp_path, "llama-3-70b")
    colocated = {"prefill.count": 0, "decode.count": 0, "colocated.count": 1,
                 "colocated.engine.tensor_parallel_size": 2}
    with pytest.raises(ConfigError, match=r"num_gpus \(1\) must be at least engine.tensor_parallel_size \(2\)"):
        plan_for(model_dir, 2, 141, **colocated, **{"colocated.num_gpus": 1})
    config, plan = plan_for(model_dir, 2, 141, **colocated)  # by default a GPU a rank
    (worker,) = plan.gpu_workers
    shape = ModelShape.read(model_dir)
    assert worker.ranks == 2 and worker.weight_bytes == shape.num_params * 2 // 2
    assert worker.page_bytes * 2 == shape.page_bytes(config.colocated.engine)
    assert worker.weight_bytes + GPU_RESERVE_BYTES + worker.kv_pages * worker.page_bytes <= worker.share_bytes
    assert config.colocated.num_gpus == 2.0
    assert config.colocated.engine.host_cache_pages > 0  # from the RAM left; each rank holds its heads' share
