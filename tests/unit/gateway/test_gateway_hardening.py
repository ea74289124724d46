"""The gateway under hostile or careless clients (issue 8): every bad request is a 4xx naming what is
wrong, server errors show no internals, slow clients cannot hold what others need, readiness is
cheap, and only same-host JSON requests are served."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import time
from types import SimpleNamespace

import pytest
from prometheus_client.parser import text_string_to_metric_families

from cluster.serve.config import GatewayConfig
from common.config import SamplingDefaults
from router.backend import BackendError, ErrorKind
from router.gateway import GatewayServer, build_app, readiness
from tests.gateway_backend import smollm2_backend
from tests.gateway_http import app_client, assert_error

try:
    import httpx
except ImportError:  # the successor package keeps httpx's API under a new name
    import httpx2 as httpx

pytestmark = pytest.mark.slow
MODEL = "smollm2"
CHAT, COMPLETION = "/v1/chat/completions", "/v1/completions"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
TRACEBACK = ('Traceback (most recent call last):\n  File "/srv/ops/tandem/decode_worker/worker.py", line 88, in step\n'
             '    logits = self.model(x)\nRuntimeError: CUDA error: an illegal memory access was encountered')


@pytest.fixture(scope="module")
def backend():
    with smollm2_backend(num_pages=64) as backend:
        yield backend


@pytest.fixture(scope="module")
def client(backend):
    return app_client(backend)


def scrape(client) -> dict:
    text = client.get("/metrics").text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def good_request_works(client) -> None:
    r = client.post(COMPLETION, json={"model": MODEL, "prompt": "Hi", "max_tokens": 1, "temperature": 0})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 1, r.text


def raw_body(payload_text: str) -> bytes:
    """A JSON text sent as is: `json=` in the clients would escape or refuse what the test needs."""
    return payload_text.encode()


JSON = {"Content-Type": "application/json"}


# ---- defect 9: mislabelled errors ---------------------------------------------------------------
@pytest.mark.parametrize("role", [{"x": 1}, ["user"], 3, None, True])
def test_non_string_role_is_400(client, role):
    body = {"model": MODEL, "messages": [{"role": role, "content": "hi"}], "max_tokens": 1}
    assert_error(client.post(CHAT, json=body), 400, "invalid_value", "messages[0].role")
    good_request_works(client)


LONE_SURROGATES = [
    (COMPLETION, '{"prompt": "\\ud800", "max_tokens": 1}', "prompt"),
    (COMPLETION, '{"prompt": ["ab\\udfffc"], "max_tokens": 1}', "prompt[0]"),
    (COMPLETION, '{"prompt": "hi", "max_tokens": 1, "stop": ["ok", "\\ud800"]}', "stop[1]"),
    (CHAT, '{"messages": [{"role": "user", "content": "x\\ud83d"}], "max_tokens": 1}', "messages[0].content"),
    (CHAT, '{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\udc00"}]}]}',
     "messages[0].content[0].text"),
    (CHAT, '{"messages": [{"role": "user\\ud800", "content": "x"}]}', "messages[0].role"),
    (COMPLETION, '{"prompt": "hi", "user": "\\ud800"}', "user"),  # even a field the server ignores
]


@pytest.mark.parametrize("path,text,param", LONE_SURROGATES)
def test_lone_surrogate_is_400_naming_the_field(client, path, text, param):
    error = assert_error(client.post(path, content=raw_body(text), headers=JSON), 400, "invalid_value", param)
    assert "surrogate" in error["message"]
    good_request_works(client)


def test_a_valid_surrogate_pair_is_a_character(client):
    r = client.post(COMPLETION, content=raw_body('{"prompt": "smile \\ud83d\\ude00", "max_tokens": 1}'), headers=JSON)
    assert r.status_code == 200, r.text


def test_server_errors_show_an_error_id_and_no_internals(client, backend, caplog):
    caplog.set_level(logging.WARNING, logger="router.gateway")
    backend.fail_start = BackendError(ErrorKind.INTERNAL, TRACEBACK)
    error = assert_error(client.post(CHAT, json={"messages": QUESTION, "max_tokens": 2}), 500, "internal")
    assert error["message"].startswith("internal server error (error id err-"), error
    error_id = error["message"].rsplit(" ", 1)[-1].rstrip(")")
    logged = [r for r in caplog.records if error_id in r.getMessage()]
    assert len(logged) == 1 and "CUDA error" in logged[0].getMessage() and logged[0].levelno == logging.ERROR

    backend.fail_start = BackendError(ErrorKind.UNAVAILABLE, f"decode-0 died: {TRACEBACK}")
    error = assert_error(client.post(CHAT, json={"messages": QUESTION, "max_tokens": 2}), 503, "unavailable")
    message = error["message"]
    assert message.startswith("decode-0 died: Traceback") and "\n" not in message and "err-" in message
    assert "/srv" not in message and "ops/tandem" not in message and "CUDA" not in message


def test_a_gateway_bug_is_a_bare_500_with_the_traceback_in_the_log(client, backend, caplog):
    caplog.set_level(logging.WARNING, logger="router.gateway")
    backend.crash_after_tokens = 2  # the backend's stream raises RuntimeError("a bug in the backend")
    body = {"prompt": "Hi", "max_tokens": 4, "ignore_eos": True}
    error = assert_error(client.post(COMPLETION, json=body), 500, "internal_error")
    assert "a bug" not in error["message"] and "RuntimeError" not in error["message"] and "err-" in error["message"]
    frames = [f for f in client.post(COMPLETION, json={**body, "stream": True}).text.split("\n\n") if f]
    streamed = json.loads(frames[-2][6:])["error"]
    assert frames[-1] == "data: [DONE]" and "a bug" not in streamed["message"] and "err-" in streamed["message"]
    traced = [r for r in caplog.records if r.exc_info and "a bug in the backend" in str(r.exc_info[1])]
    assert len(traced) == 2 and all(r.getMessage().startswith("err-") for r in traced)


def test_client_gone_mid_upload_is_a_disconnect_not_an_internal_error(backend, caplog):
    caplog.set_level(logging.INFO)
    app = build_app(backend, GatewayConfig(port=0))
    server = GatewayServer(app, GatewayConfig(port=0))
    port = server.start_in_thread()
    try:
        with socket.create_connection(("127.0.0.1", port)) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:%d\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 1000\r\n\r\n{\"prompt\": \"Hi" % port)
            time.sleep(0.3)  # the gateway is reading the body now
        m = {}
        deadline = time.monotonic() + 10
        while ("tandem:request_failure_total", (("kind", "client_disconnect"),)) not in m:
            assert time.monotonic() < deadline, m
            time.sleep(0.05)
            text = httpx.get(f"http://127.0.0.1:{port}/metrics").text
            m = {(s.name, tuple(sorted(s.labels.items()))): s.value
                 for family in text_string_to_metric_families(text) for s in family.samples}
        assert m[("tandem:request_failure_total", (("kind", "client_disconnect"),))] == 1
        assert not any(name == "tandem:request_failure_total" and labels != (("kind", "client_disconnect"),)
                       for name, labels in m), m
        assert not [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info], caplog.text
    finally:
        server.stop()
        assert server.join(15)


# ---- defect 4: slow clients hold no in-flight slot; connections are bounded ----------------------
class Serving:
    """A real gateway server on a free loopback port, for tests that need sockets."""

    def __init__(self, backend, **config):
        self.config = GatewayConfig(port=0, **config)
        self.server = GatewayServer(build_app(backend, self.config), self.config)
        self.port = self.server.start_in_thread()
        self.url = f"http://127.0.0.1:{self.port}"

    def connect(self, head: bytes = b"") -> socket.socket:
        sock = socket.create_connection(("127.0.0.1", self.port))
        sock.settimeout(10)
        if head:
            sock.sendall(head)
        return sock

    def slow_body(self, sent: bytes = b'{"prompt": "Hi') -> socket.socket:
        """A request whose headers promise 1000 body bytes, of which only `sent` ever come."""
        return self.connect(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:%d\r\nContent-Type: application/json\r\n"
                            b"Content-Length: 1000\r\n\r\n%s" % (self.port, sent))

    def close(self) -> None:
        self.server.stop()
        assert self.server.join(15)


def read_response(sock: socket.socket) -> bytes:
    """One whole response with a Content-Length body."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536)
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(next(line.split(b":")[1] for line in head.lower().split(b"\r\n")
                      if line.startswith(b"content-length")))
    while len(body) < length:
        body += sock.recv(65536)
    return head + b"\r\n\r\n" + body


