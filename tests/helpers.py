"""Builders shared by tests: tiny engines, random prompts, HF reference generation."""

from __future__ import annotations

import functools
import random
import weakref

import torch

from common.config import EngineConfig, SamplingParams
from engine import EngineCore, build_engine
from kernels.model.arch import LlamaArch
from kernels.model.tiny import make_tiny_llama

TINY_EOS = 2
SPEC_MAX_NEW = 24
"""Tokens the speculative engine tests generate per prompt (their `reference` fixture's length)."""


@functools.cache
def tiny_models(seed: int = 0):
    """(ours, hf_reference, arch) for the seeded tiny Llama; built once per process."""
    ours, ref = make_tiny_llama(seed)
    return ours, ref, LlamaArch.from_hf_config(ref.config)


def make_engine(page_size=4, num_pages=256, chunk_size=64, eos=(), l3=None, **kw) -> EngineCore:
    ours, _, arch = tiny_models()
    config = EngineConfig(page_size=page_size, num_pages=num_pages, chunk_size=chunk_size, debug_kv=True, **kw)
    return build_engine(config, ours, arch, eos_token_ids=eos, l3=l3)


def make_prompts(n: int, min_len=4, max_len=60, seed=0, vocab=256) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randrange(min_len, max_len + 1))] for _ in range(n)]


_GREEDY: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
"""hf_greedy's answers per model object (a model freed is forgotten, so a new one at its address is not
mistaken for it): modules ask for the same prompts, and HF's eager decode costs ~80 ms a token here."""


def hf_greedy(model, prompt: list[int], max_new_tokens: int, eos_token_id=None) -> list[int]:
    """HF transformers' own greedy decode of one prompt (the independent reference); each answer computed
    once per model object."""
    eos = tuple(eos_token_id) if isinstance(eos_token_id, (list, tuple)) else eos_token_id
    key = (tuple(prompt), max_new_tokens, eos)
    known = _GREEDY.setdefault(model, {})
    if key not in known:
        ids = torch.tensor([prompt])
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                 do_sample=False, eos_token_id=eos_token_id, pad_token_id=0)
        known[key] = out[0, len(prompt):].tolist()
    return list(known[key])


def assert_pool_at_rest(engine: EngineCore) -> None:
    """Every page FREE or CACHED with no lock, and evicting the tree returns the pool to full."""
    while engine.busy():  # host-tier backups still in flight lock their nodes
        engine.step()
    engine.check_integrity()
    usage = engine.kvm.pool.usage()
    assert usage.private == 0 and usage.in_flight == 0, f"pages still owned after all requests ended: {usage}"
    assert not engine.kvm.live, f"requests still hold KV: {list(engine.kvm.live)}"
    cache = engine.kvm.prefix_cache
    assert cache.evictable_pages() == cache.cached_pages(), "a tree node is still locked"
    cache.evict(usage.total)
    assert engine.kvm.pool.num_free == usage.total, "evicting the whole tree did not return the pool to full"
    engine.check_integrity()


def why_not_at_rest(worker) -> str:
    """"" when a worker of any role (the worker contract) holds nothing for any request, else what it
    still holds: work, transfers, PRIVATE or IN_FLIGHT device pages, landing pages, a failed check."""
    stats, live = worker.stats(), list(worker.engine.kvm.live)
    if worker.busy() or stats.num_running or stats.num_waiting or stats.num_transfers:
        return f"unfinished work: {stats}"
    if stats.device.private or stats.device.in_flight or live:
        return f"device pages still owned: {stats.device}, requests {live}"
    if stats.landing is not None and stats.landing.free != stats.landing.total:
        return f"landing pages still held: {stats.landing}"
    return stats.integrity_error


greedy = functools.partial(SamplingParams, temperature=0.0)


