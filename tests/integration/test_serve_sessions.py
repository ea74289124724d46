"""Streaming sessions and the host tier through the product: `tandem serve` whose decode worker (where
sessions live) has a small device pool (64 pages) and a host tier (4x), KV checked after every
scheduler step. A session's history is pinned on device between turns; when plain requests need
those pages while the session is idle, its history goes to L2 instead of them waiting, and the
session's next turn finds it there (cached, the pages they evicted loaded back, nothing recomputed).
Every answer is HF transformers' greedy one on the same ids."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.helpers import CHAT_PROMPTS, hf_greedy, smollm2
from tests.integration.serve_harness import metric, serving

pytestmark = pytest.mark.slow

PAGE = 16
DECODE_PAGES = 64  # 1,008 usable tokens
MAX_NEW = 12


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with serving(tmp_path_factory, "serve-sessions", ["--set", f"decode.engine.num_pages={DECODE_PAGES}",
                                                      "--set", "decode.engine.host_cache_ratio=4"],
                 env={"TANDEM_DEBUG_KV": "1"}, warm=False) as server:
        yield server


def natural_ids(num_tokens: int, salt: str) -> list[int]:
    loaded, _ = smollm2()
    ids = loaded.tokenizer.encode(salt + " " + " ".join(CHAT_PROMPTS * 8), add_special_tokens=False)[:num_tokens]
    assert len(ids) == num_tokens
    return ids


def hf_ids(prompt: list[int]) -> list[int]:
    _, reference = smollm2()
    return hf_greedy(reference, prompt, MAX_NEW)


def complete(server, prompt: list[int], **fields) -> dict:
    resp = httpx.post(f"{server.base_url}/v1/completions", timeout=300, json={
        "model": "smollm2", "prompt": prompt, "max_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True, **fields})
    assert resp.status_code == 200, resp.text
    return resp.json()


def answer_is_hf(body: dict, prompt: list[int]) -> bool:
    loaded, _ = smollm2()
    return body["choices"][0]["text"] == loaded.tokenizer.decode(hf_ids(prompt), skip_special_tokens=True)


def test_an_idle_sessions_history_makes_room_through_l2_and_its_next_turn_finds_it(server):
    resp = httpx.post(f"{server.base_url}/v1/sessions", timeout=60,
                      json={"capacity_tokens": 480, "idle_timeout_s": 600})
    assert resp.status_code == 200, resp.text
    session_id = resp.json()["id"]
    first = natural_ids(300, "A session about travel.")
    assert answer_is_hf(complete(server, first, session_id=session_id), first)
    history = first + hf_ids(first)
    # three plain requests of 412 tokens each: 78 pages, beside a history pinning 19 of 63
    plain = [natural_ids(400, f"Plain request {i}.") for i in range(3)]
    before = server.metrics()
    with ThreadPoolExecutor(3) as pool:
        bodies = list(pool.map(lambda prompt: complete(server, prompt), plain))
    assert all(answer_is_hf(body, prompt) for body, prompt in zip(bodies, plain))
    middle = server.metrics()
    offloads = metric(middle, "tandem:session_offloads_total", role="decode") - \
        metric(before, "tandem:session_offloads_total", role="decode")
    assert offloads == 1, "the idle session kept its device pages while requests needed them"
    new = natural_ids(20, "And next?")
    turn = complete(server, new, session_id=session_id)
    full = history + new
    assert answer_is_hf(turn, full)
    history_pages = (len(history) - 1) // PAGE * PAGE  # the first turn's last token has no KV
    assert turn["usage"]["prompt_tokens"] == len(full)
    assert turn["usage"]["prompt_tokens_details"]["cached_tokens"] >= history_pages
    after = server.metrics()
    hits = {tier: metric(after, "tandem:prefix_cache_hit_tokens_total", tier=tier, role="decode") -
            metric(middle, "tandem:prefix_cache_hit_tokens_total", tier=tier, role="decode") for tier in ("l1", "l2")}
    # the plain requests evicted as many of the history's device pages as they needed, from its end
    # (the prefix cache evicts leaves first): those come back from L2, the rest are still on device
    assert hits["l2"] >= PAGE, f"the history did not come back from the host tier: {hits}"
    assert hits["l1"] + hits["l2"] >= history_pages, f"part of the history was recomputed: {hits}"
    assert httpx.delete(f"{server.base_url}/v1/sessions/{session_id}", timeout=60).status_code == 200


def test_a_session_turn_samples_under_its_logit_rules(server):
    """A turn's rules see its whole prompt (the history included) as a plain request's do: greedy with
    repetition_penalty and a banned token gives HF's tokens over the same ids."""
    from tests.integration.logit_rules_check import hf_greedy_with

    session_id = httpx.post(f"{server.base_url}/v1/sessions", timeout=60, json={"capacity_tokens": 256}).json()["id"]
    first, new = natural_ids(40, "A session about rivers."), natural_ids(10, "Go on.")
    answer = complete(server, first, session_id=session_id, return_token_ids=True)["choices"][0]["token_ids"]
    prompt = [*first, *answer, *new]
    plain = hf_greedy_with(prompt, MAX_NEW)
    turn = complete(server, new, session_id=session_id, repetition_penalty=1.3, logit_bias={str(plain[0]): -100},
                    return_token_ids=True)["choices"][0]
    assert turn["prompt_token_ids"] == prompt
    want = hf_greedy_with(prompt, MAX_NEW, repetition_penalty=1.3, sequence_bias={(plain[0],): -100.0})
    assert turn["token_ids"][:len(want)] == want and want[0] != plain[0], (turn["token_ids"], want)
    assert httpx.delete(f"{server.base_url}/v1/sessions/{session_id}", timeout=60).status_code == 200


