"""`tandem serve --speculative eagle` on a fresh machine: with an empty cache (no head trained here)
it starts on the head the package ships for smollm2, says so in its log, answers chat requests at
temperature 0 with exactly HF transformers' greedy tokens on the same weights, and /metrics shows
drafts verified and accepted on the way."""

from __future__ import annotations

import time

import httpx
import openai
import pytest

from tests.helpers import CHAT_PROMPTS, hf_greedy, smollm2
from tests.integration.lm_eval_check import check_lm_eval
from tests.integration.logit_rules_check import check_logit_rules
from tests.integration.logprobs_check import check_logprobs
from tests.integration.serve_harness import eventually, metric, seeded_streams, start_server
from tests.integration.structured_check import check_structured
from tests.integration.tools_check import check_tools

pytestmark = pytest.mark.slow

MAX_NEW = 48
PROMPTS = [CHAT_PROMPTS[i] for i in (1, 2, 3, 7)]


@pytest.fixture(scope="module")
def fresh_cache(tmp_path_factory):
    """A cache with no EAGLE head in it: only the converted model, linked from the shared cache (what a
    fresh machine converts on its first start is tested on its own; here it would add ~30 s)."""
    from kernels.model.convert import ensure_smollm2

    cache = tmp_path_factory.mktemp("tandem-cache-without-heads")
    (cache / "models").symlink_to(ensure_smollm2().parent, target_is_directory=True)
    return cache


@pytest.fixture(scope="module")
def eagle_server(tmp_path_factory, fresh_cache):
    # --no-speculative-adaptive: draft at every step, not only where the engine measured it pays
    # (output is the same either way), so the drafts verified below are a count of this head's work
    server = start_server(tmp_path_factory.mktemp("serve-eagle"),
                          ["--speculative", "eagle", "--no-speculative-adaptive"],
                          env={"TANDEM_CACHE_DIR": str(fresh_cache), "TANDEM_DEBUG_KV": "1"},
                          warm=False)
    try:
        yield server
    finally:
        server.terminate()


@pytest.fixture(scope="module")
def hf_answers():
    """(token ids, text) of HF's greedy answer to each prompt, stopping at SmolLM2's EOS like the server."""
    from kernels.model.tokenizer import apply_chat_template, decode

    loaded, reference = smollm2()
    answers = []
    for prompt in PROMPTS:
        ids = hf_greedy(reference, apply_chat_template(loaded.tokenizer, prompt), MAX_NEW,
                        eos_token_id=list(loaded.eos_token_ids))
        answers.append((ids, decode(loaded.tokenizer, ids)))
    return answers


def test_penalties_biases_and_min_tokens_give_hfs_greedy_tokens_on_verify_rows(eagle_server):
    """Short prompts prefill on the decode worker itself here; the rules hold on the verify rows (a
    request with a history-dependent rule drafts chains)."""
    before = eagle_server.metrics()
    check_logit_rules(openai.OpenAI(base_url=f"{eagle_server.base_url}/v1", api_key="none", max_retries=0,
                                    timeout=300))
    drafted = lambda: metric(eagle_server.metrics(), "tandem:spec_draft_tokens_total") - metric(  # noqa: E731
        before, "tandem:spec_draft_tokens_total")
    eventually(lambda: drafted() > 0, "drafts verified under the rules")


def test_logprobs_come_from_the_targets_verify_rows_and_lm_eval_scores_as_hf(eagle_server):
    before = eagle_server.metrics()
    check_logprobs(openai.OpenAI(base_url=f"{eagle_server.base_url}/v1", api_key="none", max_retries=0, timeout=300))
    drafted = lambda: metric(eagle_server.metrics(), "tandem:spec_draft_tokens_total") - metric(  # noqa: E731
        before, "tandem:spec_draft_tokens_total")
    # (the counters reach /metrics with the decode worker's next heartbeat)
    eventually(lambda: drafted() > 0, "a draft verified: the logprobs came from verify rows")
    check_lm_eval(eagle_server.base_url)


