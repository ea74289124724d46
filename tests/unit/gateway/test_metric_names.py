"""Renamed metrics: the landing pool's usage under its name and, for one release, its old one."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from common.protocol import WorkerRole
from router.backend import WorkerGauge
from router.gateway.metrics import DEPRECATED_LANDING_USAGE, BackendGauges


class _Backend:
    def __init__(self, gauges: list[WorkerGauge]):
        self.gauges = gauges

    def num_requests(self) -> tuple[int, int]:
        return 0, 0

    def worker_gauges(self) -> list[WorkerGauge]:
        return self.gauges


def scrape(gauges: list[WorkerGauge]) -> dict[tuple[str, str], float]:
    registry = CollectorRegistry()
    registry.register(BackendGauges(_Backend(gauges)))
    text = generate_latest(registry).decode()
    return {(s.name, s.labels.get("worker", "")): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_the_landing_pools_usage_is_exported_under_its_name_and_its_old_one():
    decode = WorkerGauge("decode-0", WorkerRole.DECODE, True, 1, 0, 0.5, 0.25, 0)
    prefill = WorkerGauge("prefill-0", WorkerRole.PREFILL, True, 0, 0, 0.125, None, 0)
    m = scrape([decode, prefill])
    assert m[("tandem:landing_kv_cache_usage_perc", "decode-0")] == 0.25
    assert m[(DEPRECATED_LANDING_USAGE, "decode-0")] == 0.25
    assert ("tandem:landing_kv_cache_usage_perc", "prefill-0") not in m  # a prefill worker has no landing pool
    assert m[("tandem:kv_cache_usage_perc", "prefill-0")] == 0.125
