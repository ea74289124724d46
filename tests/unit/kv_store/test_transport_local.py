"""LocalTransport and the shared transport pieces (coalesce, validation, statuses, fault injection)."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import pytest
import torch

from kv_store.transfer import (
    LocalTransport,
    MemoryRegion,
    PeerUnreachable,
    RegistrationError,
    TransferError,
    TransferFailed,
    TransferStatus,
    WriteOp,
    coalesce,
    measure_write_bandwidth,
)
from kv_store.transfer import local as local_module

PAGE = 64  # bytes per page in these tests


@dataclass
class Pair:
    """Sender `a` with `src` registered as `src_region`; receiver `b` with `dst` as `dst_region`."""

    a: LocalTransport
    b: LocalTransport
    src: torch.Tensor  # [num_pages * PAGE] uint8, random
    dst: torch.Tensor  # [num_pages * PAGE] uint8, zeros
    src_region: MemoryRegion
    dst_region: MemoryRegion

    def op(self, src_page: int, dst_page: int, num_pages: int = 1) -> WriteOp:
        return WriteOp(self.src_region.addr + src_page * PAGE, self.dst_region.addr + dst_page * PAGE,
                       num_pages * PAGE)


def random_bytes(num_bytes: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (num_bytes,), dtype=torch.uint8, generator=gen)


def expected_after(pair: Pair, page_moves: list[tuple[int, int]]) -> torch.Tensor:
    """The receiver's buffer after copying src page s to dst page d for each (s, d)."""
    out = torch.zeros_like(pair.dst)
    for s, d in page_moves:
        out[d * PAGE:(d + 1) * PAGE] = pair.src[s * PAGE:(s + 1) * PAGE]
    return out


@pytest.fixture
def pair():
    with contextlib.ExitStack() as stack:
        a, b = LocalTransport(), LocalTransport()
        stack.callback(b.close)
        stack.callback(a.close)
        src, dst = random_bytes(16 * PAGE), torch.zeros(16 * PAGE, dtype=torch.uint8)
        src_before = src.clone()
        p = Pair(a, b, src, dst, stack.enter_context(a.register_tensor(src)),
                 stack.enter_context(b.register_tensor(dst)))
        yield p
        assert torch.equal(src, src_before), "a write modified its source"
    assert a.session_id not in local_module._PEERS and b.session_id not in local_module._PEERS


# ---- byte movement -----------------------------------------------------------------------------
def test_write_lands_byte_identical(pair):
    moves = [(0, 5), (1, 6), (2, 7), (9, 0), (15, 12)]
    handle = pair.a.write(pair.b.session_id, [pair.op(s, d) for s, d in moves])
    assert pair.a.poll(handle) is TransferStatus.DONE
    pair.a.wait(handle, timeout_s=1.0)
    assert pair.a.error(handle) is None
    assert torch.equal(pair.dst, expected_after(pair, moves))
    assert (handle.peer, handle.num_bytes, handle.num_ops) == (pair.b.session_id, 5 * PAGE, 3)


def test_write_multi_page_op(pair):
    handle = pair.a.write(pair.b.session_id, [pair.op(4, 10, num_pages=3)])
    assert pair.a.poll(handle) is TransferStatus.DONE
    assert torch.equal(pair.dst, expected_after(pair, [(4, 10), (5, 11), (6, 12)]))


def test_peers_write_both_ways(pair):
    back = torch.zeros(16 * PAGE, dtype=torch.uint8)
    with pair.a.register_tensor(back) as back_region:
        handle = pair.b.write(pair.a.session_id, [WriteOp(pair.dst_region.addr, back_region.addr, PAGE)])
        pair.b.wait(handle, timeout_s=1.0)
    assert torch.equal(back, torch.zeros_like(back))  # dst was still zeros: zeros copied
    pair.a.wait(pair.a.write(pair.b.session_id, [pair.op(3, 0)]), timeout_s=1.0)
    assert torch.equal(pair.dst[:PAGE], pair.src[3 * PAGE:4 * PAGE])


# ---- coalesce ----------------------------------------------------------------------------------
def test_coalesce_merges_runs_adjacent_on_both_sides():
    ops = [WriteOp(5 * PAGE, 13 * PAGE, PAGE), WriteOp(3 * PAGE, 10 * PAGE, PAGE), WriteOp(4 * PAGE, 11 * PAGE, PAGE)]
    assert coalesce(ops) == [WriteOp(3 * PAGE, 10 * PAGE, 2 * PAGE), WriteOp(5 * PAGE, 13 * PAGE, PAGE)]


