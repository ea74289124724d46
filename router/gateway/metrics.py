"""Prometheus metrics of one gateway app (vLLM-style names under `tandem:`), in a registry of its own.

Request metrics are observed by the gateway as chunks pass through it; load gauges are read from the
backend at scrape time, so they are never stale and cost nothing between scrapes.

Latency accounting of one request (times from `time.monotonic()`):

    arrival ------ first chunk with tokens ------ chunk ------ ... ------ last chunk
            TTFT                            gap g, k tokens
                                            -> k inter-token samples of g / k

A chunk can carry several tokens (a batched stream, speculative decoding); spreading its gap evenly
keeps the histogram's count equal to the number of generated tokens after the first one. Tokens that
arrive in the same chunk as the first token are not inter-token samples (their gap is not known).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from router.backend import GenerationChunk
from router.gateway.request_log import RequestLog

# Bucket edges in seconds, following vLLM's choices for the same histograms.
TTFT_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                  20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS_S = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                 40.0, 80.0)
E2E_BUCKETS_S = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                 480.0, 960.0, 1920.0, 7680.0)
KV_TRANSFER_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
TEMPERATURE_BUCKETS = (0.0, 0.1, 0.2, 0.3, 0.5, 0.7, 0.8, 1.0, 1.2, 1.5, 2.0)
TOP_P_BUCKETS = (0.1, 0.2, 0.5, 0.8, 0.9, 0.95, 0.99, 1.0)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
DEPRECATED_LANDING_USAGE = "tandem:host_kv_cache_usage_perc"
"""The landing pool's usage under its old name, which said "host" for what is not the host tier (L2):
exported beside `tandem:landing_kv_cache_usage_perc` for one release, then removed."""


class GatewayMetrics:
    """Every metric of one app. Not thread-safe beyond what prometheus_client guarantees (it locks)."""

    def __init__(self, backend: Any, extra_collectors: Iterable[Any] = (), slow_request_log_s: float = 0.0):
        self.requests = RequestLog(slow_request_log_s)
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.ttft = Histogram("tandem:time_to_first_token_seconds", "Time from arrival to the first token.",
                              buckets=TTFT_BUCKETS_S, registry=r)
        self.itl = Histogram("tandem:inter_token_latency_seconds",
                             "Gap between output tokens (a chunk of k tokens after a gap g counts g/k k times).",
                             buckets=ITL_BUCKETS_S, registry=r)
        self.e2e = Histogram("tandem:e2e_request_latency_seconds", "Time from arrival to the last token.",
                             buckets=E2E_BUCKETS_S, registry=r)
        self.success = Counter("tandem:request_success", "Requests finished by their own stop rules.",
                               ["finished_reason"], registry=r)
        self.failure = Counter("tandem:request_failure", "Generation requests that ended with an error.",
                               ["kind"], registry=r)
        self.prompt_tokens = Counter("tandem:prompt_tokens", "Prompt tokens of started requests.", registry=r)
        self.generation_tokens = Counter("tandem:generation_tokens", "Tokens generated.", registry=r)
        # What the engines were asked for, after the generation config filled unset fields (vLLM's
        # request_params_* histograms).
        self.temperature = Histogram("tandem:request_params_temperature", "Sampling temperature of started requests.",
                                     buckets=TEMPERATURE_BUCKETS, registry=r)
        self.top_p = Histogram("tandem:request_params_top_p", "Nucleus (top_p) of started requests.",
                               buckets=TOP_P_BUCKETS, registry=r)
        self.cache_queries = Counter("tandem:prefix_cache_queries", "Prompt tokens looked up in a prefix cache.",
                                     registry=r)
        self.cache_hits = Counter("tandem:prefix_cache_hits", "Prompt tokens served by a prefix cache.", registry=r)
        self.kv_bytes = Counter("tandem:kv_transfer_bytes", "Prompt KV bytes moved prefill -> decode.", registry=r)
        self.kv_seconds = Histogram("tandem:kv_transfer_seconds", "Prefill-side KV transfer time per request.",
                                    buckets=KV_TRANSFER_BUCKETS_S, registry=r)
        self.routed = Counter("tandem:requests_routed", "Finished requests by the workers that served them.",
                              ["prefill_worker", "decode_worker"], registry=r)
        r.register(BackendGauges(backend))
        for collector in extra_collectors:
            r.register(collector)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)

    def observe_last_chunk(self, request_id: str, prompt_len: int, chunk: GenerationChunk) -> None:
        """Per-request totals carried by a request's last chunk (finished or failed); its timeline
        goes to `requests` (`router.gateway.request_log`)."""
        self.requests.record(request_id, prompt_len, chunk)
        self.cache_queries.inc(prompt_len)
        self.cache_hits.inc(chunk.cached_tokens)
        self.kv_bytes.inc(chunk.kv_transfer_bytes)
        if chunk.kv_transfer_s is not None:
            self.kv_seconds.observe(chunk.kv_transfer_s)
        if chunk.decode_worker or chunk.prefill_worker:
            self.routed.labels(prefill_worker=chunk.prefill_worker, decode_worker=chunk.decode_worker).inc()


class RequestClock:
    """Latency observations of one request, fed chunk by chunk (see the module docstring)."""

    def __init__(self, metrics: GatewayMetrics, arrival_s: float):
        self._metrics, self._arrival_s = metrics, arrival_s
        self._last_token_s: float | None = None

    def on_tokens(self, num_tokens: int, now_s: float) -> None:
        if num_tokens <= 0:
            return
        self._metrics.generation_tokens.inc(num_tokens)
        if self._last_token_s is None:
            self._metrics.ttft.observe(now_s - self._arrival_s)
        else:
            gap_s = (now_s - self._last_token_s) / num_tokens
            for _ in range(num_tokens):
                self._metrics.itl.observe(gap_s)
        self._last_token_s = now_s

    def on_success(self, finished_reason: str, now_s: float) -> None:
        self._metrics.e2e.observe(now_s - self._arrival_s)
        self._metrics.success.labels(finished_reason=finished_reason).inc()


class BackendGauges:
    """A custom collector: the backend's load, read at scrape time."""

    def __init__(self, backend: Any):
        self._backend = backend

    def describe(self) -> list[Metric]:
        return []  # names are only known by collecting; describing nothing skips the duplicate check

    def collect(self) -> Iterable[Metric]:
        running, waiting = self._backend.num_requests()
        yield _gauge("tandem:num_requests_running", "Requests in a running batch.", running)
        yield _gauge("tandem:num_requests_waiting", "Requests queued for a batch.", waiting)
        gauges = list(self._backend.worker_gauges())
        labels = ["worker", "role"]
        usage = GaugeMetricFamily("tandem:kv_cache_usage_perc", "Device KV pages in use, fraction.", labels=labels)
        landing = GaugeMetricFamily("tandem:landing_kv_cache_usage_perc",
                                    "Landing-pool KV pages in use (decode workers), fraction.", labels=labels)
        old_landing = GaugeMetricFamily(DEPRECATED_LANDING_USAGE, "Deprecated alias of "
                                        "tandem:landing_kv_cache_usage_perc (removed in the next release).",
                                        labels=labels)
        alive = GaugeMetricFamily("tandem:worker_alive", "1 while the worker is alive.", labels=labels)
        restarts = GaugeMetricFamily("tandem:worker_restarts", "Times the worker was restarted.", labels=labels)
        for g in gauges:
            key = [g.worker_id, g.role]
            usage.add_metric(key, g.kv_usage)
            alive.add_metric(key, 1.0 if g.alive else 0.0)
            restarts.add_metric(key, g.restarts)
            if g.landing_kv_usage is not None:
                landing.add_metric(key, g.landing_kv_usage)
                old_landing.add_metric(key, g.landing_kv_usage)
        yield from (usage, landing, old_landing, alive, restarts)
        yield from _tier_metrics(gauges)
        yield from _graph_metrics(gauges)
        yield from _thread_metrics(gauges)
        yield from _spec_metrics(gauges)


