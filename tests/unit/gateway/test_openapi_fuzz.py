"""The HTTP API fuzzed from its own /openapi.json (schemathesis, valid and invalid bodies), then a
hand-made corpus of hostile requests, against the real dispatcher and in-process workers on the tiny
Llama. No request may get a server error, responses must match the documented schema, and afterwards
every worker is alive and at rest."""

from __future__ import annotations

import json
import socket
import time

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from prometheus_client.parser import text_string_to_metric_families
from schemathesis import GenerationMode
from schemathesis import checks as st_checks

from router.gateway.openapi import ChatCompletionChunk, ChatCompletionResponse, CompletionChunk, CompletionResponse
from tests.gateway_cluster import GatewayStack

try:
    import httpx
except ImportError:  # the successor package keeps httpx's API under a new name
    import httpx2 as httpx

BODY_TIMEOUT_S = 3.0  # far above one 2-token request: the slow-upload test needs that margin on a loaded machine
FUZZ_EXAMPLES = 30  # per operation; the POST ones run a generation for each valid body


@pytest.fixture(scope="module")
def stack():
    with GatewayStack(body_timeout_s=BODY_TIMEOUT_S, ready_interval_s=0.5) as stack:
        yield stack
        stack.assert_at_rest()


@pytest.fixture(scope="module")
def api_schema(stack):
    return schemathesis.openapi.from_url(stack.url + "/openapi.json")


