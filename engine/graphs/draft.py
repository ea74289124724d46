"""The EAGLE head's forward replayed from CUDA graphs (docs/design.md §6), as the target's decode step is.

Every head call (the catch-up over committed positions, each draft step) is one decode row per
token: a sequence with q new tokens at KV length S is the q rows (token i, length S - q + 1 + i) over
its page table. The head writes every row's K/V before any row attends, so this is the causal
extend the eager call runs (the verify rows of `runner.py` use the same identity). A call
replays the smallest captured bucket that holds its rows, over `StaticBuffers` plus a feature
buffer; padding rows sit on scratch page 0. Draft logits are computed for every row (the head's
LM head is the reduced draft vocabulary) and each sequence's last row is kept.

Calls the buckets cannot hold, or whose page tables are wider than `max_model_len`, run eagerly.
No relocation gate is needed: a head call's rows are derived from the requests' pages at the call,
never before an allocation. On CPU nothing is captured; `expand` (tests) runs the same padded
buffers eagerly. With FlashInfer the head stays eager (its graph wrappers are planned per target
shape).
"""

from __future__ import annotations

import functools
import logging
import time

import torch

from engine.graphs.capture import StaticBuffers, bucket_for, capture_graph
from engine.graphs.tree import TreeBuffers
from engine.runner import ForwardRow
from kernels.attention.metadata import AttnMetadata
from kernels.kv_layout import KVCacheTensors
from kernels.model.eagle import EagleDraftHead

log = logging.getLogger("tandem.engine")


