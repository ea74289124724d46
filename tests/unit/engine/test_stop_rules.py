"""Stop rules: incremental stop-string matching equals decoding and searching the whole output after
every token, on the real SmolLM2 tokenizer, at a cost per token that does not grow with the output."""

from __future__ import annotations

import functools

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from common.config import MAX_STOP_CHARS, MAX_STOP_STRINGS, EngineConfig, SamplingParams
from engine import build_engine
from engine.request import FinishReason
from engine.stop import SPLIT_AFTER_TOKENS, StopRules, StopStringMatcher, cut_at_stop, decode, first_stop
from tests.helpers import assert_pool_at_rest, make_engine, make_prompts, tiny_models

pytestmark = pytest.mark.slow  # the real SmolLM2 tokenizer (no model weights)

LITERAL_FFFD = "\ufffd"  # the character itself, as mojibake in training text has it
TEXTS = ["The capital of France is Paris. It is lovely in spring!",
         "café déjà vu — naïve coöperation, 東京 and 北京 😀🎉 ok",
         f"broken {LITERAL_FFFD}{LITERAL_FFFD} bytes and ```code```\n\n- item"]


@functools.cache
def tokenizer():
    from transformers import AutoTokenizer  # the engine's (the loader's): its token helpers pick the cases

    from kernels.model.loader import resolve_model_dir

    return AutoTokenizer.from_pretrained(resolve_model_dir("smollm2"))


@functools.cache
def pieces() -> dict[str, list[int]]:
    """Token ids by kind: text (whole words, multi-byte characters), lone bytes (split characters,
    invalid UTF-8), special tokens (decoded to nothing)."""
    tok = tokenizer()
    text = [t for s in TEXTS for t in tok.encode(s, add_special_tokens=False)]
    lone_bytes = [t for t in range(len(tok)) if len(tok.convert_ids_to_tokens(t)) == 1][:300]
    return {"text": text, "bytes": lone_bytes, "special": list(tok.all_special_ids)}


def reference(token_ids: list[int], stop: tuple[str, ...]) -> tuple[int, int] | None:
    """The old rule: after each token decode the whole output and search every stop string.
    (tokens until it stops, where the text is cut), or None when it never stops."""
    for n in range(1, len(token_ids) + 1):
        at = first_stop(decode(tokenizer(), token_ids[:n]), stop)
        if at is not None:
            return n, at
    return None


def incremental(token_ids: list[int], stop: tuple[str, ...], tok=None) -> tuple[int, int] | None:
    matcher = StopStringMatcher(tok or tokenizer(), stop)
    for n in range(1, len(token_ids) + 1):
        at = matcher.feed(token_ids[:n])
        if at is not None:
            return n, at
    return None


@st.composite
def streams(draw) -> list[int]:
    kinds = pieces()
    out: list[int] = []
    for _ in range(draw(st.integers(1, 12))):
        kind = draw(st.sampled_from(["text", "text", "bytes", "special", "random"]))
        if kind == "text":
            start = draw(st.integers(0, len(kinds["text"]) - 1))
            out += kinds["text"][start:start + draw(st.integers(1, 12))]
        elif kind == "random":
            out += draw(st.lists(st.integers(0, len(tokenizer()) - 1), min_size=1, max_size=4))
        else:
            out += draw(st.lists(st.sampled_from(kinds[kind]), min_size=1, max_size=6))
    return out


@st.composite
def stream_and_stops(draw) -> tuple[list[int], tuple[str, ...]]:
    ids = draw(streams())
    text = decode(tokenizer(), ids)
    stops = []
    for _ in range(draw(st.integers(1, 4))):
        if text and draw(st.booleans()):  # a piece of the output: it will be found, maybe across tokens
            i = draw(st.integers(0, len(text) - 1))
            stops.append(text[i:i + draw(st.integers(1, 12))])
        else:
            stops.append(draw(st.text(alphabet="aeiost .!é😀東" + LITERAL_FFFD, min_size=1, max_size=6)))
    return ids, tuple(stops)


@settings(max_examples=400, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(case=stream_and_stops())
def test_incremental_stop_matches_whole_output_search(case):
    ids, stop = case
    assert incremental(ids, stop) == reference(ids, stop)


def test_stop_in_a_split_character_and_in_literal_replacement_chars():
    tok = tokenizer()
    smile = tok.encode("ok 😀 then", add_special_tokens=False)
    assert any(decode(tok, smile[:n]).endswith("\ufffd") for n in range(len(smile)))  # it does split
    for stop in (("😀",), ("\ufffd",), ("k 😀 t",), ("en",)):
        assert incremental(smile, stop) == reference(smile, stop)
    mojibake = tok.encode("a" + LITERAL_FFFD * 30 + "b", add_special_tokens=False)
    for stop in ((LITERAL_FFFD * 3,), ("\ufffdb",), ("a\ufffd",), ("zz",)):
        assert incremental(mojibake, stop) == reference(mojibake, stop)


class CountingTokenizer:
    """Counts what the matcher asks the tokenizer to decode."""

    def __init__(self, tok):
        self.tok, self.calls, self.tokens, self.max_tokens = tok, 0, 0, 0

    def decode(self, ids, skip_special_tokens=False):
        self.calls += 1
        self.tokens += len(ids)
        self.max_tokens = max(self.max_tokens, len(ids))
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)


