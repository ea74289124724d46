"""Training data for a draft head: the shipped chat prompts, the target's own greedy answers to them
(through tandem's colocated engine, as `tandem run` generates), and the target's aux hidden states
over prompt + answer.

The prompts are template-made chat requests (explain / compare / write / code ...). The evaluation
set uses slot values (topics, tasks) that no training prompt uses.
"""

from __future__ import annotations

import json
import logging
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from kernels.model.llama import LlamaForCausalLM

log = logging.getLogger("tandem.train")

DATA_DIR = Path(__file__).parent / "data"
PROMPT_FILES = {"train": DATA_DIR / "train_prompts.jsonl", "eval": DATA_DIR / "eval_prompts.jsonl"}
AUX_TOKENS_PER_PASS = 2048  # target tokens per aux forward: bounds the pass's KV and activations


@dataclass(frozen=True)
class Sample:
    """One training sequence: the prompt's tokens (chat template applied) and the target's answer."""

    token_ids: tuple[int, ...]  # prompt + answer
    prompt_len: int

    def __post_init__(self):
        assert 1 <= self.prompt_len <= len(self.token_ids), (
            f"prompt_len {self.prompt_len} outside [1, {len(self.token_ids)}]: answer cut from its prompt?")

    @property
    def answer(self) -> tuple[int, ...]:
        return self.token_ids[self.prompt_len:]


def load_prompts(split: str, limit: int | None = None) -> list[list[dict]]:
    """The first `limit` (all: None) chat prompts of the shipped `split` ("train" or "eval"), each a
    list of {role, content} messages. Raises ValueError when the split holds fewer than `limit`."""
    if split not in PROMPT_FILES:
        raise ValueError(f"prompt split {split!r}: expected one of {sorted(PROMPT_FILES)}")
    lines = PROMPT_FILES[split].read_text().splitlines()
    prompts = [json.loads(line)["messages"] for line in lines if line.strip()]
    if limit is not None and limit > len(prompts):
        raise ValueError(f"{limit} {split} prompts asked for; the shipped set has {len(prompts)}")
    return prompts[:limit]


def tokenize(tokenizer, prompts: list[list[dict]]) -> list[list[int]]:
    from kernels.model.tokenizer import apply_chat_template

    return [apply_chat_template(tokenizer, messages) for messages in prompts]


def generate(model: LlamaForCausalLM, arch, eos_token_ids, prompts: list[list[int]], max_new_tokens: int,
             max_running: int = 128) -> list[Sample]:
    """The target's greedy answers through the colocated engine (batched, as `tandem run` does; in
    `model`'s dtype), in prompt order. The engine's KV is freed before returning; `model` is left as it was."""
    from tqdm import tqdm

    from common.config import EngineConfig, SamplingParams
    from engine import build_engine
    from kernels.kv_layout import DTYPE_NAMES

    longest = max(len(p) for p in prompts) + max_new_tokens
    page_size = 16
    num_pages = 2 + min(max_running, len(prompts)) * -(-longest // page_size)
    # no prefix cache: the prompts share little beyond the system prompt, and a pool full of cached
    # answers makes every new page an eviction
    param = next(model.parameters())
    config = EngineConfig(device=param.device.type, dtype=DTYPE_NAMES[param.dtype], page_size=page_size,
                          num_pages=num_pages, max_running_requests=max_running, enable_prefix_cache=False,
                          host_cache_pages=0)
    engine = build_engine(config, model, arch, eos_token_ids=eos_token_ids)
    try:
        with tqdm(total=len(prompts), desc="generating", unit="prompt", file=sys.stderr, disable=None) as bar:
            reqs = engine.generate(prompts, SamplingParams(max_tokens=max_new_tokens),
                                   on_finish=lambda _: bar.update(1))
    finally:
        engine.close()
    return [Sample(tuple(r.prompt_token_ids) + tuple(r.output_token_ids), len(r.prompt_token_ids)) for r in reqs]


def aux_states(model: LlamaForCausalLM, samples: list[Sample], aux_layer_ids: tuple[int, ...],
               tokens_per_pass: int = AUX_TOKENS_PER_PASS) -> list[torch.Tensor]:
    """Per sample, the hidden states entering `aux_layer_ids` at every position: ``[n, 3h]`` float32,
    from ragged prefill passes of whole sequences (`LlamaForCausalLM.forward_with_aux`)."""
    return [aux for aux, _ in target_states(model, samples, aux_layer_ids, tokens_per_pass)]


@torch.no_grad()
def target_states(model: LlamaForCausalLM, samples: list[Sample], aux_layer_ids: tuple[int, ...],
                  tokens_per_pass: int = AUX_TOKENS_PER_PASS) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per sample, (aux states ``[n, 3h]``, ``[n, 0]`` for no aux layers, the target's final-normed
    hidden ``[n, h]``), float32: the
    target's logits for token j + 1 are its lm_head of hidden[j] (soft labels, `trainer`)."""
    out: list[tuple[torch.Tensor, torch.Tensor]] = []
    for group in _groups(samples, tokens_per_pass):
        out += _aux_pass(model, [samples[i] for i in group], aux_layer_ids)
    return out


def _groups(samples: list[Sample], tokens_per_pass: int) -> list[list[int]]:
    """Consecutive sample indices, about `tokens_per_pass` tokens a group (a longer sample goes alone)."""
    groups: list[list[int]] = []
    current: list[int] = []
    tokens = 0
    for i, sample in enumerate(samples):
        if current and tokens + len(sample.token_ids) > tokens_per_pass:
            groups.append(current)
            current, tokens = [], 0
        current.append(i)
        tokens += len(sample.token_ids)
    return groups + [current] if current else groups


def _aux_pass(model: LlamaForCausalLM, samples: list[Sample], aux_layer_ids: tuple[int, ...]
              ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    from kernels.attention.metadata import build_attn_metadata
    from kernels.kv_layout import KVCacheTensors

    arch, page_size = model.arch, 16
    lens = [len(s.token_ids) for s in samples]
    page_tables, next_page = [], 1  # page 0 is scratch
    for n in lens:
        num_pages = -(-n // page_size)
        page_tables.append(list(range(next_page, next_page + num_pages)))
        next_page += num_pages
    param = next(model.parameters())
    kv = KVCacheTensors.allocate(arch.num_layers, next_page, page_size, arch.num_kv_heads, arch.head_dim,
                                 param.dtype, param.device)
    meta, positions = build_attn_metadata(page_size, lens, lens, page_tables, [], param.device)
    ids = torch.tensor([t for s in samples for t in s.token_ids], dtype=torch.int64, device=param.device)
    hidden, _, aux = model.forward_with_aux(ids, positions, meta, kv, aux_layer_ids)
    aux = hidden.new_empty(len(ids), 0) if aux is None else aux  # no aux layers (an eagle head): [n, 0]
    return [(a.float().cpu(), h.float().cpu()) for a, h in zip(aux.split(lens), hidden.split(lens))]
