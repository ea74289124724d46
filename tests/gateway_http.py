"""The client side of the gateway tests: an in-process test client of the gateway app over any
backend, and the check of an OpenAI-style error body."""

from __future__ import annotations

from starlette.testclient import TestClient

from cluster.serve.config import GatewayConfig
from router.gateway import build_app

BASE_URL = "http://127.0.0.1:8000"  # a Host the gateway answers (it refuses others: test_gateway_hardening)


def app_client(backend, **config) -> TestClient:
    """A test client of `build_app(backend, GatewayConfig(**config))`; a server error comes back as
    its 500 response instead of raising in the test."""
    return TestClient(build_app(backend, GatewayConfig(**config)), raise_server_exceptions=False, base_url=BASE_URL)


def assert_error(response, status: int, code: str | None = None, param: str | None = None) -> dict:
    """`response` has `status` and a body of exactly `{"error": {message, type, param, code}}`, with
    this `code` and `param` where given; returns the `error` object."""
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    if code is not None:
        assert body["error"]["code"] == code, body
    if param is not None:
        assert body["error"]["param"] == param, body
    return body["error"]
