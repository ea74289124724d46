"""Each architecture beyond Llama, as a tiny random model: our ragged paged forward against
transformers' full-sequence forward (chunked prefill, decode, two sequences in one batch, 4-token
pages), weights loaded through the real loader from a checkpoint transformers wrote,
and greedy tokens through an engine with its prefix cache against transformers' `generate`."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from common.config import EngineConfig, SamplingParams
from engine.build import build_engine
from kernels.model.arch import LlamaArch
from kernels.model.loader import build_model, read_config
from tests.unit.engine.test_model_parity import PageDealer, assert_matches_hf, make_kv, make_seqs, run_step

VOCAB = 128
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6, tie_word_embeddings=False,
              bos_token_id=1, eos_token_id=2, pad_token_id=0)
WINDOW = 8
ATOL = 2e-5


def _families() -> dict[str, tuple[str, str, dict]]:
    """name -> (transformers config class, model class, config fields beyond COMMON)."""
    gemma = dict(head_dim=16, query_pre_attn_scalar=24, sliding_window=WINDOW)
    return {
        "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=16)),
        "mistral-window": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=WINDOW)),
        "phi3-window": ("Phi3Config", "Phi3ForCausalLM", dict(sliding_window=WINDOW)),
        "gemma2": ("Gemma2Config", "Gemma2ForCausalLM",
                   dict(gemma, attn_logit_softcapping=4.0, final_logit_softcapping=3.0, tie_word_embeddings=True)),
        "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM",
                   dict(gemma, layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 500.0},
                                         "full_attention": {"rope_type": "linear", "factor": 2.0,
                                                            "rope_theta": 20000.0}})),
        "llama-yarn": ("LlamaConfig", "LlamaForCausalLM",
                       dict(head_dim=16, rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0,
                                                          "original_max_position_embeddings": 64})),
        "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=4, num_experts_per_tok=2,
                                                                sliding_window=None)),
        "qwen2-moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                      dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                           shared_expert_intermediate_size=48, mlp_only_layers=[1], norm_topk_prob=False)),
        "qwen3-moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                      dict(head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                           norm_topk_prob=True)),
    }


FAMILIES = _families()


def reference(name: str, seed: int = 0, **overrides):
    """transformers' model of family `name` (`overrides`: config fields), random weights (norms and
    biases too, so they matter)."""
    import transformers

    config_cls, model_cls, extra = FAMILIES[name]
    config = getattr(transformers, config_cls)(**{**COMMON, **extra, **overrides})
    config._attn_implementation = "eager"  # softcaps and windows as transformers computes them in full
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).eval()
    with torch.no_grad():
        for pname, param in model.named_parameters():
            if pname.endswith(("norm.weight", "layernorm.weight", ".bias")):
                param.normal_(0.0 if "gemma" in name else 1.0, 0.2)
            elif pname.endswith(("q_proj.weight", "qkv_proj.weight")):
                param.mul_(10.0)  # scores well past the soft cap, attention far from uniform
    return model


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    """(name, transformers' model, ours loaded through `build_model` from the checkpoint it wrote)."""
    ref = reference(request.param)
    path = Path(tmp_path_factory.mktemp(request.param))
    ref.save_pretrained(path)
    ours = build_model(path, read_config(path), "cpu", torch.float32, "torch")
    return request.param, ref, ours


def test_the_arch_is_what_transformers_builds(family):
    name, ref, ours = family
    arch = ours.arch
    assert arch.model_type == ref.config.model_type
    assert arch.windowed == (name in ("mistral-window", "phi3-window", "gemma2", "gemma3"))
    assert arch.is_moe == ("moe" in name or name == "mixtral")
    assert arch.plain_llama == (name == "llama-yarn")
    if name == "qwen2-moe":
        assert arch.moe_layers == (True, False, True) and arch.shared_expert_intermediate_size == 48


def test_chunked_prefill_and_decode_match_transformers(family):
    """Two sequences of 40 and 25 tokens in one ragged batch over 4-token pages: prefilled in chunks
    of 16, then three decode steps; every position's logits equal transformers' (a window of 8 is
    crossed many times, and so are pages)."""
    _, ref, ours = family
    page_size = 4
    kv = make_kv(ours.arch, 64, page_size)
    seqs = make_seqs([40, 25], page_size, PageDealer(64, 3), VOCAB, seed=5)
    for chunk in ([16, 16], [16, 6], [5, 0]):
        live = [(s, n) for s, n in zip(seqs, chunk) if n]
        run_step(ours, kv, page_size, [s for s, _ in live], [n for _, n in live])
    for _ in range(3):
        run_step(ours, kv, page_size, seqs, [1, 1])
    for seq in seqs:
        assert_matches_hf(ref, seq, ATOL)


def test_greedy_tokens_through_an_engine_with_its_prefix_cache(family):
    """transformers' greedy continuation, from an engine (chunked prefill, decode); then the same prompt
    again, its whole pages from the prefix cache, the same tokens."""
    name, ref, ours = family
    prompt = torch.randint(3, VOCAB, (30,), generator=torch.Generator().manual_seed(11)).tolist()
    with torch.no_grad():
        expected = ref.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, min_new_tokens=12,
                                eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    engine = build_engine(EngineConfig(page_size=4, num_pages=64, chunk_size=8, max_model_len=128, debug_kv=True,
                                       cuda_graph=False), ours, ours.arch)
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    first = engine.generate([prompt], params)[0]
    again = engine.generate([prompt], params)[0]
    assert first.output_token_ids == expected, name
    assert again.output_token_ids == expected and again.cached_tokens >= 28, (again.cached_tokens, name)
    engine.check_integrity()


@pytest.mark.parametrize("name", ["mistral-window", "phi3-window"])
def test_pages_behind_a_window_on_every_layer_are_freed_when_pages_run_short(name, tmp_path):
    """Two requests decoding 40 tokens past their window of 8 over 4-token pages need 27 pages; the
    pool has 16. Pages behind their windows are freed as room runs short (their slots the scratch
    page, reused by the other request): nobody is retracted, transformers' greedy tokens, with and
    without the prefix cache; KV integrity checked every step."""
    ref = reference(name)
    ref.save_pretrained(tmp_path)
    ours = build_model(tmp_path, read_config(tmp_path), "cpu", torch.float32, "torch")
    assert ours.arch.kv_window == WINDOW
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in (14, 9)]
    expected = []
    with torch.no_grad():
        for prompt in prompts:
            out = ref.generate(torch.tensor([prompt]), max_new_tokens=40, do_sample=False, min_new_tokens=40,
                               eos_token_id=None, pad_token_id=0)
            expected.append(out[0, len(prompt):].tolist())
    for prefix_cache in (False, True):
        engine = build_engine(EngineConfig(page_size=4, num_pages=1 + 16, chunk_size=8, max_model_len=128,
                                           debug_kv=True, cuda_graph=False, enable_prefix_cache=prefix_cache),
                              ours, ours.arch)
        reqs = [engine.add_request(p, SamplingParams(max_tokens=40, ignore_eos=True)) for p in prompts]
        dropped = 0
        while engine.busy():
            engine.step()
            dropped = max([dropped] + [r.kv.dropped for r in reqs if r.kv is not None and r.kv.state.name == "ACTIVE"])
        assert [r.output_token_ids for r in reqs] == expected, (name, prefix_cache)
        assert dropped > 0 and engine.num_retractions == 0, (dropped, prefix_cache)
        engine.check_integrity()
        assert engine.kvm.pool.usage().private == 0


def test_llama_with_no_variation_is_plain():
    import transformers

    arch = LlamaArch.from_hf_config(transformers.LlamaConfig(**COMMON))
    assert arch.plain_llama and not arch.windowed and not arch.is_moe
