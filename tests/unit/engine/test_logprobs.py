"""Logprobs of output and prompt tokens (`engine.logprobs`) against transformers' log-softmax of the
same sequence: plain rows, chunked prompts, a cached prefix that must not be reused, sampled rows
(raw values, before temperature and rules), and EAGLE verify rows (chain and tree)."""

from __future__ import annotations

import pytest
import torch

from common.config import ConfigError, SamplingParams
from kernels.model.eagle import DraftStyle
from tests.helpers import SPEC_MAX_NEW, TINY_EOS, make_engine, make_spec_engine, tiny_draft_head, tiny_models
from tests.unit.engine.test_spec_engine import _script_drafts
from tests.unit.engine.test_spec_tree import script_trees

PROMPTS = [[5, 9, 9, 17, 23, 5, 9, 30, 31, 2, 8], [40, 41, 42, 40, 41, 42, 40, 41]]
TOP = 3


def _hf_logprobs(hf, ids: list[int]) -> torch.Tensor:
    """[len(ids), V]: HF's log-softmax at every position of `ids` (row p predicts token p + 1)."""
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)


def _check(entry, want_row: torch.Tensor, token: int) -> None:
    assert entry.logprob == pytest.approx(float(want_row[token]), abs=1e-4)
    assert entry.rank == int((want_row > want_row[token]).sum()) + 1
    top = want_row.topk(TOP)
    assert [t for t, _ in entry.top] == top.indices.tolist()
    assert [v for _, v in entry.top] == pytest.approx(top.values.tolist(), abs=1e-4)


def _check_request(hf, req) -> None:
    ids = req.prompt_token_ids + req.output_token_ids
    want = _hf_logprobs(hf, ids)
    p = len(req.prompt_token_ids)
    assert len(req.output_logprobs) == len(req.output_token_ids)
    for i, (token, entry) in enumerate(zip(req.output_token_ids, req.output_logprobs)):
        _check(entry, want[p - 1 + i], token)
    if req.params.prompt_logprobs is not None:
        assert len(req.prompt_logprobs) == p and req.prompt_logprobs[0] is None
        for pos in range(1, p):
            _check(req.prompt_logprobs[pos], want[pos - 1], req.prompt_token_ids[pos])


@pytest.mark.parametrize("temperature", [0.0, 0.8], ids=["greedy", "sampled"])
def test_output_and_prompt_logprobs_are_hfs(temperature):
    """Chunks of 4 tokens: the prompt's logprobs come from several chunks; a sampled request's values
    are still the model's own (raw), whatever its temperature and penalty."""
    _, hf, _ = tiny_models()
    engine = make_engine(chunk_size=4, eos=(TINY_EOS,))
    params = SamplingParams(max_tokens=6, temperature=temperature, seed=3, logprobs=TOP, prompt_logprobs=TOP,
                            frequency_penalty=0.5 if temperature else 0.0)
    try:
        reqs = engine.generate(PROMPTS, params)
        engine.check_integrity()
    finally:
        engine.close()
    for req in reqs:
        _check_request(hf, req)


def test_a_cached_prefix_is_computed_again_for_prompt_logprobs():
    _, hf, _ = tiny_models()
    engine = make_engine(eos=(TINY_EOS,))
    try:
        engine.generate([PROMPTS[0]], SamplingParams(max_tokens=2))  # its prompt enters the prefix cache
        again = engine.generate([PROMPTS[0] + [7]], SamplingParams(max_tokens=2, logprobs=TOP))[0]
        assert again.cached_tokens > 0, "the test needs a cache hit to prove the next request skips it"
        req = engine.generate([PROMPTS[0] + [7]], SamplingParams(max_tokens=2, logprobs=TOP,
                                                                 prompt_logprobs=TOP))[0]
        assert req.cached_tokens == 0
        engine.check_integrity()
    finally:
        engine.close()
    _check_request(hf, req)


@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
def test_verify_rows_give_the_targets_logprobs(spec_prompts, reference, tree):
    """Drafts steered to be accepted most of the time (a tree's on random branches), so the emitted
    tokens come from verify rows past the first, and a tree's from its accepted path's rows."""
    _, hf, _ = tiny_models()
    params = SamplingParams(max_tokens=SPEC_MAX_NEW, logprobs=TOP, prompt_logprobs=TOP)
    if tree:
        engine = make_spec_engine(tiny_draft_head(DraftStyle.EAGLE3), speculative_topk=2)
        script_trees(engine, reference, accept=0.8, seed=1)
    else:
        engine = make_spec_engine()
        _script_drafts(engine, reference, accept=0.7, seed=1)
    try:
        reqs = engine.generate(spec_prompts[:3], params)
        accepted = dict(engine.spec_stats().accepted_per_verify)
        assert sum(n for k, n in accepted.items() if k > 0) > 0, "no draft was accepted: verify rows unproven"
        engine.check_integrity()
    finally:
        engine.close()
    for req in reqs:
        _check_request(hf, req)


def test_a_session_turn_refuses_prompt_logprobs():
    engine = make_engine()
    try:
        with pytest.raises(ValueError, match="prompt_logprobs"):
            engine.add_request([1, 2, 3], SamplingParams(prompt_logprobs=1), session_id="s")
    finally:
        engine.close()


@pytest.mark.parametrize("bad", [dict(logprobs=21), dict(prompt_logprobs=-1), dict(logprobs=1.5)])
def test_logprob_counts_out_of_range_are_refused(bad):
    with pytest.raises(ConfigError):
        SamplingParams(**bad)
