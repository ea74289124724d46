"""A CPU KV pool: zeroed, each tensor its own storage, and resident only as far as it is used."""

from __future__ import annotations

import os

import torch

from kernels.kv_layout import KVCacheTensors


def resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_a_cpu_pool_is_zeroed_owns_its_storage_and_costs_memory_only_where_written():
    before = resident_bytes()
    kv = KVCacheTensors.allocate(8, 4096, 16, 4, 64, torch.float32, "cpu")  # 1 GiB of K and V
    layer_bytes = kv.k[0].numel() * 4
    assert resident_bytes() - before < layer_bytes  # nothing touched yet: not resident
    assert all(t.is_contiguous() and not t._is_view() and t.storage_offset() == 0
               and t.untyped_storage().nbytes() == layer_bytes for t in (*kv.k, *kv.v))
    ends = sorted((t.data_ptr(), t.data_ptr() + layer_bytes) for t in (*kv.k, *kv.v))
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(ends, ends[1:]))  # disjoint: registrable
    assert not any(bool(t.any()) for t in (kv.k[0], kv.v[7]))  # zeros (read back without writing)
    kv.k[3].fill_(1.0)
    assert resident_bytes() - before >= layer_bytes  # written: resident
    assert float(kv.k[2].sum()) == 0.0 and float(kv.k[4].sum()) == 0.0 and float(kv.k[3].sum()) == kv.k[3].numel()
    half = KVCacheTensors.allocate(2, 4, 16, 3, 64, torch.bfloat16, "cpu")
    assert half.k[0].dtype == torch.bfloat16 and half.k[0].shape == (4, 16, 3, 64) and not half.v[1].any()
