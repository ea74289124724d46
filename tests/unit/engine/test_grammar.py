"""Structured outputs (engine/grammar.py) on the real SmolLM2 tokenizer: what a random model emits
under the masks is a sentence of the grammar; masks for drafts, forks and replays equal the masks of
accepting token by token; compiles are cached, bounded, asynchronous and fail with GrammarError."""

from __future__ import annotations

import functools
import json
import pickle
import re
import time
from concurrent.futures import CancelledError

import jsonschema
import pytest
import torch

from engine.grammar import (
    GrammarCompiler,
    GrammarError,
    GrammarSpec,
    GrammarState,
    allocate_bitmask,
    apply_bitmask,
)

pytestmark = pytest.mark.slow  # the real SmolLM2 tokenizer (no model weights)

EOS = 2  # SmolLM2's <|im_end|>, the tokenizer's eos_token_id
SCHEMA = {  # every value bounded, so that a random walk ends within ~100 tokens
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 5},
        "n": {"type": "integer", "minimum": 0, "maximum": 999},
        "ok": {"type": "boolean"},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
        "kind": {"enum": ["x", "y"]},
    },
    "required": ["name", "n", "ok", "tags", "kind"],
    "additionalProperties": False,
}
CHOICES = ['say "hi"', "back\\slash", "new\nline", "café 東京", "", "[x]"]


@functools.cache
def tokenizer():
    from transformers import AutoTokenizer  # the engine's tokenizer (xgrammar reads its vocabulary)

    from kernels.model.loader import resolve_model_dir

    return AutoTokenizer.from_pretrained(resolve_model_dir("smollm2"))


def encode(text: str) -> list[int]:
    return tokenizer().encode(text, add_special_tokens=False)


def make_compiler(extra_vocab: int = 0, **kw) -> GrammarCompiler:
    return GrammarCompiler(tokenizer(), len(tokenizer()) + extra_vocab, **kw)


@pytest.fixture(scope="module")
def compiler():
    compiler = make_compiler()
    yield compiler
    compiler.check_integrity()
    compiler.close()


def allowed(state: GrammarState) -> torch.Tensor:
    """The mask of the next token as bools.  # [vocab_size]"""
    logits = torch.zeros(state.grammar.vocab_size)
    state.fill_mask(logits)
    return logits > float("-inf")