def read_until_closed(sock: socket.socket) -> bytes:
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def test_slow_bodies_take_no_in_flight_slot_and_time_out_with_408(backend):
    body_timeout_s = 4.0  # far above two 1-token requests, even on a loaded machine
    serving = Serving(backend, max_pending_requests=1, body_timeout_s=body_timeout_s)
    try:
        slow = [serving.slow_body() for _ in range(4)]
        time.sleep(0.3)  # every slow request is in the app, reading its body
        t0 = time.monotonic()
        for _ in range(2):
            r = httpx.post(serving.url + COMPLETION, json={"prompt": "Hi", "max_tokens": 1}, timeout=30)
            assert r.status_code == 200, r.text
        assert time.monotonic() - t0 < body_timeout_s, "the good requests waited for the slow ones"
        for sock in slow:
            answer = read_until_closed(sock)  # the server answers, then closes the half-read connection
            head, _, body = answer.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 408 ") and b"connection: close" in head.lower(), answer
            assert json.loads(body)["error"]["code"] == "request_timeout"
            sock.close()
        assert time.monotonic() - t0 < 15
    finally:
        serving.close()


def test_a_connection_without_a_whole_request_head_is_closed(backend):
    serving = Serving(backend, header_timeout_s=0.5)
    try:
        idle, slow_head = serving.connect(), serving.connect(b"POST /v1/completions HTTP/1.1\r\nHost: 127")
        t0 = time.monotonic()
        assert read_until_closed(idle) == b"" and read_until_closed(slow_head) == b""
        assert 0.4 < time.monotonic() - t0 < 5
        # a keep-alive connection gets a new head deadline after each response
        with serving.connect() as sock:
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1:%d\r\n\r\n" % serving.port)
            assert read_response(sock).startswith(b"HTTP/1.1 200 ")
            sock.sendall(b"GET /health HTTP/1.1\r\n")
            t1 = time.monotonic()
            assert read_until_closed(sock) == b"" and time.monotonic() - t1 < 5
    finally:
        serving.close()