_TIER_COUNTERS = (  # (metric, documentation, extra label, {label value: TierStats field})
    ("tandem:prefix_cache_hit_tokens", "Prompt tokens served from each KV tier at admission.", "tier",
     {"l1": "hit_tokens_l1", "l2": "hit_tokens_l2", "l3": "hit_tokens_l3"}),
    ("tandem:kv_tier_copy_bytes", "KV bytes copied between device and host.", "direction",
     {"l1_to_l2": "l1_to_l2_bytes", "l2_to_l1": "l2_to_l1_bytes"}),
    ("tandem:kv_tier_copy_seconds", "Seconds spent copying KV between device and host.", "direction",
     {"l1_to_l2": "l1_to_l2_seconds", "l2_to_l1": "l2_to_l1_seconds"}),
    ("tandem:kv_evicted_pages", "KV pages evicted from each tier.", "tier",
     {"l1": "evicted_pages_l1", "l2": "evicted_pages_l2"}),
    ("tandem:l3_pages", "Pages read from / written to the L3 store.", "op",
     {"get": "l3_get_pages", "put": "l3_put_pages"}),
    ("tandem:l3_errors", "L3 faults, each a counted miss.", "kind", {"call": "l3_errors", "corrupt": "l3_corrupt"}),
    ("tandem:l3_seconds", "Seconds spent in L3 calls.", "op", {"get": "l3_get_seconds", "put": "l3_put_seconds"}),
    ("tandem:kv_checksum_failures", "KV that failed its checksum where it crossed a boundary: a landed prompt "
     "(transfer), a host page at load-back (l2), an L3 value; each discarded and computed again, never served.",
     "boundary", {"transfer": "transfer_corrupt", "l2": "l2_corrupt", "l3": "l3_corrupt"}),
    ("tandem:kv_checksum_verified_pages", "KV pages whose checksum was checked where they crossed a boundary.",
     "boundary", {"transfer": "transfer_verified_pages"}),
)


