"""The OpenAI gateway over a real SmolLM2 engine: text equals the offline engine's, streams add up,
errors keep their shape and status, metrics count exactly, a vanished client aborts its request."""

from __future__ import annotations

import asyncio
import json
import random
import socket
import threading
import time

import pytest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.parser import text_string_to_metric_families
from starlette.testclient import TestClient

from cluster.serve.config import GatewayConfig
from kernels.model.tokenizer import apply_chat_template, encode_prompt
from router.backend import BackendError, ErrorKind
from router.gateway import GatewayServer, build_app
from router.gateway.detokenize import IncrementalDetokenizer, final_text
from tests.gateway_backend import WORKER_ID, smollm2_backend
from tests.gateway_http import BASE_URL, app_client
from tests.gateway_http import assert_error as assert_error_body
from tests.helpers import greedy, make_smollm2_engine

try:
    import httpx
except ImportError:  # the successor package keeps httpx's API under a new name
    import httpx2 as httpx

pytestmark = pytest.mark.slow
MODEL = "smollm2"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
PROMPT = "The three primary colors are"
TRANSFER = (4096, 0.002)  # (bytes, seconds) the test backend reports per request
JSON = {"Content-Type": "application/json"}


@pytest.fixture(scope="module")
def backend():
    with smollm2_backend(kv_transfer=TRANSFER) as backend:
        yield backend


@pytest.fixture(scope="module")
def reference():
    """An engine of its own (no prefix cache) for the offline output of a prompt."""
    engine = make_smollm2_engine(num_pages=64, enable_prefix_cache=False)

    def run(prompt_ids, params):
        [req] = engine.generate([prompt_ids], params)
        return engine.output_text(req), req
    return run


@pytest.fixture(scope="module")
def tok(backend):
    return backend.tokenizer


def events(response) -> list:
    """SSE frames of a finished stream: parsed JSON bodies, and "[DONE]"."""
    assert response.headers["content-type"].startswith("text/event-stream")
    frames = [f for f in response.text.split("\n\n") if f]
    assert all(f.startswith("data: ") for f in frames), frames
    return [f[6:] if f == "data: [DONE]" else json.loads(f[6:]) for f in frames]


def assert_error(response, status: int, code: str | None = None, param: str | None = None) -> dict:
    """`assert_error_body`, and the message is a non-empty string."""
    error = assert_error_body(response, status, code, param)
    assert isinstance(error["message"], str) and error["message"], error
    return error


def good_request_works(client):
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 1, "temperature": 0})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 1


# ---- detokenizer ---------------------------------------------------------------------------------
DETOK_TEXTS = ["héllo wörld 😀🎉 你好, 世界! naïve café", "The capital of France is Paris.\n\nParis is big."]


@pytest.mark.parametrize("stop", [(), ("Paris",), ("😀", "xyz"), ("\n\n",), ("is P", "Par")])
def test_detokenizer_deltas_add_up_to_final_text(tok, stop):
    rng = random.Random(0)
    sequences = [encode_prompt(tok, t) for t in DETOK_TEXTS]
    sequences += [[rng.randrange(len(tok)) for _ in range(40)] for _ in range(5)]  # arbitrary byte pieces
    for ids in sequences:
        for _ in range(4):
            detok, parts, i = IncrementalDetokenizer(tok, stop), [], 0
            expected = final_text(tok, ids, stop)
            while i < len(ids):
                k = rng.randint(1, 3)
                parts.append(detok.feed(ids[i:i + k]))
                assert expected.startswith("".join(parts)), "emitted text that the final text does not have"
                i += k
            parts.append(detok.finish())
            assert "".join(parts) == expected == detok.text


def test_detokenizer_holds_back_incomplete_utf8(tok):
    ids = encode_prompt(tok, "😀")
    assert len(ids) == 3 and tok.decode(ids[:1]) == "\ufffd"
    detok = IncrementalDetokenizer(tok)
    assert [detok.feed([t]) for t in ids] == ["", "", "😀"]
    assert detok.finish() == ""


def test_detokenizer_holds_back_a_possible_stop_string(tok):
    detok = IncrementalDetokenizer(tok, stop=("Paris!",))
    ids = encode_prompt(tok, "I love Paris and Paris!")
    sent = ""
    for i, t in enumerate(ids):
        sent += detok.feed([t])
        if not detok.stopped:  # everything but the last len("Paris!") - 1 characters
            so_far = final_text(tok, ids[:i + 1], ())
            assert sent == so_far[:max(0, len(so_far) - 5)]
    assert detok.stopped and sent == "I love Paris and "
    assert detok.feed(encode_prompt(tok, " more")) == "" and detok.finish() == ""