def test_structured_outputs_verify_drafts_under_the_grammar(eagle_server):
    before = eagle_server.metrics()
    check_structured(eagle_server.base_url)
    drafted = lambda: metric(eagle_server.metrics(), "tandem:spec_draft_tokens_total") - metric(  # noqa: E731
        before, "tandem:spec_draft_tokens_total")
    eventually(lambda: drafted() > 0, "a draft verified under a grammar")
    check_tools(eagle_server.base_url)  # a forced call's grammar on verify rows


def test_n_seeded_choices_differ_and_repeat_under_speculation(eagle_server):
    client = openai.OpenAI(base_url=f"{eagle_server.base_url}/v1", api_key="none", max_retries=0, timeout=300)
    ask = dict(model="smollm2", messages=[{"role": "user", "content": PROMPTS[0]}], n=3, seed=9, temperature=0.8,
               max_tokens=12)
    texts = [[c.message.content for c in sorted(client.chat.completions.create(**ask).choices, key=lambda c: c.index)]
             for _ in range(2)]
    assert texts[0] == texts[1] and len(set(texts[0])) == 3, texts


def test_a_fresh_cache_serves_with_the_shipped_head_and_says_so(eagle_server, fresh_cache):
    deadline = time.monotonic() + 30  # worker logs reach the server's through Ray, a little later
    while "speculative eagle uses the shipped head for smollm2, recipe v" not in eagle_server.log_tail(10 ** 6):
        assert time.monotonic() < deadline, f"no log line names the shipped head:\n{eagle_server.log_tail()}"
        time.sleep(1)
    assert not (fresh_cache / "eagle").exists(), "nothing may be trained or cached for the head"


def test_greedy_answers_equal_hf_greedy_and_drafts_were_verified(eagle_server, hf_answers):
    server = eagle_server
    before = server.metrics()
    for prompt, (ids, text) in zip(PROMPTS, hf_answers):
        resp = httpx.post(f"{server.base_url}/v1/chat/completions", timeout=300, json={
            "model": "smollm2", "messages": [{"role": "user", "content": prompt}], "max_tokens": MAX_NEW,
            "temperature": 0})
        assert resp.status_code == 200, resp.text
        body = resp.json()
        assert body["choices"][0]["message"]["content"] == text, prompt
        assert body["usage"]["completion_tokens"] == len(ids), prompt
    produced = sum(len(ids) for ids, _ in hf_answers)
    drafted_since = lambda: metric(server.metrics(), "tandem:spec_draft_tokens_total") - metric(  # noqa: E731
        before, "tandem:spec_draft_tokens_total")
    eventually(lambda: drafted_since() >= produced, f"{produced} drafts verified (was drafting on?)")
    after = server.metrics()
    drafted = metric(after, "tandem:spec_draft_tokens_total") - metric(before, "tandem:spec_draft_tokens_total")
    accepted = metric(after, "tandem:spec_accepted_tokens_total") - metric(before, "tandem:spec_accepted_tokens_total")
    # a working head gets a good share accepted (the shipped one: ~half at k = 3); a broken one ~none
    assert accepted >= 0.2 * produced, f"{accepted} of {drafted} drafts accepted for {produced} tokens"


def test_streams_resume_token_identically_after_the_decode_worker_is_killed(eagle_server):
    """Last in this module (it kills the decode worker): 4 seeded sampled streams (temperature 0.8)
    drafting with EAGLE across a SIGKILL of the only decode worker resume on its restart, each the
    undisturbed text: verification chooses the sampler's own draw, so the drafts the restarted
    worker makes (from a fresh prefill) cannot change a token."""
    import os
    import signal

    server = eagle_server
    decode = next(w for w in server.workers() if w["role"] == "decode")
    undisturbed = seeded_streams(server.base_url, "none", 4)
    faulted = seeded_streams(server.base_url, "none", 4, lambda: os.kill(decode["pid"], signal.SIGKILL))
    assert [text for text, _, _ in faulted] == [text for text, _, _ in undisturbed]
    assert all(tokens == 32 for _, tokens, _ in faulted), faulted
    assert metric(server.metrics(), "tandem:request_migrations_total", outcome="resumed") >= 1