def sampled(prompts, max_tokens: int = SPEC_MAX_NEW, seed: int = 0) -> list[SamplingParams]:
    """Seeded temperature-1 sampling over the top 8 tokens, one seed per prompt."""
    return [SamplingParams(max_tokens=max_tokens, temperature=1.0, top_k=8, seed=seed + i, ignore_eos=True)
            for i in range(len(prompts))]


@functools.cache
def smollm2():
    """(LoadedModel, HF reference model) for the bundled SmolLM2-135M-Instruct, fp32, once per process."""
    from transformers import AutoModelForCausalLM

    from kernels.model.loader import load_model

    loaded = load_model("smollm2")
    reference = AutoModelForCausalLM.from_pretrained(loaded.model_dir, dtype=torch.float32).eval()
    return loaded, reference


def make_smollm2_engine(**kw) -> EngineCore:
    loaded, _ = smollm2()
    config = EngineConfig(debug_kv=True, **{"num_pages": 1024, **kw})
    return build_engine(config, loaded.model, loaded.arch, loaded.tokenizer, loaded.eos_token_ids)


CHAT_PROMPTS = [
    "Hi!",
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers greater than 100 and explain how you checked them.",
    "Explain, step by step, why the sky looks blue during the day but red at sunset. " * 3,
    "Translate to French: 'The cat sleeps on the warm windowsill while the rain falls outside.'",
    "Summarize the following text in one sentence: " + "Paged attention stores the key and value cache "
    "in fixed-size pages so that memory is allocated on demand and shared between requests. " * 6,
    "Give me a short Python function that reverses a linked list, with a docstring.",
]


def random_page_tables(seq_lens: list[int], page_size: int, spare_pages: int,
                       gen: torch.Generator) -> tuple[int, list[list[int]]]:
    """(num_pages, one page table per sequence): a random permutation of pages 1..num_pages-1 dealt to
    the sequences in order, so tables are non-contiguous, page 0 (scratch) is nobody's and
    `spare_pages` pages are left over."""
    pages_per_seq = [-(-s // page_size) for s in seq_lens]
    num_pages = 1 + sum(pages_per_seq) + spare_pages
    free = (torch.randperm(num_pages - 1, generator=gen) + 1).tolist()
    tables = []
    for n in pages_per_seq:
        tables.append(free[:n])
        free = free[n:]
    return num_pages, tables


def tiny_draft_head(style=None, seed: int = 0, draft_vocab: int = 64, target=None):
    """A random EAGLE head for the tiny Llama (eagle3 by default, over a `draft_vocab`-token draft
    vocabulary; eagle: the target's lm_head). Random weights: it drafts badly, which verification
    must make harmless. `target`: another tiny Llama (`make_tiny_llama`) to draft for; None:
    `tiny_models()`'s."""
    from kernels.model.eagle import DraftArch, DraftStyle, EagleDraftHead

    style = style or DraftStyle.EAGLE3
    ours, _, arch = tiny_models() if target is None else (target, None, target.arch)
    eagle3 = style is DraftStyle.EAGLE3
    head = EagleDraftHead(DraftArch.for_target(arch, style, draft_vocab if eagle3 else None), ours.model.embed_tokens,
                          None if eagle3 else ours.lm_head)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in head.named_parameters():
            if name.startswith("embed") or (name.startswith("lm_head") and not eagle3):
                continue  # the target's own
            noise = 0.1 * torch.randn(param.shape, generator=gen)
            param.copy_(1 + noise if "norm" in name else noise)
    return head


def make_spec_engine(head=None, page_size=4, num_pages=256, chunk_size=64, eos=(), **kw) -> EngineCore:
    """`make_engine` with EAGLE speculation over `head` (default: `tiny_draft_head()`)."""
    ours, _, arch = tiny_models()
    config = EngineConfig(page_size=page_size, num_pages=num_pages, chunk_size=chunk_size, speculative="eagle",
                          **{"debug_kv": True, "speculative_adaptive": False, **kw})
    return build_engine(config, ours, arch, eos_token_ids=eos, draft_head=head or tiny_draft_head())
