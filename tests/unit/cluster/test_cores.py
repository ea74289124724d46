"""Cores that follow the work: workers on one node lend their idle threads (cluster/worker_host/cores.py)."""

from __future__ import annotations

import os

import pytest
import torch

from cluster.worker_host.cores import MAX_SLOTS, CoreShare, CoreShareSpec, ThreadFollower, core_share_path


@pytest.fixture
def path(tmp_path):
    return str(tmp_path / "cores")


def test_a_busy_worker_borrows_the_idle_workers_threads_and_only_theirs(path):
    prefill, decode = CoreShare(CoreShareSpec(path, 0), 1), CoreShare(CoreShareSpec(path, 3), 1)
    assert decode.threads(True) == 2  # the prefill worker has no compute: its core is lent
    assert prefill.threads(True) == 1  # the decode worker is busy: nothing to borrow
    assert decode.threads(True) == 1  # both busy: each its own share
    assert prefill.threads(False) == 1 and decode.threads(True) == 2  # it waits again: lent again
    third = CoreShare(CoreShareSpec(path, 7), 2)
    assert decode.threads(True) == 4  # 1 + the idle prefill's 1 + the idle third's 2
    third.close()
    assert decode.threads(True) == 2  # a worker that left lends nothing
    prefill.close(), decode.close()


def test_a_worker_whose_compile_holds_a_core_neither_lends_nor_borrows(path):
    """A decode worker compiling beside serving: the prefill worker would otherwise take its core
    for a 2-thread OpenMP region while the compile thread runs there too (a cold 1k-token prefill
    took ~4x as long then)."""
    prefill, decode = CoreShare(CoreShareSpec(path, 0), 1), CoreShare(CoreShareSpec(path, 1), 1)
    assert decode.threads(False, holds_a_core=True) == 1  # idle, compiling: keeps its share
    assert prefill.threads(True) == 1, "borrowed the core the compile runs on"
    assert decode.threads(True, holds_a_core=True) == 1  # it steps (eagerly) on its own share only
    prefill.threads(False)
    assert decode.threads(True, holds_a_core=True) == 1, "borrowed beside its own compile"
    assert decode.threads(False) == 1 and prefill.threads(True) == 2  # compiled: lent again
    assert prefill.threads(False) == 1 and decode.threads(True) == 2  # and borrows again
    prefill.close(), decode.close()


def test_the_last_worker_out_removes_the_file(path):
    a, b = CoreShare(CoreShareSpec(path, 0), 1), CoreShare(CoreShareSpec(path, 1), 1)
    a.close()
    assert os.path.exists(path)
    b.close()
    assert not os.path.exists(path)
    b.close()  # twice: harmless


def test_a_restarted_worker_takes_its_slot_back(path):
    decode, prefill = CoreShare(CoreShareSpec(path, 1), 1), CoreShare(CoreShareSpec(path, 0), 1)
    prefill.threads(True)
    del prefill  # a crash: no close, its byte stays "busy"
    assert decode.threads(True) == 1
    again = CoreShare(CoreShareSpec(path, 0), 1)  # the next incarnation starts idle in the same slot
    assert decode.threads(True) == 2
    again.close(), decode.close()


def test_bad_specs_are_refused(path):
    with pytest.raises(ValueError, match="slot"):
        CoreShareSpec(path, MAX_SLOTS)
    with pytest.raises(ValueError, match="share"):
        CoreShare(CoreShareSpec(path, 0), 0)


def test_the_file_lives_in_memory_where_there_is_shared_memory():
    assert core_share_path("abc").endswith("tandem-cores-abc")
    if os.path.isdir("/dev/shm"):
        assert core_share_path("abc").startswith("/dev/shm/")


def test_the_follower_sets_torch_threads_and_counts_steps(path):
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        follower = ThreadFollower(CoreShare(CoreShareSpec(path, 0), 1))
        other = CoreShare(CoreShareSpec(path, 1), 1)
        assert follower.before(True) == 2 and torch.get_num_threads() == 2
        assert follower.before(False) == 2  # waiting changes nothing but its byte
        other.threads(True)
        assert follower.before(True) == 1 and torch.get_num_threads() == 1
        assert follower.step_threads() == ((1, 1), (2, 1))
        follower.share.close(), other.close()
    finally:
        torch.set_num_threads(before)