def test_open_connections_are_bounded(backend):
    serving = Serving(backend, max_connections=3, max_pending_requests=1, header_timeout_s=60)
    try:
        idle = [serving.connect() for _ in range(2)]
        time.sleep(0.2)
        assert httpx.get(serving.url + "/health", timeout=10).status_code == 200  # the third connection fits
        idle.append(serving.connect())
        time.sleep(0.2)
        r = httpx.get(serving.url + "/health", timeout=10)  # the fourth does not: the API's error shape, not text
        assert "too many open connections" in assert_error(r, 503, "unavailable")["message"]
        assert r.headers["connection"] == "close" and r.headers["retry-after"] == "1"
        for sock in idle:
            sock.close()
        time.sleep(0.2)
        assert httpx.get(serving.url + "/health", timeout=10).status_code == 200
    finally:
        serving.close()


def test_tandem_serve_runs_the_gateway_through_gateway_server(monkeypatch):
    """`tandem serve` uses GatewayServer (so the connection bounds apply), hands uvicorn's server to the
    signal guard, and a port in use is a start-up error rather than a traceback."""
    from cluster.serve import actors, launch
    from router import dispatcher, gateway

    served = []

    class FakeDispatcher:
        def __init__(self, *args, **kwargs):
            self.tokenizer, self.model_name, self.max_model_len = kwargs["tokenizer"], "m", 64

        @classmethod
        def build(cls, source, config, *, tokenizer=None):
            return cls(tokenizer=tokenizer)

        async def start(self):
            served.append("dispatcher started")

    class RecordingServer(gateway.GatewayServer):
        async def serve(self, on_started=None):
            served.append(self)

    class Record:
        max_request_tokens = 64

    monkeypatch.setattr(dispatcher, "Dispatcher", FakeDispatcher)
    monkeypatch.setattr(actors, "ControllerViews", lambda controller: controller)
    monkeypatch.setattr(gateway, "GatewayServer", RecordingServer)
    guard = launch._SignalGuard()
    config = _serve_config(port=0, header_timeout_s=2.0, max_connections=300)
    asyncio.run(launch._serve_gateway(config, object(), [Record()], _Vocabulary(), SamplingDefaults(), guard))
    server = served[-1]
    assert served[0] == "dispatcher started" and isinstance(server, RecordingServer)
    assert server.config is config.gateway and guard.server is server.uvicorn_server
    assert server.uvicorn_server.config.http.max_connections == 300
    assert server.uvicorn_server.config.http.head_timeout_s == 2.0
    server._socket.close()

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        config = _serve_config(port=taken.getsockname()[1])
        with pytest.raises(launch.ServeStartError, match="cannot listen on 127.0.0.1"):
            asyncio.run(launch._serve_gateway(config, object(), [Record()], _Vocabulary(), SamplingDefaults(),
                                              launch._SignalGuard()))