# ---- generation ----------------------------------------------------------------------------------
def test_completion_text_matches_offline_engine(client, tok, reference):
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 10, "temperature": 0})
    body = r.json()
    ids = encode_prompt(tok, PROMPT)
    text, req = reference(ids, greedy(max_tokens=10))
    assert r.status_code == 200 and body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    assert body["model"] == MODEL and isinstance(body["created"], int)
    [choice] = body["choices"]
    assert choice["text"] == text and choice["finish_reason"] == req.finish_reason.value
    usage = body["usage"]
    assert usage["prompt_tokens"] == len(ids) and usage["completion_tokens"] == len(req.output_token_ids)
    assert usage["total_tokens"] == len(ids) + len(req.output_token_ids)
    assert usage["prompt_tokens_details"] == {"cached_tokens": 0,
                                              "cached_tokens_details": {"device": 0, "host": 0, "l3": 0}}
    for prompt in (ids, [PROMPT], [ids]):  # token ids and batches of one are the same prompt
        r = client.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 10, "temperature": 0})
        assert r.json()["choices"][0]["text"] == text


def test_chat_text_matches_offline_engine_with_template(client, tok, reference):
    text, req = reference(apply_chat_template(tok, QUESTION), greedy(max_tokens=12))
    assert text
    parts = [{"role": "user", "content": [{"type": "text", "text": QUESTION[0]["content"]}]}]
    for messages in (QUESTION, parts):
        r = client.post("/v1/chat/completions", json={"model": MODEL, "messages": messages, "max_tokens": 12,
                                                      "temperature": 0, "user": "ignored", "some_extension": 1})
        body = r.json()
        assert r.status_code == 200 and body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
        [choice] = body["choices"]
        assert choice["message"] == {"role": "assistant", "content": text}
        assert choice["finish_reason"] == req.finish_reason.value
        assert body["usage"]["prompt_tokens"] == len(apply_chat_template(tok, QUESTION))
    # the second run of the same prompt found it in the prefix cache, and says so
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


def test_return_token_ids_names_the_prompt_and_every_output_token(client, tok, reference):
    """vLLM's `return_token_ids`: the token ids the offline engine takes and gives (an EOS or stop
    token included), where vLLM puts them; without it, neither field appears."""
    ids = encode_prompt(tok, PROMPT)
    text, req = reference(ids, greedy(max_tokens=10))
    body = client.post(COMPLETION_PATH, json={"prompt": PROMPT, "max_tokens": 10, "temperature": 0,
                                              "return_token_ids": True}).json()
    [choice] = body["choices"]
    assert choice["prompt_token_ids"] == ids and choice["token_ids"] == list(req.output_token_ids)
    assert choice["text"] == text
    chat_ids = apply_chat_template(tok, QUESTION)
    chat_text, chat_req = reference(chat_ids, greedy(max_tokens=12))
    body = client.post(CHAT_PATH, json={"messages": QUESTION, "max_tokens": 12, "temperature": 0,
                                        "return_token_ids": True}).json()
    assert body["prompt_token_ids"] == chat_ids and body["choices"][0]["token_ids"] == list(chat_req.output_token_ids)
    assert body["choices"][0]["message"]["content"] == chat_text
    plain = client.post(COMPLETION_PATH, json={"prompt": PROMPT, "max_tokens": 2}).json()
    assert "token_ids" not in plain["choices"][0] and "prompt_token_ids" not in plain["choices"][0]


@pytest.mark.parametrize("include_usage", [True, False])
def test_chat_stream_frames_and_text(client, tok, reference, include_usage):
    text, req = reference(apply_chat_template(tok, QUESTION), greedy(max_tokens=12))
    r = client.post("/v1/chat/completions", json={"model": MODEL, "messages": QUESTION, "max_tokens": 12,
                                                  "temperature": 0, "stream": True,
                                                  "stream_options": {"include_usage": include_usage}})
    frames = events(r)
    assert frames[-1] == "[DONE]"
    chunks = frames[:-1]
    assert len({c["id"] for c in chunks}) == 1 and all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    if include_usage:
        usage_chunk, chunks = chunks[-1], chunks[:-1]
        assert usage_chunk["choices"] == []
        assert usage_chunk["usage"]["completion_tokens"] == len(req.output_token_ids)
    finish = chunks[-1]["choices"][0]
    assert finish["delta"] == {} and finish["finish_reason"] == req.finish_reason.value
    content = [c["choices"][0] for c in chunks[1:-1]]
    assert all(set(c["delta"]) == {"content"} and c["delta"]["content"] and c["finish_reason"] is None
               for c in content)
    assert "".join(c["delta"]["content"] for c in content) == text


