"""A worker's role is a `WorkerRole` from its spec to the wire and after (no role travels as a bare
string), and wherever it leaves the program as text (a log line, a metric label, a JSON body) it
prints its value, as the strings it replaced did."""

from __future__ import annotations

import dataclasses
import json
import pickle

import pytest

from cluster.worker_host.build import WorkerSpec
from common import protocol as p
from common.config import EngineConfig
from common.protocol import WorkerRole


def test_a_spec_takes_a_role_or_its_value_and_refuses_any_other():
    assert WorkerSpec("decode", EngineConfig()).role is WorkerRole.DECODE  # a config's word
    assert WorkerSpec(WorkerRole.PREFILL, EngineConfig()).role is WorkerRole.PREFILL
    with pytest.raises(ValueError, match="unknown worker role 'router': one of"):
        WorkerSpec("router", EngineConfig())


@pytest.mark.parametrize("msg", [p.WorkerReady(WorkerRole.DECODE, "session-1"),
                                 p.WorkerCrashed(WorkerRole.PREFILL, "boom")])
def test_a_role_crosses_the_wire_as_the_member_and_prints_its_value(msg):
    back = pickle.loads(pickle.dumps(msg))  # how the relay and the worker pipe carry it
    assert back == msg and back.role is msg.role
    assert json.loads(json.dumps(dataclasses.asdict(msg)))["role"] == msg.role.value  # /debug/workers
    assert str(msg.role) == f"{msg.role}" == "%s" % msg.role == msg.role.value  # noqa: UP031 - logs, messages


def test_a_metric_label_is_the_roles_value():
    from prometheus_client import CollectorRegistry, Counter, generate_latest
    from prometheus_client.core import GaugeMetricFamily

    registry = CollectorRegistry()
    Counter("polls", "", ["role"], registry=registry).labels(role=WorkerRole.DECODE).inc()

    class Gauges:
        def collect(self):
            family = GaugeMetricFamily("usage", "", labels=["role"])
            family.add_metric([WorkerRole.COLOCATED], 0.5)
            yield family

    registry.register(Gauges())
    text = generate_latest(registry).decode()
    assert 'polls_total{role="decode"} 1.0' in text and 'usage{role="colocated"} 0.5' in text
    assert "WorkerRole" not in text