def _serve_config(**gateway_fields):
    from cluster.serve.config_load import load_serve_config

    return load_serve_config(None, {f"gateway.{k}": v for k, v in gateway_fields.items()})


class _Vocabulary:
    """All the launch test's app needs of a tokenizer: its size."""

    def __len__(self):
        return 256


# ---- defect 5: readiness is cheap and shared; /metrics and /health -------------------------------
def test_concurrent_readiness_probes_share_one_generation(backend, monkeypatch):
    app = build_app(backend, GatewayConfig(ready_interval_s=30.0))
    backend.start_delay_s = 0.3  # the probe's generation is still running when the others arrive
    later_s = [0.0]  # the probe's clock runs ahead by this much: the interval passes without a wall-clock wait
    monkeypatch.setattr(readiness, "time", SimpleNamespace(monotonic=lambda: time.monotonic() + later_s[0]))

    def probes() -> list[str]:
        return [r for r in backend.started_ids if r.startswith("ready-")]

    async def scenario():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1") as client:
            before = len(probes())
            first = await asyncio.gather(*[client.get("/health/ready") for _ in range(40)])
            assert len(probes()) == before + 1, "concurrent callers must await the probe in flight"
            cached = await asyncio.gather(*[client.get("/health/ready") for _ in range(40)])
            assert len(probes()) == before + 1, "within ready_interval_s the cached answer is served"
            later_s[0] = 30.0
            later = await client.get("/health/ready")
            assert len(probes()) == before + 2
            return first + cached + [later]

    responses = asyncio.run(scenario())
    assert all(r.status_code == 200 and r.json() == {"status": "ready"} for r in responses)


def test_a_failed_probe_is_cached_too(backend):
    client = app_client(backend, ready_interval_s=60)
    backend.fail_start = BackendError(ErrorKind.UNAVAILABLE, "no decode worker")
    started = len(backend.abort_calls), len(backend.started_ids)
    for _ in range(5):
        assert "no decode worker" in assert_error(client.get("/health/ready"), 503, "unavailable")["message"]
    assert (len(backend.abort_calls), len(backend.started_ids)) == started  # refused: nothing ran, nothing to abort
    backend.fail_start = None
    assert_error(client.get("/health/ready"), 503)  # still the cached answer within the interval


def test_metrics_follow_the_api_key(backend):
    client = app_client(backend, api_key="sekret")
    assert_error(client.get("/metrics"), 401, "invalid_api_key")
    r = client.get("/metrics", headers={"Authorization": "Bearer sekret"})
    assert r.status_code == 200 and "tandem:num_requests_running" in r.text


class _Gauged:
    """`backend` reporting the given workers as (role, alive)."""

    def __init__(self, backend, workers):
        self._backend, self._workers = backend, workers

    def worker_gauges(self):
        from common.protocol import WorkerRole
        from router.backend import WorkerGauge
        return [WorkerGauge(f"{role}-{i}", WorkerRole(role), alive, 0, 0, 0.0, None, 0)
                for i, (role, alive) in enumerate(self._workers)]

    def __getattr__(self, name):
        return getattr(self._backend, name)


