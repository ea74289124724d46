"""A request resumed on a fresh engine from the tokens a dead worker had streamed (`Request.resume`,
`Generate.resume_output`) continues token-identically to the undisturbed run: seeded sampling with
penalties and `min_tokens`, with and without EAGLE drafting (equal to each other), and stop strings spanning the point
of resumption. The undisturbed run on another engine is the reference."""

from __future__ import annotations

import pytest

from common.config import SamplingParams
from engine.stop import StopRules
from tests.helpers import assert_pool_at_rest, make_engine, make_prompts, make_spec_engine, tiny_draft_head

NEW = 20


def _run(engine, prompts, params, resumed=None) -> list[list[int]]:
    reqs = [engine.add_request(p, params, f"r{i}", resumed=resumed[i] if resumed else ())
            for i, p in enumerate(prompts)]
    while engine.busy():
        engine.step()
    assert_pool_at_rest(engine)
    return [r.output_token_ids for r in reqs]


@pytest.mark.parametrize("speculative", [False, True], ids=["plain", "eagle"])
def test_a_resumed_request_continues_as_the_undisturbed_run(speculative):
    """Seeded sampling with penalties, plain and with EAGLE drafting (a verify row chooses the
    sampler's own draw, so the resumed run's different drafts change nothing); the EAGLE runs equal
    the plain ones too."""
    prompts = make_prompts(4, min_len=5, max_len=30, seed=9)
    params = SamplingParams(max_tokens=NEW, temperature=0.9, top_p=0.95, seed=1234,
                            frequency_penalty=0.6, presence_penalty=0.3, repetition_penalty=1.2, min_tokens=NEW)
    build = (lambda: make_spec_engine(tiny_draft_head(), eos=(2,))) if speculative else \
        (lambda: make_engine(eos=(2,)))
    undisturbed = _run(build(), prompts, params)
    if speculative:
        assert undisturbed == _run(make_engine(eos=(2,)), prompts, params)
    assert all(len(out) == NEW for out in undisturbed)  # min_tokens held EOS off
    for cut in (1, 7, NEW - 1):
        resumed = [out[:cut] for out in undisturbed]
        assert _run(build(), prompts, params, resumed) == undisturbed, cut


def test_a_resumed_output_must_leave_room_and_be_in_the_vocabulary():
    engine = make_engine()
    params = SamplingParams(max_tokens=4)
    with pytest.raises(ValueError, match="resumed output of 4 tokens leaves no room"):
        engine.add_request([5, 6, 7], params, resumed=[1, 2, 3, 4])
    with pytest.raises(ValueError, match=r"resumed output token ids must be in \[0, 256\)"):
        engine.add_request([5, 6, 7], params, resumed=[999])
    assert not engine.busy()


def test_stop_strings_span_the_point_of_resumption():
    """A stop string whose first half was streamed before the death and whose second half comes after
    it is found, at the same place as in one run."""
    from tests.helpers import smollm2

    loaded, _ = smollm2()
    tok = loaded.tokenizer
    ids = tok.encode("The boats came in at dawn, and then the market opened.", add_special_tokens=False)
    params = SamplingParams(max_tokens=64, stop=("at dawn",))
    whole = StopRules(params, frozenset(), tok, 4096)
    ends = next(n for n in range(1, len(ids) + 1) if whole.check(ids[:n], n))
    for cut in range(1, ends):
        rules = StopRules(params, frozenset(), tok, 4096)
        rules.resume(ids[:cut])
        at = next(n for n in range(cut + 1, len(ids) + 1) if rules.check(ids[:n], n))
        assert (at, rules.text_len) == (ends, whole.text_len), cut
