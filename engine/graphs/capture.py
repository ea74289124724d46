"""What every captured step shares (DESIGN §5): the batch-size buckets, the static buffers a replay
reads, and the capture itself. The graph wing's ground floor: `runner.py` (the target's decode
step), `tree.py` (tree verify rows) and `draft.py` (the draft head's calls) build on it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

import torch

from kernels.attention.metadata import AttnMetadata, slot_of

if TYPE_CHECKING:
    from torch.cuda import _POOL_HANDLE as GraphPool  # noqa: N811 - torch's type of `CUDAGraph.pool()`

    from engine.runner import ForwardRow
    from kernels.attention.base import AttentionBackend

BUCKET_STEP = 8
"""Past 8, buckets grow by this many rows (1, 2, 4, 8, 16, 24, 32, ...)."""


def batch_buckets(max_batch: int, sizes: Iterable[int] = ()) -> tuple[int, ...]:
    """The batch sizes to capture: `sizes` when given (those <= max_batch), else 1, 2, 4, 8, then every
    BUCKET_STEP up to `max_batch`; `max_batch` itself is always one."""
    chosen = [s for s in sizes if 1 <= s <= max_batch]
    if not chosen:
        chosen = [s for s in (1, 2, 4) if s < max_batch]
        chosen += range(8, max_batch, BUCKET_STEP)
    return tuple(sorted({*chosen, max_batch}))


def bucket_for(buckets: tuple[int, ...], batch: int) -> int | None:
    """The smallest bucket that holds `batch` rows, or None when none does."""
    return next((b for b in buckets if b >= batch), None)


@dataclass
class StaticBuffers:
    """What a replayed step reads: one row per batch slot, sized for the largest bucket."""

    input_ids: torch.Tensor  # [max_batch] int64
    positions: torch.Tensor  # [max_batch] int64
    seq_lens: torch.Tensor  # [max_batch] int64, KV length after this token
    slot_mapping: torch.Tensor  # [max_batch] int64, where this token's K/V go
    page_table: torch.Tensor  # [max_batch, max_pages] int64, unused entries page 0
    query_start_loc: torch.Tensor  # [max_batch + 1] int64: 0, 1, 2, ... (one token a row)
    logits_indices: torch.Tensor  # [max_batch] int64: 0, 1, 2, ...

    @classmethod
    def allocate(cls, max_batch: int, max_pages: int, device: torch.device) -> StaticBuffers:
        def zeros(*shape: int) -> torch.Tensor:
            return torch.zeros(shape, dtype=torch.int64, device=device)

        rows = torch.arange(max_batch + 1, dtype=torch.int64, device=device)
        bufs = cls(zeros(max_batch), zeros(max_batch), zeros(max_batch), zeros(max_batch), zeros(max_batch, max_pages),
                   rows, rows[:-1].clone())
        bufs.seq_lens.fill_(1)
        return bufs

    @property
    def max_pages(self) -> int:
        return self.page_table.shape[1]

    def fill(self, rows: list[ForwardRow], bucket: int, page_size: int) -> None:
        """Rows [0, len(rows)) from the batch, [len(rows), bucket) padding on scratch page 0."""
        n = len(rows)
        pad = bucket - n
        seq_lens = [r.seq_len for r in rows] + [1] * pad
        positions = [s - 1 for s in seq_lens]
        slots = [slot_of(r.pages, r.seq_len - 1, page_size) for r in rows]
        table = torch.zeros((bucket, self.max_pages), dtype=torch.int64)
        for i, r in enumerate(rows):
            table[i, :len(r.pages)] = torch.tensor(r.pages, dtype=torch.int64)
        self.input_ids[:bucket].copy_(torch.tensor([r.token_ids[0] for r in rows] + [0] * pad, dtype=torch.int64))
        self.positions[:bucket].copy_(torch.tensor(positions, dtype=torch.int64))
        self.seq_lens[:bucket].copy_(torch.tensor(seq_lens, dtype=torch.int64))
        self.slot_mapping[:bucket].copy_(torch.tensor(slots + [0] * pad, dtype=torch.int64))
        self.page_table[:bucket].copy_(table)

    def meta(self, bucket: int, page_size: int, seq_lens_cpu: tuple[int, ...]) -> AttnMetadata:
        """A step over rows [0, bucket) of the buffers (views: refilling the buffers changes it).
        `seq_lens_cpu` sizes the attention's work: the real lengths, or the capacity when captured."""
        return AttnMetadata(page_size=page_size, query_start_loc=self.query_start_loc[:bucket + 1],
                            seq_lens=self.seq_lens[:bucket], page_table=self.page_table[:bucket],
                            slot_mapping=self.slot_mapping[:bucket], logits_indices=self.logits_indices[:bucket],
                            query_lens_cpu=(1,) * bucket, seq_lens_cpu=seq_lens_cpu)


OutT = TypeVar("OutT")  # what a captured body returns: the tensors each replay writes


def capture_graph(body: Callable[[AttnMetadata], OutT], make_meta: Callable[[], AttnMetadata],
                  backend: AttentionBackend, device: torch.device,
                  pool: GraphPool | None) -> tuple[torch.cuda.CUDAGraph, OutT]:
    """(graph, its output tensors) of `body` over static buffers: two warm-up runs on a side stream,
    then the capture (in memory pool `pool`, None: a new one). `make_meta` gives a new metadata object
    each time: backends memoise plans per object, and the captured plan must be built for the
    capture (`backend.prepare_graph_decode`, outside it), not reused from the warm-up."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            body(make_meta())
    torch.cuda.current_stream().wait_stream(side)
    meta = make_meta()
    backend.prepare_graph_decode(meta)  # host-side planning stays out of the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = body(meta)
    return graph, out
