"""The gateway tests' shared fixtures: per module, a real SmolLM2 engine behind `EngineBackend` and an
in-process client of the app over it (a module overrides `backend` or `client` for another setup);
after each test, the engine at rest (`settle_backend`)."""

from __future__ import annotations

import pytest

from tests.gateway_backend import settle_backend, smollm2_backend
from tests.gateway_http import app_client


@pytest.fixture(scope="module")
def backend():
    with smollm2_backend() as backend:
        yield backend


@pytest.fixture(scope="module")
def client(backend):
    return app_client(backend)


@pytest.fixture(autouse=True)
def engine_at_rest(request):
    """After each test: no request holds KV; faults cleared."""
    yield
    settle_backend(request)
