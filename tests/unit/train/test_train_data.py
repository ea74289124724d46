"""The training data plumbing on the tiny target: the engine's greedy answers come back in prompt
order and equal HF's greedy decode (a bfloat16 copy's those of HF in bfloat16), and aux states from
grouped ragged passes equal one pass per sequence."""

from __future__ import annotations

import copy

import pytest
import torch

from cluster.train.data import Sample, aux_states, generate
from kernels.attention.metadata import build_attn_metadata
from kernels.kv_layout import KVCacheTensors
from tests.helpers import hf_greedy, make_prompts, tiny_models


def test_answers_are_the_targets_greedy_continuations_in_prompt_order():
    target, reference, arch = tiny_models()
    prompts = make_prompts(3, min_len=4, max_len=30, seed=11)
    samples = generate(target, arch, (), prompts, max_new_tokens=12, max_running=2)
    for prompt, sample in zip(prompts, samples):
        assert sample.token_ids[:sample.prompt_len] == tuple(prompt)
        assert list(sample.answer) == hf_greedy(reference, prompt, 12)


def test_a_bfloat16_copy_answers_in_bfloat16():
    """`precision` bf16: the engine takes the model's dtype (a float32 KV pool under bfloat16 weights
    failed in attention), and its answers are the bfloat16 model's: HF's bfloat16 greedy decode, up to
    the near-ties that two bfloat16 implementations may break differently."""
    target, reference, arch = tiny_models()
    target16, reference16 = copy.deepcopy(target).bfloat16(), copy.deepcopy(reference).bfloat16()
    prompts = make_prompts(6, min_len=4, max_len=30, seed=11)
    samples = generate(target16, arch, (), prompts, max_new_tokens=16, max_running=3)
    same = total = 0
    for prompt, sample in zip(prompts, samples):
        expected = hf_greedy(reference16, prompt, 16)
        assert sample.token_ids[:sample.prompt_len] == tuple(prompt) and len(sample.answer) == 16
        assert sample.answer[0] == expected[0]
        same += sum(a == b for a, b in zip(sample.answer, expected))
        total += len(expected)
    assert same >= 0.9 * total, f"bfloat16 answers match HF's bfloat16 greedy at {same} of {total} tokens"


def test_grouped_aux_passes_equal_one_pass_per_sequence():
    target, _, arch = tiny_models()
    samples = [Sample(tuple(p), 2) for p in make_prompts(5, min_len=5, max_len=40, seed=12)]
    grouped = aux_states(target, samples, (1, 0), tokens_per_pass=50)
    for sample, aux in zip(samples, grouped):
        n = len(sample.token_ids)
        kv = KVCacheTensors.allocate(arch.num_layers, 12, 4, arch.num_kv_heads, arch.head_dim, torch.float32, "cpu")
        meta, positions = build_attn_metadata(4, [n], [n], [list(range(1, 12))], [], "cpu")
        _, _, alone = target.forward_with_aux(torch.tensor(sample.token_ids), positions, meta, kv, (1, 0))
        assert aux.shape == (n, 2 * arch.hidden_size)
        torch.testing.assert_close(aux, alone, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("bf16", [True, False], ids=["bf16", "fp32"])
def test_training_answers_come_from_a_bfloat16_copy_and_held_out_ones_from_the_target(bf16, tmp_path, monkeypatch):
    """`eagle._answerer` with bf16 is a bfloat16 copy the loader makes, else the target itself (no
    load); `eagle._generations` answers the training prompts with it (HF's bfloat16 greedy), the
    held-out prompts always with the target (HF's float32 greedy: acceptance is measured against
    the target's own answers); saved for a resume."""
    from types import SimpleNamespace

    import kernels.model.loader as loader
    from cluster.train import data, eagle
    from cluster.train.settings import TrainSettings

    target, reference, arch = tiny_models()
    prompts = {"train": make_prompts(4, min_len=4, max_len=20, seed=21),
               "eval": make_prompts(2, min_len=4, max_len=20, seed=22)}
    monkeypatch.setattr(data, "load_prompts", lambda split, limit=None: prompts[split][:limit])
    monkeypatch.setattr(data, "tokenize", lambda tokenizer, ps: ps)
    loads = []

    def load_copy(spec, device="cpu", dtype=torch.float32, backend="torch", cache_dir=None):
        loads.append(dtype)
        return SimpleNamespace(model=copy.deepcopy(target).to(dtype), arch=arch, eos_token_ids=())

    monkeypatch.setattr(loader, "load_model", load_copy)
    settings = TrainSettings(num_prompts=4, max_new_tokens=10)
    loaded = SimpleNamespace(model=target, arch=arch, eos_token_ids=(), tokenizer=None)
    answerer = eagle._answerer(loaded, settings, bf16, None, "cpu")
    assert loads == ([torch.bfloat16] if bf16 else [])
    assert (answerer is loaded) != bf16
    assert next(answerer.model.parameters()).dtype == (torch.bfloat16 if bf16 else torch.float32)
    path = tmp_path / "generations.json"
    train, held_out = eagle._generations(path, loaded, answerer, settings)
    train_reference = copy.deepcopy(reference).bfloat16() if bf16 else reference
    agree = sum(a == b for s, p in zip(train, prompts["train"])
                for a, b in zip(s.answer, hf_greedy(train_reference, p, 10)))
    assert agree >= 0.9 * 40
    for sample, prompt in zip(held_out, prompts["eval"]):
        assert list(sample.answer) == hf_greedy(reference, prompt, 10)
    assert eagle._generations(path, None, None, settings) == (train, held_out)  # a resume reads them back