def random_walk(state: GrammarState, seed: int, max_tokens: int = 200) -> list[int]:
    """Greedy choice over seeded random logits under the mask until a stop token; the ids before it."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(max_tokens):
        logits = torch.randn(state.grammar.vocab_size, generator=gen)
        state.fill_mask(logits)
        token_id = int(logits.argmax())
        assert state.accept([token_id]) == [True], f"the grammar refused {token_id}, which its mask allowed"
        if state.is_terminated():
            assert token_id == EOS
            return out
        out.append(token_id)
    raise AssertionError(f"no stop token after {max_tokens} tokens: {tokenizer().decode(out)!r}")


@pytest.mark.parametrize("seed", range(4))
def test_json_schema_output_validates(compiler, seed):
    state = compiler.new_state(GrammarSpec.json_schema(SCHEMA))
    ids = random_walk(state, seed)
    jsonschema.validate(json.loads(tokenizer().decode(ids)), SCHEMA)
    assert state.num_accepted == len(ids) + 1 and state.token_ids[-1] == EOS


def test_json_object_allows_objects_only(compiler):
    state = compiler.new_state(GrammarSpec.json_object())
    first = {tokenizer().decode([i]) for i in allowed(state).nonzero().flatten().tolist()}
    assert first and all(text.startswith("{") for text in first), first
    assert all(state.accept(encode('{"a": [1, {"b": null}], "c": "d"}')))
    assert state.is_completed() and allowed(state)[EOS]


@pytest.mark.parametrize("seed", range(3))
def test_regex_output_matches(compiler, seed):
    pattern = r"[0-9]{3}-[a-z]{2,4}(\.[A-Z])?"
    ids = random_walk(compiler.new_state(GrammarSpec.regex(pattern)), seed)
    assert re.fullmatch(pattern, tokenizer().decode(ids))


@pytest.mark.parametrize("seed", range(3))
def test_choice_output_is_one_choice(compiler, seed):
    ids = random_walk(compiler.new_state(GrammarSpec.choice(CHOICES)), seed)
    assert tokenizer().decode(ids) in CHOICES


@pytest.mark.parametrize("choice", CHOICES)
def test_every_choice_is_accepted_whole(compiler, choice):
    state = compiler.new_state(GrammarSpec.choice(CHOICES))
    assert all(state.accept(encode(choice))) and state.is_completed()
    assert state.accept([EOS]) == [True] and state.is_terminated()


@pytest.mark.parametrize("spec, words", [
    (GrammarSpec.regex("a(b"), "parenthesis is not closed"),
    (GrammarSpec.json_schema({"type": "nonsense"}), 'Unsupported type "nonsense"'),
    (GrammarSpec.json_schema(False), "cannot accept any value"),
    (GrammarSpec("json_schema", "{not json"), "Failed to parse JSON"),
    (GrammarSpec.json_schema({"$ref": "#/$defs/gone"}), "Cannot find field '$defs'"),
    (GrammarSpec.grammar('root ::= "a" foo'), 'Rule "foo" is not defined'),
])
def test_a_bad_spec_raises_grammar_error_naming_the_fault(compiler, spec, words):
    compiles = compiler.num_compiles
    future = compiler.submit(spec)
    with pytest.raises(GrammarError, match=re.escape(words)) as raised:
        future.result(timeout=30)
    assert "/project/" not in str(raised.value) and str(raised.value).startswith(f"{spec.kind} does not compile")
    with pytest.raises(GrammarError, match=re.escape(words)):
        compiler.compile_now(spec)
    assert compiler.ready(spec) and compiler.num_compiles == compiles + 1  # the failure is cached


@pytest.mark.parametrize("make, words", [
    (lambda: GrammarSpec("yaml", ""), "unknown grammar kind"),
    (lambda: GrammarSpec.choice([]), "non-empty JSON list"),
    (lambda: GrammarSpec("choice", '["a", 1]'), "non-empty JSON list of strings"),
    (lambda: GrammarSpec("regex", "a+", strict=False), "json_schema option"),
    (lambda: GrammarSpec.json_schema("{}"), "object or a boolean"),
])
def test_a_malformed_spec_is_refused_when_built(make, words):
    with pytest.raises(GrammarError, match=words):
        make()


def test_specs_are_equal_by_value_and_pickle():
    a = GrammarSpec.json_schema({"type": "object", "properties": {"b": {}, "a": {}}})
    b = GrammarSpec.json_schema({"type": "object", "properties": {"b": {}, "a": {}}})
    assert a == b and hash(a) == hash(b) and pickle.loads(pickle.dumps(a)) == a
    # property order is kept: xgrammar emits properties in declared order
    assert a != GrammarSpec.json_schema({"type": "object", "properties": {"a": {}, "b": {}}})
    assert a != GrammarSpec.json_schema({"type": "object", "properties": {"b": {}, "a": {}}}, strict=False)


def test_cache_compiles_a_spec_once_and_evicts_the_least_recent():
    compiler = make_compiler(cache_entries=2)
    a, b, c = (GrammarSpec.regex(p) for p in ("a+", "b+", "c+"))
    assert compiler.compile_now(a) is compiler.compile_now(GrammarSpec.regex("a+"))
    assert compiler.num_compiles == 1
    compiler.compile_now(b)
    compiler.compile_now(a)  # a is now the most recent: c evicts b
    compiler.compile_now(c)
    assert (compiler.num_compiles, compiler.num_cached) == (3, 2)
    compiler.compile_now(a)
    assert compiler.num_compiles == 3
    compiler.compile_now(b)
    assert (compiler.num_compiles, compiler.num_cached) == (4, 2)
    compiler.check_integrity()
    compiler.close()


def test_cache_bytes_bound_keeps_the_newest_compiles():
    compiler = make_compiler(cache_bytes=1)  # smaller than any compiled grammar
    a, b = GrammarSpec.regex("a+"), GrammarSpec.regex("b+")
    compiler.compile_now(a)
    assert compiler.num_cached == 1  # the newest stays, however large
    compiled_b = compiler.compile_now(b)
    assert (compiler.num_cached, compiler.cached_bytes) == (1, compiled_b.memory_bytes)
    compiler.compile_now(a)
    assert compiler.num_compiles == 3
    compiler.check_integrity()
    compiler.close()


def test_a_cancelled_compile_is_submitted_again_and_close_cancels_the_queue():
    compiler = make_compiler(max_threads=1)
    slow = compiler.submit(GrammarSpec.json_schema(big_schema(100)))  # holds the one thread
    spec = GrammarSpec.regex("x+")
    cancelled = compiler.submit(spec)
    assert cancelled.cancel()  # as asyncio.wrap_future does when its waiter is cancelled
    again = compiler.submit(spec)
    assert again is not cancelled and compiler.num_compiles == 3
    assert again.result(timeout=60).spec == spec and slow.done()
    queued = [compiler.submit(GrammarSpec.json_schema(big_schema(100 + i))) for i in range(2)]
    compiler.close()  # the second waits behind the first (~0.2 s) on the one thread
    with pytest.raises(CancelledError):
        queued[1].result(timeout=60)
    compiler.check_integrity()


def masks_one_at_a_time(state: GrammarState, token_ids: list[int]) -> list[torch.Tensor]:
    """The mask before each of `token_ids` and after the last, accepting them on a fork."""
    walker, masks = state.fork(), []
    for token_id in token_ids:
        masks.append(allowed(walker))
        assert walker.accept([token_id]) == [True]
    return masks + [allowed(walker)]


def bitmask_rows(bitmask: torch.Tensor, vocab_size: int) -> list[torch.Tensor]:
    """Each row of `bitmask` as bools.  # [vocab_size] each"""
    logits = torch.zeros(bitmask.shape[0], vocab_size)
    apply_bitmask(logits, bitmask, vocab_size)
    return list(logits > float("-inf"))


