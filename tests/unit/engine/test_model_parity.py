"""Our ragged paged forward against transformers' full-sequence forward.

Tiny random Llama (fast, fp32, 1e-5) for every batch shape and page size; the real SmolLM2
(marked slow) for chat prefill, decode and greedy generation (1e-4 / exact tokens).
"""

from __future__ import annotations

import platform
import random
from dataclasses import dataclass, field

import pytest
import torch
import torch.nn.functional as F

from kernels.attention import build_attn_metadata, get_backend
from kernels.kv_layout import KVCacheTensors
from kernels.model.arch import LlamaArch
from kernels.model.llama import LlamaForCausalLM
from kernels.model.loader import make_tiny_llama, tiny_llama_config

TINY_ATOL = 1e-5
SMOLLM2_ATOL = 1e-4


# ---------------------------------------------------------------- helpers


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """On a shared 2-core box, 2 OpenMP threads competing with another busy process make every
    matmul spin-wait (measured 13x slower); one thread keeps this module fast either way."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@dataclass
class Seq:
    """A test sequence: all its token ids, its pages, and how many tokens are in the KV cache."""

    token_ids: list[int]
    pages: list[int]
    kv_len: int = 0
    logits: dict[int, torch.Tensor] = field(default_factory=dict)  # position -> [vocab]


class PageDealer:
    """Hands out page ids 1..num_pages-1 in a shuffled order, so sequences get scattered pages."""

    def __init__(self, num_pages: int, seed: int) -> None:
        self.free = list(range(1, num_pages))
        random.Random(seed).shuffle(self.free)

    def take(self, n: int) -> list[int]:
        assert n <= len(self.free), f"test pool exhausted: need {n}, have {len(self.free)}"
        taken, self.free = self.free[:n], self.free[n:]
        return taken


def make_kv(arch: LlamaArch, num_pages: int, page_size: int) -> KVCacheTensors:
    return KVCacheTensors.allocate(
        arch.num_layers, num_pages, page_size, arch.num_kv_heads, arch.head_dim, torch.float32, "cpu"
    )


def make_seqs(lengths: list[int], page_size: int, pool: PageDealer, vocab: int, seed: int) -> list[Seq]:
    gen = torch.Generator().manual_seed(seed)
    seqs = []
    for n in lengths:
        ids = torch.randint(0, vocab, (n,), generator=gen).tolist()
        seqs.append(Seq(token_ids=ids, pages=pool.take(-(-n // page_size))))
    return seqs


def run_step(model, kv, page_size: int, seqs: list[Seq], new_lens: list[int], **meta_kw) -> None:
    """One ragged forward: seq i gets its next ``new_lens[i]`` tokens; logits of every row recorded."""
    ids, q_lens, s_lens = [], [], []
    for seq, n in zip(seqs, new_lens):
        ids += seq.token_ids[seq.kv_len : seq.kv_len + n]
        q_lens.append(n)
        s_lens.append(seq.kv_len + n)
    num_tokens = len(ids)
    meta, positions = build_attn_metadata(
        page_size, q_lens, s_lens, [s.pages for s in seqs], list(range(num_tokens)), "cpu", **meta_kw
    )
    _, logits = model(torch.tensor(ids), positions, meta, kv)  # [T, vocab]
    row = 0
    for seq, n in zip(seqs, new_lens):
        for pos in range(seq.kv_len, seq.kv_len + n):
            seq.logits[pos] = logits[row]
            row += 1
        seq.kv_len += n


@torch.no_grad()
def hf_logits(reference, token_ids: list[int]) -> torch.Tensor:
    """[len, vocab] float32 logits of transformers' full-sequence forward."""
    return reference(torch.tensor([token_ids])).logits[0].float()


def assert_matches_hf(reference, seq: Seq, atol: float) -> None:
    expected = hf_logits(reference, seq.token_ids)
    for pos, got in seq.logits.items():
        torch.testing.assert_close(got, expected[pos], atol=atol, rtol=0, msg=lambda m, pos=pos: f"position {pos}: {m}")


# ---------------------------------------------------------------- tiny model


