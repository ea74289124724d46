"""The connectors alone, against `ConnectorPorts` built by hand: no engine anywhere. A `KVSender`
ships a prefill pool's pages through a `LocalTransport` into a `KVReceiver`'s landing, the receiver
loads them to its device pool, and the bytes are compared page by page; aborts come back to the
"engine" (this test) as data: `take_stopped`, then `take_finished`."""

from __future__ import annotations

import pytest
import torch

from common import protocol as p
from common.config import SamplingParams
from decode_worker.receiver import KVReceiver
from engine.connector import ConnectorPorts
from engine.core import EngineCore
from engine.request import FinishReason, Request, RequestStatus
from engine.scheduler import ScheduledStep
from engine.stop import StopRules
from kernels.kv_layout import KVCacheTensors
from kv_store.device_pool import DevicePool
from kv_store.kv_manager import KVManager, ReleaseReason, ReqKV
from kv_store.radix_cache import NullPrefixCache
from kv_store.transfer.local import LocalTransport
from kv_store.transfer.session import FailureReason
from prefill_worker.sender import KVSender

PAGE_SIZE, LAYERS, HEADS, HEAD_DIM = 4, 2, 2, 8
PARAMS = SamplingParams(max_tokens=4, ignore_eos=True)


class RecordingKV:
    """The `ConnectorKV` port over a real `KVManager`, recording which methods the connector called."""

    def __init__(self, kvm: KVManager):
        self.kvm, self.calls = kvm, []

    def open_for_load(self, request_id: str, num_tokens: int) -> ReqKV | None:
        self.calls.append("open_for_load")
        return self.kvm.try_open(request_id, num_tokens)

    def commit_loaded(self, kv: ReqKV, num_tokens: int) -> None:
        self.calls.append(("commit_loaded", num_tokens))
        self.kvm.commit(kv, num_tokens)

    def release_kv(self, kv: ReqKV, reason: ReleaseReason, token_ids: list[int] | None) -> None:
        self.calls.append("release_kv")
        self.kvm.release(kv, reason, [], cache=False)

    def pin_for_transfer(self, kv: ReqKV, first_page: int, end_page: int, handle: object) -> object:
        self.calls.append(("pin_for_transfer", first_page, end_page))
        return self.kvm.pin_for_transfer(kv, first_page, end_page, handle)

    def unpin_transfer(self, handle: object) -> list[int]:
        self.calls.append("unpin_transfer")
        return self.kvm.unpin_transfer(handle)

    def lent_pages(self, kv: ReqKV) -> list[int]:
        return self.kvm.lent_pages(kv)


def new_request(prompt: list[int], params: SamplingParams, request_id: str) -> Request:
    return Request(request_id, list(prompt), params, stop_rules=StopRules(params, frozenset(), None, 1_000))


def make_ports(num_pages: int, seed: int) -> tuple[ConnectorPorts, RecordingKV]:
    cache = KVCacheTensors.allocate(LAYERS, num_pages, PAGE_SIZE, HEADS, HEAD_DIM, torch.float32, "cpu")
    gen = torch.Generator().manual_seed(seed)
    for t in (*cache.k, *cache.v):
        t.copy_(torch.randn(t.shape, generator=gen))
    pool = DevicePool(cache)
    kv = RecordingKV(KVManager(pool.pages, NullPrefixCache(pool.pages)))
    features = {"a": b"feature-of-a"}
    return ConnectorPorts(cache, pool, PAGE_SIZE, kv, new_request, EngineCore.accept_first_token,
                          lambda rid: features.get(rid, b""), kv.kvm.check_integrity), kv


@pytest.fixture
def pair():
    """(sender, its ports' KV, receiver, its ports' KV, receiver ports), wired over two LocalTransports."""
    p_ports, p_kv = make_ports(32, seed=1)
    d_ports, d_kv = make_ports(32, seed=2)
    sender, receiver = KVSender(p_ports, LocalTransport()), KVReceiver(d_ports, LocalTransport(), host_pages=32)
    yield sender, p_kv, receiver, d_kv, d_ports
    for connector in (sender, receiver):
        connector.close()
        connector.transport.close()


def prefilled(kv: RecordingKV, request_id: str, prompt: list[int]) -> Request:
    """A RUNNING request whose prompt's KV is computed (committed) in the prefill pool."""
    req = new_request(prompt, SamplingParams(max_tokens=1), request_id)
    req_kv = kv.kvm.try_open(request_id, len(prompt))
    kv.kvm.commit(req_kv, len(prompt))
    req.admit(req_kv)
    return req


def page_bytes(cache: KVCacheTensors, pages: list[int]) -> list[torch.Tensor]:
    return [t[pages].clone() for t in (*cache.k, *cache.v)]


