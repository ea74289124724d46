"""Pages a pending transfer reads stay pinned by that transfer, whoever owns them (DESIGN §4 rule 2).

A prefill write ships prefix-cache pages as well as the request's own. Those cached pages must stay
put until the write's handle retires, even when the request that issued the write is retracted or
aborted meanwhile (which drops the request's own tree lock).
"""

import torch

from cluster.worker_host.build import make_worker
from common.config import EngineConfig
from engine.request import RequestStatus
from kv_store.page_pool import PageState
from kv_store.transfer.local import LocalTransport
from tests.helpers import assert_pool_at_rest, greedy, make_engine, make_prompts, tiny_models
from tests.step_pair import StepPair

PAGE_SIZE = 4


def make_tight_pair(prefill_pages: int) -> StepPair:
    """A prefill worker with `prefill_pages` usable pages and 3-token chunks (so a chunk can end
    inside a page); a roomy decode worker. The clock stands still: no deadline fires."""
    ours, _, arch = tiny_models()
    clock = lambda: 0.0  # noqa: E731
    prefill_cfg = EngineConfig(page_size=PAGE_SIZE, num_pages=1 + prefill_pages, chunk_size=3, debug_kv=True)
    decode_cfg = EngineConfig(page_size=PAGE_SIZE, num_pages=128, chunk_size=16, debug_kv=True)
    prefill = make_worker("prefill", prefill_cfg, ours, arch, LocalTransport(), clock=clock)
    decode = make_worker("decode", decode_cfg, ours, arch, LocalTransport(), host_pages=128, clock=clock)
    return StepPair(prefill, decode)


def page_bytes(kv_cache, pages: list[int]) -> list[torch.Tensor]:
    """K and V of `pages` in every layer, copied: [2 * num_layers] x [len(pages), page_size, heads, dim]."""
    return [t[pages].clone() for t in (*kv_cache.k, *kv_cache.v)]


def deliver_decode_messages(pair: StepPair) -> None:
    """Hand the decode worker's pending messages (AbortTransfer) to the prefill worker now."""
    outbox = pair.decode.receiver.outbox
    for _peer, msg in outbox:
        pair.prefill.handle(msg)
    outbox.clear()


def test_retracted_request_cannot_expose_cached_pages_its_pending_write_reads():
    shared, other, late = make_prompts(3, min_len=24, max_len=24, seed=11)
    pair = make_tight_pair(prefill_pages=11)
    prefill, transport = pair.prefill, pair.prefill.sender.transport
    engine, shipments = prefill.engine, prefill.sender.shipments

    # The shared prefix (6 pages) goes into the prefill worker's prefix cache.
    [first] = pair.generate([shared], greedy(max_tokens=2))
    assert engine.kvm.prefix_cache.cached_pages() == 6
    transport.stall_next(1000)  # every later write stays PENDING until the test releases it

    # "hold": 4 pages, prefilled, lent to its stalled writes: the pool has 1 free page left.
    pair.submit("hold", other[:16], greedy(max_tokens=2))
    while "hold" not in shipments or shipments["hold"].first_token is None:
        pair.step()
    assert engine.kvm.pool.num_free == 1

    # "b": the shared prefix + 8 tokens. Its first chunk (3 tokens) ends inside its first own page,
    # so its first write reads the 6 cached pages only.
    pair.submit("b", shared + late[:8], greedy(max_tokens=2))
    pair.step()
    b_kv = engine.requests["b"].kv
    assert b_kv.cache_protected_len == 24 and b_kv.kv_committed_len == 27
    [b_handle] = shipments["b"].handles
    read_pages = b_kv.pages[:6]
    assert all(engine.kvm.pool.state(p) is PageState.CACHED for p in read_pages)
    source_at_write = page_bytes(engine.kv_cache, read_pages)

    # Its next chunk needs a page the pool does not have: "b" is retracted, dropping its tree lock.
    pair.step()
    assert engine.requests["b"].status is RequestStatus.WAITING and engine.num_retractions == 1
    assert transport.poll(b_handle).value == "pending"

    # The client gives up on "b"; "c" arrives and needs pages the pool can only find by eviction.
    pair.abort("b")
    deliver_decode_messages(pair)
    assert "b" not in engine.requests and "b" in shipments
    pair.submit("c", late[8:20], greedy(max_tokens=2))
    for _ in range(6):
        pair.step()
        for p in read_pages:
            assert engine.kvm.pool.state(p) is PageState.CACHED, (
                f"page {p} read by b's pending write became {engine.kvm.pool.state(p).value} "
                f"(owner {engine.kvm.pool.owner(p)!r}) while the write was pending")
    assert engine.kvm.prefix_cache.evict(100) == 0  # nothing evictable: the pending write pins them

    # The write finally copies: the landing holds exactly the KV the cached pages held at hand-off.
    landing_pages = list(pair.decode.receiver.inbound["b"].landing.page_ids[:6])
    transport.release_stalled()
    assert transport.poll(b_handle).value == "done"
    for layer, (want,
                got) in enumerate(zip(source_at_write, page_bytes(pair.decode.receiver.landing.kv, landing_pages))):
        assert torch.equal(got, want), f"tensor {layer}: the landing got other bytes than the cached KV"

    while pair.busy():
        transport.release_stalled()  # writes still stall: let each go at once
        pair.step()
    reference = make_engine(page_size=PAGE_SIZE).generate([shared, other[:16], late[8:20]], greedy(max_tokens=2))
    assert [first.token_ids, pair.results["hold"].token_ids, pair.results["c"].token_ids] == [
        r.output_token_ids for r in reference]
    assert not engine.kvm.transfer_pins, f"pins left after every write retired: {engine.kvm.transfer_pins}"
    for worker in (prefill, pair.decode):
        assert_pool_at_rest(worker.engine)
        worker.close()
    prefill.sender.transport.close(), pair.decode.receiver.transport.close()
