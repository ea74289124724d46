"""Streaming sessions through the HTTP API (POST/DELETE /v1/sessions, `session_id` on completions and
chat) over the test backend on the tiny Llama with a byte-level tokenizer: each turn sends the whole
conversation (history + the new turn), its text equals a no-cache engine's for that conversation,
later turns hit the pinned history, and a failed turn leaves the history as it was."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from cluster.serve.config import GatewayConfig
from common.config import EngineConfig
from engine.build import build_engine
from kernels.model.tokenizer import apply_chat_template, encode_prompt
from router.backend import ErrorKind
from router.gateway import build_app
from router.gateway.detokenize import final_text
from tests.gateway_backend import EngineBackend, settle_backend
from tests.gateway_cluster import byte_tokenizer
from tests.gateway_http import BASE_URL, app_client, assert_error
from tests.helpers import greedy, make_engine, tiny_models

try:
    import httpx
except ImportError:  # the successor package keeps httpx's API under a new name
    import httpx2 as httpx

PAGE_SIZE = 4
COMPLETION, CHAT, SESSIONS = "/v1/completions", "/v1/chat/completions", "/v1/sessions"
CAPACITY = 200  # two sessions fit the engine's session budget (half of 1024 tokens), three do not


@pytest.fixture(scope="module")
def backend():
    ours, _, arch = tiny_models()
    config = EngineConfig(page_size=PAGE_SIZE, num_pages=257, chunk_size=64, max_model_len=512, debug_kv=True)
    backend = EngineBackend(build_engine(config, ours, arch, byte_tokenizer()))
    yield backend
    backend.close()


@pytest.fixture(scope="module")
def reference():
    """Greedy output ids of a prompt on an engine with no cache at all."""
    engine = make_engine(page_size=PAGE_SIZE, num_pages=257, enable_prefix_cache=False)

    def run(prompt_ids: list[int], max_tokens: int) -> list[int]:
        [req] = engine.generate([prompt_ids], greedy(max_tokens=max_tokens))
        return req.output_token_ids
    yield run
    engine.check_integrity()


@pytest.fixture
def client(backend):
    return app_client(backend)


@pytest.fixture(autouse=True)
def sessions_closed(request, backend):
    """After each test: no request holds KV, and no session is left open or pinned in the engine."""
    yield
    settle_backend(request)
    left = backend.on_engine(lambda e: [s for s in list(e.sessions.sessions) if e.close_session(s)])
    backend.open_sessions.clear()
    assert backend.on_engine(lambda e: not e.kvm.prefix_pins), "a closed session still pins its history"
    assert not left, f"sessions left open in the engine: {left}"


def open_session(client, **body) -> str:
    r = client.post(SESSIONS, json={"capacity_tokens": CAPACITY, **body})
    assert r.status_code == 200, r.text
    return r.json()["id"]


def turn(client, path: str, session_id: str, max_tokens: int | None = 6, **body) -> dict:
    r = client.post(path, json={"session_id": session_id, "max_tokens": max_tokens, "temperature": 0, **body})
    assert r.status_code == 200, r.text
    return r.json()


def pinned(backend, session_id: str) -> int:
    return backend.on_engine(lambda e: e.sessions.sessions[session_id].pinned_tokens)


def aligned_history(num_tokens: int) -> int:
    """What the engine keeps pinned of a history: its page-aligned committed KV (the last token has none)."""
    return (num_tokens - 1) // PAGE_SIZE * PAGE_SIZE


# ---- open and delete -----------------------------------------------------------------------------
def test_open_and_delete_a_session(client, backend):
    r = client.post(SESSIONS, json={"capacity_tokens": CAPACITY, "idle_timeout_s": 30})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body == {"id": body["id"], "object": "session", "capacity_tokens": CAPACITY, "idle_timeout_s": 30.0}
    assert backend.on_engine(lambda e: e.sessions.sessions[body["id"]].capacity_tokens) == CAPACITY
    r = client.delete(f"{SESSIONS}/{body['id']}")
    assert r.status_code == 200 and r.json() == {"id": body["id"], "object": "session.deleted", "deleted": True}
    assert backend.on_engine(lambda e: body["id"] not in e.sessions.sessions)
    assert_error(client.delete(f"{SESSIONS}/{body['id']}"), 404, "session_not_found")
    assert_error(client.delete(f"{SESSIONS}/sess-never-opened"), 404, "session_not_found")


def test_defaults_are_the_context_and_five_minutes(client, backend):
    body = client.post(SESSIONS, json={}).json()
    assert body["capacity_tokens"] == backend.max_model_len and body["idle_timeout_s"] == 300.0
    client.delete(f"{SESSIONS}/{body['id']}")


def test_a_full_session_budget_is_429_and_frees_on_delete(client):
    first, second = open_session(client), open_session(client)
    err = assert_error(client.post(SESSIONS, json={"capacity_tokens": CAPACITY}), 429, "queue_full")
    assert "budget full" in err["message"]
    client.delete(f"{SESSIONS}/{first}")
    third = open_session(client)
    for session_id in (second, third):
        client.delete(f"{SESSIONS}/{session_id}")


@pytest.mark.parametrize("body,param", [
    ({"capacity_tokens": 0}, "capacity_tokens"), ({"capacity_tokens": -5}, "capacity_tokens"),
    ({"capacity_tokens": 513}, "capacity_tokens"), ({"capacity_tokens": 1.5}, "capacity_tokens"),
    ({"capacity_tokens": "100"}, "capacity_tokens"), ({"capacity_tokens": True}, "capacity_tokens"),
    ({"idle_timeout_s": 0}, "idle_timeout_s"), ({"idle_timeout_s": -1}, "idle_timeout_s"),
    ({"idle_timeout_s": 3601}, "idle_timeout_s"), ({"idle_timeout_s": "60"}, "idle_timeout_s"),
])
def test_bad_session_bodies_are_400_naming_the_field(client, body, param):
    assert_error(client.post(SESSIONS, json=body), 400, param=param)


def test_session_bodies_must_be_json_objects(client):
    assert_error(client.post(SESSIONS, content=b"[1]", headers={"Content-Type": "application/json"}), 400,
                 "invalid_json")
    assert_error(client.post(SESSIONS, content=b"{", headers={"Content-Type": "application/json"}), 400,
                 "invalid_json")
    assert_error(client.post(SESSIONS, content=b"{}", headers={"Content-Type": "text/plain"}), 415)


def test_sessions_need_the_api_key(backend):
    client = app_client(backend, api_key="sekret")
    key = {"Authorization": "Bearer sekret"}
    assert_error(client.post(SESSIONS, json={}), 401, "invalid_api_key")
    r = client.post(SESSIONS, json={"capacity_tokens": CAPACITY}, headers=key)
    assert r.status_code == 200, r.text
    session_id = r.json()["id"]
    assert_error(client.post(COMPLETION, json={"prompt": "Hi", "session_id": session_id}), 401, "invalid_api_key")
    assert_error(client.delete(f"{SESSIONS}/{session_id}"), 401, "invalid_api_key")
    assert client.delete(f"{SESSIONS}/{session_id}", headers=key).status_code == 200


def test_the_openapi_document_describes_sessions(backend):
    client = app_client(backend, api_key="sekret")
    doc = client.get("/openapi.json", headers={"Authorization": "Bearer sekret"}).json()
    post, delete = doc["paths"][SESSIONS]["post"], doc["paths"][SESSIONS + "/{session_id}"]["delete"]
    assert post["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith("/SessionCreateRequest")
    assert post["responses"]["200"]["content"]["application/json"]["schema"]["$ref"].endswith("/SessionObject")
    assert delete["responses"]["200"]["content"]["application/json"]["schema"]["$ref"].endswith("/SessionDeleted")
    assert "404" in delete["responses"] and post["security"] == delete["security"] == [{"bearer": []}]
    schemas = doc["components"]["schemas"]
    capacity = schemas["SessionCreateRequest"]["properties"]["capacity_tokens"]["anyOf"]
    assert {"maximum": backend.max_model_len, "minimum": 1, "type": "integer"} in capacity
    for request in ("CompletionRequest", "ChatCompletionRequest"):
        assert "session_id" in schemas[request]["properties"]
    assert "409" in doc["paths"][COMPLETION]["post"]["responses"]


# ---- turns ---------------------------------------------------------------------------------------
def test_completion_turns_send_the_history_and_hit_the_pin(client, backend, reference):
    tok = backend.tokenizer
    session_id = open_session(client)
    history: list[int] = []
    for i, new_text in enumerate(["The capital of France", " is where", " we all go."]):
        body = turn(client, COMPLETION, session_id, prompt=new_text)
        prompt = history + encode_prompt(tok, new_text)
        sent, sent_session = backend.sent[body["id"]]
        assert list(sent) == prompt and sent_session == session_id, f"turn {i}: not history + new tokens"
        expect = reference(prompt, 6)
        assert body["choices"][0]["text"] == final_text(tok, expect, ())
        usage = body["usage"]
        assert usage["prompt_tokens"] == len(prompt) and usage["completion_tokens"] == 6
        if i:
            cached = usage["prompt_tokens_details"]["cached_tokens"]
            assert cached == aligned_history(len(history)) > 0, f"turn {i} recomputed its history ({cached})"
        history = prompt + expect
        assert pinned(backend, session_id) == aligned_history(len(history))
    client.delete(f"{SESSIONS}/{session_id}")


def test_a_streamed_turn_reports_the_hit_in_its_usage(client, backend, reference):
    tok = backend.tokenizer
    session_id = open_session(client)
    first = turn(client, COMPLETION, session_id, prompt="Once upon a time")
    history = encode_prompt(tok, "Once upon a time") + reference(encode_prompt(tok, "Once upon a time"), 6)
    r = client.post(COMPLETION, json={"session_id": session_id, "prompt": " there", "max_tokens": 5,
                                      "temperature": 0, "stream": True, "stream_options": {"include_usage": True}})
    frames = [f[6:] for f in r.text.split("\n\n") if f]
    assert frames[-1] == "[DONE]"
    chunks = [json.loads(f) for f in frames[:-1]]
    prompt = history + encode_prompt(tok, " there")
    assert list(backend.sent[chunks[0]["id"]][0]) == prompt and first["id"] != chunks[0]["id"]
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == final_text(tok, reference(prompt, 5), ())
    assert chunks[-1]["usage"]["prompt_tokens_details"]["cached_tokens"] == aligned_history(len(history))
    client.delete(f"{SESSIONS}/{session_id}")


def test_chat_turns_render_the_whole_conversation(client, backend, reference):
    tok = backend.tokenizer
    session_id = open_session(client)
    conversation: list[dict] = []
    previous_prompt: list[int] = []
    for i, content in enumerate(["Hi!", "And then?", "Bye."]):
        new = [{"role": "user", "content": content}]
        body = turn(client, CHAT, session_id, messages=new)
        prompt = apply_chat_template(tok, conversation + new)
        assert list(backend.sent[body["id"]][0]) == prompt, f"turn {i}: not the whole conversation"
        text = final_text(tok, reference(prompt, 6), ())
        assert body["choices"][0]["message"] == {"role": "assistant", "content": text}
        cached = body["usage"]["prompt_tokens_details"]["cached_tokens"]
        if i:  # at least the previous turn's prompt (its reply re-encodes as the model wrote it, or close)
            assert cached >= len(previous_prompt) // PAGE_SIZE * PAGE_SIZE > 0, f"turn {i}: cached {cached}"
        conversation += new + [{"role": "assistant", "content": text}]
        previous_prompt = prompt
    client.delete(f"{SESSIONS}/{session_id}")


def test_a_session_keeps_to_its_endpoint(client):
    session_id = open_session(client)
    turn(client, CHAT, session_id, messages=[{"role": "user", "content": "Hi"}])
    err = assert_error(client.post(COMPLETION, json={"session_id": session_id, "prompt": "x"}), 400,
                       param="session_id")
    assert "/v1/chat/completions" in err["message"]
    turn(client, CHAT, session_id, messages=[{"role": "user", "content": "again"}])
    client.delete(f"{SESSIONS}/{session_id}")


def test_plain_requests_still_send_the_whole_prompt(client, backend, reference):
    tok = backend.tokenizer
    r = client.post(COMPLETION, json={"prompt": "Hello", "max_tokens": 4, "temperature": 0})
    assert r.status_code == 200, r.text
    assert backend.sent[r.json()["id"]] == (tuple(encode_prompt(tok, "Hello")), "")
    assert r.json()["choices"][0]["text"] == final_text(tok, reference(encode_prompt(tok, "Hello"), 4), ())


# ---- refusals ------------------------------------------------------------------------------------
def test_unknown_and_deleted_sessions_are_404(client):
    for path, body in ((COMPLETION, {"prompt": "Hi"}), (CHAT, {"messages": [{"role": "user", "content": "Hi"}]})):
        err = assert_error(client.post(path, json={"session_id": "sess-nope", **body}), 404, "session_not_found",
                           "session_id")
        assert "sess-nope" in err["message"]
    session_id = open_session(client)
    client.delete(f"{SESSIONS}/{session_id}")
    assert_error(client.post(COMPLETION, json={"session_id": session_id, "prompt": "Hi"}), 404, "session_not_found")


@pytest.mark.parametrize("session_id", [5, "", ["s"], {"id": "s"}, "x" * 129])
def test_bad_session_ids_are_400(client, session_id):
    assert_error(client.post(COMPLETION, json={"session_id": session_id, "prompt": "Hi"}), 400, param="session_id")


def test_a_turn_past_the_session_capacity_is_400(client, backend):
    session_id = open_session(client, capacity_tokens=40)
    turn(client, COMPLETION, session_id, prompt="x" * 20, max_tokens=5)
    err = assert_error(client.post(COMPLETION, json={"session_id": session_id, "prompt": "y" * 10, "max_tokens": 10}),
                       400, "context_length_exceeded")
    assert "capacity_tokens=40" in err["message"]
    body = turn(client, COMPLETION, session_id, max_tokens=None, prompt="y" * 10)  # default: what capacity leaves
    assert body["usage"]["total_tokens"] == 40
    client.delete(f"{SESSIONS}/{session_id}")


def test_a_concurrent_turn_is_409_and_the_first_still_counts(backend, reference):
    app = build_app(backend, GatewayConfig())
    tok = backend.tokenizer

    async def scenario():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url=BASE_URL) as c:
            session_id = (await c.post(SESSIONS, json={"capacity_tokens": CAPACITY})).json()["id"]
            backend.step_delay_s = 0.02
            first = asyncio.create_task(c.post(COMPLETION, json={"session_id": session_id, "prompt": "slow turn",
                                                                 "max_tokens": 30, "temperature": 0}))
            while not any(s == session_id for _, s in backend.sent.values()):
                await asyncio.sleep(0.01)
            second = await c.post(COMPLETION, json={"session_id": session_id, "prompt": "eager", "temperature": 0})
            first = await first
            backend.step_delay_s = 0.0
            third = await c.post(COMPLETION, json={"session_id": session_id, "prompt": " next", "max_tokens": 2,
                                                   "temperature": 0})
            await c.delete(f"{SESSIONS}/{session_id}")
            return first, second, third

    first, second, third = asyncio.run(scenario())
    assert first.status_code == 200, first.text
    err = assert_error(second, 409, "session_busy", "session_id")
    assert "one turn at a time" in err["message"]
    history = encode_prompt(tok, "slow turn") + reference(encode_prompt(tok, "slow turn"), 30)
    assert list(backend.sent[third.json()["id"]][0]) == history + encode_prompt(tok, " next")


def test_a_failed_turn_leaves_the_history_unchanged(client, backend, reference):
    tok = backend.tokenizer
    session_id = open_session(client)
    turn(client, COMPLETION, session_id, prompt="Alpha")
    history = encode_prompt(tok, "Alpha") + reference(encode_prompt(tok, "Alpha"), 6)
    backend.fail_after_tokens = (2, ErrorKind.UNAVAILABLE)
    assert_error(client.post(COMPLETION, json={"session_id": session_id, "prompt": " Beta", "max_tokens": 6}), 503)
    backend.reset_faults()
    body = turn(client, COMPLETION, session_id, prompt=" Gamma")
    assert list(backend.sent[body["id"]][0]) == history + encode_prompt(tok, " Gamma")
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] >= aligned_history(len(history))
    client.delete(f"{SESSIONS}/{session_id}")


def test_a_session_the_backend_lost_is_404_and_forgotten(client, backend):
    session_id = open_session(client)
    backend.open_sessions.discard(session_id)  # as the dispatcher does when the worker holding it dies
    assert_error(client.post(COMPLETION, json={"session_id": session_id, "prompt": "Hi"}), 404, "session_not_found")
    assert_error(client.delete(f"{SESSIONS}/{session_id}"), 404, "session_not_found")
    assert backend.on_engine(lambda e: e.close_session(session_id))


def test_an_idle_session_expires(client, backend):
    session_id = open_session(client, idle_timeout_s=0.2)
    turn(client, COMPLETION, session_id, prompt="Hi")
    time.sleep(0.3)
    assert_error(client.post(COMPLETION, json={"session_id": session_id, "prompt": "again"}), 404,
                 "session_not_found")
    assert session_id not in backend.open_sessions
    assert backend.on_engine(lambda e: session_id not in e.sessions.sessions)