class HeadGraphs:
    """`run` replays the head for one call when a bucket holds it, else returns None (run it eagerly)."""

    def __init__(self, head: EagleDraftHead, kv: KVCacheTensors, page_size: int, device: torch.device,
                 buckets: tuple[int, ...], max_pages: int, feature_dim: int, dtype: torch.dtype, capture: bool):
        """`capture`: the engine's steps are captured CUDA graphs (`StepPlan.captures`)."""
        self.head, self.kv, self.page_size, self.buckets = head, kv, page_size, buckets
        self.bufs = StaticBuffers.allocate(buckets[-1], max_pages, device)
        self.features = torch.zeros(buckets[-1], feature_dim, dtype=dtype, device=device)
        self.replays = 0
        self.expand = False
        """Replay over the buffers (captured graphs on CUDA, the eager head over them on CPU)."""
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, tuple[torch.Tensor, torch.Tensor]]] = {}
        if capture and head.self_attn.backend.name != "flashinfer":
            self._capture_all(device)
            self.expand = True

    def run(self, ids: list[int], features: torch.Tensor, query_lens: list[int], seq_lens: list[int],
            pages: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(x [T, h], draft logits of each sequence's last row), or None when no bucket holds the call."""
        n = len(ids)
        bucket = bucket_for(self.buckets, n) if self.expand else None
        if bucket is None or any(len(p) > self.bufs.max_pages for p in pages):
            return None
        token = iter(ids)
        rows = [ForwardRow([next(token)], seq_len - q + 1 + i, table, True)
                for q, seq_len, table in zip(query_lens, seq_lens, pages) for i in range(q)]
        self.bufs.fill(rows, bucket, self.page_size)
        self.features[:n].copy_(features)
        meta = self.bufs.meta(bucket, self.page_size, tuple(r.seq_len for r in rows) + (1,) * (bucket - n))
        last = torch.tensor(query_lens).cumsum(0) - 1
        self.replays += 1
        captured = self._graphs.get(bucket)
        if captured is None:
            x, logits = self._body(bucket, meta)
        else:
            self.head.self_attn.backend.prepare_graph_decode(meta)
            graph, (x, logits) = captured
            graph.replay()
        return x[:n].clone(), logits[last.to(logits.device)]

    @torch.inference_mode()
    def _body(self, bucket: int, meta: AttnMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        return self.head(self.bufs.input_ids[:bucket], self.features[:bucket], self.bufs.positions[:bucket],
                         meta, self.kv)

    def _capture_all(self, device: torch.device) -> None:
        start_s, free_before = time.perf_counter(), torch.cuda.mem_get_info(device)[0]
        pool = None
        for bucket in reversed(self.buckets):
            self.bufs.fill([], bucket, self.page_size)  # all padding: scratch page 0
            capacity = (self.bufs.max_pages * self.page_size,) * bucket
            graph, out = capture_graph(functools.partial(self._body, bucket),
                                       functools.partial(self.bufs.meta, bucket, self.page_size, capacity),
                                       self.head.self_attn.backend, device, pool)
            self._graphs[bucket] = (graph, out)
            pool = graph.pool()
        torch.cuda.synchronize(device)
        log.info("captured draft-head graphs for batch sizes %s in %.1f s, %.0f MiB", list(self.buckets),
                 time.perf_counter() - start_s, (free_before - torch.cuda.mem_get_info(device)[0]) / 2**20)


class HeadTreeGraphs:
    """The head's tree level calls replayed per (level, bucket of requests): level d's call is w rows a
    request at the end of a window of w x d slots (`DraftTree.head_mask`), a fixed shape, so it
    replays over `tree.TreeBuffers` as the tree verify does (CUDA with Triton attention; on
    CPU `expand`, tests, runs the same buffers eagerly). Calls of another shape run eagerly."""

    def __init__(self, head: EagleDraftHead, kv: KVCacheTensors, page_size: int, device: torch.device,
                 buckets: tuple[int, ...], max_pages: int, feature_dim: int, dtype: torch.dtype, width: int,
                 depth: int, capture: bool):

        self.head, self.kv, self.page_size, self.buckets, self.width = head, kv, page_size, buckets, width
        self.levels = {d: TreeBuffers(buckets[-1], width, width * d, max_pages, device) for d in range(1, depth)}
        self.features = torch.zeros(buckets[-1] * width, feature_dim, dtype=dtype, device=device)
        self.replays = 0
        self.expand = capture and head.self_attn.backend.name == "triton"
        self._graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, tuple[torch.Tensor, torch.Tensor]]] = {}
        if self.expand:
            self._capture_all(device)

    def run(self, level: int, ids: list[int], features: torch.Tensor, seq_lens: list[int], pages: list[list[int]],
            masks: list) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(x, draft logits) of every row of level `level`'s call, or None when no graph holds it."""
        bufs, w = self.levels.get(level), self.width
        if (not self.expand or bufs is None or any(m is None or len(m.offsets) != w for m in masks)
                or any(len(p) > bufs.max_pages for p in pages)):
            return None
        bucket = bucket_for(self.buckets, len(seq_lens))
        if bucket is None:
            return None
        n = len(ids)
        bufs.fill([(ids[i * w:(i + 1) * w], s, p, m) for i, (s, p, m) in enumerate(zip(seq_lens, pages, masks))],
                  bucket, self.page_size)
        self.features[:n].copy_(features)
        meta = bufs.meta(bucket, self.page_size, tuple(seq_lens) + (bufs.width,) * (bucket - len(seq_lens)))
        self.replays += 1
        captured = self._graphs.get((level, bucket))
        if captured is None:
            x, logits = self._body(bufs, bucket, meta)
        else:
            graph, (x, logits) = captured
            graph.replay()
        return x[:n].clone(), logits[:n].clone()

    @torch.inference_mode()
    def _body(self, bufs: TreeBuffers, bucket: int, meta: AttnMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        n = bucket * self.width
        return self.head(bufs.input_ids[:n], self.features[:n], bufs.positions[:n], meta, self.kv)

    def _capture_all(self, device: torch.device) -> None:
        start_s, pool = time.perf_counter(), None
        for level, bufs in self.levels.items():
            for bucket in reversed(self.buckets):
                bufs.fill([], bucket, self.page_size)
                capacity = (bufs.max_pages * self.page_size,) * bucket
                graph, out = capture_graph(functools.partial(self._body, bufs, bucket),
                                           functools.partial(bufs.meta, bucket, self.page_size, capacity),
                                           self.head.self_attn.backend, device, pool)
                self._graphs[(level, bucket)] = (graph, out)
                pool = graph.pool()
        torch.cuda.synchronize(device)
        log.info("captured draft-head tree level graphs (levels %s, batch sizes %s) in %.1f s", list(self.levels),
                 list(self.buckets), time.perf_counter() - start_s)
