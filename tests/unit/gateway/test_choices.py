"""`n` choices through the gateway over a real engine: each choice is its own seeded sample (the
engine's output for that choice's seed), the same on a repeat, streamed with its index, the prompt
counted once, and the siblings' prompts served by the prefix cache choice 0 filled."""

from __future__ import annotations

import json

import pytest

from common.config import SamplingParams
from kernels.model.tokenizer import encode_prompt
from router.gateway.siblings import sibling_seed
from tests.helpers import make_smollm2_engine

PROMPT = ("The history of the printing press begins in the fifteenth century, when a goldsmith in Mainz "
          "combined movable metal type, oil-based ink and a wooden press. Its effects were")
SAMPLING = {"temperature": 0.9, "top_p": 0.95, "max_tokens": 8, "ignore_eos": True}


@pytest.fixture(scope="module")
def expected(backend):
    """Choice i's text: an engine of its own (no prefix cache) sampling with choice i's seed."""
    engine = make_smollm2_engine(num_pages=64, enable_prefix_cache=False)
    prompt = encode_prompt(backend.tokenizer, PROMPT)
    reqs = engine.generate([prompt] * 4, [SamplingParams(seed=sibling_seed(11, i), **SAMPLING) for i in range(4)])
    texts = [engine.output_text(r) for r in reqs]
    engine.close()
    return texts


def _hits(client) -> float:
    for line in client.get("/metrics").text.splitlines():
        if line.startswith("tandem:prefix_cache_hits_total"):
            return float(line.split()[-1])
    raise AssertionError("no prefix cache metric")


def test_n_seeded_choices_are_the_siblings_samples_and_repeat(client, backend, expected):
    hits_before = _hits(client)
    bodies = [client.post("/v1/completions", json={"prompt": PROMPT, "n": 4, "seed": 11, **SAMPLING}).json()
              for _ in range(2)]
    assert bodies[0]["choices"] == bodies[1]["choices"]
    choices = bodies[0]["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2, 3]
    assert [c["text"] for c in choices] == expected
    assert len(set(expected)) == 4, "the siblings drew the same numbers"
    prompt_len = len(encode_prompt(backend.tokenizer, PROMPT))
    assert bodies[0]["usage"] == {"prompt_tokens": prompt_len, "completion_tokens": 32, "total_tokens": prompt_len + 32,
                                  "prompt_tokens_details": bodies[0]["usage"]["prompt_tokens_details"]}
    page = backend.engine.config.page_size
    # each request: the three siblings found choice 0's whole pages (the second request's choice 0 too)
    assert _hits(client) - hits_before >= 7 * (prompt_len - page), (prompt_len, page)
    one = client.post("/v1/completions", json={"prompt": PROMPT, "seed": 11, **SAMPLING}).json()
    assert one["choices"][0]["text"] == expected[0]  # n = 1 is choice 0


def test_streamed_choices_carry_their_index_and_the_usage_comes_last(client, expected):
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Name a color."}], "n": 3,
                                                  "seed": 5, "stream": True, "stream_options": {"include_usage": True},
                                                  **SAMPLING})
    frames = [f[6:] for f in r.text.split("\n\n") if f]
    assert frames[-1] == "[DONE]"
    chunks = [json.loads(f) for f in frames[:-1]]
    usage, chunks = chunks[-1], chunks[:-1]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 24
    texts, finished, opened = ["", "", ""], set(), set()
    for chunk in chunks:
        [choice] = chunk["choices"]
        index = choice["index"]
        if choice["delta"].get("role") == "assistant":
            opened.add(index)
        elif choice["finish_reason"] is not None:
            finished.add(index)
        else:
            assert index not in finished
            texts[index] += choice["delta"]["content"]
    assert opened == finished == {0, 1, 2}
    full = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Name a color."}],
                                                     "n": 3, "seed": 5, **SAMPLING}).json()
    assert [c["message"]["content"] for c in full["choices"]] == texts


@pytest.mark.parametrize("fields, param", [(dict(n=0), "n"), (dict(n=17), "n"), (dict(n=1.5), "n"),
                                           (dict(n=2, best_of=3), "best_of")])
def test_bad_n_is_a_400_naming_it(client, fields, param):
    r = client.post("/v1/completions", json={"prompt": PROMPT, **SAMPLING, **fields})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_a_batch_of_prompts_gets_n_choices_each_in_vllms_order(client, backend, expected):
    other = "Describe the sea in one sentence:"
    body = client.post("/v1/completions", json={"prompt": [PROMPT, other], "n": 2, "seed": 11,
                                                "return_token_ids": True, **SAMPLING}).json()
    choices = body["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2, 3]
    assert [c["text"] for c in choices[:2]] == expected[:2]  # prompt 0's choices: the same seeds as alone
    ids = [encode_prompt(backend.tokenizer, p) for p in (PROMPT, other)]
    assert [c["prompt_token_ids"] for c in choices] == [ids[0], ids[0], ids[1], ids[1]]
    alone = client.post("/v1/completions", json={"prompt": ids[1], "n": 2, "seed": 11, **SAMPLING}).json()
    assert [c["text"] for c in choices[2:]] == [c["text"] for c in alone["choices"]]
    assert body["usage"]["prompt_tokens"] == len(ids[0]) + len(ids[1]) and body["usage"]["completion_tokens"] == 32
    r = client.post("/v1/completions", json={"prompt": [PROMPT] * 9, "n": 2, **SAMPLING})
    assert r.status_code == 400 and r.json()["error"]["param"] == "n"
    r = client.post("/v1/completions", json={"prompt": [PROMPT, ""], **SAMPLING})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"


def test_tokenize_and_detokenize_are_the_endpoints_own_encodings(client, backend):
    from kernels.model.tokenizer import apply_chat_template

    tok = backend.tokenizer
    got = client.post("/tokenize", json={"prompt": PROMPT}).json()
    assert got["tokens"] == encode_prompt(tok, PROMPT) and got["count"] == len(got["tokens"])
    assert got["max_model_len"] == backend.max_model_len
    messages = [{"role": "user", "content": "Name a color."}]
    assert client.post("/tokenize", json={"messages": messages}).json()["tokens"] == apply_chat_template(tok, messages)
    assert client.post("/detokenize", json={"tokens": got["tokens"]}).json() == {"prompt": tok.decode(got["tokens"])}
    for path, body, param in [("/tokenize", {}, "prompt"), ("/detokenize", {"tokens": [10**9]}, "tokens"),
                              ("/detokenize", {"tokens": "x"}, "tokens"), ("/tokenize", {"messages": []}, "messages")]:
        r = client.post(path, json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (path, r.text)
    assert client.post("/tokenize", content=b"x", headers={"Content-Type": "text/plain"}).status_code == 415
