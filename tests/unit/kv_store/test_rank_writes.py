"""Prefill ranks writing their KV heads into decode ranks' landings (`kv_store/transfer/heads.py`,
`prefill_worker/rank_writes.py`): each rank's transport reads only its own pool (LocalTransport
refuses any other source), every head is written once, and the landings hold the whole model's KV
byte for byte, at every pair of tensor-parallel degrees."""

from __future__ import annotations

import contextlib

import pytest
import torch

from common.landing import KVLayout, Landing, LandingShard
from kernels.kv_layout import KVCacheTensors
from kernels.model.tp import split
from kv_store.transfer import LocalTransport
from kv_store.transfer.base import TransferError, TransferStatus
from kv_store.transfer.heads import SourceKV, sent_heads
from prefill_worker.rank_writes import GroupWrite, OtherRanks, ShardWrites

LAYERS, PAGES, PAGE_SIZE, HEAD_DIM = 2, 8, 4, 8
SRC_PAGES, LANDING_PAGES = [1, 2, 6], (5, 0, 3)


def held_by(heads: int, size: int) -> list[range]:
    """Each rank's KV heads as `kernels.model.tp.Shard` splits them (shared when fewer than ranks)."""
    if heads >= size:
        return [split(heads, size, r) for r in range(size)]
    copies = size // heads
    return [range(r // copies, r // copies + 1) for r in range(size)]


def pool(full: list[torch.Tensor], heads: range) -> list[torch.Tensor]:
    return [t[:, :, heads.start:heads.stop].contiguous() for t in full]


@pytest.mark.parametrize("heads,prefill,decode", [(3, 1, 1), (3, 2, 1), (3, 1, 2), (3, 2, 2), (3, 3, 1), (3, 2, 3),
                                                  (2, 4, 1), (2, 1, 4)])
def test_every_rank_writes_its_heads_and_the_landings_hold_the_whole_kv(heads, prefill, decode):
    gen = torch.Generator().manual_seed(heads * 10 + prefill * 3 + decode)
    full_k, full_v = ([torch.randn(PAGES, PAGE_SIZE, heads, HEAD_DIM, generator=gen) for _ in range(LAYERS)]
                      for _ in "kv")
    with contextlib.ExitStack() as stack:
        held_p, held_d = held_by(heads, prefill), held_by(heads, decode)
        sources = []
        for rank, mine in enumerate(held_p):
            kv = KVCacheTensors(pool(full_k, mine), pool(full_v, mine))
            transport = stack.enter_context(contextlib.closing(LocalTransport()))
            for t in (*kv.k, *kv.v):
                stack.enter_context(transport.register_tensor(t))
            sources.append((transport, SourceKV.of(kv, mine, sent_heads(held_p, rank)), kv))  # kv: kept alive
        landings, shards = [], []
        for mine in held_d:
            kv = KVCacheTensors.allocate(LAYERS, PAGES, PAGE_SIZE, len(mine), HEAD_DIM, torch.float32, "cpu")
            transport = stack.enter_context(contextlib.closing(LocalTransport()))
            for t in (*kv.k, *kv.v):
                stack.enter_context(transport.register_tensor(t))
            landings.append(kv)
            shards.append(LandingShard(transport.session_id, tuple(t.data_ptr() for t in kv.k),
                                       tuple(t.data_ptr() for t in kv.v), (mine.start, mine.stop)))
        layout = KVLayout(LAYERS, PAGE_SIZE, heads, HEAD_DIM, "float32", 4)
        landing = Landing("r", shards[0].session, LANDING_PAGES, shards[0].k_base, shards[0].v_base, layout, 60.0,
                          tuple(shards) if decode > 1 else ())
        written = 0
        for transport, source, _ in sources:
            writes = ShardWrites(transport)
            handle = writes.write(source, landing, SRC_PAGES, 0)
            assert writes.poll(handle) is TransferStatus.DONE and writes.settled(handle)
            written += handle.num_bytes
            writes.retire(handle)
        landed = sum(len(mine) for mine in held_d) * len(SRC_PAGES) * layout.page_bytes // heads
        assert written == landed, "a head was written twice to one landing, or not at all"
        for kv, mine in zip(landings, held_d):
            for layer in range(LAYERS):
                for got, full in ((kv.k[layer], full_k[layer]), (kv.v[layer], full_v[layer])):
                    assert torch.equal(got[list(LANDING_PAGES)], full[SRC_PAGES][:, :, mine.start:mine.stop])


def test_one_rank_and_one_landing_write_whole_pages_in_one_op_per_run():
    """Same degrees: a page is one op, and consecutive pages on both sides merge (no per-token ops)."""
    from kv_store.transfer.heads import head_ops

    layout = KVLayout(LAYERS, PAGE_SIZE, 3, HEAD_DIM, "float32", 4)
    bases = lambda first: tuple(first + layer * 1_000_000 for layer in range(LAYERS))  # noqa: E731
    landing = Landing("r", "d", (4, 5, 9), bases(10_000_000), bases(20_000_000), layout, 60.0)
    source = SourceKV(bases(30_000_000), bases(40_000_000), range(3), range(3))
    (ops,) = head_ops(source, [0, 1, 2], landing, 0).values()
    assert len(ops) == 2 * LAYERS * 2  # per layer, K and V: pages 0-1 -> 4-5 merged, 2 -> 9 alone
    assert sum(op.length for op in ops) == 3 * layout.page_bytes


class FakeControl:
    """Rank 0's control group with the other ranks' answers scripted."""

    def __init__(self) -> None:
        self.sent: list[tuple] = []
        self.answers: list[list] = []

    def send(self, call: tuple) -> None:
        self.sent.append(call)

    def gather(self, obj) -> list:
        return [obj, *self.answers.pop(0)]


def rank_zero_and_landing(stack, transport, heads: int) -> tuple[KVCacheTensors, Landing]:
    """Rank 0's pool of `heads` KV heads and a one-shard landing of all 3, both registered with `transport`."""
    kv = KVCacheTensors.allocate(LAYERS, PAGES, PAGE_SIZE, heads, HEAD_DIM, torch.float32, "cpu")
    landing_kv = KVCacheTensors.allocate(LAYERS, PAGES, PAGE_SIZE, 3, HEAD_DIM, torch.float32, "cpu")
    for t in (*kv.k, *kv.v, *landing_kv.k, *landing_kv.v):
        stack.enter_context(transport.register_tensor(t))
    stack.callback(lambda: (kv, landing_kv))  # kept alive while registered
    layout = KVLayout(LAYERS, PAGE_SIZE, 3, HEAD_DIM, "float32", 4)
    return kv, Landing("r", transport.session_id, LANDING_PAGES, tuple(t.data_ptr() for t in landing_kv.k),
                       tuple(t.data_ptr() for t in landing_kv.v), layout, 60.0)


def test_a_write_over_ranks_is_done_only_when_every_rank_says_so_and_settled_only_when_all_are():
    control = FakeControl()
    others = OtherRanks(control, [range(0, 2), range(2, 3), range(2, 3)])
    transport = LocalTransport()
    try:
        with contextlib.ExitStack() as stack:
            kv, landing = rank_zero_and_landing(stack, transport, 2)
            writes = ShardWrites(transport, others)
            handle = writes.write(SourceKV.of(kv, range(0, 2), range(0, 2)), landing, SRC_PAGES, 0)
            assert isinstance(handle, GroupWrite) and control.sent[-1][:2] == ("ship", handle.key)
            control.answers = [[{}, {}], [{handle.key: ("done", "", True, (0, [[[1]]]))},
                                          {handle.key: ("failed", "peer gone", False, None)}],
                               [{}, {handle.key: ("failed", "peer gone", True, None)}]]
            writes.refresh()  # nobody has finished: rank 0's own part is done, the write is not
            assert writes.poll(handle) is TransferStatus.PENDING
            writes.refresh()
            assert writes.poll(handle) is TransferStatus.FAILED and "rank 2: peer gone" in writes.error(handle)
            assert not writes.settled(handle)  # rank 2's batches may still move bytes
            writes.refresh()
            assert writes.settled(handle)
            writes.retire(handle)
            polls = len(control.sent)
            writes.refresh()  # nothing open: no call to the other ranks
            assert len(control.sent) == polls and control.answers == []
    finally:
        transport.close()


def test_a_prefill_rank_over_a_device_pool_needs_a_transport_that_reads_device_memory():
    """A rank whose pool is device memory (`meta` stands for it here) and whose transport copies from
    host memory only (the non-CUDA Mooncake build) is refused before it registers anything."""
    from engine.tp_launch import RankContext
    from kernels.model.tp import Shard
    from prefill_worker.rank_writes import RankSender
    from tests.unit.kernels.test_tensor_parallel import smollm2_like

    pool = KVCacheTensors.allocate(LAYERS, PAGES, PAGE_SIZE, 1, HEAD_DIM, torch.float32, "meta")
    shards = [Shard.of(smollm2_like(), r, 2) for r in range(2)]
    with contextlib.ExitStack() as closing:
        ctx = RankContext(1, shards, pool, control=None, closing=closing)
        with pytest.raises(TransferError, match="needs a transport that reads device memory"):
            RankSender("127.0.0.1", "tcp").start(ctx)


def test_the_other_ranks_digest_parts_reported_with_done_are_added_to_the_request_sums():
    """Rank 0 adds each other rank's `shard_sums` (reported with its DONE) to the request's sums once
    the write is DONE: with rank 0's own part the digests are whole; a rank that sent none leaves
    them unvouched (no digests, so the decode side checks nothing it cannot)."""
    from kv_store.transfer.page_digest import PartialSums

    control = FakeControl()
    others = OtherRanks(control, [range(0, 1), range(1, 2), range(2, 3)])
    transport = LocalTransport()
    try:
        with contextlib.ExitStack() as stack:
            kv, landing = rank_zero_and_landing(stack, transport, 1)
            writes = ShardWrites(transport, others)
            for reported, whole in ((True, True), (False, False)):
                handle = writes.write(SourceKV.of(kv, range(0, 1), range(0, 1)), landing, SRC_PAGES[:1], 0)
                own = [[[5] * 2 * LAYERS]]  # one page, one shard, per tensor
                part = (0, [[[10] * 2 * LAYERS]])
                control.answers = [[{handle.key: ("done", "", True, part)},
                                    {handle.key: ("done", "", True, part if reported else None)}]]
                writes.refresh()
                assert writes.poll(handle) is TransferStatus.DONE
                sums = PartialSums(3)
                sums.add(0, own)
                writes.add_other_sums(handle, sums)
                expected = PartialSums(1)
                expected.add(0, [[[25] * 2 * LAYERS]])
                assert sums.digests(1) == (expected.digests(1) if whole else ())
                writes.retire(handle)
    finally:
        transport.close()