def _tier_metrics(gauges: list) -> Iterable[Metric]:
    """Per-worker KV-hierarchy counters and the session/L2 gauges, from each worker's last heartbeat."""
    labels = ["worker", "role"]
    families = [(CounterMetricFamily(name, doc, labels=labels + [extra]), fields)
                for name, doc, extra, fields in _TIER_COUNTERS]
    prefetch = CounterMetricFamily("tandem:l3_prefetches", "L3 prefetches by outcome.", labels=labels + ["outcome"])
    sessions = GaugeMetricFamily("tandem:sessions_open", "Streaming sessions open.", labels=labels)
    session_pages = GaugeMetricFamily("tandem:session_kv_pages", "Device KV pages held by sessions between turns.",
                                      labels=labels)
    offloads = CounterMetricFamily("tandem:session_offloads", "Idle sessions whose history was let go from "
                                   "device to the host tier because a request needed the pages.", labels=labels)
    l2 = GaugeMetricFamily("tandem:l2_kv_cache_usage_perc", "L2 host-cache KV pages in use, fraction.", labels=labels)
    for g in gauges:
        key = [g.worker_id, g.role]
        if g.host_cache_usage is not None:
            l2.add_metric(key, g.host_cache_usage)
        if g.tiers is None:
            continue
        for family, fields in families:
            for value, field_name in fields.items():
                family.add_metric(key + [value], getattr(g.tiers, field_name))
        for outcome, count in g.tiers.prefetches:
            prefetch.add_metric(key + [outcome], count)
        sessions.add_metric(key, g.tiers.sessions_open)
        session_pages.add_metric(key, g.tiers.session_pages)
        offloads.add_metric(key, g.tiers.session_offloads)
    yield from (family for family, _ in families)
    yield from (prefetch, sessions, session_pages, offloads, l2)


def _graph_metrics(gauges: list) -> Iterable[Metric]:
    """Per-worker decode steps replayed by the graph runner, those run eagerly by reason, and whether
    its CPU decode step still compiles."""
    labels = ["worker", "role"]
    replays = CounterMetricFamily("tandem:graph_replays", "Decode steps replayed from a captured graph.",
                                  labels=labels)
    fallbacks = CounterMetricFamily("tandem:graph_fallbacks", "Steps run eagerly instead of replayed, by reason.",
                                    labels=labels + ["reason"])
    compiling = GaugeMetricFamily("tandem:graph_compiling", "1 while the worker's CPU decode step compiles beside "
                                  "serving (its steps run eagerly meanwhile), else 0.", labels=labels)
    for g in gauges:
        if g.graphs is None:
            continue
        replays.add_metric([g.worker_id, g.role], g.graphs.replays)
        for reason, count in g.graphs.fallbacks:
            fallbacks.add_metric([g.worker_id, g.role, reason], count)
        compiling.add_metric([g.worker_id, g.role], float(g.graphs.compiling))
    yield from (replays, fallbacks, compiling)


def _thread_metrics(gauges: list) -> Iterable[Metric]:
    """Per-worker steps by the torch threads they ran on (workers that share their node's cores)."""
    steps = CounterMetricFamily("tandem:worker_steps", "Steps run, by the torch threads each ran on (a worker "
                                "borrows the threads of idle workers on its node).",
                                labels=["worker", "role", "threads"])
    for g in gauges:
        for threads, count in g.step_threads:
            steps.add_metric([g.worker_id, g.role, str(threads)], count)
    yield steps


def _spec_metrics(gauges: list) -> Iterable[Metric]:
    """Per-worker speculative decoding: drafts accepted per verify (a histogram over 0 .. k), and per
    draft position the drafts verified, accepted, and the acceptance rate."""
    labels = ["worker", "role"]
    accepted = HistogramMetricFamily("tandem:spec_accepted_drafts_per_verify",
                                     "Draft tokens accepted per verify (the verify emits one more).", labels=labels)
    drafted = CounterMetricFamily("tandem:spec_draft_tokens", "Draft tokens verified, by draft position.",
                                  labels=labels + ["position"])
    taken = CounterMetricFamily("tandem:spec_accepted_tokens", "Draft tokens accepted, by draft position.",
                                labels=labels + ["position"])
    rate = GaugeMetricFamily("tandem:spec_acceptance_rate", "Accepted / verified drafts, by draft position.",
                             labels=labels + ["position"])
    for g in gauges:
        if g.spec is None or not g.spec.verifies:
            continue
        key, hist = [g.worker_id, g.role], dict(g.spec.accepted_per_verify)
        buckets, running = [], 0
        for bound in range(max(hist) + 1):
            running += hist.get(bound, 0)
            buckets.append((str(bound), running))
        buckets.append(("+Inf", running))
        accepted.add_metric(key, buckets, sum_value=sum(a * n for a, n in hist.items()))
        accepted_at = dict(g.spec.accepted_at)
        for position, n in g.spec.drafted_at:
            drafted.add_metric(key + [str(position)], n)
            taken.add_metric(key + [str(position)], accepted_at.get(position, 0))
            rate.add_metric(key + [str(position)], accepted_at.get(position, 0) / n)
    yield from (accepted, drafted, taken, rate)


def _gauge(name: str, documentation: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, documentation, value=value)