@pytest.mark.parametrize("workers,healthy", [
    ([], True),  # a backend without workers to report (a test double)
    ([("decode", True)], True),
    ([("prefill", False), ("decode", True)], True),  # prefill is optional: decode prefills locally
    ([("colocated", True)], True),
    ([("prefill", True), ("decode", False)], False),
    ([("prefill", True)], False),
    ([("decode", False), ("colocated", False)], False),
])
def test_health_needs_a_live_token_producing_worker(backend, workers, healthy):
    client = app_client(_Gauged(backend, workers))
    r = client.get("/health")
    if healthy:
        assert r.status_code == 200 and r.json() == {"status": "ok"}
        assert client.get("/health/ready").status_code == 200
    else:
        assert "no decode or colocated worker is alive" in assert_error(r, 503, "unavailable")["message"]
        started = len(backend.started_ids)
        assert_error(client.get("/health/ready"), 503, "unavailable")
        assert len(backend.started_ids) == started, "no probe generation when no worker can answer it"


# ---- defect 10: JSON bodies only; Host and Origin name this server -------------------------------
@pytest.mark.parametrize("content_type,status", [
    ("application/json", 200), ("application/json; charset=utf-8", 200), ("Application/JSON", 200),
    ("application/vnd.api+json", 200),
    ("text/plain", 415), ("text/plain; charset=utf-8", 415), ("application/x-www-form-urlencoded", 415),
    ("multipart/form-data; boundary=x", 415), (None, 415), ("application/jsonx", 415), ("application/+json", 415),
    ("text/json", 415),
])
def test_post_bodies_must_be_declared_json(client, content_type, status):
    body = json.dumps({"prompt": "Hi", "max_tokens": 1}).encode()
    headers = {"Content-Type": content_type} if content_type is not None else {}
    r = client.post(COMPLETION, content=body, headers=headers)
    if status == 200:
        assert r.status_code == 200, r.text
    else:
        assert_error(r, 415, "unsupported_media_type", "Content-Type")
    r = client.post(CHAT, content=json.dumps({"messages": QUESTION, "max_tokens": 1}).encode(), headers=headers)
    assert r.status_code == status


@pytest.fixture(scope="module")
def serving(backend):
    serving = Serving(backend)
    yield serving
    serving.close()


def test_host_header_must_name_this_server(serving):
    port = serving.port
    ok = [f"127.0.0.1:{port}", f"localhost:{port}", "localhost", "127.0.0.1", f"[::1]:{port}", f"LOCALHOST.:{port}"]
    refused = [f"127.0.0.1:{port + 1}", f"evil.example:{port}", "evil.example", f"127.0.0.1.nip.io:{port}",
               f"localhost:{port}x", f"[::1]x:{port}", "[::1", "127.0.0.2"]
    with httpx.Client(base_url=serving.url) as http:
        for host in ok:
            assert http.get("/health", headers={"Host": host}).status_code == 200, host
        for host in refused:
            for r in (http.get("/health", headers={"Host": host}),
                      http.post(COMPLETION, json={"prompt": "Hi", "max_tokens": 1}, headers={"Host": host})):
                assert_error(r, 403, "forbidden_host", "Host")


def test_cross_site_origins_are_refused(serving):
    port = serving.port
    ok = [f"http://127.0.0.1:{port}", f"http://localhost:{port}", f"https://[::1]:{port}", "http://localhost"]
    refused = ["https://evil.example", f"http://evil.example:{port}", "null", "http://localhost:3000",
               f"file://127.0.0.1:{port}", "http://localhost:99999999"]
    body = {"prompt": "Hi", "max_tokens": 1}
    with httpx.Client(base_url=serving.url) as http:
        for origin in ok:
            assert http.post(COMPLETION, json=body, headers={"Origin": origin}).status_code == 200, origin
        for origin in refused:
            assert_error(http.post(COMPLETION, json=body, headers={"Origin": origin}), 403, "forbidden_origin")


def test_allowed_hosts_configured(backend):
    named = Serving(backend, allowed_hosts=("api.example", "gw.internal"))
    anyone = Serving(backend, allowed_hosts=("*",))
    try:
        with httpx.Client() as http:
            assert http.get(named.url + "/health", headers={"Host": "api.example"}).status_code == 200
            assert http.get(named.url + "/health", headers={"Host": f"gw.internal:{named.port}"}).status_code == 200
            assert_error(http.get(named.url + "/health"), 403, "forbidden_host")  # 127.0.0.1 is not in the list
            r = http.get(named.url + "/health", headers={"Host": "api.example", "Origin": "https://api.example"})
            assert r.status_code == 200
            for host in ("evil.example", f"127.0.0.1:{anyone.port}"):
                r = http.get(anyone.url + "/health", headers={"Host": host, "Origin": "https://evil.example"})
                assert r.status_code == 200
    finally:
        named.close()
        anyone.close()