def test_draft_masks_equal_masks_of_accepting_one_at_a_time(compiler):
    state = compiler.new_state(GrammarSpec.json_schema(SCHEMA))
    text = '{"name": "Bo", "n": 42, "ok": true, "tags": ["a"], "kind": "y"}'
    ids = encode(text)
    assert all(state.accept(ids[:3]))
    before, drafts = allowed(state), ids[3:9]
    bitmask, num_valid = state.draft_bitmask(drafts)
    assert num_valid == len(drafts) and bitmask.shape[0] == len(drafts) + 1
    expected = masks_one_at_a_time(state, drafts)
    for row, (got, want) in enumerate(zip(bitmask_rows(bitmask, compiler.vocab_size), expected)):
        assert torch.equal(got, want), f"row {row}"
    assert state.token_ids == tuple(ids[:3]) and torch.equal(allowed(state), before)
    logits = torch.zeros(len(drafts) + 1, compiler.vocab_size)
    assert state.fill_draft_masks(logits, drafts) == len(drafts)
    assert [torch.equal(row > float("-inf"), want) for row, want in zip(logits, expected)] == [True] * len(expected)


def test_a_refused_draft_ends_the_chain_of_masks(compiler):
    state = compiler.new_state(GrammarSpec.json_schema(SCHEMA))
    good = encode('{"name"')
    refused = encode("}")[0]
    bitmask, num_valid = state.draft_bitmask(good + [refused] + good)
    rows = bitmask_rows(bitmask, compiler.vocab_size)
    assert num_valid == len(good)
    assert [torch.equal(a, b) for a, b in zip(rows, masks_one_at_a_time(state, good))] == [True] * (len(good) + 1)
    assert not rows[len(good)][refused]
    assert all(bool(row.all()) for row in rows[len(good) + 1:])  # never read by verification
    assert state.num_accepted == 0


def test_a_stop_token_draft_ends_the_chain_and_is_rolled_back(compiler):
    state = compiler.new_state(GrammarSpec.choice(["yes", "no"]))
    assert all(state.accept(encode("ye")))
    drafts = encode("s") + [EOS] + encode("x")
    bitmask, num_valid = state.draft_bitmask(drafts)
    rows = bitmask_rows(bitmask, compiler.vocab_size)
    assert num_valid == 2 and rows[1].nonzero().flatten().tolist() == [EOS] and bool(rows[2].all())
    assert not state.is_terminated() and state.num_accepted == len(encode("ye"))


