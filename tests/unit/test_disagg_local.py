"""Prefill worker -> LocalTransport -> decode worker's host tier -> device, in one process."""

import random

import pytest
import torch

from cluster.config import EngineConfig
from cluster.worker_host.local_pair import LocalPair
from decode_worker.worker import DecodeWorker
from kv_store.transfer.local import LocalTransport
from kv_store.transfer.session import TransferDeadlines
from prefill_worker.request import FinishReason
from prefill_worker.worker import PrefillWorker
from tests.helpers import assert_pool_at_rest, greedy, make_engine, make_prompts, tiny_models


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def make_pair(page_size=4, chunk_size=16, num_pages=256, host_pages=256, clock=None, deadlines=TransferDeadlines()):
    ours, _, arch = tiny_models()
    clock = clock or FakeClock()
    config = EngineConfig(page_size=page_size, num_pages=num_pages, chunk_size=chunk_size, debug_kv=True)
    prefill = PrefillWorker(config, ours, arch, LocalTransport(), deadlines=deadlines, clock=clock)
    decode = DecodeWorker(config, ours, arch, LocalTransport(), host_pages=host_pages, deadlines=deadlines,
                          clock=clock)
    return LocalPair(prefill, decode)


def assert_pair_at_rest(pair: LocalPair) -> None:
    assert not pair.busy()
    assert_pool_at_rest(pair.prefill)
    assert_pool_at_rest(pair.decode)
    host = pair.decode.host.pool.usage()
    assert host.free == host.total, f"host tier pages still held: {host}"
    pair.decode.host.check_integrity()
    pair.prefill.close(), pair.decode.close()
    pair.prefill.transport.close(), pair.decode.transport.close()


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_disaggregated_greedy_matches_colocated_and_hf(prompts, hf_outputs, page_size):
    chunk = 16
    assert max(map(len, prompts)) >= 3 * chunk  # the longest prompt crosses >= 3 chunks
    pair = make_pair(page_size=page_size, chunk_size=chunk)
    results = pair.generate(prompts, greedy(max_tokens=24))
    colocated = make_engine(page_size=page_size, chunk_size=chunk).generate(prompts, greedy(max_tokens=24))
    assert [r.token_ids for r in results] == [r.output_token_ids for r in colocated] == hf_outputs
    assert all(r.finish_reason is FinishReason.LENGTH and not r.error for r in results)
    assert pair.decode.device_pool.relocation_version == len(prompts)  # one load per request
    assert_pair_at_rest(pair)


def test_loaded_device_pages_are_byte_identical_to_prefill_pages(prompts):
    pair = make_pair(page_size=4, chunk_size=16)
    prompt = prompts[4]
    pair.submit("r", prompt, greedy(max_tokens=5))
    while "r" not in pair.decode.requests:
        pair.step()
    dec_pages = pair.decode.requests["r"].kv.pages
    pre = pair.prefill.kvm.prefix_cache.match(prompt, len(prompt))  # prefill cached its pages on release
    full = len(prompt) // 4
    assert len(pre.pages) == full
    for layer in range(len(pair.decode.kv_cache.k)):
        for dec_t, pre_t in ((pair.decode.kv_cache.k[layer], pair.prefill.kv_cache.k[layer]),
                             (pair.decode.kv_cache.v[layer], pair.prefill.kv_cache.v[layer])):
            assert torch.equal(dec_t[dec_pages[:full]], pre_t[pre.pages]), f"layer {layer} differs"
            assert dec_t[dec_pages[:full]].abs().sum() > 0
    while pair.busy():
        pair.step()
    assert_pair_at_rest(pair)


def test_stall_trips_deadline_and_both_sides_release(prompts):
    clock = FakeClock()
    pair = make_pair(clock=clock, deadlines=TransferDeadlines(waiting_s=5, transferring_s=5))
    pair.prefill.transport.stall_next(100)
    pair.submit("stuck", prompts[4], greedy(max_tokens=5))
    for _ in range(10):
        pair.step()
    assert pair.prefill.device_pool.pages.usage().in_flight > 0  # its pages are lent to the stalled writes
    clock.now += 6
    pair.step()
    res = pair.results["stuck"]
    assert res.finish_reason is FinishReason.ABORT and "timeout" in res.error
    host = pair.decode.host.pool.usage()
    assert host.in_flight > 0, "landing freed while the stalled writes could still land"
    pair.prefill.transport.release_stalled(fail=True)  # the stalled writes end
    for _ in range(3):
        pair.step()
    assert_pair_at_rest(pair)


def test_transport_failure_is_typed_and_next_request_succeeds(prompts, hf_outputs):
    pair = make_pair()
    pair.prefill.transport.fail_next(1)
    [failed] = pair.generate([prompts[5]], greedy(max_tokens=24))
    assert failed.finish_reason is FinishReason.ABORT and "transport_error" in failed.error
    [ok] = pair.generate([prompts[5]], greedy(max_tokens=24))
    assert ok.token_ids == hf_outputs[5] and not ok.error
    assert_pair_at_rest(pair)


