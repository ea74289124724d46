"""The FlashInfer attention backend on CUDA: parity with the torch backend on the same GPU (decode,
prefill, extend over a cached prefix, mixed steps), no host sync in a planned step, greedy tiny-model
output against HF transformers, and a captured decode graph replayed after the lengths changed.

Marked `gpu`; skipped where torch sees no CUDA device or flashinfer-python (the `gpu` extra) is not
importable. Run with `pytest -m gpu`. Without flashinfer's prebuilt kernel packages the first test
of each dtype / head_dim JIT-compiles its kernels (needs nvcc; minutes).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kernels.attention import build_attn_metadata, get_backend, import_error, resolve_backend

_SKIP = ("needs a CUDA device" if not torch.cuda.is_available() else
         f"needs flashinfer: {import_error('flashinfer')}" if import_error("flashinfer") else "")
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(bool(_SKIP), reason=_SKIP)]
DTYPES = pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
PAGE_SIZES = pytest.mark.parametrize("page_size", [1, 16, 64])
GQA = pytest.mark.parametrize("heads,kv_heads", [(8, 8), (9, 3), (32, 8), (12, 2)],
                              ids=["gqa1", "gqa3", "gqa4", "gqa6"])  # gqa6: tensor-core decode
NEAR_TIE = {torch.float16: 0.01, torch.bfloat16: 0.05}
"""HF top-2 logit margins below which a greedy token may legitimately differ (half-precision rounding)."""


@pytest.fixture(scope="module")
def parity():
    """The Triton parity test's case builder and NaN-poisoned comparison, imported only when a test
    runs (importing triton while a CPU run collects this file would stop the interpreter switch)."""
    from tests.unit.kernels import test_triton_parity

    return test_triton_parity


def flashinfer_backend():
    from kernels.cuda.flashinfer_backend import FlashInferAttentionBackend

    return FlashInferAttentionBackend()


def _seq_lens(count: int, low: int, high: int, seed: int) -> list[int]:
    return torch.randint(low, high, (count,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_auto_picks_flashinfer_for_half_dtypes_on_cuda():
    assert resolve_backend("auto", "cuda", torch.bfloat16) == "flashinfer"
    assert resolve_backend("auto", "cuda", torch.float16) == "flashinfer"
    assert resolve_backend("auto", "cuda", torch.float32) in ("triton", "torch")
    assert get_backend("flashinfer").name == "flashinfer"


@DTYPES
@PAGE_SIZES
@GQA
@pytest.mark.parametrize("head_dim", [64, 128])
def test_decode_batch_matches_torch_on_cuda(parity, dtype, page_size, heads, kv_heads, head_dim):
    prefix_lens = [0, 1, 63, 64, 4095, *_seq_lens(27, 1, 3000, seed=page_size)]
    case = parity.make_case([1] * 32, prefix_lens, page_size, heads, kv_heads, head_dim, dtype, seed=1, device="cuda")
    parity.assert_parity(case, flashinfer_backend())


@DTYPES
@PAGE_SIZES
@GQA
@pytest.mark.parametrize("head_dim", [64, 128])
def test_extend_and_prefill_match_torch_on_cuda(parity, dtype, page_size, heads, kv_heads, head_dim):
    # fresh prefill, a decode row in a mixed step, extends over prefixes that do and do not end on a page
    q_lens, prefix_lens = [700, 1, 129, 300, 64], [0, 2000, 511, 1024, 3]
    case = parity.make_case(q_lens, prefix_lens, page_size, heads, kv_heads, head_dim, dtype, seed=2, device="cuda")
    parity.assert_parity(case, flashinfer_backend())


@pytest.mark.parametrize("q_lens,prefix_lens", [([1] * 16, list(range(100, 1700, 100))), ([300, 40, 1], [100, 0, 7])],
                         ids=["decode", "extend"])
def test_a_planned_step_does_not_sync_the_host(parity, q_lens, prefix_lens):
    """After the first step (kernel load), planning and running a new step issue no synchronising
    CUDA call (lengths come from the metadata's host tuples)."""
    backend = flashinfer_backend()
    first, second = (parity.make_case(q_lens, prefix_lens, 16, 8, 2, 64, torch.bfloat16, seed=s, device="cuda")
                     for s in (3, 4))
    parity.run_step(backend, first, first.k_cache, first.v_cache, 0.125)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = parity.run_step(backend, second, second.k_cache, second.v_cache, 0.125)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert out.shape == second.q.shape


def _decode_meta(seq_lens: list[int], page_size: int, width: int, seed: int):
    """Decode metadata over disjoint random pages, every table padded to ``width`` pages."""
    perm = (torch.randperm(len(seq_lens) * width, generator=torch.Generator().manual_seed(seed)) + 1).tolist()
    tables = [perm[i * width : (i + 1) * width] for i in range(len(seq_lens))]
    meta, _ = build_attn_metadata(page_size, [1] * len(seq_lens), seq_lens, tables, [0], "cuda")
    return meta


def test_captured_decode_graph_replays_after_the_lengths_change(parity):
    """The graph runner's sequence: warm up eagerly, prepare with the capacity and capture, then per
    replay refill the static tensors, prepare with the real lengths and replay; each replay equals an
    eager torch step over the same lengths, longer and then shorter than before."""
    batch, heads, kv_heads, head_dim, page_size, width = 8, 16, 4, 128, 16, 128
    dtype, scale = torch.bfloat16, head_dim**-0.5
    gen = torch.Generator(device="cuda").manual_seed(5)
    num_pages = 1 + batch * width

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device="cuda", dtype=dtype)

    k_cache, v_cache = randn(num_pages, page_size, kv_heads, head_dim), randn(num_pages, page_size, kv_heads, head_dim)
    q, k, v = randn(batch, heads, head_dim), randn(batch, kv_heads, head_dim), randn(batch, kv_heads, head_dim)
    static = _decode_meta([3 + i for i in range(batch)], page_size, width, seed=6)
    backend = flashinfer_backend()

    def step(meta):
        backend.write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
        return backend.attention(q, k_cache, v_cache, meta, scale)

    step(static)  # eager warm-up: loads the kernels, fixes the attention shape
    captured = dataclasses.replace(static, seq_lens_cpu=(width * page_size,) * batch)
    backend.prepare_graph_decode(captured)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step(captured)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step(captured)

    torch_backend = get_backend("torch")
    for lens, seed in ((_seq_lens(batch, 1000, width * page_size, seed=7), 8), (_seq_lens(batch, 1, 40, seed=9), 10)):
        real = _decode_meta(lens, page_size, width, seed=seed)
        for name in ("seq_lens", "page_table", "slot_mapping", "query_start_loc"):
            getattr(static, name).copy_(getattr(real, name))
        replayed = dataclasses.replace(static, seq_lens_cpu=real.seq_lens_cpu)
        ref_k, ref_v = k_cache.clone(), v_cache.clone()
        backend.prepare_graph_decode(replayed)
        graph.replay()
        torch_backend.write_kv(ref_k, ref_v, k, v, real.slot_mapping)
        expected = torch_backend.attention(q, ref_k, ref_v, real, scale)
        atol, rtol = parity.TOLERANCES[dtype]
        torch.testing.assert_close(out, expected, atol=atol, rtol=rtol)
        assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)