def test_completion_stream_text(client, tok, reference):
    text, req = reference(encode_prompt(tok, PROMPT), greedy(max_tokens=10))
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 10, "temperature": 0,
                                             "stream": True, "stream_options": {"include_usage": True}})
    frames = events(r)
    assert frames[-1] == "[DONE]" and frames[-2]["choices"] == [] and "usage" in frames[-2]
    finish = frames[-3]["choices"][0]
    assert finish["text"] == "" and finish["finish_reason"] == req.finish_reason.value
    assert "".join(f["choices"][0]["text"] for f in frames[:-3]) == text
    assert all(f["object"] == "text_completion" and f["choices"][0]["finish_reason"] is None for f in frames[:-3])


@pytest.mark.parametrize("engine_applies_stop", [True, False])
def test_stop_strings_cut_the_text(client, backend, tok, reference, engine_applies_stop):
    full, _ = reference(apply_chat_template(tok, QUESTION), greedy(max_tokens=12))
    word = full.split()[-2]  # a word in the middle of the answer
    expected = full[:full.index(word)]
    offline, req = reference(apply_chat_template(tok, QUESTION), greedy(max_tokens=12, stop=(word, "zzz")))
    assert offline == expected and req.finish_reason.value == "stop"
    backend.ignore_stop_strings = not engine_applies_stop  # then only the gateway sees the stop string
    aborts_before = len(backend.abort_calls)
    body = {"model": MODEL, "messages": QUESTION, "max_tokens": 12, "temperature": 0, "stop": [word, "zzz"]}
    r = client.post("/v1/chat/completions", json=body)
    assert r.json()["choices"][0]["message"]["content"] == expected
    assert r.json()["choices"][0]["finish_reason"] == "stop"
    frames = events(client.post("/v1/chat/completions", json={**body, "stream": True}))
    assert "".join(f["choices"][0]["delta"].get("content", "") for f in frames[:-1]) == expected
    assert frames[-2]["choices"][0]["finish_reason"] == "stop"
    # a backend still generating past the stop string is aborted, once per request
    assert len(backend.abort_calls) - aborts_before == (0 if engine_applies_stop else 2)


def test_sampling_params_reach_the_engine(client, tok, reference):
    from common.config import SamplingParams
    params = {"temperature": 0.9, "top_p": 0.9, "top_k": 40, "seed": 7, "max_tokens": 8, "ignore_eos": True}
    expected, _ = reference(encode_prompt(tok, PROMPT), SamplingParams(**params))
    for _ in range(2):
        r = client.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT, **params})
        assert r.json()["choices"][0]["text"] == expected and r.json()["usage"]["completion_tokens"] == 8
    greedy_text, _ = reference(encode_prompt(tok, PROMPT), greedy(max_tokens=8, ignore_eos=True))
    assert expected != greedy_text, "pick a seed whose sample differs from greedy, or the test proves nothing"


def test_default_max_tokens_is_capped_by_the_context_left(backend, tok):
    client = app_client(backend, default_max_tokens=3)
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT, "temperature": 0, "ignore_eos": True})
    assert r.json()["usage"]["completion_tokens"] == 3 and r.json()["choices"][0]["finish_reason"] == "length"
    prompt_len = len(encode_prompt(tok, PROMPT))
    limited = _Limited(backend, max_model_len=prompt_len + 2)
    r = app_client(limited).post("/v1/completions", json={"model": MODEL, "prompt": PROMPT, "temperature": 0,
                                                          "ignore_eos": True})
    assert r.json()["usage"]["completion_tokens"] == 2


class _Limited:
    """`backend` with a smaller context limit."""

    def __init__(self, backend, max_model_len):
        self._backend, self.max_model_len = backend, max_model_len

    def __getattr__(self, name):
        return getattr(self._backend, name)