def test_a_prompt_ships_lands_and_loads_byte_for_byte_without_an_engine(pair):
    sender, p_kv, receiver, d_kv, d_ports = pair
    prompt = list(range(10))  # 3 pages, the last one partly filled
    landing = receiver.reserve("a", prompt, PARAMS, peer=sender.transport.session_id)
    req = prefilled(p_kv, "a", prompt)
    sender.open(req, landing)
    sender.before_step()
    sender.after_commit(ScheduledStep(requests=[req]))
    assert p_kv.calls == [("pin_for_transfer", 0, 3)]
    req.output_token_ids.append(42)  # the first token: the prompt's last step sampled it
    assert sender.request_finished(req, FinishReason.LENGTH) is True  # the sender holds its KV on
    assert sender.take_stopped() == []
    sender.before_step()  # the write is DONE (a local write copies at once): it retires
    assert sender.take_finished() == [(req, FinishReason.LENGTH)]
    assert p_kv.calls[-1] == "unpin_transfer" and not p_kv.kvm.transfer_pins
    [complete] = sender.outbox
    assert isinstance(complete, p.KVComplete)
    assert (complete.first_token, complete.draft_feature) == (42, b"feature-of-a")

    receiver.on_message(complete)
    outputs = receiver.before_step()
    for _ in range(200):
        arrived = receiver.take_arrived()
        if arrived:
            break
        outputs += receiver.before_step()
    [(arrived_req, device_kv)] = arrived
    assert arrived_req.request_id == "a" and arrived_req.output_token_ids == [42]
    assert [(o.request_id, o.new_token_ids, o.finish_reason) for o in outputs] == [("a", [42], None)]
    assert d_kv.calls == ["open_for_load", ("commit_loaded", 10)]
    sent = page_bytes(sender.kv_cache, req.kv.pages)
    got = page_bytes(d_ports.kv_cache, device_kv.pages)
    for i, (want, have) in enumerate(zip(sent, got)):
        assert torch.equal(want, have), f"tensor {i}: the decode pool got other bytes than the prefill pool held"

    p_kv.kvm.release(req.kv, ReleaseReason.FINISHED, [], cache=False)
    d_kv.kvm.release(device_kv, ReleaseReason.FINISHED, [], cache=False)
    for kvm in (p_kv.kvm, d_kv.kvm):
        kvm.check_integrity()
        assert kvm.pool.usage().private == 0
    receiver.check_integrity()
    assert receiver.landing.pool.num_free == receiver.landing.pool.num_usable


def test_an_abort_reaches_the_engine_as_data_and_the_kv_waits_for_its_write(pair):
    sender, p_kv, receiver, _, _ = pair
    transport = sender.transport
    running = prefilled(p_kv, "run", list(range(8)))
    waiting = new_request(list(range(6)), SamplingParams(max_tokens=1), "wait")
    for req in (running, waiting):
        sender.open(req, receiver.reserve(req.request_id, req.prompt_token_ids, PARAMS,
                                          peer=transport.session_id))
    transport.stall_next(1)
    sender.after_commit(ScheduledStep(requests=[running]))  # its write stays PENDING
    assert p_kv.lent_pages(running.kv)  # its own pages are lent to the write: the scheduler won't retract it

    sender.abort_transfer("run", FailureReason.ABORTED, "client gone")
    sender.abort_transfer("wait", FailureReason.ABORTED, "client gone")
    assert sender.take_stopped() == [running, waiting]
    assert sender.take_stopped() == []  # handed over once
    waiting.finish(FinishReason.ABORT)  # the engine ends what holds no KV; `running` leaves its batch

    sender.before_step()
    assert sender.take_finished() == []  # the write may still read `running`'s pages
    assert [type(m) for m in sender.outbox] == [p.TransferAborted]  # `wait` had nothing in flight
    transport.release_stalled()
    sender.before_step()
    assert sender.take_finished() == [(running, FinishReason.ABORT)]
    assert running.status is RequestStatus.RUNNING  # the engine releases it, not the connector
    assert [m.request_id for m in sender.outbox] == ["wait", "run"]
    assert all(m.failure is p.Failure.TRANSFER for m in sender.outbox)
    p_kv.kvm.release(running.kv, ReleaseReason.ABORTED, [], cache=False)
    p_kv.kvm.check_integrity()
    assert not p_kv.kvm.transfer_pins and p_kv.kvm.pool.usage().private == 0


def test_a_landing_given_up_ends_its_request_as_an_output_and_frees_on_the_peers_word(pair):
    sender, _, receiver, d_kv, _ = pair
    receiver.reserve("a", list(range(10)), PARAMS, peer=sender.transport.session_id)
    assert receiver.abort("a")
    [(peer, abort)] = receiver.outbox
    assert (peer, type(abort)) == (sender.transport.session_id, p.AbortTransfer)
    [out] = receiver.before_step()
    assert (out.request_id, out.finish_reason, out.failure) == ("a", FinishReason.ABORT, p.Failure.TRANSFER)
    assert receiver.landing.pool.num_free < receiver.landing.pool.num_usable  # the peer may still write it
    receiver.on_message(p.TransferAborted("a", "aborted by the client"))
    assert not receiver.inbound and receiver.landing.pool.num_free == receiver.landing.pool.num_usable
    assert d_kv.calls == []  # nothing reached the device pool
    receiver.check_integrity()