def _hf_greedy_with_margins(model, prompt: list[int], max_new_tokens: int) -> tuple[list[int], list[float]]:
    ids = torch.tensor([prompt], device="cuda")
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False,
                             pad_token_id=0, eos_token_id=None, output_scores=True, return_dict_in_generate=True)
    margins = [float(top[0] - top[1]) for top in (s[0].float().topk(2).values for s in out.scores)]
    return out.sequences[0, len(prompt):].tolist(), margins


@DTYPES
@pytest.mark.parametrize("page_size", [1, 16])
def test_tiny_greedy_matches_hf_with_flashinfer(dtype, page_size):
    """Greedy tokens equal HF's on the same GPU and dtype; a prompt may part from HF only where HF's
    own top-2 margin is a near-tie (half-precision rounding), and most tokens must be compared."""
    from common.config import EngineConfig
    from engine import build_engine
    from kernels.kv_layout import DTYPE_NAMES
    from kernels.model.arch import LlamaArch
    from kernels.model.llama import LlamaForCausalLM
    from kernels.model.tiny import make_tiny_llama
    from tests.helpers import assert_pool_at_rest, greedy, make_prompts

    _, ref = make_tiny_llama(seed=0, device="cuda", dtype=dtype, head_dim=64)
    arch = LlamaArch.from_hf_config(ref.config)
    ours = LlamaForCausalLM(arch, flashinfer_backend()).to(device="cuda", dtype=dtype).eval()
    ours.load_hf_state_dict(ref.state_dict())
    config = EngineConfig(device="cuda", dtype=DTYPE_NAMES[dtype],
                          attention_backend="flashinfer", num_pages=512, page_size=page_size, chunk_size=64,
                          cuda_graph=False, debug_kv=True)
    engine = build_engine(config, ours, arch)
    prompts = make_prompts(8, seed=1)
    outputs = [r.output_token_ids for r in engine.generate(prompts, greedy(max_tokens=16))]
    compared = 0
    for i, (prompt, got) in enumerate(zip(prompts, outputs)):
        expect, margins = _hf_greedy_with_margins(ref, prompt, 16)
        differ = next((t for t, (a, b) in enumerate(zip(got, expect)) if a != b), None)
        if differ is not None:
            assert margins[differ] < NEAR_TIE[dtype], (
                f"prompt {i}: token {differ} is {got[differ]}, HF's {expect[differ]}, though HF's top-2 margin "
                f"there is {margins[differ]:.4f}: not a rounding tie"
            )
        compared += len(expect) if differ is None else differ
    assert compared >= 8 * 16 // 2, f"only {compared} of {8 * 16} tokens compared before near-ties: a vacuous run"
    assert_pool_at_rest(engine)
    engine.close()