def test_coalesce_needs_both_src_and_dst_adjacent():
    src_only = [WriteOp(0, 100, 10), WriteOp(10, 200, 10)]
    dst_only = [WriteOp(0, 100, 10), WriteOp(50, 110, 10)]
    assert coalesce(src_only) == src_only
    assert coalesce(dst_only) == dst_only
    assert coalesce([]) == []


def test_coalesce_long_run_and_mixed_lengths():
    ops = [WriteOp(0, 1000, 10), WriteOp(10, 1010, 30), WriteOp(40, 1040, 5), WriteOp(45, 2000, 5),
           WriteOp(50, 2005, 5)]
    assert coalesce(ops) == [WriteOp(0, 1000, 45), WriteOp(45, 2000, 10)]


# ---- validation copies nothing -----------------------------------------------------------------
@pytest.mark.parametrize("bad", ["src_past_end", "src_before_start", "dst_past_end", "zero_length"])
def test_invalid_op_raises_naming_op_and_copies_nothing(pair, bad):
    ops = {
        "src_past_end": pair.op(15, 0, num_pages=2),
        "src_before_start": WriteOp(pair.src_region.addr - 1, pair.dst_region.addr, PAGE),
        "dst_past_end": pair.op(0, 15, num_pages=2),
        "zero_length": WriteOp(pair.src_region.addr, pair.dst_region.addr, 0),
    }
    bad_op = ops[bad]
    with pytest.raises(TransferError, match=f"WriteOp\\(src_addr={bad_op.src_addr}, dst_addr={bad_op.dst_addr}"):
        pair.a.write(pair.b.session_id, [pair.op(1, 1), bad_op])  # a valid op first: still nothing copied
    assert torch.equal(pair.dst, torch.zeros_like(pair.dst))


def test_empty_write_raises(pair):
    with pytest.raises(TransferError, match="no ops"):
        pair.a.write(pair.b.session_id, [])


# ---- peers -------------------------------------------------------------------------------------
def test_unknown_and_closed_peer_unreachable(pair):
    with pytest.raises(PeerUnreachable, match="no-such-peer"):
        pair.a.write("no-such-peer", [pair.op(0, 0)])
    pair.b.close()
    with pytest.raises(PeerUnreachable, match=pair.b.session_id):
        pair.a.write(pair.b.session_id, [pair.op(0, 0)])
    assert torch.equal(pair.dst, torch.zeros_like(pair.dst))


def test_duplicate_session_name_rejected():
    with LocalTransport("dup-name"):
        with pytest.raises(TransferError, match="already open"):
            LocalTransport("dup-name")
    with LocalTransport("dup-name"):  # the name is free again after close
        pass


# ---- registration ------------------------------------------------------------------------------
def test_register_exit_unregisters_both_sides(pair):
    extra_src, extra_dst = random_bytes(PAGE, seed=1), torch.zeros(PAGE, dtype=torch.uint8)
    with pair.a.register_tensor(extra_src) as rs, pair.b.register_tensor(extra_dst) as rd:
        pair.a.wait(pair.a.write(pair.b.session_id, [WriteOp(rs.addr, rd.addr, PAGE)]), timeout_s=1.0)
    assert torch.equal(extra_dst, extra_src)
    extra_dst.zero_()
    with pytest.raises(TransferError, match="source .* not inside a registered local region"):
        pair.a.write(pair.b.session_id, [WriteOp(rs.addr, pair.dst_region.addr, PAGE)])
    with pytest.raises(TransferError, match="destination .* not inside a region registered by peer"):
        pair.a.write(pair.b.session_id, [WriteOp(pair.src_region.addr, rd.addr, PAGE)])
    assert torch.equal(extra_dst, torch.zeros_like(extra_dst))
    assert torch.equal(pair.dst, torch.zeros_like(pair.dst))


def test_register_rejects_overlap_bogus_and_strided(pair):
    with pytest.raises(RegistrationError, match="overlaps"):
        with pair.a.register(pair.src_region.addr + PAGE, PAGE):
            pass
    with pytest.raises(RegistrationError, match="not readable memory"):
        with pair.a.register(0x1000, 4096):
            pass
    with pytest.raises(RegistrationError, match="length > 0"):
        with pair.a.register(pair.src_region.addr, 0):
            pass
    with pytest.raises(RegistrationError, match="not contiguous"):
        with pair.a.register_tensor(torch.zeros(8, 8, dtype=torch.uint8).t()):
            pass