@pytest.fixture(scope="module")
def tiny():
    return make_tiny_llama(seed=0)


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_ragged_prefill_extend_decode_match_hf(tiny, page_size):
    ours, reference = tiny
    pool = PageDealer(num_pages=160, seed=page_size)
    kv = make_kv(ours.arch, 160, page_size)
    fresh, extend, dec_a, dec_b = make_seqs([11, 13, 9, 5], page_size, pool, ours.arch.vocab_size, seed=1)
    # Earlier step: the extend's first chunk and the decoders' prompts go in the cache.
    run_step(ours, kv, page_size, [extend, dec_a, dec_b], [7, 8, 4])
    # Mixed step, decode rows deliberately not contiguous in T.
    run_step(ours, kv, page_size, [dec_a, fresh, dec_b, extend], [1, 11, 1, 6])
    for seq in (fresh, extend, dec_a, dec_b):
        assert seq.kv_len == len(seq.token_ids)
        assert_matches_hf(reference, seq, TINY_ATOL)


def test_explicit_out_of_order_pages_match_hf(tiny):
    ours, reference = tiny
    kv = make_kv(ours.arch, 12, 4)
    gen = torch.Generator().manual_seed(2)
    seq = Seq(token_ids=torch.randint(0, 256, (12,), generator=gen).tolist(), pages=[7, 3, 9])
    run_step(ours, kv, 4, [seq], [10])
    run_step(ours, kv, 4, [seq], [1])
    run_step(ours, kv, 4, [seq], [1])
    assert_matches_hf(reference, seq, TINY_ATOL)


def test_padding_and_scratch_page_do_not_leak(tiny):
    """Garbage in page 0 and in unused pages, zero-padded page tables and a padding row on page 0
    leave real rows' logits unchanged."""
    ours, _ = tiny
    page_size = 4
    results = []
    for dirty in (False, True):
        kv = make_kv(ours.arch, 40, page_size)
        if dirty:
            gen = torch.Generator().manual_seed(9)
            for t in kv.k + kv.v:
                t.copy_(torch.randn(t.shape, generator=gen) * 100)
        short, long_ = make_seqs([6, 30], page_size, PageDealer(40, 3), ours.arch.vocab_size, seed=4)
        run_step(ours, kv, page_size, [short, long_], [5, 29])
        if dirty:  # the padding row writes K/V to page 0 and attends over it
            pad = Seq(token_ids=[0], pages=[0])
            run_step(ours, kv, page_size, [short, pad, long_], [1, 1, 1], allow_scratch_page=True)
        else:
            run_step(ours, kv, page_size, [short, long_], [1, 1])
        results.append((short.logits, long_.logits))
    for clean, dirty in zip(*results):
        for pos in clean:
            torch.testing.assert_close(dirty[pos], clean[pos], atol=1e-6, rtol=0)


VARIANTS = pytest.mark.parametrize(
    "overrides",
    [
        dict(attention_bias=True, num_key_value_heads=4),
        dict(num_key_value_heads=1, tie_word_embeddings=True),
        dict(
            rope_parameters=dict(
                rope_type="llama3",
                rope_theta=500000.0,
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=64,
            )
        ),
        dict(rope_parameters=dict(rope_type="linear", rope_theta=10000.0, factor=2.0)),
    ],
    ids=["attention_bias", "mqa_tied", "llama3_rope", "linear_rope"],
)


@VARIANTS
def test_architecture_variants_match_hf(overrides):
    ours, reference = make_tiny_llama(seed=5, **overrides)
    pool = PageDealer(80, 5)
    kv = make_kv(ours.arch, 80, 4)
    seqs = make_seqs([40, 7], 4, pool, ours.arch.vocab_size, seed=6)
    run_step(ours, kv, 4, seqs, [39, 7])
    run_step(ours, kv, 4, seqs[:1], [1])
    for seq in seqs:
        assert_matches_hf(reference, seq, TINY_ATOL)


