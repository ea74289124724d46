"""Choosing the attention backend (`auto` and named), and the FlashInfer backend's CPU-checkable parts.

FlashInfer's kernels need CUDA (their checks are in tests/gpu/test_flashinfer_cuda.py). Here: which
backend `auto` becomes per device, dtype and importability (the import probe patched); that config,
loader and registry agree on names; the page table -> CSR conversion against a loop over host lists;
and the backend's planning and routing over a stand-in `flashinfer` module whose wrappers compute
attention from the CSR they are given as FlashInfer documents it, against the torch backend.
"""

from __future__ import annotations

import dataclasses
import math
import sys
import types

import pytest
import torch

import kernels.attention as attention
from common.config import ATTENTION_BACKENDS, ConfigError, EngineConfig
from kernels.attention import AUTO, BACKEND_NAMES, build_attn_metadata, get_backend, resolve_backend
from kernels.cuda.flashinfer_backend import FlashInferAttentionBackend, paged_kv_index_no_sync

HALF = pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])


@pytest.fixture
def importable(monkeypatch):
    """Patch the import probe: ``importable({"triton"})`` makes only triton importable from then on,
    and returns the list of modules probed from then on."""

    def patch(modules: set[str]) -> list[str]:
        probed: list[str] = []

        def probe(module: str) -> str | None:
            probed.append(module)
            return None if module in modules else f"ModuleNotFoundError: No module named {module!r}"

        monkeypatch.setattr(attention, "import_error", probe)
        return probed

    return patch


# ---- auto ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_auto_is_the_cpu_backend_on_a_cpu_without_probing_gpu_libraries(importable, dtype):
    probed = importable({"flashinfer", "triton"})
    assert resolve_backend(AUTO, "cpu", dtype) == "cpu"
    assert resolve_backend(AUTO, torch.device("cpu")) == "cpu"
    assert probed == []


def test_auto_on_a_cpu_without_its_c_kernels_is_torch_and_says_why(monkeypatch, caplog):
    from kernels.cpu import native

    monkeypatch.setattr(native, "_loaded", [None])  # what a machine without a C compiler has
    with caplog.at_level("INFO", logger="tandem.kernels"):
        assert resolve_backend(AUTO, "cpu", torch.float32) == "torch"
    assert "cpu: its C kernels could not be built here" in caplog.text
    with pytest.raises(ValueError, match="'cpu' cannot be used: its C kernels could not be built"):
        resolve_backend("cpu", "cpu", torch.float32)
    with pytest.raises(ValueError, match="cpu runs on the CPU only, not cuda"):
        resolve_backend("cpu", "cuda", torch.float32)


PREBUILT = attention.FLASHINFER_PREBUILT


@HALF
def test_auto_on_cuda_prefers_flashinfer_with_prebuilt_kernels_for_half_dtypes(importable, dtype):
    importable({"flashinfer", PREBUILT, "triton"})
    assert resolve_backend(AUTO, "cuda", dtype) == "flashinfer"
    assert resolve_backend(AUTO, "cuda:1", dtype) == "flashinfer"


@HALF
def test_auto_passes_over_flashinfer_that_would_jit_compile_and_says_why(importable, dtype, caplog):
    """FlashInfer without its prebuilt kernels compiles each one with nvcc on first use (minutes, in
    start-up's graph capture): `auto` takes Triton and logs why; naming flashinfer still gets it."""
    importable({"flashinfer", "triton"})
    with caplog.at_level("INFO", logger="tandem.kernels"):
        assert resolve_backend(AUTO, "cuda", dtype) == "triton"
    assert resolve_backend("flashinfer", "cuda", dtype) == "flashinfer"
    importable({"flashinfer"})
    with caplog.at_level("INFO", logger="tandem.kernels"):
        assert resolve_backend(AUTO, "cuda", dtype) == "torch"
    assert "flashinfer: no prebuilt kernels (flashinfer_jit_cache not importable" in caplog.text


def test_auto_on_cuda_falls_back_to_triton_then_torch(importable):
    importable({"flashinfer", PREBUILT, "triton"})
    assert resolve_backend(AUTO, "cuda", torch.float32) == "triton", "flashinfer has no fp32 kernels"
    importable({"triton"})
    assert resolve_backend(AUTO, "cuda", torch.bfloat16) == "triton"
    probed = importable(set())
    assert resolve_backend(AUTO, "cuda", torch.bfloat16) == "torch"
    assert probed == ["flashinfer", "triton"]  # flashinfer itself missing: its kernels are not probed