# ---- request errors ------------------------------------------------------------------------------
CHAT_PATH, COMPLETION_PATH = "/v1/chat/completions", "/v1/completions"
BAD_REQUESTS = [
    (COMPLETION_PATH, {"model": "gpt-4", "prompt": "x"}, 404, "model_not_found", "model"),
    (COMPLETION_PATH, {"model": MODEL}, 400, "missing_parameter", "prompt"),
    (CHAT_PATH, {"model": MODEL}, 400, "missing_parameter", "messages"),
    (CHAT_PATH, {"model": MODEL, "messages": []}, 400, None, "messages"),
    (COMPLETION_PATH, {"prompt": "x", "max_tokens": 0}, 400, None, "max_tokens"),
    (COMPLETION_PATH, {"prompt": "x", "max_tokens": -5}, 400, None, "max_tokens"),
    (COMPLETION_PATH, {"prompt": "x", "max_tokens": "ten"}, 400, None, "max_tokens"),
    (CHAT_PATH, {"messages": QUESTION, "max_completion_tokens": 0}, 400, None, "max_completion_tokens"),
    (COMPLETION_PATH, {"prompt": "x", "max_tokens": 10 ** 6}, 400, "context_length_exceeded", "max_tokens"),
    (COMPLETION_PATH, {"prompt": "x", "temperature": -0.5}, 400, None, "temperature"),
    (COMPLETION_PATH, {"prompt": "x", "top_p": 0}, 400, None, "top_p"),
    (COMPLETION_PATH, {"prompt": "x", "top_p": 1.5}, 400, None, "top_p"),
    (COMPLETION_PATH, {"prompt": "x", "top_k": -3}, 400, None, "top_k"),
    (COMPLETION_PATH, {"prompt": "x", "stop": ""}, 400, None, "stop"),
    (COMPLETION_PATH, {"prompt": "x", "stop_token_ids": [-1]}, 400, None, "stop_token_ids"),
    (COMPLETION_PATH, {"prompt": "x", "n": 17}, 400, None, "n"),
    (COMPLETION_PATH, {"prompt": "x", "n": 0}, 400, None, "n"),
    (COMPLETION_PATH, {"prompt": "x", "logprobs": 21}, 400, None, "logprobs"),
    (COMPLETION_PATH, {"prompt": "x", "prompt_logprobs": -1}, 400, None, "prompt_logprobs"),
    (COMPLETION_PATH, {"prompt": "x", "echo": True, "max_tokens": -1}, 400, None, "max_tokens"),
    (COMPLETION_PATH, {"prompt": "x", "best_of": 3}, 400, "unsupported_parameter", "best_of"),
    (COMPLETION_PATH, {"prompt": "x", "return_token_ids": 1}, 400, None, "return_token_ids"),
    (CHAT_PATH, {"messages": QUESTION, "return_token_ids": True, "stream": True}, 400, "unsupported_parameter",
     "return_token_ids"),
    (COMPLETION_PATH, {"prompt": [1, 10 ** 9]}, 400, None, "prompt"),
    (COMPLETION_PATH, {"prompt": ""}, 400, None, "prompt"),
    (CHAT_PATH, {"messages": QUESTION, "top_logprobs": 2}, 400, None, "top_logprobs"),
    (CHAT_PATH, {"messages": QUESTION, "response_format": {"type": "yaml"}}, 400, None, "response_format.type"),
    (CHAT_PATH, {"messages": QUESTION, "response_format": {"type": "json_schema"}}, 400, None,
     "response_format.json_schema"),
    (CHAT_PATH, {"messages": QUESTION, "response_format": {"type": "json_object"}, "guided_regex": "a"}, 400, None,
     "guided_regex"),
    (CHAT_PATH, {"messages": QUESTION, "structured_outputs": {"regex": "(unclosed"}}, 400, "invalid_grammar",
     "structured_outputs"),
    (CHAT_PATH, {"messages": QUESTION, "structured_outputs": {"regex": "a", "choice": ["b"]}}, 400, None,
     "structured_outputs"),
    (COMPLETION_PATH, {"prompt": "x", "structured_outputs": {"choice": []}}, 400, None, "structured_outputs.choice"),
    (COMPLETION_PATH, {"prompt": "x", "guided_json": "{not json"}, 400, None, "guided_json"),
    (COMPLETION_PATH, {"prompt": "x", "response_format": {"type": "json_object"}, "min_tokens": 2}, 400,
     "unsupported_parameter", "min_tokens"),
    (CHAT_PATH, {"messages": QUESTION, "logprobs": True, "top_logprobs": 21}, 400, None, "top_logprobs"),
    (CHAT_PATH, {"messages": QUESTION, "tools": [{"type": "function"}]}, 400, None, "tools[0]"),
    (CHAT_PATH, {"messages": QUESTION, "tools": [{"type": "function", "function": {"name": "a b"}}]}, 400, None,
     "tools[0].function.name"),
    (CHAT_PATH, {"messages": QUESTION, "tools": [{"type": "function", "function": {"name": "f"}}],
                 "tool_choice": {"type": "function", "function": {"name": "g"}}}, 400, None, "tool_choice"),
    (CHAT_PATH, {"messages": QUESTION, "tool_choice": "required"}, 400, None, "tool_choice"),
    (CHAT_PATH, {"messages": [{"role": "tool", "content": "1"}]}, 400, None, "messages[0].tool_call_id"),
    (CHAT_PATH, {"messages": [{"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f"}}]}]},
     400, None, "messages[0].tool_calls[0]"),
    (CHAT_PATH, {"messages": QUESTION, "n": 3, "session_id": "s"}, 404, "session_not_found", "session_id"),
    (CHAT_PATH, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400, "unsupported_parameter",
     "messages[0].content[0]"),
    (CHAT_PATH, {"messages": [{"role": "wizard", "content": "x"}]}, 400, None, "messages[0].role"),
    (CHAT_PATH, {"messages": ["hello"]}, 400, None, "messages[0]"),
]


