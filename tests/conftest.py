"""Every test that builds an engine ends with that engine's integrity check (docs/design.md §3):
engines made during a test are recorded, and each one still alive is checked at teardown."""

from __future__ import annotations

import os
import weakref

import pytest
import torch

if not torch.cuda.is_available():  # Triton kernels run interpreted on CPU; set before anything imports triton
    os.environ.setdefault("TRITON_INTERPRET", "1")

from engine.core import EngineCore


@pytest.fixture(autouse=True)
def engines_intact(monkeypatch):
    engines: weakref.WeakSet[EngineCore] = weakref.WeakSet()
    build = EngineCore.__init__

    def recording_init(self, *args, **kwargs):
        build(self, *args, **kwargs)
        engines.add(self)

    monkeypatch.setattr(EngineCore, "__init__", recording_init)
    yield engines
    for engine in list(engines):
        engine.check_integrity()  # KV pools (and a receiver's host tier) consistent after the test


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory):
    """A real `redis-server` on loopback for the module (tests/redis_server.py), stopped after it."""
    from tests.redis_server import RedisServer

    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    yield server
    server.stop()
