"""CUDA parity: the same engine and kernels on a GPU, against HF transformers on the same GPU.

Marked `gpu`; skipped where torch sees no CUDA device (CPU CI). Run with `pytest -m gpu`.
"""

import copy

import pytest
import torch

from cluster.config import EngineConfig
from prefill_worker.engine import EngineCore, load_engine
from kernels.model.loader import load_model
from kernels.model.tokenizer import apply_chat_template
from tests.helpers import CHAT_PROMPTS, assert_pool_at_rest, greedy, hf_greedy, make_prompts, tiny_models

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
BF16_LOGIT_ATOL = 0.25  # bf16 weights + activations over 30 layers; fp32 runs are held to 1e-4


def _engine(model, arch, tokenizer=None, eos=(), **kw):
    config = EngineConfig(device="cuda", num_pages=1024, debug_kv=True, **kw)
    return EngineCore(config, model, arch, tokenizer, eos)


def test_tiny_greedy_on_cuda_matches_hf():
    ours, ref, arch = tiny_models()
    prompts = make_prompts(8, seed=1)
    expect = [hf_greedy(ref, p, 16) for p in prompts]  # CPU reference
    engine = _engine(copy.deepcopy(ours).to("cuda"), arch, page_size=4)
    assert [r.output_token_ids for r in engine.generate(prompts, greedy(max_tokens=16))] == expect
    assert_pool_at_rest(engine)


@pytest.mark.parametrize("page_size", [1, 16])
def test_smollm2_fp32_greedy_on_cuda_matches_hf(page_size):
    from transformers import AutoModelForCausalLM

    loaded = load_model("smollm2", device="cuda")
    ref = AutoModelForCausalLM.from_pretrained(loaded.model_dir, dtype=torch.float32).to("cuda").eval()
    ids = [apply_chat_template(loaded.tokenizer, p) for p in CHAT_PROMPTS]
    eos = list(loaded.eos_token_ids)
    expect = [hf_greedy(ref, p, 32, eos_token_id=eos) for p in ids]
    engine = _engine(loaded.model, loaded.arch, loaded.tokenizer, loaded.eos_token_ids, page_size=page_size,
                     chunk_size=64)
    assert [r.output_token_ids for r in engine.generate(ids, greedy(max_tokens=32))] == expect
    assert_pool_at_rest(engine)


def test_smollm2_bf16_logits_close_to_fp32():
    from kv_store.req_kv import ReleaseReason
    from prefill_worker.engine.runner import ForwardRow

    fp32 = load_model("smollm2", device="cuda")
    bf16 = load_model("smollm2", device="cuda", dtype=torch.bfloat16)
    ids = apply_chat_template(fp32.tokenizer, CHAT_PROMPTS[4])
    logits = []
    for loaded, dtype in ((fp32, "float32"), (bf16, "bfloat16")):
        engine = EngineCore(EngineConfig(device="cuda", dtype=dtype, num_pages=256), loaded.model, loaded.arch)
        kv = engine.kvm.open("probe")
        assert engine.kvm.try_allocate(kv, len(ids))
        logits.append(engine.runner.forward([ForwardRow(ids, len(ids), list(kv.pages), True)]).logits[0])
        engine.kvm.release(kv, ReleaseReason.ABORTED, [], cache=False)
        engine.check_integrity()
    assert (logits[0] - logits[1]).abs().max().item() < BF16_LOGIT_ATOL
    assert logits[0].argmax() == logits[1].argmax()
