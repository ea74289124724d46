"""The real `Dispatcher` over in-process workers, for integration tests: `WorkerHost` threads, each
with its own `LocalTransport` (peers find each other by session id) and the seeded tiny Llama in
place of a loaded model.

    hosts = start_hosts(config, (("prefill-0", "prefill", 0), ("decode-0", "decode", 64)))
    try:
        tokens, last = serve(hosts, scenario)    # async def scenario(d, views): ... run(d, "r0", ...)
    finally:
        stop_hosts(hosts)                        # loops stopped, nothing crashed, integrity OK
"""

from __future__ import annotations

import asyncio
import functools
import time

import pytest

from cluster.worker_host.build import WorkerSpec, build_worker
from cluster.worker_host.thread import HostLink, WorkerHost
from common.config import EngineConfig
from common.protocol import WorkerRole
from kv_store.transfer.local import LocalTransport
from router.admission import AdmissionParams
from router.dispatcher import Dispatcher, DispatcherConfig, WorkerInfo
from tests.helpers import why_not_at_rest

TIMEOUT_S = 60.0  # bounds every scenario: pytest-timeout is not installed
REST_TIMEOUT_S = 10.0
MAX_MODEL_LEN = 1024  # the tiny Llama's max_position_embeddings


def load_tiny(*_args, **_kw):
    """`load_for_serving` for the tiny Llama: a fresh copy per worker (same seeded weights, so one L3 namespace)."""
    from kernels.model.arch import LlamaArch
    from kernels.model.loader import LoadedModel
    from kernels.model.tiny import make_tiny_llama

    ours, ref = make_tiny_llama(0)
    return LoadedModel(ours, LlamaArch.from_hf_config(ref.config), ref.config, None, None, ())


def start_hosts(config: EngineConfig, workers, build=build_worker, **spec_fields) -> dict[str, WorkerHost]:
    """One host per `(worker_id, role, host_pages)` of `workers`, heartbeat every 20 ms, built by
    `build` (`build_worker` or a test's wrapper of it). `spec_fields`: the rest of every `WorkerSpec`
    (`transport` deadlines, `l3`). The model is loaded while the hosts are built, not later."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("kernels.model.loader.load_for_serving", load_tiny)  # what `build_worker` loads with
        return {wid: WorkerHost(WorkerSpec(role, config, host_pages=host_pages, heartbeat_interval_s=0.02,
                                           **spec_fields),
                                wid, build=functools.partial(build, transport=LocalTransport()))
                for wid, role, host_pages in workers}


def stop_hosts(hosts: dict[str, WorkerHost]) -> None:
    """Teardown: every loop stops, none crashed, every worker's pools and tree pass `check_integrity`."""
    for host in hosts.values():
        assert host.shutdown(), f"{host.worker_id}: loop did not stop"
        assert not host.crashed, host.crashed
        host.worker.check_integrity()


class RecordingLink(HostLink):
    """`HostLink` that records every message sent to the worker, in order."""

    def __init__(self, host: WorkerHost):
        super().__init__(host)
        self.sent: list = []

    async def send(self, msgs: list) -> None:
        self.sent += msgs
        await super().send(msgs)


class Views:
    """The dispatcher's view source: the hosts as a controller would report them, one incarnation and
    one `link(host)` each; the worker ids a test adds to `dead` are reported dead from then on."""

    def __init__(self, hosts: dict[str, WorkerHost], link=HostLink):
        self.hosts, self.links, self.dead = hosts, {wid: link(h) for wid, h in hosts.items()}, set()

    async def workers(self) -> list[WorkerInfo]:
        return [WorkerInfo(wid, WorkerRole(h.spec.role), 1, wid not in self.dead, h.session, h.conn.stats, 0,
                           self.links[wid]) for wid, h in self.hosts.items()]


def serve(hosts: dict[str, WorkerHost], scenario, link=HostLink, **dispatcher_fields):
    """`await scenario(d, views)` on a fresh loop, bounded by TIMEOUT_S, with `d` a fresh `Dispatcher`
    over `Views(hosts, link)` (refresh and collect every 20 ms unless `dispatcher_fields` say
    otherwise), closed afterwards. Returns what the scenario returns."""
    views = Views(hosts, link)

    async def main():
        d = Dispatcher.build(views, DispatcherConfig(model_name="tiny", max_model_len=MAX_MODEL_LEN, **{
            "refresh_interval_s": 0.02, "collect_timeout_s": 0.02, **dispatcher_fields}))
        await d.start()
        try:
            return await asyncio.wait_for(scenario(d, views), TIMEOUT_S)
        finally:
            await d.close()
    return asyncio.run(main())


async def run(d: Dispatcher, rid: str, prompt: list[int], params, **generate_fields):
    """(token ids, last chunk) of one request streamed to its end."""
    chunks = [c async for c in d.generate(rid, prompt, params, **generate_fields)]
    return [t for c in chunks for t in c.new_token_ids], chunks[-1]


async def wait_for(condition, what: str, timeout_s: float = REST_TIMEOUT_S) -> None:
    """Poll `condition()` until true; async so the dispatcher keeps relaying meanwhile."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out after {timeout_s}s waiting for {what}"
        await asyncio.sleep(0.01)


REST_SETTLE_S = 0.2


async def settled(why_busy, timeout_s: float, settle_s: float = REST_SETTLE_S) -> None:
    """Wait until `why_busy()` is empty at two looks `settle_s` apart: work the dispatcher already sent
    when a request ended (its answer's prefill, `PrefillAnswer`) may reach a worker just after it
    looked idle."""
    deadline = time.monotonic() + timeout_s
    while True:
        while why := why_busy():
            assert time.monotonic() < deadline, f"not at rest after {timeout_s}s: {why}"
            await asyncio.sleep(0.01)
        await asyncio.sleep(settle_s)
        if not why_busy():
            return


async def all_at_rest(hosts: dict[str, WorkerHost], timeout_s: float = REST_TIMEOUT_S) -> None:
    """Wait until no worker holds anything for any request (`why_not_at_rest`), all at one look."""
    await settled(lambda: {wid: why for wid, h in hosts.items() if (why := why_not_at_rest(h.worker))}, timeout_s)


def queue_all(n: int) -> AdmissionParams:
    """Admission that queues up to `n` requests however long they wait: nothing is shed."""
    return AdmissionParams(max_queue_delay_s=1e9, max_queued_requests=n, max_requests_per_worker=n)