@pytest.mark.parametrize("text", [" ".join(TEXTS) * 40, LITERAL_FFFD * 3000])
def test_cost_per_token_does_not_grow_with_the_output(text):
    tok = CountingTokenizer(tokenizer())
    ids = tok.tok.encode(text, add_special_tokens=False)
    assert len(ids) >= 1000
    per_stop = MAX_STOP_CHARS // MAX_STOP_STRINGS
    stops = tuple(f"{i:02d}" + "~" * (per_stop - 2) for i in range(MAX_STOP_STRINGS))  # never found
    matcher = StopStringMatcher(tok, stops)
    half = len(ids) // 2
    for n in range(1, half + 1):
        assert matcher.feed(ids[:n]) is None
    cost_first = (tok.calls, tok.tokens, matcher.chars_searched)
    for n in range(half + 1, 2 * half + 1):
        assert matcher.feed(ids[:n]) is None
    cost_second = (tok.calls - cost_first[0], tok.tokens - cost_first[1], matcher.chars_searched - cost_first[2])
    # bounded per token (a whole-output decode and search would be ~len(ids) / 2 tokens and
    # 64 * len(text) / 2 characters per token), and the second half costs what the first did
    window = 2 * SPLIT_AFTER_TOKENS + 2  # context and pending tokens, each settled by then
    assert tok.max_tokens <= window, "a decode window grew with the output"
    assert cost_second[0] <= 2.5 * half and cost_second[1] <= window * half, cost_second
    assert cost_second[2] <= 2 * MAX_STOP_CHARS * half, "searched more than the overlap plus the new text"
    for first, second in zip(cost_first, cost_second):
        assert second <= 1.2 * first + 100, (cost_first, cost_second)


def test_stop_rules_order_and_cut():
    tok = tokenizer()
    ids = tok.encode("I love Paris and Paris!", add_special_tokens=False)
    rules = StopRules(SamplingParams(max_tokens=100, stop=("Paris!", "and P")), frozenset(), tok, 10_000)
    reasons = [rules.check(ids[:n], 50 + n) for n in range(1, len(ids) + 1)]
    first = next(i for i, r in enumerate(reasons) if r is not None)
    assert reasons[first] is FinishReason.STOP and decode(tok, ids[:first + 1]).startswith("I love Paris and P")
    assert rules.text_len == len("I love Paris ")
    assert cut_at_stop(decode(tok, ids), ("Paris!", "and P")) == "I love Paris "
    eos = StopRules(SamplingParams(max_tokens=3, stop_token_ids=(7,)), frozenset({2}), tok, 10)
    assert [eos.check([5], 6), eos.check([5, 2], 7), eos.check([5, 7], 7), eos.check([5, 6, 8], 8)] == \
        [None, FinishReason.STOP, FinishReason.STOP, FinishReason.LENGTH]
    assert StopRules(SamplingParams(ignore_eos=True), frozenset({2}), tok, 10).check([2], 9) is None
    assert StopRules(SamplingParams(), frozenset(), tok, 10).check([4], 10) is FinishReason.LENGTH


def test_engine_stops_where_the_whole_output_search_does():
    """The tiny Llama's ids (< 256) are SmolLM2 specials, single characters and lone UTF-8 bytes."""
    tok = tokenizer()
    prompts = make_prompts(6, seed=21)
    free = make_engine().generate(prompts, SamplingParams(max_tokens=40))
    params, expect = [], []
    for r in free:
        text = decode(tok, r.output_token_ids)
        stop = (text[len(text) // 2:len(text) // 2 + 3] or "x", "never")
        params.append(SamplingParams(max_tokens=40, stop=stop))
        expect.append(reference(r.output_token_ids, stop))
    ours, _, arch = tiny_models()
    engine = build_engine(EngineConfig(page_size=4, num_pages=256, debug_kv=True), ours, arch, tok)
    out = engine.generate(prompts, params)
    for r, want in zip(out, expect):
        n, at = want
        assert r.finish_reason is FinishReason.STOP and len(r.output_token_ids) == n and r.text_len == at
        assert engine.output_text(r) == decode(tok, r.output_token_ids)[:at]
    assert_pool_at_rest(engine)


def test_engine_decodes_a_bounded_window_per_token():
    """The engine's own cost with a long output and the most stop strings allowed (none found)."""
    tok = CountingTokenizer(tokenizer())
    ours, _, arch = tiny_models()
    engine = build_engine(EngineConfig(page_size=4, num_pages=256, debug_kv=True), ours, arch, tok)
    stops = tuple(f"{i:02d}" + "~" * (MAX_STOP_CHARS // MAX_STOP_STRINGS - 2) for i in range(MAX_STOP_STRINGS))
    [r] = engine.generate(make_prompts(1, seed=5), SamplingParams(max_tokens=600, ignore_eos=True, stop=stops))
    assert r.finish_reason is FinishReason.LENGTH and len(r.output_token_ids) == 600
    window = 2 * SPLIT_AFTER_TOKENS + 2
    assert tok.max_tokens <= window, f"decoded {tok.max_tokens} tokens at once: the whole output again?"
    assert tok.tokens <= window * 600 and tok.calls <= 3 * 600
    assert r.stop_rules.chars_searched <= 2 * MAX_STOP_CHARS * 600
