"""Tree verify steps replayed from CUDA graphs (docs/design.md §6, tree drafting).

A tree verify row cannot replay as decode rows (its nodes share slots that no per-row page table
orders), but it has a fixed shape: every full tree of an engine has the same number of nodes, so its
row is q = nodes + 1 tokens under a [q, q] tree mask. A step whose rows are all full tree rows replays
a graph per batch bucket over `TreeBuffers`: the tokens, RoPE positions, slots, page tables, lengths
and the masks themselves are device buffers, and the Triton extend kernel reads every length and
mask entry from the device, so one capture serves every tree shape and context length. Padding
requests sit on scratch page 0 and see only themselves. Only the Triton backend replays (the torch
backend sizes its extend from host lengths; FlashInfer takes no tree mask); on CPU nothing is
captured, and `expand` (tests) runs the same buffers eagerly.
"""

from __future__ import annotations

import functools
import logging
import time

import torch

from common.config import EngineConfig
from engine.graphs.capture import batch_buckets, bucket_for, capture_graph
from engine.runner import ForwardOut, ForwardRow, ModelRunner
from kernels.attention.metadata import AttnMetadata, TreeMask, slot_of
from kernels.speculative import verify_tree_mask

log = logging.getLogger("tandem.engine")


def tree_verify_rows(config: EngineConfig) -> int:
    """Tokens of a full tree verify row (nodes + the last token), 0 when the engine drafts no trees."""
    if config.speculative == "none" or config.speculative_topk == 1:
        return 0
    return (config.speculative_tree_nodes or config.speculative_topk * config.num_draft_tokens) + 1


class TreeBuffers:
    """`max_batch` sequences of q new tokens each under a tree window of `width` slots (q <= width)."""

    def __init__(self, max_batch: int, q: int, width: int, max_pages: int, device: torch.device):
        def zeros(*shape: int, dtype: torch.dtype = torch.int64) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device=device)

        self.q, self.width = q, width
        seqs = torch.arange(max_batch + 1, dtype=torch.int64, device=device)
        self.input_ids, self.positions, self.slot_mapping = (zeros(max_batch * q) for _ in range(3))
        self.seq_lens, self.page_table = zeros(max_batch), zeros(max_batch, max_pages)
        self.query_start_loc, self.logits_indices = seqs * q, torch.arange(max_batch * q, device=device)
        self.tree_mask = zeros(max_batch * q * width, dtype=torch.bool)
        self.tree_mask_start, self.tree_widths = seqs[:-1] * q * width, torch.full_like(seqs[:-1], width)

    @property
    def max_pages(self) -> int:
        return self.page_table.shape[1]

    def fill(self, seqs: list[tuple[list[int], int, list[int], TreeMask]], bucket: int, page_size: int) -> None:
        """Sequences (token ids, seq_len, pages, mask) in rows [0, len(seqs)); the rest padding on page 0."""
        q, width, pad = self.q, self.width, bucket - len(seqs)
        ids, positions, slots, masks = [], [], [], []
        table = torch.zeros((bucket, self.max_pages), dtype=torch.int64)
        for i, (tokens, seq_len, pages, mask) in enumerate(seqs):
            ids += tokens
            positions += [seq_len - width + offset for offset in mask.offsets]
            slots += [slot_of(pages, p, page_size) for p in range(seq_len - q, seq_len)]
            masks += [v for row in mask.visible for v in row]
            table[i, :len(pages)] = torch.tensor(pages, dtype=torch.int64)
        alone = [[j == width - q + i for j in range(width)] for i in range(q)]  # padding: each row sees itself
        ids += [0] * q * pad
        positions += list(range(q)) * pad
        slots += [p % page_size for p in range(width - q, width)] * pad
        masks += [v for row in alone for v in row] * pad
        n = bucket * q
        self.input_ids[:n].copy_(torch.tensor(ids, dtype=torch.int64))
        self.positions[:n].copy_(torch.tensor(positions, dtype=torch.int64))
        self.slot_mapping[:n].copy_(torch.tensor(slots, dtype=torch.int64))
        self.seq_lens[:bucket].copy_(torch.tensor([s for _, s, _, _ in seqs] + [width] * pad, dtype=torch.int64))
        self.page_table[:bucket].copy_(table)
        self.tree_mask[:n * width].copy_(torch.tensor(masks, dtype=torch.bool))

    def meta(self, bucket: int, page_size: int, seq_lens_cpu: tuple[int, ...]) -> AttnMetadata:
        """A step over sequences [0, bucket) of the buffers (views); `seq_lens_cpu` as in `StaticBuffers.meta`."""
        n = bucket * self.q
        return AttnMetadata(page_size=page_size, query_start_loc=self.query_start_loc[:bucket + 1],
                            seq_lens=self.seq_lens[:bucket], page_table=self.page_table[:bucket],
                            slot_mapping=self.slot_mapping[:n], logits_indices=self.logits_indices[:n],
                            query_lens_cpu=(self.q,) * bucket, seq_lens_cpu=seq_lens_cpu,
                            tree_mask=self.tree_mask[:n * self.width], tree_mask_start=self.tree_mask_start[:bucket],
                            tree_widths=self.tree_widths[:bucket], tree_widths_cpu=(self.width,) * bucket)