def test_rollback_returns_to_the_earlier_mask(compiler):
    spec = GrammarSpec.json_schema(SCHEMA)
    ids = encode('{"name": "Bo", "n": 42, ')
    state, reference = compiler.new_state(spec), compiler.new_state(spec)
    assert all(state.accept(ids)) and all(reference.accept(ids[:2]))
    state.rollback(len(ids) - 2)
    assert state.token_ids == tuple(ids[:2]) and torch.equal(allowed(state), allowed(reference))
    with pytest.raises(AssertionError, match="rollback of 3 tokens with 2 accepted"):
        state.rollback(3)


def test_a_terminated_state_fills_no_mask(compiler):
    state = compiler.new_state(GrammarSpec.choice(["yes"]))
    assert state.accept(encode("yes") + [EOS, EOS]) == [True] * len(encode("yes")) + [True, False]
    with pytest.raises(RuntimeError, match="accepted a stop token"):
        allowed(state)
    state.rollback(1)
    assert not state.is_terminated() and allowed(state).nonzero().flatten().tolist() == [EOS]


def test_fork_and_replay_equal_the_original(compiler):
    spec = GrammarSpec.json_schema(SCHEMA)
    ids = encode('{"name": "Bo", "n": 4')
    state = compiler.new_state(spec)
    assert all(state.accept(ids))
    fork, replayed = state.fork(), compiler.rebuild_state(spec, list(ids))
    for other in (fork, replayed):
        assert other.token_ids == state.token_ids and torch.equal(allowed(other), allowed(state))
    assert all(fork.accept(encode("2, ")))  # the fork moves alone
    assert state.token_ids == tuple(ids) and not torch.equal(allowed(fork), allowed(state))
    with pytest.raises(GrammarError, match="token .* at 1 is refused"):
        compiler.rebuild_state(spec, [ids[0], encode("}")[0]])
    with pytest.raises(TypeError, match="rebuild_state"):
        pickle.dumps(state)


def test_logits_wider_than_the_vocab_are_masked_past_it(compiler):
    state = compiler.new_state(GrammarSpec.regex("[a-z]+"))
    vocab = compiler.vocab_size
    wide = torch.zeros(2, vocab + 100)
    state.fill_mask(wide)
    assert bool((wide[:, vocab:] == float("-inf")).all())
    assert torch.equal(wide[0] > float("-inf"), wide[1] > float("-inf")) and bool((wide[0, :vocab] == 0).any())
    with pytest.raises(AssertionError, match="fewer than the grammar's vocab_size"):
        state.fill_mask(torch.zeros(vocab - 1))


def test_model_vocab_past_the_tokenizer_is_never_allowed():
    padded = make_compiler(extra_vocab=64)  # an lm_head padded past the tokenizer's vocabulary
    state = padded.new_state(GrammarSpec.json_schema(True))  # any JSON value
    mask = allowed(state)
    assert mask.shape[0] == len(tokenizer()) + 64 and mask[:len(tokenizer())].any()
    assert not mask[len(tokenizer()):].any()
    bitmask = allocate_bitmask(3, padded.vocab_size)
    state.fill_bitmask(bitmask, row=1)
    assert torch.equal(bitmask_rows(bitmask, padded.vocab_size)[1], mask)
    padded.close()


def big_schema(num_fields: int) -> dict:
    props = {f"field_{i}": {"type": "string", "pattern": f"[a-z]{{1,{i % 7 + 1}}}[0-9]+x{i}"}
             for i in range(num_fields)}
    return {"type": "object", "properties": props, "required": list(props)}


def test_submit_does_not_block_on_a_slow_compile():
    compiler = make_compiler(max_threads=1)
    spec = GrammarSpec.json_schema(big_schema(200))  # ~0.4 s to compile on one core
    future = compiler.submit(spec)
    assert not compiler.ready(spec) and compiler.num_compiles == 1  # submit returned before the compile ended
    deadline = time.monotonic() + 60
    while not compiler.ready(spec):
        assert time.monotonic() < deadline, "the compile never finished"
        time.sleep(0.01)
    assert future.done() and compiler.compiled(spec).spec == spec and compiler.num_compiles == 1
    compiler.close()