def test_a_session_turns_logprobs_are_hfs_over_its_whole_prompt(server):
    """A turn's logprobs are the model's after the history (whose KV the session kept); a turn samples
    under a grammar; its prompt's logprobs are refused, naming the field (that KV is not computed again)."""
    from tests.integration.logprobs_check import TOLERANCE, hf_logprobs

    session_id = httpx.post(f"{server.base_url}/v1/sessions", timeout=60, json={"capacity_tokens": 256}).json()["id"]
    first, new = natural_ids(30, "A session about mountains."), natural_ids(8, "Tell me more.")
    answer = complete(server, first, session_id=session_id, return_token_ids=True)["choices"][0]["token_ids"]
    turn = complete(server, new, session_id=session_id, logprobs=2, return_token_ids=True)["choices"][0]
    prompt, tokens = [*first, *answer, *new], turn["token_ids"]
    assert turn["prompt_token_ids"] == prompt and len(turn["logprobs"]["token_logprobs"]) == len(tokens)
    want = hf_logprobs(prompt + tokens)
    got = turn["logprobs"]["token_logprobs"]
    assert got == pytest.approx([float(want[len(prompt) - 1 + i, t]) for i, t in enumerate(tokens)], abs=TOLERANCE)
    choice = complete(server, natural_ids(6, "Yes or no?"), session_id=session_id,
                      structured_outputs={"choice": ["yes", "no"]})["choices"][0]  # a turn under a grammar
    assert choice["text"] in ("yes", "no") and choice["finish_reason"] == "stop"
    refused = httpx.post(f"{server.base_url}/v1/completions", timeout=60, json={
        "model": "smollm2", "prompt": new, "session_id": session_id, "prompt_logprobs": 1})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "prompt_logprobs"
    assert httpx.delete(f"{server.base_url}/v1/sessions/{session_id}", timeout=60).status_code == 200


def test_a_session_outlives_its_decode_worker(server):
    """Last in this module (it kills the decode worker): a turn streaming when the session's worker
    is SIGKILLed resumes on its restart with HF's tokens, and the session's next turn opens it again
    there, finding the history the resumed turn left cached, with HF's tokens."""
    import os
    import signal

    import openai

    loaded, reference = smollm2()
    sid = httpx.post(f"{server.base_url}/v1/sessions", timeout=60,
                     json={"capacity_tokens": 240, "idle_timeout_s": 600}).json()["id"]
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none", max_retries=0, timeout=300)
    prompt = natural_ids(60, "A session that survives.")
    stream = client.completions.create(model="smollm2", prompt=prompt, max_tokens=40, temperature=0, stream=True,
                                       extra_body={"session_id": sid, "ignore_eos": True})
    decode = next(w for w in server.workers() if w["role"] == "decode")
    text = []
    for chunk in stream:
        if chunk.choices:
            if not text:
                os.kill(decode["pid"], signal.SIGKILL)
            text.append(chunk.choices[0].text)
    answer = hf_greedy(reference, prompt, 40)
    assert "".join(text) == loaded.tokenizer.decode(answer, skip_special_tokens=True)
    new = natural_ids(10, "Then?")
    turn = complete(server, new, session_id=sid)
    assert answer_is_hf(turn, prompt + answer + new)
    assert turn["usage"]["prompt_tokens_details"]["cached_tokens"] > len(prompt)