def test_client_abort_mid_transfer_and_dead_peer(prompts):
    pair = make_pair(chunk_size=8)
    pair.submit("a", prompts[4], greedy(max_tokens=5))
    pair.step()
    assert pair.decode.inbound["a"].phase.value == "landing"
    pair.abort("a")
    for _ in range(3):
        pair.step()
    assert pair.results["a"].finish_reason is FinishReason.ABORT
    pair.prefill.transport.stall_next(100)
    pair.submit("b", prompts[4], greedy(max_tokens=5))
    pair.step()
    pair.decode.peer_dead(pair.prefill_id)  # heartbeat lost: nothing more can arrive from it
    pair.prefill.peer_dead(pair.decode.transport.session_id)
    pair.prefill.transport.release_stalled(fail=True)
    for _ in range(3):
        pair.step()
    assert pair.results["b"].finish_reason is FinishReason.ABORT and "peer_dead" in pair.results["b"].error
    assert_pair_at_rest(pair)


def test_200_random_requests_with_aborts_leak_nothing():
    rng = random.Random(5)
    pair = make_pair(page_size=4, chunk_size=24, num_pages=1 + 256 // 4, host_pages=1 + 192 // 4)
    prompts = make_prompts(200, min_len=2, max_len=60, seed=9)
    max_tokens = {f"r{i}": rng.randrange(1, 12) for i in range(len(prompts))}
    pending = list(enumerate(prompts))
    aborted, step = set(), 0
    while pending or pair.busy():
        for _ in range(rng.randrange(0, 4)):
            if pending:
                i, p = pending.pop(0)
                pair.submit(f"r{i}", p, greedy(max_tokens=max_tokens[f"r{i}"]))
        live = [rid for rid, res in pair.results.items() if res.finish_reason is None]
        if live and rng.random() < 0.15:
            rid = rng.choice(live)
            pair.abort(rid)
            aborted.add(rid)
        pair.step()
        step += 1
        assert step < 20_000, "pair made no progress"
    assert len(aborted) >= 20
    assert all(pair.results[rid].finish_reason is FinishReason.ABORT for rid in aborted)
    done = [rid for rid in pair.results if rid not in aborted]
    reference = make_engine(page_size=4, num_pages=2048).generate(
        [prompts[int(rid[1:])] for rid in done], [greedy(max_tokens=max_tokens[rid]) for rid in done])
    assert [pair.results[rid].token_ids for rid in done] == [r.output_token_ids for r in reference]
    assert_pair_at_rest(pair)


def test_slow_but_moving_transfer_outlives_its_deadline(prompts, hf_outputs):
    """Progress restarts the deadline on both sides: many chunks, each within the deadline, but
    together far beyond it, still complete."""
    clock = FakeClock()
    pair = make_pair(chunk_size=8, clock=clock, deadlines=TransferDeadlines(waiting_s=5, transferring_s=5))
    pair.submit("slow", prompts[4], greedy(max_tokens=24))
    steps = 0
    while pair.busy():
        clock.now += 3  # every step looks slow
        pair.step()
        steps += 1
    assert steps * 3 > 5 * 3  # the whole transfer took several deadlines
    assert pair.results["slow"].token_ids == hf_outputs[4] and not pair.results["slow"].error
    assert_pair_at_rest(pair)


def test_failed_write_that_may_still_land_holds_pages_and_landing(prompts, monkeypatch):
    """A write the transport gave up on can still be moving bytes (a hung peer's abandoned batch):
    until it settles, the prefill pages stay lent and the decode landing stays reserved."""
    pair = make_pair()
    transport = pair.prefill.transport
    unsettled = {"on": True}
    real_settled = type(transport).settled
    monkeypatch.setattr(type(transport), "settled", lambda self, h: not unsettled["on"] and real_settled(self, h))
    transport.fail_next(1)
    pair.submit("z", prompts[4], greedy(max_tokens=5))
    for _ in range(5):
        pair.step()
    res = pair.results["z"]
    assert res.finish_reason is None  # the decode side has no verdict yet: nothing told it
    assert pair.prefill.device_pool.pages.usage().in_flight > 0, "pages freed while a write may still read them"
    assert pair.decode.host.pool.usage().in_flight > 0, "landing freed while a write may still land"
    pair.prefill.check_integrity(), pair.decode.check_integrity()
    unsettled["on"] = False
    for _ in range(3):
        pair.step()
    assert res.finish_reason is FinishReason.ABORT and "transport_error" in res.error
    assert_pair_at_rest(pair)


def test_a_prompt_larger_than_the_whole_host_tier_is_rejected_not_retried_forever():
    pair = make_pair(page_size=4, host_pages=1 + 3)  # 3 usable landing pages: 12 tokens
    with pytest.raises(ValueError, match="needs 4 host-tier pages.*has 3"):
        pair.decode.reserve("big", list(range(3, 16)), greedy(max_tokens=2), "prefill-0")
    assert pair.decode.reserve("fits", list(range(3, 15)), greedy(max_tokens=2), "prefill-0") is not None
    assert pair.decode.reserve("later", list(range(3, 7)), greedy(max_tokens=2), "prefill-0") is None  # full now
    pair.decode.abort("fits")
    pair.decode.peer_dead("prefill-0")  # the landing was never written: the writer's end frees it
    assert [out.finish_reason for out in pair.decode.step()] == [FinishReason.ABORT]
    pair.decode.outbox.clear()  # the AbortTransfer nobody is there to read
    assert_pair_at_rest(pair)