@pytest.mark.parametrize("path,body,status,code,param", BAD_REQUESTS)
def test_bad_request_gets_status_and_error_shape(client, path, body, status, code, param):
    error = assert_error(client.post(path, json=body), status, code, param)
    assert error["type"] == "invalid_request_error"
    good_request_works(client)


def test_body_that_is_not_a_json_object(client):
    assert_error(client.post(COMPLETION_PATH, content=b"{not json", headers=JSON), 400, "invalid_json")
    assert_error(client.post(COMPLETION_PATH, content=b"[1, 2]", headers=JSON), 400, "invalid_json")
    assert_error(client.post(COMPLETION_PATH, content=b"\xff\xfe", headers=JSON), 400, "invalid_json")
    assert_error(client.post(COMPLETION_PATH, content=b"[" * 100_000, headers=JSON), 400, "invalid_json")  # too deep
    good_request_works(client)


def test_unknown_route_and_method_keep_the_error_shape(client):
    assert_error(client.get("/v1/nothing"), 404)
    assert_error(client.get(COMPLETION_PATH), 405)


def test_framework_validation_errors_are_400_in_the_error_shape(backend):
    app = build_app(backend, GatewayConfig())

    @app.get("/typed")
    async def typed(n: int):  # a route with a declared type: FastAPI would answer 422 on its own
        return {"n": n}
    client = TestClient(app, base_url=BASE_URL)
    assert client.get("/typed?n=3").json() == {"n": 3}
    assert assert_error(client.get("/typed?n=three"), 400)["param"] == "query.n"


def test_body_too_large_declared_or_chunked(backend):
    client = app_client(backend, max_body_bytes=1024)
    big = json.dumps({"model": MODEL, "prompt": "x" * 2000}).encode()
    assert_error(client.post(COMPLETION_PATH, content=big, headers=JSON), 413, "request_too_large")
    assert_error(client.post(COMPLETION_PATH, content=iter([big[:1000], big[1000:]]), headers=JSON), 413,
                 "request_too_large")
    good_request_works(client)


def test_prompt_longer_than_max_prompt_tokens(backend):
    client = app_client(backend, max_prompt_tokens=4)
    assert_error(client.post(COMPLETION_PATH, json={"prompt": "one two three four five six"}), 400, "prompt_too_long")
    good_request_works(client)


def test_served_model_name_and_models_list(backend):
    client = app_client(backend, served_model_name="tandem-small")
    body = client.get("/v1/models").json()
    assert body["object"] == "list" and [m["id"] for m in body["data"]] == ["tandem-small"]
    assert body["data"][0]["object"] == "model"
    assert_error(client.post(COMPLETION_PATH, json={"model": MODEL, "prompt": "x"}), 404, "model_not_found")
    r = client.post(COMPLETION_PATH, json={"model": "tandem-small", "prompt": "Hi", "max_tokens": 1})
    assert r.status_code == 200 and r.json()["model"] == "tandem-small"


