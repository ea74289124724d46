"""Logprobs through the gateway over a real SmolLM2 engine, against transformers' log-softmax of the
same tokens: chat `logprobs`/`top_logprobs` (whole and streamed), completion `logprobs` with `echo`
and `max_tokens: 0` (an evaluation harness's loglikelihood request, on a batch of token-id prompts),
vLLM's `prompt_logprobs`, and `n` siblings that share their leader's prompt logprobs."""

from __future__ import annotations

import json

import pytest
import torch

from kernels.model.tokenizer import apply_chat_template, encode_prompt
from tests.gateway_http import assert_error
from tests.helpers import smollm2

QUESTION = [{"role": "user", "content": "Name a color."}]
TOL = 2e-3  # fp32 against fp32, different kernels


def _hf(ids: list[int]) -> torch.Tensor:
    """HF's log-softmax at each position of `ids` ([len, vocab]; row p predicts token p + 1)."""
    _, hf = smollm2()
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)


def test_chat_logprobs_are_the_models_and_streamed_alike(client, backend):
    body = {"messages": QUESTION, "max_tokens": 5, "temperature": 0, "logprobs": True, "top_logprobs": 3,
            "return_token_ids": True}
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    out = r.json()
    choice, prompt = out["choices"][0], out["prompt_token_ids"]
    tokens, content = choice["token_ids"], choice["logprobs"]["content"]
    assert prompt == apply_chat_template(backend.tokenizer, QUESTION) and len(content) == len(tokens) == 5
    want = _hf(prompt + tokens)
    for i, (token, item) in enumerate(zip(tokens, content)):
        row = want[len(prompt) - 1 + i]
        assert item["logprob"] == pytest.approx(float(row[token]), abs=TOL)
        assert item["token"] == backend.tokenizer.decode([token]) and item["bytes"] == list(item["token"].encode())
        assert [t["logprob"] for t in item["top_logprobs"]] == pytest.approx(row.topk(3).values.tolist(), abs=TOL)
        assert item["top_logprobs"][0]["token"] == item["token"]  # greedy: the best token came
    stream = client.post("/v1/chat/completions", json={**body, "stream": True, "return_token_ids": False})
    frames = [json.loads(f[6:]) for f in stream.text.split("\n\n") if f.startswith("data: {")]
    streamed = [item for f in frames for c in f["choices"] if c["logprobs"] for item in c["logprobs"]["content"]]
    assert [s["token"] for s in streamed] == [c["token"] for c in content]
    assert [s["logprob"] for s in streamed] == pytest.approx([c["logprob"] for c in content], abs=1e-6)


def test_echo_with_max_tokens_0_scores_a_batch_of_prompts(client, backend):
    """lm-eval's loglikelihood request: token-id prompts, echo, logprobs 1, max_tokens 0."""
    texts = ["The capital of France is Paris", "Two plus two equals four"]
    prompts = [encode_prompt(backend.tokenizer, t) for t in texts]
    r = client.post("/v1/completions", json={"prompt": prompts, "echo": True, "logprobs": 1, "max_tokens": 0,
                                             "temperature": 0})
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["usage"]["completion_tokens"] == 0 and out["usage"]["prompt_tokens"] == sum(map(len, prompts))
    for prompt, text, choice in zip(prompts, texts, sorted(out["choices"], key=lambda c: c["index"])):
        lp, want = choice["logprobs"], _hf(prompt)
        assert choice["text"] == text and choice["finish_reason"] == "length" and "prompt_logprobs" not in choice
        assert lp["tokens"] == [backend.tokenizer.decode([t]) for t in prompt]
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        assert lp["token_logprobs"][1:] == pytest.approx([float(want[p - 1, prompt[p]]) for p in range(1, len(prompt))],
                                                         abs=TOL)
        for p in range(1, len(prompt)):
            top = lp["top_logprobs"][p]
            assert lp["tokens"][p] in top and len(top) <= 2  # the best token and the token itself
            assert max(top.values()) == pytest.approx(float(want[p - 1].max()), abs=TOL)
        assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(len(prompt))]


def test_echo_with_tokens_and_prompt_logprobs(client, backend):
    prompt = encode_prompt(backend.tokenizer, "Once upon a time")
    body = {"prompt": prompt, "echo": True, "logprobs": 2, "prompt_logprobs": 1, "max_tokens": 3, "temperature": 0}
    out = client.post("/v1/completions", json=body).json()
    choice = out["choices"][0]
    lp, pl = choice["logprobs"], choice["prompt_logprobs"]
    assert len(lp["tokens"]) == len(prompt) + 3 and out["usage"]["completion_tokens"] == 3
    assert choice["text"].startswith("Once upon a time") and pl[0] is None and len(pl) == len(prompt)
    want = _hf(prompt)
    for p in range(1, len(prompt)):
        entry = pl[p][str(prompt[p])]
        assert entry["logprob"] == pytest.approx(float(want[p - 1, prompt[p]]), abs=TOL)
        assert entry["rank"] == int((want[p - 1] > want[p - 1, prompt[p]]).sum()) + 1
        assert entry["logprob"] == pytest.approx(lp["token_logprobs"][p], abs=1e-6)
    streamed = client.post("/v1/completions", json={**body, "stream": True})
    frames = [json.loads(f[6:]) for f in streamed.text.split("\n\n") if f.startswith("data: {")]
    text = "".join(c["text"] for f in frames for c in f["choices"])
    tokens = [t for f in frames for c in f["choices"] if c["logprobs"] for t in c["logprobs"]["tokens"]]
    offsets = [o for f in frames for c in f["choices"] if c["logprobs"] for o in c["logprobs"]["text_offset"]]
    assert text == choice["text"] and tokens == lp["tokens"] and offsets == lp["text_offset"]


def test_siblings_share_their_leaders_prompt_logprobs(client):
    body = {"prompt": "A short story:", "n": 3, "seed": 5, "temperature": 1.0, "max_tokens": 2,
            "prompt_logprobs": 0, "logprobs": 0}
    choices = client.post("/v1/completions", json=body).json()["choices"]
    assert len(choices) == 3 and all(c["prompt_logprobs"] == choices[0]["prompt_logprobs"] for c in choices)
    assert all(len(c["logprobs"]["tokens"]) == 2 for c in choices)


@pytest.mark.parametrize("path, body, param", [
    ("/v1/chat/completions", {"messages": QUESTION, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": QUESTION, "top_logprobs": 1}, "top_logprobs"),
    ("/v1/completions", {"prompt": "x", "logprobs": True}, "logprobs"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "prompt_logprobs": 99}, "prompt_logprobs"),
])
def test_bad_logprob_fields_are_400s_naming_them(client, path, body, param):
    assert_error(client.post(path, json=body), 400, param=param)