class TreeVerifyGraphs:
    """Replays steps of full tree verify rows (`takes`), one graph per bucket of requests."""

    def __init__(self, eager: ModelRunner, max_batch: int, q: int, max_pages: int, capture: bool):
        self.eager, self.q, self.page_size = eager, q, eager.page_size
        self.buckets = batch_buckets(max_batch)
        self.bufs = TreeBuffers(self.buckets[-1], q, q, max_pages, eager.device)
        self.expand = capture
        """Replay over the buffers (captured graphs on CUDA, the eager model over them on CPU)."""
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, ForwardOut]] = {}
        if capture:
            self._capture_all()

    def takes(self, rows: list[ForwardRow]) -> int | None:
        """The bucket that replays `rows`, or None: not every row is a full tree verify row, or too many."""
        if not self.expand or not all(r.draft_parents is not None and len(r.token_ids) == self.q for r in rows):
            return None
        return bucket_for(self.buckets, len(rows))

    def replay(self, rows: list[ForwardRow], bucket: int) -> ForwardOut:
        self.bufs.fill([(r.token_ids, r.seq_len, r.pages, _tree_mask(r)) for r in rows],
                       bucket, self.page_size)
        meta = self.bufs.meta(bucket, self.page_size, tuple(r.seq_len for r in rows) + (self.q,) * (bucket - len(rows)))
        n = len(rows) * self.q
        captured = self._graphs.get(bucket)
        if captured is None:
            out = self._body(bucket, meta)
            return ForwardOut(out.logits[:n], out.hidden[:n], None if out.aux is None else out.aux[:n])
        graph, out = captured
        graph.replay()
        return ForwardOut(out.logits[:n].clone(), out.hidden[:n].clone(),
                          None if out.aux is None else out.aux[:n].clone())

    @torch.inference_mode()
    def _body(self, bucket: int, meta: AttnMetadata) -> ForwardOut:
        n = bucket * self.q
        return self.eager.run_model(self.bufs.input_ids[:n], self.bufs.positions[:n], meta)

    def _capture_all(self) -> None:
        device = self.eager.device
        start_s, free_before = time.perf_counter(), torch.cuda.mem_get_info(device)[0]
        pool = None
        for bucket in reversed(self.buckets):
            self.bufs.fill([], bucket, self.page_size)
            capacity = (self.bufs.max_pages * self.page_size,) * bucket
            self._graphs[bucket] = capture_graph(functools.partial(self._body, bucket),
                                                 functools.partial(self.bufs.meta, bucket, self.page_size, capacity),
                                                 self.eager.model.backend, device, pool)
            pool = self._graphs[bucket][0].pool()
        torch.cuda.synchronize(device)
        log.info("captured tree verify graphs (%d tokens a request) for batch sizes %s in %.1f s, %.0f MiB", self.q,
                 list(self.buckets), time.perf_counter() - start_s,
                 (free_before - torch.cuda.mem_get_info(device)[0]) / 2**20)


def _tree_mask(row: ForwardRow) -> TreeMask:
    assert row.draft_parents is not None, \
        f"a chain row ({len(row.token_ids)} tokens) in a tree replay: one `TreeVerifyGraphs.takes` refused?"
    return verify_tree_mask(row.draft_parents)
