"""Penalties, logit biases, min-p and min_tokens (`kernels.sampling.adjust_logits`, the sampler's
min-p), against transformers' own logits processors where it has them and a plain loop where it does
not; then through the engine: greedy output with each rule equals HF generate's (or a reference
loop over HF's logits), plainly and on EAGLE verify rows."""

from __future__ import annotations

import pytest
import torch

from common.config import ConfigError, SamplingParams
from kernels.sampling import adjust_logits, filtered_probs
from tests.helpers import TINY_EOS, make_engine, make_spec_engine, tiny_models

VOCAB = 50


def _logits(rows: int = 1, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def test_repetition_penalty_is_hfs_over_prompt_and_output():
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    prompt, output, logits = [3, 7, 7, 11], [20, 3, 41], _logits()
    ours = adjust_logits(logits, SamplingParams(repetition_penalty=1.3), prompt, output)
    hf = RepetitionPenaltyLogitsProcessor(1.3)(torch.tensor([prompt + output]), logits.clone())
    torch.testing.assert_close(ours, hf)


def test_frequency_and_presence_penalties_count_the_output_only():
    prompt, output, logits = [5, 5, 9], [9, 12, 12, 12, 30], _logits(seed=1)
    ours = adjust_logits(logits, SamplingParams(frequency_penalty=0.5, presence_penalty=-0.25), prompt, output)
    want = logits.clone()
    for token in set(output):  # the OpenAI API's formula, token by token
        want[0, token] -= 0.5 * output.count(token) - 0.25
    torch.testing.assert_close(ours, want)


def test_verify_rows_see_the_drafts_before_them():
    """Row j of a verify row is the position after the output and drafts[:j]: each row's penalties
    are those of a plain row at that position."""
    params = SamplingParams(frequency_penalty=0.7, repetition_penalty=1.2, presence_penalty=0.3, min_tokens=5,
                            logit_bias={4: 2.0}, max_tokens=10)
    prompt, output, drafts, logits = [1, 2, 3], [8, 9], [9, 17, 4], _logits(4, seed=2)
    rows = adjust_logits(logits, params, prompt, output, stop_ids={2, 17}, drafts=drafts)
    for j in range(4):
        alone = adjust_logits(logits[j:j + 1], params, prompt, output + drafts[:j], stop_ids={2, 17})
        torch.testing.assert_close(rows[j:j + 1], alone)


def test_min_tokens_masks_the_stop_tokens_until_reached_and_the_bias_adds():
    params = SamplingParams(min_tokens=3, logit_bias={6: -100.0, 7: 5.5}, max_tokens=8)
    logits = _logits(3, seed=3)
    out = adjust_logits(logits, params, [1], [10], stop_ids={2, 40}, drafts=[11, 12])
    assert torch.isinf(out[:2, [2, 40]]).all() and out[2, 2] == logits[2, 2]  # row 2 is output token 3
    torch.testing.assert_close(out[:, 7], logits[:, 7] + 5.5)
    torch.testing.assert_close(out[:, 6], logits[:, 6] - 100)


def test_min_p_is_hfs():
    from transformers.generation.logits_process import MinPLogitsWarper

    logits = _logits(2, seed=4)
    ours = filtered_probs(logits, 0.7, 0, 1.0, min_p=0.1)
    hf = MinPLogitsWarper(0.1)(None, logits / 0.7).softmax(dim=-1)
    torch.testing.assert_close(ours, hf)


@pytest.mark.parametrize("bad", [dict(frequency_penalty=2.5), dict(repetition_penalty=-1.0), dict(min_p=1.5),
                                 dict(min_tokens=9, max_tokens=8), dict(logit_bias={3: 101})])
def test_values_out_of_range_are_refused(bad):
    with pytest.raises(ConfigError):
        SamplingParams(**bad)


def _hf_generate(hf, prompt: list[int], n: int, **kw) -> list[int]:
    ids = torch.tensor([prompt])
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False, **kw)
    return out[0, len(prompt):].tolist()


def _hf_greedy_loop(hf, prompt: list[int], n: int, params: SamplingParams) -> list[int]:
    """Greedy over HF's logits with the OpenAI penalties applied by hand, one token at a time."""
    out: list[int] = []
    for _ in range(n):
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + out])).logits[0, -1].float()
        for token in set(out):
            logits[token] -= params.frequency_penalty * out.count(token) + params.presence_penalty
        out.append(int(logits.argmax()))
        if out[-1] == TINY_EOS:
            break
    return out


PROMPTS = [[5, 9, 9, 17, 23, 5, 9], [40, 41, 42, 40, 41, 42, 40, 41]]
RULES = [
    (SamplingParams(max_tokens=10, repetition_penalty=1.5), dict(repetition_penalty=1.5)),
    (SamplingParams(max_tokens=10, logit_bias={5: 8.0, 9: -100.0}),
     dict(sequence_bias={(5,): 8.0, (9,): -100.0})),
    (SamplingParams(max_tokens=10, frequency_penalty=1.5, presence_penalty=0.5), None),
]


@pytest.mark.parametrize("params, hf_kwargs", RULES, ids=["repetition", "logit_bias", "frequency_presence"])
@pytest.mark.parametrize("speculative", [False, True], ids=["plain", "eagle"])
def test_greedy_output_with_each_rule_is_the_references(params, hf_kwargs, speculative):
    _, hf, _ = tiny_models()
    engine = make_spec_engine(eos=(TINY_EOS,)) if speculative else make_engine(eos=(TINY_EOS,))
    try:
        got = [r.output_token_ids for r in engine.generate(PROMPTS, [params] * len(PROMPTS))]
        if speculative:
            assert engine.speculator.counters.verifies > 0, "no verify row ran: the rules were not checked there"
        engine.check_integrity()
    finally:
        engine.close()
    want = [_hf_generate(hf, p, params.max_tokens, **hf_kwargs) if hf_kwargs is not None
            else _hf_greedy_loop(hf, p, params.max_tokens, params) for p in PROMPTS]
    assert got == want
    plain = [_hf_generate(hf, p, params.max_tokens) for p in PROMPTS]
    assert got != plain, "the rule changed nothing here: the test proves nothing"


def test_min_tokens_holds_eos_back_as_hfs_min_new_tokens():
    _, hf, _ = tiny_models()
    first = _hf_generate(hf, PROMPTS[0], 1)[0]  # make the model's first greedy token its EOS
    engine = make_engine(eos=(first,))
    try:
        params = SamplingParams(max_tokens=6, min_tokens=4)
        out = engine.generate([PROMPTS[0]], [params])[0]
        assert engine.generate([PROMPTS[0]], [SamplingParams(max_tokens=6)])[0].output_token_ids == [first]
        engine.check_integrity()
    finally:
        engine.close()
    want = _hf_generate(hf, PROMPTS[0], 6, min_new_tokens=4, eos_token_id=first)
    assert out.output_token_ids == want[:len(out.output_token_ids)] and len(out.output_token_ids) >= 4