# Each operation fuzzed on its own (the lazy `schemathesis.pytest.from_fixture` integration does not
# run under this pytest); `test_every_operation_is_fuzzed` keeps this list equal to the document's.
OPERATIONS = [("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("GET", "/v1/models"),
              ("GET", "/health"), ("GET", "/health/ready"), ("GET", "/debug/workers"), ("GET", "/metrics"),
              ("POST", "/v1/sessions"), ("DELETE", "/v1/sessions/{session_id}"), ("POST", "/tokenize"),
              ("POST", "/detokenize")]
NEVER_200 = {("DELETE", "/v1/sessions/{session_id}")}  # random ids name no open session: 404 is the right answer
CHECKS = [st_checks.not_a_server_error, st_checks.status_code_conformance, st_checks.content_type_conformance,
          st_checks.response_schema_conformance, st_checks.negative_data_rejection]


def test_every_operation_is_fuzzed(api_schema):
    documented = {(op.ok().method.upper(), op.ok().path) for op in api_schema.get_all_operations()}
    assert documented == set(OPERATIONS)


FUZZED = [(method, path, GenerationMode.POSITIVE) for method, path in OPERATIONS] + [
    (method, path, GenerationMode.NEGATIVE) for method, path in OPERATIONS if method == "POST"]  # GETs take no input


@pytest.mark.parametrize("method,path,mode", FUZZED)
def test_fuzz_from_openapi(api_schema, stack, method, path, mode):
    operation = api_schema[path][method]
    statuses = []

    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(max_examples=FUZZ_EXAMPLES, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    def fuzz(case):
        response = case.call(timeout=30)
        statuses.append(response.status_code)
        case.validate_response(response, checks=CHECKS)

    fuzz()
    assert statuses and all(s < 500 for s in statuses), statuses
    if mode is GenerationMode.POSITIVE and (method, path) not in NEVER_200:
        assert 200 in statuses, f"no valid body of {path} was served: the fuzz would prove nothing ({statuses})"


# ---- the hand-made corpus ------------------------------------------------------------------------
COMPLETION, CHAT = "/v1/completions", "/v1/chat/completions"
USER = [{"role": "user", "content": "hi"}]
JSON_TYPE = {"Content-Type": "application/json"}


def raw(text: str) -> dict:
    """A JSON text sent byte for byte (clients would escape or refuse what these cases need)."""
    return {"content": text.encode(), "headers": JSON_TYPE}


CORPUS = [  # (name, path, request kwargs, expected status)
    ("top_k 2^63", COMPLETION, {"json": {"prompt": "a", "max_tokens": 4, "top_k": 2**63}}, 200),
    ("top_k 2^64 chat", CHAT, {"json": {"messages": USER, "max_tokens": 4, "top_k": 2**64, "temperature": 0.7}}, 200),
    ("top_k -2", COMPLETION, {"json": {"prompt": "a", "top_k": -2}}, 400),
    ("seed 2^64", COMPLETION, {"json": {"prompt": "a", "seed": 2**64}}, 400),
    ("max_tokens 2^63", COMPLETION, {"json": {"prompt": "a", "max_tokens": 2**63}}, 400),
    ("token id 2^63", COMPLETION, {"json": {"prompt": [2**63], "max_tokens": 2}}, 400),
    ("stop token id 2^63", COMPLETION, {"json": {"prompt": "a", "stop_token_ids": [2**63]}}, 400),
    ("4301-digit integer", COMPLETION, raw('{"prompt": "a", "max_tokens": ' + "9" * 4301 + "}"), 400),
    ("lone surrogate prompt", COMPLETION, raw('{"prompt": "\\ud800", "max_tokens": 2}'), 400),
    ("lone surrogate content", CHAT, raw('{"messages": [{"role": "user", "content": "a\\udfff"}]}'), 400),
    ("lone surrogate stop", COMPLETION, raw('{"prompt": "a", "stop": ["\\udbff"]}'), 400),
    ("NaN temperature", COMPLETION, raw('{"prompt": "a", "temperature": NaN}'), 400),
    ("Infinity top_p", CHAT, raw('{"messages": [{"role": "user", "content": "a"}], "top_p": Infinity}'), 400),
    ("1e999 temperature", COMPLETION, raw('{"prompt": "a", "temperature": 1e999}'), 400),
    ("90,000 stop strings", COMPLETION, {"json": {"prompt": "a", "stop": [f"s{i}" for i in range(90_000)]}}, 400),
    ("one 5000-character stop string", COMPLETION, {"json": {"prompt": "a", "stop": "x" * 5000}}, 400),
    ("dict role", CHAT, {"json": {"messages": [{"role": {"r": 1}, "content": "a"}]}}, 400),
    ("list role", CHAT, {"json": {"messages": [{"role": ["user"], "content": "a"}]}}, 400),
    ("text/plain body", COMPLETION, {"content": b'{"prompt": "a"}', "headers": {"Content-Type": "text/plain"}}, 415),
    ("form body", CHAT, {"content": b"messages=a", "headers": {"Content-Type": "application/x-www-form-urlencoded"}},
     415),
    ("bad Host", COMPLETION, {"json": {"prompt": "a"}, "headers": {"Host": "attacker.example"}}, 403),
    ("cross-site Origin", CHAT, {"json": {"messages": USER}, "headers": {"Origin": "https://attacker.example"}}, 403),
    ("deep nesting", COMPLETION, raw('{"prompt": ' + "[" * 50_000 + "]" * 50_000 + "}"), 400),
    ("body over 1 MiB", COMPLETION, {"json": {"prompt": "a" * (1 << 20)}}, 413),
    ("NUL in prompt", COMPLETION, {"json": {"prompt": "a\x00b", "max_tokens": 2}}, 200),
    ("stop strings while streaming", CHAT, {"json": {"messages": USER, "max_tokens": 30, "stream": True,
                                                     "stop": ["a", "e", "\ufffd"], "stream_options": {
                                                         "include_usage": True}}}, 200),
    ("null assistant turn", CHAT, {"json": {"messages": [*USER, {"role": "assistant", "content": None}, *USER],
                                            "max_tokens": 2}}, 200),
]


@pytest.mark.parametrize("name,path,kwargs,status", CORPUS, ids=[c[0] for c in CORPUS])
def test_hand_made_corpus(stack, name, path, kwargs, status):
    with httpx.Client(base_url=stack.url, timeout=60) as http:
        r = http.post(path, **kwargs)
    assert r.status_code == status, (name, r.status_code, r.text[:500])
    if status != 200:
        assert set(r.json()) == {"error"} and set(r.json()["error"]) == {"message", "type", "param", "code"}
    elif r.headers["content-type"].startswith("text/event-stream"):
        assert_valid_stream(r.text, ChatCompletionChunk if path == CHAT else CompletionChunk)
    else:
        (ChatCompletionResponse if path == CHAT else CompletionResponse).model_validate(r.json())


def assert_valid_stream(text: str, chunk_model) -> None:
    frames = [f for f in text.split("\n\n") if f]
    assert frames[-1] == "data: [DONE]" and all(f.startswith("data: ") for f in frames), frames[-3:]
    for frame in frames[:-1]:
        chunk_model.model_validate(json.loads(frame[6:]))


def test_slow_bodies_get_408_while_others_are_served(stack):
    slow = []
    for _ in range(8):
        sock = socket.create_connection(("127.0.0.1", stack.port))
        sock.settimeout(20)
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:%d\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 500\r\n\r\n{\"prompt\": " % stack.port)
        slow.append(sock)
    t0 = time.monotonic()
    r = httpx.post(stack.url + COMPLETION, json={"prompt": "a", "max_tokens": 2}, timeout=30)
    assert r.status_code == 200 and time.monotonic() - t0 < BODY_TIMEOUT_S, "a slow upload held up another client"
    for sock in slow:
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
        sock.close()
        assert answer.startswith(b"HTTP/1.1 408 "), answer[:200]
    assert time.monotonic() - t0 < BODY_TIMEOUT_S + 5


def test_a_stream_cut_by_its_client_is_released(stack):
    body = {"prompt": "a", "max_tokens": 100, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=stack.url, timeout=30) as http:
        with http.stream("POST", COMPLETION, json=body) as r:
            assert r.status_code == 200
            next(line for line in r.iter_lines() if line.startswith("data: "))
    stack.assert_at_rest()


def test_workers_alive_and_at_rest_afterwards(stack):
    """Runs last in this module: whatever the fuzz and the corpus sent, nothing leaked or died."""
    stack.assert_at_rest()
    assert httpx.get(stack.url + "/health").status_code == 200
    time.sleep(0.6)  # past ready_interval_s: a fresh generation, not a cached answer
    assert httpx.get(stack.url + "/health/ready").json() == {"status": "ready"}
    text = httpx.get(stack.url + "/metrics").text
    failures = {s.labels["kind"]: s.value for family in text_string_to_metric_families(text)
                for s in family.samples if s.name == "tandem:request_failure_total"}
    assert failures.get("internal", 0) == 0 and failures.get("unavailable", 0) == 0, failures
    assert all(g.alive for g in stack.dispatcher.worker_gauges())