def test_api_key(backend):
    client = app_client(backend, api_key="sekret")
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 1}
    assert assert_error(client.post(COMPLETION_PATH, json=body), 401)["type"] == "authentication_error"
    assert_error(client.post(COMPLETION_PATH, json=body, headers={"Authorization": "Bearer wrong"}), 401)
    assert_error(client.get("/v1/models"), 401)
    ok = {"Authorization": "Bearer sekret"}
    assert client.post(COMPLETION_PATH, json=body, headers=ok).status_code == 200
    assert client.get("/v1/models", headers=ok).status_code == 200
    assert [client.get(p).status_code for p in ("/health", "/health/ready")] == [200, 200]  # probes carry no key
    assert_error(client.get("/metrics"), 401, "invalid_api_key")
    assert client.get("/metrics", headers=ok).status_code == 200


# ---- backend errors ------------------------------------------------------------------------------
@pytest.mark.parametrize("kind,status", [(ErrorKind.REJECTED, 400), (ErrorKind.QUEUE_FULL, 429),
                                         (ErrorKind.UNAVAILABLE, 503), (ErrorKind.INTERNAL, 500)])
@pytest.mark.parametrize("stream", [False, True])
def test_backend_refusal_maps_to_status(client, backend, kind, status, stream):
    backend.fail_start = BackendError(kind, "refused for the test", retry_after_s=2.5)
    r = client.post(CHAT_PATH, json={"model": MODEL, "messages": QUESTION, "max_tokens": 4, "stream": stream})
    error = assert_error(r, status, kind.value)
    assert r.headers["content-type"] == "application/json"
    if status == 500:  # a backend's account of a bug stays in the log; the client gets an error id
        assert "refused for the test" not in error["message"] and "(error id err-" in error["message"]
    else:
        assert "refused for the test" in error["message"]
    assert r.headers.get("retry-after") == ("3" if status in (429, 503) else None)
    backend.fail_start = None
    good_request_works(client)


def test_failure_after_tokens(client, backend):
    backend.fail_after_tokens = (3, ErrorKind.UNAVAILABLE)
    aborts = len(backend.abort_calls)
    r = client.post(CHAT_PATH, json={"model": MODEL, "messages": QUESTION, "max_tokens": 10, "temperature": 0})
    assert_error(r, 503, "unavailable")
    assert int(r.headers["retry-after"]) >= 1
    frames = events(client.post(CHAT_PATH, json={"model": MODEL, "messages": QUESTION, "max_tokens": 10,
                                                 "temperature": 0, "stream": True}))
    assert frames[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(f["choices"][0]["finish_reason"] is None for f in frames[1:-2])
    assert set(frames[-2]) == {"error"} and frames[-2]["error"]["code"] == "unavailable" and frames[-1] == "[DONE]"
    assert len(backend.abort_calls) == aborts, "the backend ended these requests itself; nothing to abort"


def test_backend_bug_mid_stream_is_a_500_and_the_request_is_aborted(client, backend):
    backend.crash_after_tokens = 2
    aborts, started = len(backend.abort_calls), len(backend.started_ids)
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 12, "ignore_eos": True, "temperature": 0}
    assert_error(client.post(COMPLETION_PATH, json=body), 500, "internal_error")
    frames = events(client.post(COMPLETION_PATH, json={**body, "stream": True}))
    assert frames[-2]["error"]["code"] == "internal_error" and frames[-1] == "[DONE]"
    assert backend.abort_calls[aborts:] == backend.started_ids[started:] and len(backend.started_ids) == started + 2
    backend.crash_after_tokens = None
    good_request_works(client)


def test_too_many_requests_in_flight(backend):
    app = build_app(backend, GatewayConfig(max_pending_requests=1))
    backend.step_delay_s = 0.05
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 8, "temperature": 0}

    async def scenario():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url=BASE_URL) as client:
            started = len(backend.started_ids)
            first = asyncio.ensure_future(client.post(COMPLETION_PATH, json=body))
            while len(backend.started_ids) == started:
                await asyncio.sleep(0.01)
            second = await client.post(COMPLETION_PATH, json=body)
            return await first, second, await client.post(COMPLETION_PATH, json=body)

    first, second, third = asyncio.run(scenario())
    assert first.status_code == 200 and third.status_code == 200
    assert_error(second, 429, "too_many_pending_requests")