def test_named_backends_are_checked_against_device_dtype_and_imports(importable):
    importable({"flashinfer", "triton"})
    assert resolve_backend("torch", "cpu", torch.float32) == "torch"
    assert resolve_backend("triton", "cpu", torch.float32) == "triton"  # the interpreter runs it on CPU
    assert resolve_backend("flashinfer", "cuda", torch.bfloat16) == "flashinfer"
    with pytest.raises(ValueError, match="'flashinfer' cannot be used: flashinfer runs on CUDA devices only, not cpu"):
        resolve_backend("flashinfer", "cpu", torch.bfloat16)
    with pytest.raises(ValueError, match="flashinfer kernels take fp16/bf16, not torch.float32"):
        resolve_backend("flashinfer", "cuda", torch.float32)
    importable({"triton"})
    with pytest.raises(ValueError, match="flashinfer cannot be imported: ModuleNotFoundError"):
        resolve_backend("flashinfer", "cuda", torch.float16)


@pytest.mark.parametrize("name", ["flash", "Torch", "", "auto "])
def test_unknown_names_are_rejected_with_the_valid_ones(name):
    expected = f"unknown attention backend {name!r}; available: auto, torch, cpu, triton, flashinfer"
    with pytest.raises(ValueError, match=expected):
        resolve_backend(name, "cpu", torch.float32)
    with pytest.raises(ValueError, match="unknown attention backend"):
        get_backend(name)
    with pytest.raises(ConfigError, match="attention_backend must be one of"):
        EngineConfig(attention_backend=name)


def test_auto_is_a_config_value_not_a_backend():
    assert EngineConfig().attention_backend == AUTO
    assert set(ATTENTION_BACKENDS) == {AUTO, *BACKEND_NAMES}
    with pytest.raises(ValueError, match="unknown attention backend 'auto'"):
        get_backend(AUTO)


def test_the_loader_resolves_auto_to_the_cpu_backend_on_a_cpu(tmp_path):
    from kernels.model.loader import build_model
    from kernels.model.tiny import make_tiny_llama

    _, ref = make_tiny_llama(seed=3)
    ref.save_pretrained(tmp_path)
    model = build_model(tmp_path, ref.config, "cpu", torch.float32, AUTO)
    assert model.backend.name == "cpu"
    assert all(layer.self_attn.backend is model.backend for layer in model.model.layers)
    with pytest.raises(ValueError, match="flashinfer runs on CUDA devices only"):
        build_model(tmp_path, ref.config, "cpu", torch.bfloat16, "flashinfer")


# ---- page table -> CSR ---------------------------------------------------------------------------------
def reference_csr(page_size, query_lens, seq_lens, tables):
    """FlashInfer's CSR by a loop over host lists: every sequence with new tokens lists the pages
    covering its positions, in order; a sequence without new tokens lists none."""
    qo_indptr, indptr, indices, last = [0], [0], [], []
    for q_len, seq_len, pages in zip(query_lens, seq_lens, tables):
        kv_len = seq_len if q_len else 0
        used = math.ceil(kv_len / page_size)
        indices += pages[:used]
        indptr.append(len(indices))
        last.append(kv_len - (used - 1) * page_size if used else 0)
        qo_indptr.append(qo_indptr[-1] + q_len)
    return qo_indptr, indptr, indices, last


def assert_csr(meta, expected):
    index = paged_kv_index_no_sync(meta)
    got = (index.qo_indptr_cpu, index.kv_indptr_cpu, index.kv_indices, index.kv_last_page_len_cpu)
    for tensor, values in zip(got, expected):
        assert tensor.dtype == torch.int32 and tensor.device.type == "cpu"
        assert tensor.tolist() == values