@pytest.mark.isa
@VARIANTS
def test_native_decode_layers_match_hf(overrides):
    """Decode steps of 1 and 3 sequences through the C layers (`NativeDecode`; with attention_bias,
    q/k/v and o biases) give HF's logits, like the torch forward."""
    from kernels.cpu.decode_layer import NativeDecode

    ours, reference = make_tiny_llama(seed=5, **overrides)
    native = NativeDecode.for_model(ours)
    assert native is not None, "the C layer does not serve a float32 tiny Llama: kernel not built?"
    if overrides.get("attention_bias"):
        with torch.no_grad():  # HF zero-inits biases; make them matter
            for layer in ours.model.layers:
                layer.self_attn.qkv_proj.bias.normal_()
                layer.self_attn.o_proj.bias.normal_()
        reference.load_state_dict(_hf_state_dict_of(ours, reference))
    kv = make_kv(ours.arch, 80, 4)
    seqs = make_seqs([40, 17, 9], 4, PageDealer(80, 5), ours.arch.vocab_size, seed=6)
    run_step(ours, kv, 4, seqs, [37, 14, 6])
    run_step(native, kv, 4, seqs[:1], [1])
    for _ in range(2):
        run_step(native, kv, 4, seqs, [1, 1, 1])
    for seq in seqs:
        assert_matches_hf(reference, seq, TINY_ATOL)