def test_default_allowed_hosts_follow_the_bind_address():
    from router.gateway.hosts import LOOPBACK_NAMES, HostPolicy

    assert HostPolicy.for_bind("127.0.0.1", None).names == LOOPBACK_NAMES
    assert HostPolicy.for_bind("::1", None).names == LOOPBACK_NAMES
    assert HostPolicy.for_bind("127.0.0.2", None).names == LOOPBACK_NAMES | {"127.0.0.2"}
    assert HostPolicy.for_bind("10.1.2.3", None).names == {"10.1.2.3"}
    assert HostPolicy.for_bind("0.0.0.0", None).names is None and HostPolicy.for_bind("::", None).names is None
    assert HostPolicy.for_bind("127.0.0.1", ["*"]).names is None
    assert HostPolicy.for_bind("0.0.0.0", ["API.example."]).names == {"api.example"}


def test_the_official_openai_client_works(serving):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=serving.url + "/v1", api_key="unused", max_retries=0)
    chat = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=3, temperature=0)
    assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens == 3
    text = client.completions.create(model=MODEL, prompt="The sky is", max_tokens=3, temperature=0)
    assert text.usage.completion_tokens == 3
    stream = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=3, temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == chat.choices[0].message.content
    assert [m.id for m in client.models.list()] == [MODEL]


# ---- defects 1 and 8 (gateway side): every integer is bounded, stop lists are bounded ------------
class _Recording:
    """`backend` that records the SamplingParams each request reached it with."""

    def __init__(self, backend):
        self._backend, self.params = backend, []

    def generate(self, request_id, prompt_token_ids, params):
        self.params.append(params)
        return self._backend.generate(request_id, prompt_token_ids, params)

    def __getattr__(self, name):
        return getattr(self._backend, name)


@pytest.mark.parametrize("top_k,engine_top_k", [(2**63, 0), (2**64 + 5, 0), (10**40, 0), (-1, 0), (0, 0), (40, 40)])
def test_top_k_beyond_the_vocabulary_is_off(backend, top_k, engine_top_k):
    recording = _Recording(backend)
    client = app_client(recording)
    r = client.post(COMPLETION, json={"prompt": "Hi", "max_tokens": 2, "top_k": top_k, "seed": 3})
    assert r.status_code == 200, r.text
    assert recording.params[-1].top_k == engine_top_k
    vocab = len(backend.tokenizer)
    for k in (vocab, vocab + 1):
        assert client.post(COMPLETION, json={"prompt": "Hi", "max_tokens": 1, "top_k": k}).status_code == 200
        assert recording.params[-1].top_k == 0