def test_csr_of_a_small_step_lists_exact_pages():
    # page size 4: seq 0 has 6 positions on pages 5, 9 (2 in the last); seq 1 one position on page 7
    # (its row padded with scratch page 0, never listed); seq 2 nine positions on 3, 8, 2 (1 in the last)
    meta, _ = build_attn_metadata(4, [1, 1, 3], [6, 1, 9], [[5, 9], [7], [3, 8, 2]], [0], "cpu")
    assert meta.page_table.tolist() == [[5, 9, 0], [7, 0, 0], [3, 8, 2]]
    assert_csr(meta, ([0, 1, 2, 5], [0, 2, 3, 6], [5, 9, 7, 3, 8, 2], [2, 1, 1]))


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_csr_matches_the_loop_on_random_ragged_steps(page_size):
    gen = torch.Generator().manual_seed(page_size)
    for _ in range(20):
        batch = int(torch.randint(1, 7, (1,), generator=gen))
        seq_lens = torch.randint(1, 70, (batch,), generator=gen).tolist()
        query_lens = [int(torch.randint(0, s + 1, (1,), generator=gen)) for s in seq_lens]
        extra = torch.randint(0, 3, (batch,), generator=gen).tolist()  # spare pages past seq_len
        counts = [math.ceil(s / page_size) + e for s, e in zip(seq_lens, extra)]
        perm = (torch.randperm(sum(counts), generator=gen) + 1).tolist()
        tables = [perm[sum(counts[:b]):sum(counts[:b + 1])] for b in range(batch)]
        rows = [max(sum(query_lens) - 1, 0)] if sum(query_lens) else []
        meta, _ = build_attn_metadata(page_size, query_lens, seq_lens, tables, rows, "cpu")
        assert_csr(meta, reference_csr(page_size, query_lens, seq_lens, tables))


def test_csr_of_capacity_lengths_lists_whole_rows_padding_included():
    """A capture's metadata: seq_lens_cpu is the table's capacity while the device lengths are 1, so
    every column is listed (the captured plan's shape); the device tensors are not read."""
    meta, _ = build_attn_metadata(16, [1, 1], [1, 1], [[4, 0, 0], [0, 0, 0]], [0, 1], "cpu", allow_scratch_page=True)
    capacity = dataclasses.replace(meta, seq_lens_cpu=(48, 48))
    assert_csr(capacity, ([0, 1, 2], [0, 3, 6], [4, 0, 0, 0, 0, 0], [16, 16]))


def test_csr_of_empty_steps():
    meta, _ = build_attn_metadata(8, [0, 0], [0, 5], [[], [3]], [], "cpu")
    assert_csr(meta, ([0, 0, 0], [0, 0, 0], [], [0, 0]))
    none, _ = build_attn_metadata(8, [], [], [], [], "cpu")
    assert_csr(none, ([0], [0], [], []))


def test_csr_rejects_lengths_the_table_cannot_hold():
    meta, _ = build_attn_metadata(4, [1], [4], [[6]], [0], "cpu")
    too_long = dataclasses.replace(meta, seq_lens_cpu=(5,))
    with pytest.raises(AssertionError, match=r"need 2 pages but page_table has 1 columns"):
        paged_kv_index_no_sync(too_long)


# ---- the backend over a stand-in flashinfer ------------------------------------------------------------
DECODE_PLAN_KWARGS = {"pos_encoding_mode", "window_left", "logits_soft_cap", "q_data_type", "kv_data_type",
                      "o_data_type", "data_type", "sm_scale", "rope_scale", "rope_theta", "non_blocking"}
PREFILL_PLAN_KWARGS = {"head_dim_vo", "custom_mask", "packed_custom_mask", "causal", "pos_encoding_mode",
                       "use_fp16_qk_reduction", "sm_scale", "window_left", "logits_soft_cap", "rope_scale",
                       "rope_theta", "q_data_type", "kv_data_type", "o_data_type", "non_blocking"}