# ---- fault injection ---------------------------------------------------------------------------
def test_fail_next_fails_without_copying(pair):
    pair.a.fail_next(1)
    handle = pair.a.write(pair.b.session_id, [pair.op(0, 0)])
    assert pair.a.poll(handle) is TransferStatus.FAILED
    assert isinstance(pair.a.error(handle), TransferFailed)
    with pytest.raises(TransferFailed, match="injected"):
        pair.a.wait(handle, timeout_s=1.0)
    assert torch.equal(pair.dst, torch.zeros_like(pair.dst))
    ok = pair.a.write(pair.b.session_id, [pair.op(0, 0)])  # the budget was one write
    assert pair.a.poll(ok) is TransferStatus.DONE
    assert torch.equal(pair.dst, expected_after(pair, [(0, 0)]))


def test_stall_stays_pending_then_completes_on_release(pair):
    pair.a.stall_next(1)
    handle = pair.a.write(pair.b.session_id, [pair.op(2, 3)])
    assert pair.a.poll(handle) is TransferStatus.PENDING
    with pytest.raises(TimeoutError):
        pair.a.wait(handle, timeout_s=0.05)
    assert torch.equal(pair.dst, torch.zeros_like(pair.dst))
    with pytest.raises(TransferError, match="still read from it"):
        pair.a._unregister_region(pair.src_region)  # pages still in flight may not be unregistered
    assert pair.a.release_stalled() == 1
    assert pair.a.poll(handle) is TransferStatus.DONE
    assert torch.equal(pair.dst, expected_after(pair, [(2, 3)]))


def test_release_stalled_fail_and_peer_gone(pair):
    pair.a.stall_next(2)
    first = pair.a.write(pair.b.session_id, [pair.op(0, 0)])
    pair.a.release_stalled(fail=True)
    assert pair.a.poll(first) is TransferStatus.FAILED
    second = pair.a.write(pair.b.session_id, [pair.op(1, 1)])
    pair.b.close()
    pair.a.release_stalled()
    assert pair.a.poll(second) is TransferStatus.FAILED
    assert "closed while stalled" in str(pair.a.error(second))
    assert torch.equal(pair.dst, torch.zeros_like(pair.dst))


def test_close_fails_outstanding_and_is_idempotent(pair):
    pair.a.stall_next(1)
    handle = pair.a.write(pair.b.session_id, [pair.op(0, 0)])
    pair.a.close()
    pair.a.close()
    assert pair.a.poll(handle) is TransferStatus.FAILED
    assert isinstance(pair.a.error(handle), TransferFailed)
    with pytest.raises(TransferError, match="closed"):
        pair.a.write(pair.b.session_id, [pair.op(0, 0)])
    assert pair.a.release_stalled() == 0
    assert torch.equal(pair.dst, torch.zeros_like(pair.dst))


# ---- handles and statuses ----------------------------------------------------------------------
def test_retire_forgets_terminal_handles_only(pair):
    pair.a.stall_next(1)
    handle = pair.a.write(pair.b.session_id, [pair.op(0, 0)])
    with pytest.raises(TransferError, match="cannot retire pending"):
        pair.a.retire(handle)
    pair.a.release_stalled()
    pair.a.retire(handle)
    with pytest.raises(TransferError, match="unknown"):
        pair.a.poll(handle)
    with pytest.raises(TransferError, match="unknown"):
        pair.b.poll(pair.a.write(pair.b.session_id, [pair.op(0, 0)]))  # another transport's handle


def test_status_moves():
    assert TransferStatus.PENDING.to(TransferStatus.DONE) is TransferStatus.DONE
    assert TransferStatus.PENDING.to(TransferStatus.FAILED) is TransferStatus.FAILED
    for bad_from, bad_to in [(TransferStatus.DONE, TransferStatus.FAILED), (TransferStatus.FAILED,
                             TransferStatus.DONE), (TransferStatus.PENDING, TransferStatus.PENDING)]:
        with pytest.raises(TransferError, match="illegal"):
            bad_from.to(bad_to)


def test_bandwidth_probe_moves_mirrored_ops(pair):
    result = measure_write_bandwidth(pair.a, pair.b.session_id, pair.src_region.addr, pair.dst_region.addr,
                                     num_bytes=8 * PAGE, op_bytes=PAGE, repeats=2)
    assert result.num_ops == 8 and result.seconds > 0 and result.bytes_per_s > 0
    assert torch.equal(pair.dst, expected_after(pair, [(i, 7 - i) for i in range(8)]))