BOUNDS = [
    ({"seed": 2**63}, "seed"), ({"seed": -2**63 - 1}, "seed"), ({"seed": 10**30}, "seed"),
    ({"stop": ["x"] * 65}, "stop"), ({"stop": ["y" * 4097]}, "stop"), ({"stop": ["z" * 2049, "w" * 2048]}, "stop"),
    ({"stop_token_ids": [1] * 1025}, "stop_token_ids"), ({"stop_token_ids": [10**9]}, "stop_token_ids"),
    ({"stop_token_ids": [2**63]}, "stop_token_ids"), ({"max_tokens": 2**63}, "max_tokens"),
    ({"max_tokens": 10**400 // 10**300}, "max_tokens"), ({"n": 2**64}, "n"), ({"best_of": 2**63}, "best_of"),
    ({"prompt": [2**63]}, "prompt"), ({"prompt": [-1]}, "prompt"),
]


@pytest.mark.parametrize("fields,param", BOUNDS)
def test_out_of_range_values_are_400_naming_the_field(client, fields, param):
    body = {"prompt": "Hi", "max_tokens": 1, **fields}
    assert_error(client.post(COMPLETION, json=body), 400, param=param)
    if param not in ("prompt", "best_of"):  # completion-only fields: chat ignores them
        assert_error(client.post(CHAT, json={"messages": QUESTION, **body}), 400, param=param)
    good_request_works(client)


def test_values_at_the_bounds_are_served(client):
    body = {"prompt": "Hi", "max_tokens": 1, "seed": 2**63 - 1, "stop": ["x"] * 63 + ["y" * (4096 - 63)],
            "stop_token_ids": list(range(1024))}
    assert client.post(COMPLETION, json=body).status_code == 200
    assert client.post(COMPLETION, json={**body, "seed": -2**63}).status_code == 200


@pytest.mark.parametrize("text,param", [
    ('{"prompt": "Hi", "temperature": NaN}', "temperature"),
    ('{"prompt": "Hi", "temperature": Infinity}', "temperature"),
    ('{"prompt": "Hi", "top_p": -Infinity}', "top_p"), ('{"prompt": "Hi", "temperature": 1e999}', "temperature"),
    ('{"prompt": "Hi", "presence_penalty": NaN}', "presence_penalty"), ('{"prompt": NaN}', "prompt"),
])
def test_non_finite_numbers_are_400_naming_the_field(client, text, param):
    assert_error(client.post(COMPLETION, content=raw_body(text), headers=JSON), 400, param=param)


# ---- defect 12: the OpenAPI document -------------------------------------------------------------
def test_openapi_document_describes_every_endpoint(client, backend):
    doc = client.get("/openapi.json").json()
    assert doc["openapi"].startswith("3.1") and "securitySchemes" not in doc.get("components", {})
    assert set(doc["paths"]) == {"/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/health/ready",
                                 "/debug/workers", "/metrics", "/v1/sessions", "/v1/sessions/{session_id}",
                                 "/tokenize", "/detokenize"}
    schemas = doc["components"]["schemas"]
    for path, request, response in (("/v1/completions", "CompletionRequest", "CompletionResponse"),
                                    ("/v1/chat/completions", "ChatCompletionRequest", "ChatCompletionResponse")):
        post = doc["paths"][path]["post"]
        assert post["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith("/" + request)
        assert set(post["requestBody"]["content"]) == {"application/json"}
        ok = post["responses"]["200"]["content"]
        assert ok["application/json"]["schema"]["$ref"].endswith("/" + response) and "text/event-stream" in ok
        for status in ("400", "401", "403", "404", "408", "413", "415", "429", "500", "503"):
            assert post["responses"][status]["content"]["application/json"]["schema"]["$ref"].endswith(
                "/ErrorResponse"), (path, status)
    props = schemas["CompletionRequest"]["properties"]
    assert {"const": MODEL, "type": "string"} in props["model"]["anyOf"]  # this app's model, by name
    max_tokens = {"maximum": backend.max_model_len, "minimum": 0, "type": "integer"}  # 0: echo
    assert max_tokens in props["max_tokens"]["anyOf"]
    assert schemas["ErrorResponse"]["required"] == ["error"]
    assert set(schemas["ErrorDetail"]["required"]) == {"message", "type", "param", "code"}
    assert {"CompletionChunk", "ChatCompletionChunk"} <= set(schemas)


def test_openapi_document_follows_the_api_key(backend):
    client = app_client(backend, api_key="sekret")
    assert_error(client.get("/openapi.json"), 401, "invalid_api_key")
    doc = client.get("/openapi.json", headers={"Authorization": "Bearer sekret"}).json()
    assert doc["components"]["securitySchemes"] == {"bearer": {"type": "http", "scheme": "bearer"}}
    guarded = {path for path, ops in doc["paths"].items() for op in ops.values() if "security" in op}
    assert guarded == {"/v1/completions", "/v1/chat/completions", "/v1/models", "/debug/workers", "/metrics",
                       "/v1/sessions", "/v1/sessions/{session_id}", "/tokenize", "/detokenize"}


def test_real_answers_match_the_documented_models(client):
    from router.gateway.openapi import (
        ChatCompletionChunk,
        ChatCompletionResponse,
        CompletionResponse,
        ErrorResponse,
        ModelList,
    )

    CompletionResponse.model_validate(client.post(COMPLETION, json={"prompt": "Hi", "max_tokens": 2}).json())
    ChatCompletionResponse.model_validate(client.post(CHAT, json={"messages": QUESTION, "max_tokens": 2}).json())
    ModelList.model_validate(client.get("/v1/models").json())
    ErrorResponse.model_validate(client.post(CHAT, json={"messages": []}).json())
    text = client.post(CHAT, json={"messages": QUESTION, "max_tokens": 3, "stream": True,
                                   "stream_options": {"include_usage": True}}).text
    frames = [f[6:] for f in text.split("\n\n") if f]
    assert frames[-1] == "[DONE]"
    for frame in frames[:-1]:
        ChatCompletionChunk.model_validate_json(frame)


# The parser agrees with the document (found by the schemathesis fuzz, test_openapi_fuzz.py):
# "off" values are type-exact, JSON Schema integers include 2.0, and every documented field is checked.
@pytest.mark.parametrize("path,fields,param", [
    (CHAT, {"functions": ""}, "functions"), (CHAT, {"tools": {}}, "tools"), (CHAT, {"logprobs": 0}, "logprobs"),
    (CHAT, {"top_logprobs": False}, "top_logprobs"), (COMPLETION, {"echo": 0}, "echo"),
    (COMPLETION, {"suffix": 0}, "suffix"), (COMPLETION, {"logprobs": False}, "logprobs"),
    (COMPLETION, {"logit_bias": []}, "logit_bias"), (COMPLETION, {"logit_bias": ""}, "logit_bias"),
    (COMPLETION, {"user": 5}, "user"), (COMPLETION, {"stream_options": {"include_usage": "yes"}},
                                        "stream_options.include_usage"),
    (CHAT, {"max_completion_tokens": 2, "max_tokens": "x"}, "max_tokens"),
    (COMPLETION, {"max_tokens": 2.5}, "max_tokens"),
])
def test_documented_fields_are_checked_even_when_off_or_unused(client, path, fields, param):
    body = {"prompt": "Hi"} if path == COMPLETION else {"messages": QUESTION}
    assert_error(client.post(path, json={**body, "max_tokens": 1, **fields}), 400, param=param)


def test_integral_floats_are_integers(client):
    body = {"prompt": [9906.0, 2.0], "max_tokens": 2.0, "n": 1.0, "best_of": 1.0, "logprobs": 0.0, "top_k": 5.0,
            "seed": 3.0, "stop_token_ids": [7.0]}
    r = client.post(COMPLETION, json=body)
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 2, r.text


def test_a_prompt_longer_than_the_context_names_no_negative_budget(backend, client):
    long_ids = [9906] * (backend.max_model_len + 5)
    error = assert_error(client.post(COMPLETION, json={"prompt": long_ids}), 400, "context_length_exceeded", "prompt")
    assert "-" not in error["message"]


def _nested(depth: int) -> dict:
    schema: dict = {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


# Hostile grammars and tools: each is refused naming its field (or served within its budget), never
# reaching a worker in a form that takes it down; the server answers a plain request afterwards.
@pytest.mark.parametrize("fields, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": _nested(200)}}}, None),
    ({"structured_outputs": {"regex": "(a|b" * 500}}, "structured_outputs"),
    ({"structured_outputs": {"grammar": "root ::= root root"}}, "structured_outputs"),
    ({"structured_outputs": {"choice": ["x"] * 10_000}}, None),
    ({"tools": [{"type": "function", "function": {"name": f"f{i}"}} for i in range(129)]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}],
      "tool_choice": "required"}, "tool_choice"),
    ({"response_format": {"type": "json_object"}, "tools": [{"type": "function", "function": {"name": "f"}}],
      "tool_choice": {"type": "function", "function": {"name": "f"}}}, "response_format"),
])
def test_hostile_grammars_and_tools_are_refused_or_served_within_budget(client, fields, param):
    r = client.post(CHAT, json={"messages": QUESTION, "max_tokens": 4, **fields})
    if param is not None:
        assert_error(r, 400, param=param)
    else:
        assert r.status_code in (200, 400), r.text
    assert client.post(CHAT, json={"messages": QUESTION, "max_tokens": 1}).status_code == 200