class _FakeWrapper:
    """Stores a plan as FlashInfer's wrappers do (copied into fixed buffers in CUDA-graph mode) and
    runs attention from it by the documented CSR rules: seq b's KV length is
    ``(pages - 1) * page_size + last_page_len``, causal with the diagonal at the end."""

    def __init__(self, workspace, kv_layout="NHD", use_cuda_graph=False, use_tensor_cores=False,
                 paged_kv_indptr_buffer=None, paged_kv_indices_buffer=None, paged_kv_last_page_len_buffer=None):
        assert kv_layout == "NHD" and workspace.dtype == torch.uint8
        self.use_cuda_graph, self.use_tensor_cores = use_cuda_graph, use_tensor_cores
        self.buffers = (paged_kv_indptr_buffer, paged_kv_indices_buffer, paged_kv_last_page_len_buffer)
        self.plans, self.runs = 0, 0
        self.log.append(self)

    def _store(self, qo_indptr, indptr, indices, last_page_len, heads, kv_heads, head_dim, page_size, kwargs):
        for host in (qo_indptr, indptr, last_page_len):
            assert host.device.type == "cpu" and host.dtype == torch.int32, "indptrs and lengths go in as host int32"
        assert indices.dtype == torch.int32 and len(indices) == int(indptr[-1])
        if self.use_cuda_graph:
            indptr_buf, indices_buf, last_buf = self.buffers
            assert len(last_page_len) == len(last_buf) and len(indices) <= len(indices_buf)
            indptr_buf.copy_(indptr)
            last_buf.copy_(last_page_len)
            indices_buf[: len(indices)].copy_(indices)
            indptr, indices, last_page_len = self.buffers
        self.plan_args = (qo_indptr.clone(), indptr, indices, last_page_len, heads, kv_heads, head_dim, page_size)
        self.kwargs = kwargs
        self.plans += 1

    def run(self, q, paged_kv_cache):
        k_cache, v_cache = paged_kv_cache
        qo_indptr, indptr, indices, last, heads, kv_heads, head_dim, page_size = self.plan_args
        assert q.dtype == self.kwargs["q_data_type"] and q.shape[1:] == (heads, head_dim)
        assert k_cache.shape[1:] == (page_size, kv_heads, head_dim)
        out = torch.full_like(q, float("nan"))
        for b in range(len(last)):
            pages = indices[int(indptr[b]) : int(indptr[b + 1])].long()
            kv_len = (len(pages) - 1) * page_size + int(last[b]) if len(pages) else 0
            k = k_cache[pages].reshape(-1, kv_heads, head_dim)[:kv_len].double().repeat_interleave(heads // kv_heads, 1)
            v = v_cache[pages].reshape(-1, kv_heads, head_dim)[:kv_len].double().repeat_interleave(heads // kv_heads, 1)
            rows = slice(int(qo_indptr[b]), int(qo_indptr[b + 1]))
            scores = torch.einsum("qhd,khd->hqk", q[rows].double(), k) * self.kwargs["sm_scale"]
            q_len = scores.shape[1]
            visible = torch.arange(kv_len)[None, :] <= torch.arange(kv_len - q_len, kv_len)[:, None]
            scores = scores.masked_fill(~visible, float("-inf"))
            out[rows] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).to(q.dtype)
        self.runs += 1
        return out


class FakeDecode(_FakeWrapper):
    def plan(self, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size, **kwargs):
        assert set(kwargs) <= DECODE_PLAN_KWARGS, f"not a decode plan() argument: {set(kwargs) - DECODE_PLAN_KWARGS}"
        qo_indptr = torch.arange(len(last_page_len) + 1, dtype=torch.int32)
        self._store(qo_indptr, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size, kwargs)


class FakePrefill(_FakeWrapper):
    def plan(self, qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, num_qo_heads,
             num_kv_heads, head_dim_qk, page_size, **kwargs):
        assert set(kwargs) <= PREFILL_PLAN_KWARGS, f"not a prefill plan() argument: {set(kwargs) - PREFILL_PLAN_KWARGS}"
        assert kwargs.get("causal") is True, "tandem's extend attention is causal"
        self._store(qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, num_qo_heads,
                    num_kv_heads, head_dim_qk, page_size, kwargs)


@pytest.fixture
def fake_flashinfer(monkeypatch):
    """A `flashinfer` module of stand-in wrappers; its `.log` lists every wrapper built."""
    module = types.ModuleType("flashinfer")
    module.log = []
    module.BatchDecodeWithPagedKVCacheWrapper = type("Decode", (FakeDecode,), {"log": module.log})
    module.BatchPrefillWithPagedKVCacheWrapper = type("Prefill", (FakePrefill,), {"log": module.log})
    monkeypatch.setitem(sys.modules, "flashinfer", module)
    return module


def make_step(q_lens, prefix_lens, page_size, heads, kv_heads, dtype, seed, head_dim=16):
    """Caches holding each prefix on random pages (page 0 only as padding), new q/k/v, metadata."""
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [p + q for p, q in zip(prefix_lens, q_lens)]
    counts = [math.ceil(s / page_size) for s in seq_lens]
    num_pages = 2 + sum(counts)
    perm = (torch.randperm(num_pages - 1, generator=gen) + 1).tolist()
    tables = [perm[sum(counts[:b]):sum(counts[:b + 1])] for b in range(len(counts))]
    meta, _ = build_attn_metadata(page_size, q_lens, seq_lens, tables, [sum(q_lens) - 1], "cpu")

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(dtype)

    cache = (num_pages, page_size, kv_heads, head_dim)
    tokens = sum(q_lens)
    return meta, randn(*cache), randn(*cache), randn(tokens, heads, head_dim), randn(tokens, kv_heads, head_dim), \
        randn(tokens, kv_heads, head_dim)


def run_layers(backend, meta, k_cache, v_cache, q, k, v, layers=3):
    """What a model does per step: each layer writes the new K/V, then attends (same caches here)."""
    outs = []
    for _ in range(layers):
        backend.write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
        outs.append(backend.attention(q, k_cache, v_cache, meta, q.shape[-1] ** -0.5))
    return outs


def assert_matches_torch(backend, step):
    meta, k_cache, v_cache, q, k, v = step
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    expected = run_layers(get_backend("torch"), meta, ref_k, ref_v, q, k, v, layers=1)[0]
    for out in run_layers(backend, meta, k_cache, v_cache, q, k, v):
        torch.testing.assert_close(out, expected, atol=1e-2, rtol=1.6e-2)
    assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)