def test_draining_refuses_new_requests(client):
    client.app.state.draining = True
    try:
        r = client.post(COMPLETION_PATH, json={"model": MODEL, "prompt": "Hi", "max_tokens": 1})
        assert_error(r, 503, "draining")
        assert int(r.headers["retry-after"]) >= 1
        assert client.get("/health").status_code == 200
        assert_error(client.get("/health/ready"), 503)
    finally:
        client.app.state.draining = False
    good_request_works(client)


# ---- health and metrics --------------------------------------------------------------------------
def test_health_and_ready(backend):
    client = app_client(backend, ready_interval_s=0.05)  # probes cached for 50 ms (test_gateway_hardening)
    assert client.get("/health").json() == {"status": "ok"}
    assert client.get("/health/ready").json() == {"status": "ready"}
    time.sleep(0.06)
    backend.fail_start = BackendError(ErrorKind.UNAVAILABLE, "no decode worker")
    assert "no decode worker" in assert_error(client.get("/health/ready"), 503)["message"]
    backend.fail_start = None
    slow = app_client(backend, ready_timeout_s=0.2)
    backend.start_delay_s = 1.0
    aborts = len(backend.abort_calls)
    assert_error(slow.get("/health/ready"), 503)
    assert len(backend.abort_calls) == aborts + 1 and backend.abort_calls[-1].startswith("ready-")


def scrape(client) -> dict:
    """{(sample name, sorted labels): value}"""
    text = client.get("/metrics").text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_metrics_count_exactly(backend):
    backend.extra_collectors = [_ConstCollector()]
    try:
        client = app_client(backend)
    finally:
        backend.extra_collectors = []
    other = app_client(backend)  # a second app in this process: its registry must stay untouched
    l1_hits_before = backend.engine.tier_stats().hit_tokens_l1
    graphs_before = backend.engine.graph_stats()
    ok = {"model": MODEL, "messages": QUESTION, "max_tokens": 6, "temperature": 0}
    usages = [client.post(CHAT_PATH, json=ok).json()["usage"],
              client.post(CHAT_PATH, json={**ok, "max_tokens": 12, "stop": ["Paris"]}).json()["usage"]]
    usages.append(events(client.post(CHAT_PATH, json={**ok, "stream": True,
                                                      "stream_options": {"include_usage": True}}))[-2]["usage"])
    assert_error(client.post(CHAT_PATH, json={**ok, "top_p": 7}), 400)
    backend.fail_start = BackendError(ErrorKind.UNAVAILABLE, "down")
    assert_error(client.post(CHAT_PATH, json=ok), 503)
    backend.fail_start = None

    m = scrape(client)
    assert m[("tandem:request_success_total", (("finished_reason", "length"),))] == 2
    assert m[("tandem:request_success_total", (("finished_reason", "stop"),))] == 1
    assert m[("tandem:request_failure_total", (("kind", "invalid_request"),))] == 1
    assert m[("tandem:request_failure_total", (("kind", "unavailable"),))] == 1
    prompt = sum(u["prompt_tokens"] for u in usages)
    generated = sum(u["completion_tokens"] for u in usages)
    assert m[("tandem:prompt_tokens_total", ())] == prompt == m[("tandem:prefix_cache_queries_total", ())]
    assert m[("tandem:generation_tokens_total", ())] == generated
    assert m[("tandem:prefix_cache_hits_total", ())] == sum(u["prompt_tokens_details"]["cached_tokens"]
                                                           for u in usages) > 0
    assert m[("tandem:time_to_first_token_seconds_count", ())] == 3
    assert m[("tandem:e2e_request_latency_seconds_count", ())] == 3
    assert m[("tandem:inter_token_latency_seconds_count", ())] == generated - 3  # one token per chunk here
    assert m[("tandem:kv_transfer_bytes_total", ())] == 3 * TRANSFER[0]
    assert m[("tandem:kv_transfer_seconds_count", ())] == 3
    assert m[("tandem:requests_routed_total", (("decode_worker", WORKER_ID), ("prefill_worker", "")))] == 3
    assert m[("tandem:num_requests_running", ())] == 0 and m[("tandem:num_requests_waiting", ())] == 0
    worker = (("role", "colocated"), ("worker", WORKER_ID))
    assert m[("tandem:worker_alive", worker)] == 1 and m[("tandem:worker_restarts", worker)] == 0
    assert m[("tandem:kv_cache_usage_perc", worker)] == 0
    assert not any(name in ("tandem:landing_kv_cache_usage_perc", "tandem:host_kv_cache_usage_perc")
                   for name, _ in m), "None means no landing pool"
    tier = lambda t: (("role", "colocated"), ("tier", t), ("worker", WORKER_ID))  # noqa: E731
    l1_hits = m[("tandem:prefix_cache_hit_tokens_total", tier("l1"))] - l1_hits_before  # the engine outlives the app
    assert l1_hits == m[("tandem:prefix_cache_hits_total", ())]
    assert m[("tandem:prefix_cache_hit_tokens_total", tier("l2"))] == 0  # nothing left the device pool
    assert 0 < m[("tandem:l2_kv_cache_usage_perc", worker)] <= 1  # the cached prompts were backed up
    graphs = backend.engine.graph_stats()  # decode steps replayed, prefill steps eager (not_decode)
    assert m[("tandem:graph_replays_total", worker)] == graphs.replays > graphs_before.replays
    not_decode = dict(graphs.fallbacks)["not_decode"]
    assert m[("tandem:graph_fallbacks_total", (("reason", "not_decode"), *worker))] == not_decode
    assert not_decode - dict(graphs_before.fallbacks).get("not_decode", 0) >= 3  # one prefill step a request at least
    assert m[("tandem:graph_compiling", worker)] == 0  # an engine made alone compiled (if at all) before serving
    assert m[("tandem_test_extra", ())] == 42
    assert scrape(other)[("tandem:generation_tokens_total", ())] == 0


