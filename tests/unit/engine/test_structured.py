"""Structured outputs through the engine (`engine/structured.py`) on SmolLM2 and its real tokenizer:
JSON schema, regex and choice outputs hold to their grammar greedy and sampled; a grammar still
compiling holds its request back without holding the step; the disaggregated pair samples the first
token under the grammar on the prefill worker and the decode worker resumes the matcher from it;
EAGLE drafts are verified under the mask (lossless against plain decoding with the grammar)."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from common.config import EngineConfig, SamplingParams
from common.grammar_spec import GrammarSpec
from engine.build import build_engine
from engine.request import FinishReason
from kernels.model.tokenizer import encode_prompt
from tests.helpers import assert_pool_at_rest, make_smollm2_engine, smollm2, tiny_draft_head
from tests.unit.engine.test_grammar import SCHEMA
from tests.unit.engine.test_spec_engine import _script_drafts

pytestmark = pytest.mark.slow

PROMPTS = ["A user record as JSON:", "Describe a cat.", "Numbers:"]
REGEX = r"[A-Z][a-z]{2,6} [0-9]{2}"
CHOICES = ["red", "green", "blue"]


def _prompts() -> list[list[int]]:
    return [encode_prompt(smollm2()[0].tokenizer, p) for p in PROMPTS]


def _check_json(engine, req) -> None:
    text = engine.tokenizer.decode(req.output_token_ids, skip_special_tokens=True)
    jsonschema.validate(json.loads(text), SCHEMA)
    assert req.finish_reason is FinishReason.STOP, (req.finish_reason, text)


@pytest.fixture(scope="module")
def engine():
    engine = make_smollm2_engine(num_pages=256)
    yield engine
    assert_pool_at_rest(engine)
    engine.close()


def test_json_schema_outputs_validate_greedy_and_sampled(engine):
    spec = GrammarSpec.json_schema(SCHEMA)
    params = [SamplingParams(max_tokens=160, grammar=spec, temperature=t, seed=s)
              for t, s in ((0.0, None), (1.0, 1), (1.0, 2))]
    reqs = engine.generate([_prompts()[0]] * 3, params)
    for req in reqs:
        _check_json(engine, req)
    engine.check_integrity()


def test_regex_and_choice_outputs_match(engine):
    regex, choice = GrammarSpec.regex(REGEX), GrammarSpec.choice(CHOICES)
    params = [SamplingParams(max_tokens=20, grammar=g, temperature=1.0, seed=i) for i, g in
              enumerate([regex, regex, choice, choice])]
    reqs = engine.generate([_prompts()[1]] * 4, params)
    texts = [engine.tokenizer.decode(r.output_token_ids, skip_special_tokens=True) for r in reqs]
    assert all(re.fullmatch(REGEX, t) for t in texts[:2]), texts
    assert all(t in CHOICES for t in texts[2:]), texts


def test_a_compiling_grammar_holds_its_request_not_the_step(engine):
    """A 150-field schema takes a while to compile: a plain request admitted beside it runs meanwhile."""
    big = {"type": "object", "properties": {f"field_{i}": {"type": "integer"} for i in range(150)},
           "required": ["field_0"]}
    held = engine.add_request(_prompts()[2], SamplingParams(max_tokens=8, grammar=GrammarSpec.json_schema(big)))
    plain = engine.add_request(_prompts()[2], SamplingParams(max_tokens=4, ignore_eos=True))
    assert held in engine.structured.held and engine.busy()
    engine.step()
    assert plain.output_token_ids and held in engine.structured.held, "the step waited for the compile"
    while engine.busy():
        engine.step()
    assert held.finish_reason is not None and held.output_token_ids and not engine.structured.held
    assert engine.tokenizer.decode(held.output_token_ids).startswith("{")


def test_a_held_request_aborts_cleanly(engine):
    other = {"type": "object", "properties": {f"g_{i}": {"type": "string"} for i in range(120)}}
    req = engine.add_request(_prompts()[2], SamplingParams(max_tokens=8, grammar=GrammarSpec.json_schema(other)))
    assert req in engine.structured.held and engine.abort(req.request_id)
    assert req.finish_reason is FinishReason.ABORT and not engine.structured.held


def test_min_tokens_with_a_grammar_is_refused(engine):
    with pytest.raises(ValueError, match="min_tokens"):
        engine.add_request(_prompts()[0], SamplingParams(min_tokens=2, grammar=GrammarSpec.json_object()))


def test_disaggregated_first_token_is_sampled_under_the_grammar():
    from cluster.worker_host.build import make_worker
    from kv_store.transfer.local import LocalTransport
    from tests.step_pair import StepPair

    loaded, _ = smollm2()
    config = EngineConfig(page_size=16, num_pages=256, chunk_size=64, debug_kv=True)
    kw = dict(tokenizer=loaded.tokenizer, eos_token_ids=loaded.eos_token_ids, clock=lambda: 0.0)
    prefill = make_worker("prefill", config, loaded.model, loaded.arch, LocalTransport(), **kw)
    decode = make_worker("decode", config, loaded.model, loaded.arch, LocalTransport(), host_pages=256, **kw)
    try:
        pair = StepPair(prefill, decode)
        choice = pair.generate([_prompts()[1]], SamplingParams(max_tokens=8, grammar=GrammarSpec.choice(CHOICES)))
        record = pair.generate([_prompts()[0]], SamplingParams(max_tokens=160, grammar=GrammarSpec.json_schema(SCHEMA)))
        text = loaded.tokenizer.decode(choice[0].token_ids, skip_special_tokens=True)
        assert text in CHOICES and choice[0].finish_reason is FinishReason.STOP
        jsonschema.validate(json.loads(loaded.tokenizer.decode(record[0].token_ids, skip_special_tokens=True)), SCHEMA)
        prefill.check_integrity()
        decode.check_integrity()
    finally:
        prefill.close()
        decode.close()


def test_eagle_verifies_drafts_under_the_mask(engine):
    """Drafts steered towards the grammar's greedy output (70% right, the rest random tokens the mask
    refuses): the output equals plain greedy decoding under the grammar, and drafts were accepted."""
    loaded, _ = smollm2()
    spec = GrammarSpec.json_schema(SCHEMA)
    prompt = _prompts()[0]
    [plain] = engine.generate([prompt], SamplingParams(max_tokens=160, grammar=spec))
    config = EngineConfig(num_pages=256, speculative="eagle", speculative_adaptive=False, debug_kv=True)
    head = tiny_draft_head(target=loaded.model)
    spec_engine = build_engine(config, loaded.model, loaded.arch, loaded.tokenizer, loaded.eos_token_ids,
                               draft_head=head)
    try:
        _script_drafts(spec_engine, {tuple(prompt): plain.output_token_ids}, accept=0.7, seed=4)
        [req] = spec_engine.generate([prompt], SamplingParams(max_tokens=160, grammar=spec))
        accepted = dict(spec_engine.spec_stats().accepted_per_verify)
        spec_engine.check_integrity()
    finally:
        spec_engine.close()
    assert req.output_token_ids == plain.output_token_ids
    assert sum(n for k, n in accepted.items() if k > 0) > 0, "no draft was accepted"
    _check_json(engine, req)


def test_a_resumed_request_continues_under_its_grammar_where_it_was(engine):
    """A JSON-schema request resumed from part of its output (a worker died mid-stream,
    `Request.resume`): its matcher is rebuilt from that output, and the seeded continuation is the
    undisturbed one, valid JSON."""
    spec = GrammarSpec.json_schema(SCHEMA)
    params = SamplingParams(max_tokens=160, grammar=spec, temperature=1.0, seed=3)
    prompt = _prompts()[0]
    [whole] = engine.generate([prompt], params)
    _check_json(engine, whole)
    cut = len(whole.output_token_ids) // 2
    req = engine.add_request(prompt, params, resumed=whole.output_token_ids[:cut])
    while engine.busy():
        engine.step()
    assert req.output_token_ids == whole.output_token_ids
    _check_json(engine, req)