@HALF
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (6, 2), (10, 2)], ids=["gqa1", "gqa3", "gqa5"])
def test_decode_steps_plan_the_decode_wrapper_once_per_step(fake_flashinfer, dtype, page_size, heads, kv_heads):
    backend = FlashInferAttentionBackend(workspace_bytes=64)
    for seed in (1, 2):
        assert_matches_torch(backend, make_step([1, 1, 1, 1], [0, 5, 16, 40], page_size, heads, kv_heads, dtype, seed))
    (decode,) = fake_flashinfer.log
    assert type(decode).__name__ == "Decode" and not decode.use_cuda_graph
    assert decode.use_tensor_cores == (heads // kv_heads >= 5)
    assert (decode.plans, decode.runs) == (2, 6), "one plan per step, one run per layer"
    assert decode.kwargs == {"q_data_type": dtype, "kv_data_type": dtype, "sm_scale": 16**-0.5, "non_blocking": True}


@HALF
@pytest.mark.parametrize("page_size", [1, 16])
def test_prefill_extend_and_mixed_steps_run_the_prefill_wrapper(fake_flashinfer, dtype, page_size):
    backend = FlashInferAttentionBackend(workspace_bytes=64)
    # a fresh prompt, an extend over a prefix ending mid-page, a decode row and a sequence with no new token
    assert_matches_torch(backend, make_step([20, 7, 1, 0], [0, 21, 9, 4], page_size, 6, 2, dtype, seed=3))
    assert_matches_torch(backend, make_step([33], [0], page_size, 6, 2, dtype, seed=4))
    (prefill,) = fake_flashinfer.log
    assert type(prefill).__name__ == "Prefill" and (prefill.plans, prefill.runs) == (2, 6)


def test_graph_decode_plans_fixed_buffers_and_replans_when_lengths_change(fake_flashinfer):
    """The graph runner's sequence on CPU: warm-up, prepare with capacity lengths (capture), then
    refill the same buffers and prepare with the real lengths before each replay."""
    dtype, page_size, width = torch.bfloat16, 4, 6
    backend = FlashInferAttentionBackend(workspace_bytes=64)
    meta, k_cache, v_cache, q, k, v = make_step([1, 1, 1], [3, 9, 0], page_size, 4, 2, dtype, seed=5)
    run_layers(backend, meta, k_cache.clone(), v_cache.clone(), q, k, v, layers=1)  # warm-up: learns the shape
    table = torch.zeros(3, width, dtype=torch.int64)
    table[:, : meta.page_table.shape[1]] = meta.page_table
    static = dataclasses.replace(meta, page_table=table, seq_lens_cpu=(width * page_size,) * 3)
    backend.prepare_graph_decode(static)
    graph = fake_flashinfer.log[-1]
    assert graph.use_cuda_graph and [len(b) for b in graph.buffers] == [4, 3 * width, 3]
    assert graph.buffers[1].tolist() == table.flatten().tolist(), "capture plans every column"

    for seed in (5, 6):  # replays: same static tensors refilled, new lengths
        step = make_step([1, 1, 1], [3 + seed, 9, 2 * seed], page_size, 4, 2, dtype, seed)
        table.zero_()
        table[:, : step[0].page_table.shape[1]] = step[0].page_table
        for name in ("seq_lens", "slot_mapping"):
            getattr(static, name).copy_(getattr(step[0], name))
        replay = dataclasses.replace(static, seq_lens_cpu=step[0].seq_lens_cpu)
        backend.prepare_graph_decode(replay)
        assert_matches_torch(backend, (replay, *step[1:]))
    assert graph.plans == 3 and graph.runs == 6
    assert len(fake_flashinfer.log) == 2, "one eager decode wrapper and one graph wrapper for (3, 6)"


def test_graph_plan_needs_a_warm_up_and_decode_rows(fake_flashinfer):
    backend = FlashInferAttentionBackend(workspace_bytes=64)
    meta, k_cache, v_cache, q, k, v = make_step([2, 1], [3, 9], 4, 4, 2, torch.float16, seed=7)
    with pytest.raises(AssertionError, match="before any eager step"):
        backend.prepare_graph_decode(meta)
    run_layers(backend, meta, k_cache, v_cache, q, k, v, layers=1)
    with pytest.raises(AssertionError, match=r"one token per sequence, got query_lens \(2, 1\)"):
        backend.prepare_graph_decode(meta)


def test_fp32_and_mismatched_caches_are_refused_by_name(fake_flashinfer):
    backend = FlashInferAttentionBackend(workspace_bytes=64)
    meta, k_cache, v_cache, q, k, v = make_step([1], [4], 4, 4, 2, torch.float32, seed=8)
    with pytest.raises(AssertionError, match="flashinfer kernels take fp16/bf16, got torch.float32"):
        backend.attention(q, k_cache, v_cache, meta, 0.25)
    meta, k_cache, v_cache, q, k, v = make_step([1], [4], 4, 4, 2, torch.float16, seed=8)
    with pytest.raises(AssertionError, match="FlashInfer reads both with one set of strides"):
        backend.attention(q, k_cache, v_cache.transpose(1, 2).contiguous().transpose(1, 2), meta, 0.25)


def test_building_the_backend_without_flashinfer_names_the_package(monkeypatch):
    monkeypatch.setitem(sys.modules, "flashinfer", None)  # import flashinfer -> ImportError
    with pytest.raises(ImportError, match="needs flashinfer-python"):
        get_backend("flashinfer")


# ---- the engine honours its config -------------------------------------------------------------------
@pytest.mark.usefixtures("triton_interpreted")
def test_build_engine_runs_the_configured_backend_whatever_the_model_was_built_with():
    """`engine.attention_backend` decides what the engine attends with, not how the model happened to
    be built: a torch-built model under `triton` runs the Triton kernels (interpreted here) and gives
    the torch engine's greedy tokens; `auto` on a CPU is torch again; a backend that cannot run here is
    a ConfigError before anything is allocated."""
    from engine import build_engine
    from kernels.attention.torch_backend import TorchAttentionBackend
    from kernels.cuda.triton_backend import TritonAttentionBackend
    from kernels.model.tiny import make_tiny_llama
    from tests.helpers import greedy, make_prompts

    model, _ = make_tiny_llama(4, num_hidden_layers=2)
    assert model.backend.name == "torch"
    arch = model.arch
    prompts, params = make_prompts(2, min_len=5, max_len=9, seed=3), greedy(max_tokens=3)
    tokens = {}
    for name, kind in (("triton", TritonAttentionBackend), ("auto", TorchAttentionBackend)):
        config = EngineConfig(page_size=4, num_pages=32, chunk_size=16, debug_kv=True, attention_backend=name)
        engine = build_engine(config, model, arch)
        try:
            assert isinstance(model.backend, kind)
            assert all(isinstance(layer.self_attn.backend, kind) for layer in model.model.layers)
            tokens[name] = [r.output_token_ids for r in engine.generate(prompts, params)]
            engine.check_integrity()
        finally:
            engine.close()
    assert tokens["triton"] == tokens["auto"] and all(len(t) == 3 for t in tokens["auto"])
    with pytest.raises(ConfigError, match="flashinfer runs on CUDA devices only"):
        build_engine(EngineConfig(page_size=4, num_pages=32, attention_backend="flashinfer"), model, arch)