class _ConstCollector:
    def collect(self):
        yield GaugeMetricFamily("tandem_test_extra", "A backend's own collector.", value=42)


# ---- a real server: disconnects and graceful shutdown ------------------------------------------
@pytest.fixture
def server(backend):
    shutdowns = []

    async def on_shutdown():
        shutdowns.append(True)
    app = build_app(backend, GatewayConfig(port=0), on_shutdown=on_shutdown)
    server = GatewayServer(app, GatewayConfig(port=0), graceful_timeout_s=10)
    server.start_in_thread()
    server.shutdowns = shutdowns
    yield server
    server.stop()
    assert server.join(15)


def wait_for(predicate, timeout_s=10.0):
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_client_disconnect_mid_stream_aborts_once(server, backend):
    backend.step_delay_s = 0.05
    aborts, started = len(backend.abort_calls), len(backend.started_ids)
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 200, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=f"http://127.0.0.1:{server.port}") as http:
        with http.stream("POST", COMPLETION_PATH, json=body) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            assert next(line for line in lines if line.startswith("data: ")) and next(lines) is not None
    wait_for(lambda: len(backend.abort_calls) > aborts)
    time.sleep(0.2)
    assert backend.abort_calls[aborts:] == [backend.started_ids[started]]
    backend.wait_idle()
    assert backend.on_engine(lambda e: (e.check_integrity(), e.kvm.pool.usage().private)[1]) == 0
    m = scrape(httpx.Client(base_url=f"http://127.0.0.1:{server.port}"))
    assert m[("tandem:request_failure_total", (("kind", "client_disconnect"),))] == 1
    assert not any(name == "tandem:request_success_total" for name, _ in m)


def test_client_disconnect_while_waiting_non_streaming_aborts_once(server, backend):
    backend.step_delay_s = 0.05
    aborts, started = len(backend.abort_calls), len(backend.started_ids)
    body = json.dumps({"model": MODEL, "prompt": PROMPT, "max_tokens": 200, "ignore_eos": True}).encode()
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:%d\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (server.port, len(body), body))
        wait_for(lambda: len(backend.started_ids) > started)
    wait_for(lambda: len(backend.abort_calls) > aborts)
    time.sleep(0.2)
    assert backend.abort_calls[aborts:] == [backend.started_ids[started]]


def test_graceful_shutdown_finishes_streams_in_flight(server, backend):
    backend.step_delay_s = 0.02
    started = len(backend.started_ids)
    result = {}

    def stream():
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 16, "ignore_eos": True, "stream": True}
        with httpx.Client(base_url=f"http://127.0.0.1:{server.port}") as http:
            result["text"] = http.post(COMPLETION_PATH, json=body, timeout=30).text
    thread = threading.Thread(target=stream)
    thread.start()
    wait_for(lambda: len(backend.started_ids) > started)
    server.stop()
    assert server.join(15) and server.shutdowns == [True]
    thread.join(15)
    frames = [f for f in result["text"].split("\n\n") if f]
    assert frames[-1] == "data: [DONE]" and json.loads(frames[-2][6:])["choices"][0]["finish_reason"] == "length"
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"http://127.0.0.1:{server.port}/health")