@pytest.mark.isa
def test_native_bf16_decode_layers_round_as_the_torch_model_and_track_hf():
    """A bfloat16 model's decode steps through the C layers (bf16 weights and KV widened in
    registers, values rounded to bf16 where HF's model rounds them): the logits are the torch bf16
    model's to a bf16 step or two and HF bf16's as closely as the torch model's, and layer 0's new K/V
    the torch model's exactly, at 1 sequence and at 6 (every decode step where the CPU has no bf16
    dot products; `max_rows` otherwise)."""
    import copy

    from kernels.cpu.decode_layer import NativeDecode

    ours, reference = make_tiny_llama(seed=5, dtype=torch.bfloat16)
    native = NativeDecode.for_model(ours)
    assert native is not None and native.dtype == torch.bfloat16
    arch = ours.arch
    kv_torch, kv_c = (KVCacheTensors.allocate(arch.num_layers, 120, 4, arch.num_kv_heads, arch.head_dim,
                                              torch.bfloat16, "cpu") for _ in range(2))
    seqs_torch = make_seqs([40, 17, 9, 23, 12, 30], 4, PageDealer(120, 5), arch.vocab_size, seed=6)
    seqs_c = copy.deepcopy(seqs_torch)
    prompt = [37, 14, 6, 20, 9, 27]
    run_step(ours, kv_torch, 4, seqs_torch, prompt)
    run_step(ours, kv_c, 4, seqs_c, prompt)
    rows = 6 if native.max_rows is None else native.max_rows
    run_step(ours, kv_torch, 4, seqs_torch[:1], [1])
    run_step(native, kv_c, 4, seqs_c[:1], [1])
    for _ in range(2):
        run_step(ours, kv_torch, 4, seqs_torch[:rows], [1] * rows)
        run_step(native, kv_c, 4, seqs_c[:rows], [1] * rows)
    for i, (seq_torch, seq_c) in enumerate(zip(seqs_torch, seqs_c)):
        expected = hf_logits(reference, seq_c.token_ids)
        decoded = [pos for pos in seq_c.logits if pos >= prompt[i]]
        assert len(decoded) == (3 if i == 0 else 2 if i < rows else 0)
        for pos in decoded:
            torch.testing.assert_close(seq_c.logits[pos], seq_torch.logits[pos], atol=8e-3, rtol=0)
            torch.testing.assert_close(seq_c.logits[pos], expected[pos], atol=2e-2, rtol=0)
    # The K/V the C layers wrote at the last step: layer 0's are the torch model's bit for bit (the same
    # norm, bf16 products and rotary rounding; deeper layers see attention outputs a bf16 step apart).
    slots = [(seq.pages[(seq.kv_len - 1) // 4], (seq.kv_len - 1) % 4) for seq in seqs_c[:rows]]
    for layer in range(arch.num_layers):
        for cache_c, cache_torch in ((kv_c.k[layer], kv_torch.k[layer]), (kv_c.v[layer], kv_torch.v[layer])):
            got, want = (torch.stack([cache[p, o] for p, o in slots]).float() for cache in (cache_c, cache_torch))
            if layer == 0:
                assert torch.equal(got, want)
            torch.testing.assert_close(got, want, atol=2e-2, rtol=1e-2)


@pytest.mark.isa
@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86-64-v3 (the AVX2 baseline) is an "
                    "x86-64 -march; this CPU is not x86-64")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_decode_layers_give_the_same_bits_built_for_this_cpu_and_for_the_avx2_baseline(
        dtype, monkeypatch, tmp_path):
    """The C layers' logits and K/V do not depend on the instruction set the kernel is built for
    (`TANDEM_CPU_MARCH`): built for the AVX2 baseline (x86-64-v3) and for this CPU (native, AVX-512
    where it has it), a step of 1 and of 3 sequences gives the same bits, so the served tokens of a
    wider CPU are the baseline's wherever the C layers run."""
    from kernels.cpu import native as cpu_native
    from kernels.cpu.decode_layer import NativeDecode

    native_lib = cpu_native.kernel()
    assert native_lib is not None, "the kernel did not build: no C compiler?"
    monkeypatch.setenv(cpu_native.MARCH_ENV, "x86-64-v3")
    baseline_path = tmp_path / "cpu_kernels-baseline.so"
    cpu_native.build(cpu_native._compiler(), baseline_path)
    baseline_lib = cpu_native.load(baseline_path)
    ours, _ = make_tiny_llama(seed=5, dtype=dtype)
    runs = []
    for lib in (native_lib, baseline_lib):
        kv = KVCacheTensors.allocate(ours.arch.num_layers, 80, 4, ours.arch.num_kv_heads, ours.arch.head_dim, dtype,
                                     "cpu")
        seqs = make_seqs([40, 17, 9], 4, PageDealer(80, 5), ours.arch.vocab_size, seed=6)
        run_step(ours, kv, 4, seqs, [37, 14, 6])
        native = NativeDecode(ours, lib)
        run_step(native, kv, 4, seqs[:1], [1])
        run_step(native, kv, 4, seqs, [1, 1, 1])
        runs.append((seqs, kv))
    (seqs_a, kv_a), (seqs_b, kv_b) = runs
    for a, b in zip(seqs_a, seqs_b):
        assert a.logits.keys() == b.logits.keys()
        assert all(torch.equal(a.logits[pos], b.logits[pos]) for pos in a.logits), "logits differ by -march"
    assert all(torch.equal(x, y) for x, y in zip((*kv_a.k, *kv_a.v), (*kv_b.k, *kv_b.v))), "K/V differ by -march"


def _hf_state_dict_of(ours, reference) -> dict:
    """`reference`'s state dict with the attention biases `ours` holds (q/k/v split back out)."""
    state = reference.state_dict()
    for i, layer in enumerate(ours.model.layers):
        q, k, v = layer.self_attn.qkv_proj.split(layer.self_attn.qkv_proj.bias.detach())
        pre = f"model.layers.{i}.self_attn."
        state |= {pre + "q_proj.bias": q, pre + "k_proj.bias": k, pre + "v_proj.bias": v,
                  pre + "o_proj.bias": layer.self_attn.o_proj.bias.detach()}
    return state


@pytest.mark.isa
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_tracks_hf(dtype):
    """Model dtype end to end (KV cache too), float32 logits; rounding differs, so a loose bound."""
    ours, reference = make_tiny_llama(seed=3, dtype=dtype)
    arch = ours.arch
    kv = KVCacheTensors.allocate(arch.num_layers, 12, 4, arch.num_kv_heads, arch.head_dim, dtype, "cpu")
    seq = make_seqs([20], 4, PageDealer(12, 3), arch.vocab_size, seed=3)[0]
    run_step(ours, kv, 4, [seq], [19])
    run_step(ours, kv, 4, [seq], [1])
    assert all(logits.dtype == torch.float32 for logits in seq.logits.values())
    assert_matches_hf(reference, seq, atol=2e-2)


def test_qwen2_qkv_bias_matches_hf():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False,
    )  # fmt: skip
    config._attn_implementation = "sdpa"
    torch.manual_seed(7)
    reference = Qwen2ForCausalLM(config).eval()
    with torch.no_grad():  # HF zero-inits biases; make them matter
        for layer in reference.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_()
    ours = LlamaForCausalLM(LlamaArch.from_hf_config(config)).eval()
    ours.load_hf_state_dict(reference.state_dict())
    kv = make_kv(ours.arch, 20, 4)
    seq = make_seqs([12], 4, PageDealer(20, 8), 128, seed=8)[0]
    run_step(ours, kv, 4, [seq], [11])
    run_step(ours, kv, 4, [seq], [1])
    assert_matches_hf(reference, seq, TINY_ATOL)


def test_unsupported_rope_type_is_rejected():
    config = tiny_llama_config(rope_parameters=dict(rope_type="dynamic", rope_theta=10000.0, factor=2.0))
    with pytest.raises(ValueError, match="rope type 'dynamic' is not supported"):
        LlamaArch.from_hf_config(config)


def test_load_hf_state_dict_is_strict(tiny):
    ours, reference = tiny
    state = dict(reference.state_dict())
    del state["model.layers.1.mlp.up_proj.weight"]
    state["model.layers.9.extra.weight"] = torch.zeros(1)
    fresh = LlamaForCausalLM(ours.arch)
    with pytest.raises(ValueError, match=r"missing 1 \['model.layers.1.mlp.up_proj.weight'\].*unexpected 1"):
        fresh.load_hf_state_dict(state)


def test_get_backend_rejects_unknown_name():
    assert get_backend("torch").name == "torch"
    with pytest.raises(ValueError, match="unknown attention backend 'nope'"):
        get_backend("nope")


def test_torch_backend_matches_dense_attention():
    """Backend alone, GQA 8:2, against a dense causal softmax per sequence."""
    torch.manual_seed(11)
    page_size, kvh, heads, hd = 4, 2, 8, 16
    backend = get_backend("torch")
    k_cache, v_cache = torch.randn(30, page_size, kvh, hd), torch.randn(30, page_size, kvh, hd)
    q_lens, s_lens, page_tables = [1, 5, 1, 3], [9, 5, 2, 12], [[4, 8, 1], [3, 5], [29], [2, 7, 6]]
    meta, _ = build_attn_metadata(page_size, q_lens, s_lens, page_tables, [0], "cpu")
    q = torch.randn(sum(q_lens), heads, hd)  # [T, H, hd]
    out = backend.attention(q, k_cache, v_cache, meta, scale=0.25)
    flat_k, flat_v = k_cache.flatten(0, 1), v_cache.flatten(0, 1)  # [slots, kvh, hd]
    row = 0
    for q_len, s_len, pages in zip(q_lens, s_lens, page_tables):
        slots = torch.tensor([pages[p // page_size] * page_size + p % page_size for p in range(s_len)])
        k = flat_k[slots].repeat_interleave(heads // kvh, dim=1)  # [s_len, H, hd]
        v = flat_v[slots].repeat_interleave(heads // kvh, dim=1)
        for i in range(q_len):
            pos = s_len - q_len + i
            scores = torch.einsum("hd,shd->hs", q[row], k[: pos + 1]) * 0.25  # [H, pos+1]
            expected = torch.einsum("hs,shd->hd", F.softmax(scores, dim=-1), v[: pos + 1])
            torch.testing.assert_close(out[row], expected, atol=1e-5, rtol=1e-5)
            row += 1


# ---------------------------------------------------------------- real SmolLM2


@pytest.fixture(scope="module")
def smollm2():
    from transformers import AutoModelForCausalLM

    from kernels.model.loader import load_model

    loaded = load_model("smollm2")
    reference = AutoModelForCausalLM.from_pretrained(loaded.model_dir, dtype=torch.float32).eval()
    return loaded, reference


CHAT_PROMPTS = ["What is the capital of France?", "Write a haiku about the sea."]


@pytest.mark.slow
def test_smollm2_prefill_and_decode_match_hf(smollm2):
    from kernels.model.tokenizer import apply_chat_template

    loaded, reference = smollm2
    ids = apply_chat_template(loaded.tokenizer, CHAT_PROMPTS[0])
    kv = make_kv(loaded.arch, 16, 16)
    seq = Seq(token_ids=ids, pages=[9, 2, 14, 5])
    run_step(loaded.model, kv, 16, [seq], [len(ids)])
    seq.token_ids = ids + [int(seq.logits[len(ids) - 1].argmax())]
    run_step(loaded.model, kv, 16, [seq], [1])
    assert_matches_hf(reference, seq, SMOLLM2_ATOL)


@pytest.mark.slow
def test_smollm2_batched_greedy_matches_hf_generate(smollm2):
    from kernels.model.tokenizer import apply_chat_template

    loaded, reference = smollm2
    num_new, page_size = 16, 8
    prompts = [apply_chat_template(loaded.tokenizer, p) for p in CHAT_PROMPTS]
    pool = PageDealer(40, 12)
    kv = make_kv(loaded.arch, 40, page_size)
    seqs = [Seq(token_ids=list(p), pages=pool.take(-(-(len(p) + num_new) // page_size))) for p in prompts]
    run_step(loaded.model, kv, page_size, seqs, [len(p) for p in prompts])
    for _ in range(num_new):
        for seq in seqs:
            seq.token_ids.append(int(seq.logits[seq.kv_len - 1].argmax()))
        run_step(loaded.model, kv, page_size, seqs, [1, 1])
    for prompt, seq in zip(prompts, seqs):
        input_ids = torch.tensor([prompt])
        with torch.no_grad():  # explicit mask: SmolLM2's pad id 2 is <|im_end|>, which HF would mask out
            expected = reference.generate(
                input_ids,
                attention_mask=torch.ones_like(input_ids),
                max_new_tokens=num_new,
                do_sample=False,
                eos_token_id=None,
            )[0].tolist()
        assert seq.token_ids == expected


def test_the_loader_reads_the_checkpoint_on_the_host_and_moves_each_tensor_to_the_models_device(tmp_path,
                                                                                                 monkeypatch):
    """A load never puts the checkpoint on the model's device beside the model: shards are mapped on
    the host, and each tensor (a packed module's parts, then the packed tensor) goes to the device as
    it is taken, one packed module's parts at a time, so a device holds the weights plus one module
    at most, not twice the weights; the model loaded that way is HF's."""
    from kernels.model import loader
    from kernels.model.packed_linear import PackedLinear

    _, ref = make_tiny_llama(seed=3)
    ref.save_pretrained(tmp_path)
    state = loader._read_state_dict(tmp_path)
    assert {t.device.type for t in state.values()} == {"cpu"}
    moved_at_once = []
    real_pack = PackedLinear.pack

    def pack(weights, biases, like, device):
        moved_at_once.append(sum(w.numel() for w in weights))
        return real_pack(weights, biases, like, device)

    monkeypatch.setattr(PackedLinear, "pack", staticmethod(pack))
    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaArch.from_hf_config(ref.config))
    model.load_hf_state_dict(state, device="meta")  # the target device, whatever the tensors' own
    assert {p.device.type for p in model.parameters()} == {"meta"}
    assert max(moved_at_once) <= max(t.numel() for t in state.values()) * 3  # one module's parts at a time
    cpu = loader.build_model(tmp_path, ref.config, "cpu", torch.float32, "torch")
    assert all(torch.equal(cpu.state_dict()[k], v) for k, v in cpu.state_dict().items())
    seq = make_seqs([9], 4, PageDealer(8, 1), cpu.arch.vocab_size, seed=1)[0]
    kv = make_kv(cpu.arch, 8, 4)
    run_step(cpu, kv, 4, [seq], [9])
    assert_matches_hf(ref, seq, TINY_ATOL)
