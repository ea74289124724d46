"""The KV reads that follow a forward wait for it explicitly (`kv_store/stream_order.py`), checked with
a recording stand-in for CUDA's events and streams: the page copier's copies run after the mark made
when the job was submitted, and a prefill worker reading its pool in place waits for the step's work
before every write."""

from __future__ import annotations

import contextlib
import threading

import torch

from common.config import EngineConfig
from kernels.kv_layout import KVCacheTensors
from kv_store.copier import Direction, PageCopier
from kv_store.stream_order import HostOrder, order_for
from kv_store.transfer.local import LocalTransport
from tests.helpers import greedy, make_prompts, tiny_models, why_not_at_rest
from tests.step_pair import StepPair


class RecordingOrder:
    """Logs (what, mark, thread name) for every ordering call; marks are 1, 2, 3, ..."""

    def __init__(self):
        self.log: list[tuple] = []
        self._lock = threading.Lock()
        self._marks = 0

    def _note(self, *entry) -> None:
        with self._lock:
            self.log.append((*entry, threading.current_thread().name))

    def mark(self) -> int:
        with self._lock:
            self._marks += 1
            mark = self._marks
        self._note("mark", mark)
        return mark

    @contextlib.contextmanager
    def copy_after(self, mark):
        self._note("wait", mark)
        yield
        self._note("synced", mark)

    def layer_done(self):
        self._note("layer", None)
        return ("event", len(self.log))

    def host_wait(self, mark) -> None:
        self._note("host_wait", mark)


def test_a_threaded_copy_waits_for_the_mark_made_at_submit_and_records_each_layer():
    device = KVCacheTensors.allocate(3, 8, 4, 2, 8, torch.float32, "cpu")
    for t in device.k + device.v:
        t.copy_(torch.randn(t.shape))
    host = KVCacheTensors.allocate(3, 8, 4, 2, 8, torch.float32, "cpu")
    order = RecordingOrder()
    copier = PageCopier(device, host, name="ordered-copier", inline=False, order=order)
    try:
        jobs = [copier.submit(Direction.TO_HOST, [1, 2], [3, 4]), copier.submit(Direction.TO_HOST, [5], [0])]
        assert all(job.wait(10.0) and job.error is None for job in jobs)
    finally:
        copier.close()
    submitter = threading.current_thread().name
    marks = [(m, who) for what, m, who in order.log if what == "mark"]
    assert marks == [(1, submitter), (2, submitter)] and [job.after for job in jobs] == [1, 2]
    on_copier = [(what, m) for what, m, who in order.log if who == "ordered-copier"]
    assert on_copier == [("wait", 1), *[("layer", None)] * 3, ("synced", 1),
                         ("wait", 2), *[("layer", None)] * 3, ("synced", 2)]
    assert all(len(job.layer_events) == 3 for job in jobs)
    assert torch.equal(host.k[2][3], device.k[2][1]) and torch.equal(host.v[0][0], device.v[0][5])


def test_a_prefill_worker_reading_its_pool_in_place_waits_for_the_step_before_each_write(monkeypatch):
    import prefill_worker.sender as sender_module
    from cluster.worker_host.build import make_worker

    order = RecordingOrder()
    monkeypatch.setattr(sender_module, "order_for", lambda device: order)
    model, _, arch = tiny_models()
    config = EngineConfig(page_size=4, num_pages=128, chunk_size=8, debug_kv=True)
    transport = LocalTransport()
    writes = []
    real_write = transport.write

    def write(peer, ops):
        writes.append(len(order.log))
        return real_write(peer, ops)

    transport.write = write
    prefill = make_worker("prefill", config, model, arch, transport)
    decode = make_worker("decode", config, model, arch, LocalTransport(), host_pages=64)
    # a prefill worker never decodes: its engine replays (and on CUDA captures) no decode bucket
    assert not prefill.engine.runner.enabled and decode.engine.runner.enabled
    try:
        StepPair(prefill, decode).generate(make_prompts(3, min_len=10, max_len=30, seed=2), greedy(max_tokens=2))
        for worker in (prefill, decode):
            assert why_not_at_rest(worker) == ""
    finally:
        prefill.close()
        decode.close()
    assert len(writes) >= 6  # prompts of 10-30 tokens in chunks of 8
    for at in writes:  # the entries just before each write: a mark, then the host waiting for it
        (mark_what, mark, _), (wait_what, waited, _) = order.log[at - 2:at]
        assert (mark_what, wait_what) == ("mark", "host_wait") and waited == mark


def test_a_cpu_device_has_nothing_to_order():
    assert isinstance(order_for("cpu"), HostOrder) and order_for(torch.device("cpu")).mark() is None
