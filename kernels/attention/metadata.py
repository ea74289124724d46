"""Attention metadata for one ragged step over paged KV, and the helper that builds it.

Index layout of sequence ``b`` (``q = query_len``, ``s = seq_len`` after this step)::

    positions   | already in the KV cache            | new this step (q tokens)   |
                0                               s - q                          s
    rows of T                                   [qsl[b], qsl[b+1])

The new tokens' K/V are written to ``slot_mapping`` before attention reads pages, so every
query row attends causally over positions ``[0, its own position]`` of its own sequence.

A sequence may carry a `TreeMask` (speculative tree drafting, docs/design.md §6): its last ``w``
positions (the window, ``w >= q``) hold tree nodes, and each new row sees every position before the
window but, inside it, only the positions its mask row names (its ancestors and itself). Its RoPE
positions come from the mask too (a node's depth), not from its slot::

    slots       | fully visible                | window: visible per row (mask [q, w])        |
                0                          s - w                                            s
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import accumulate

import torch


@dataclass(frozen=True)
class TreeMask:
    """Attention of one sequence's new rows inside a tree window (module docstring). ``visible[i][j]``:
    row i sees window position j (``s - w + j``); row i is at slot ``s - q + i`` and RoPE position
    ``s - w + offsets[i]``. Every row must see itself (it is its own last ancestor)."""

    visible: tuple[tuple[bool, ...], ...]  # [q][w]
    offsets: tuple[int, ...]  # [q]

    @property
    def width(self) -> int:
        return len(self.visible[0])


@dataclass(frozen=True)
class AttnMetadata:
    """A ragged batch of B sequences with T new tokens in total, over paged KV.

    Device tensors are what kernels read; the ``*_cpu`` tuples are host copies of the same
    lengths so backends can size work without a device->host sync. One object describes one
    step: build a new one per step rather than editing its tensors in place, because backends
    may memoise per-object plans (the torch backend does, keyed on identity).
    """

    page_size: int
    query_start_loc: torch.Tensor  # [B+1] int64; seq b's tokens are rows [qsl[b], qsl[b+1])
    seq_lens: torch.Tensor  # [B] int64, KV length of seq b after this step's tokens are written
    page_table: torch.Tensor  # [B, max_pages] int64, page ids in order; unused entries are 0 (scratch)
    slot_mapping: torch.Tensor  # [T] int64, page_id * page_size + offset of each new token's K/V
    logits_indices: torch.Tensor  # [num_logits] int64, rows of T whose logits are wanted
    query_lens_cpu: tuple[int, ...]  # [B] host copy of the new-token counts
    seq_lens_cpu: tuple[int, ...]  # [B] host copy of seq_lens
    tree_mask: torch.Tensor | None = None
    """Flat bool: the `TreeMask.visible` of every sequence with one, [q_b, w_b] row-major, in order."""
    tree_mask_start: torch.Tensor | None = None  # [B] int64, where seq b's mask starts in tree_mask
    tree_widths: torch.Tensor | None = None  # [B] int64, seq b's window width w_b (0: causal)
    tree_widths_cpu: tuple[int, ...] = ()
    """[B] host copy of tree_widths; () when no sequence has a tree mask."""
    decode_only: bool = field(init=False)
    """Every sequence has exactly one new token and no tree mask (a pure decode step)."""
    max_seq_len: int = field(init=False)
    """max(seq_lens_cpu), 0 for no sequences."""

    def __post_init__(self):
        # Derived once, here: a backend that reads only these two (not the tuples) gives
        # torch.compile nothing to guard on per row, so one compiled step serves every batch size.
        object.__setattr__(self, "decode_only",
                           all(q == 1 for q in self.query_lens_cpu) and not any(self.tree_widths_cpu))
        object.__setattr__(self, "max_seq_len", max(self.seq_lens_cpu, default=0))

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def num_tokens(self) -> int:
        return self.slot_mapping.shape[0]

    @property
    def query_start_loc_cpu(self) -> tuple[int, ...]:
        """[B+1] host copy of query_start_loc, derived from query_lens_cpu (no sync)."""
        return (0, *accumulate(self.query_lens_cpu))

    def tree_mask_of(self, b: int) -> torch.Tensor | None:
        """Seq b's mask as a [q_b, w_b] bool view of `tree_mask`, or None when it attends causally."""
        width = self.tree_widths_cpu[b] if self.tree_widths_cpu else 0
        if not width:
            return None
        start = sum(q * w for q, w in zip(self.query_lens_cpu[:b], self.tree_widths_cpu[:b]))
        q_len = self.query_lens_cpu[b]
        assert self.tree_mask is not None, f"seq {b} has tree width {width} but no tree_mask: not from _flat_masks?"
        return self.tree_mask[start:start + q_len * width].view(q_len, width)


def _check_lengths(
    page_size: int, query_lens: list[int], seq_lens: list[int], page_tables: list[list[int]], allow_scratch_page: bool,
    window: int | None = None,
) -> None:
    assert page_size >= 1, f"page_size={page_size} must be positive"
    assert len(query_lens) == len(seq_lens) == len(page_tables), (
        f"per-sequence lists disagree: {len(query_lens)} query_lens, {len(seq_lens)} seq_lens, "
        f"{len(page_tables)} page tables"
    )
    for b, (q_len, s_len, pages) in enumerate(zip(query_lens, seq_lens, page_tables)):
        assert 0 <= q_len <= s_len, f"seq {b}: query_len={q_len} > seq_len={s_len}: seq_len must include new tokens"
        assert len(pages) * page_size >= s_len, (
            f"seq {b}: {len(pages)} pages of {page_size} cannot hold seq_len={s_len}: pages not allocated?"
        )
        seen = 0 if window is None else max(0, s_len - q_len - window + 1) // page_size  # first page a row sees
        assert allow_scratch_page or 0 not in pages[seen: -(-s_len // page_size)], (
            f"seq {b} maps a live position to scratch page 0: {pages} (page not allocated?)"
        )


def slot_of(page_table: list[int], position: int, page_size: int) -> int:
    """The flat KV slot (page id x page_size + offset) holding `position` of a sequence over `page_table`."""
    return page_table[position // page_size] * page_size + position % page_size


def _positions_and_slots(
    page_size: int, query_lens: list[int], seq_lens: list[int], page_tables: list[list[int]],
    masks: list[TreeMask | None],
) -> tuple[list[int], list[int]]:
    positions: list[int] = []
    slots: list[int] = []
    for q_len, s_len, pages, mask in zip(query_lens, seq_lens, page_tables, masks):
        for pos in range(s_len - q_len, s_len):
            slots.append(slot_of(pages, pos, page_size))
        if mask is None:
            positions.extend(range(s_len - q_len, s_len))
        else:
            positions.extend(s_len - mask.width + offset for offset in mask.offsets)
    return positions, slots


def _check_masks(query_lens: list[int], seq_lens: list[int], masks: list[TreeMask | None]) -> None:
    assert len(masks) == len(query_lens), f"{len(masks)} tree masks for {len(query_lens)} sequences"
    for b, (q_len, s_len, mask) in enumerate(zip(query_lens, seq_lens, masks)):
        if mask is None:
            continue
        width = mask.width
        assert len(mask.visible) == len(mask.offsets) == q_len and q_len <= width <= s_len, (
            f"seq {b}: a tree mask of {len(mask.visible)} rows x {width} for {q_len} new tokens of {s_len}")
        assert all(len(row) == width and row[width - q_len + i] and not any(row[width - q_len + i + 1:])
                   for i, row in enumerate(mask.visible)), (
            f"seq {b}: every tree mask row has the window's width, sees its own slot and none after it")


def _flat_masks(query_lens: list[int], masks: list[TreeMask | None], device) -> dict:
    """The AttnMetadata tree fields for `masks` (none when no sequence has one)."""
    if not any(m is not None for m in masks):
        return {}
    widths = [0 if m is None else m.width for m in masks]
    flat = [v for m in masks if m is not None for row in m.visible for v in row]
    starts = [0, *accumulate(q * w for q, w in zip(query_lens, widths))][:-1]
    return dict(tree_mask=torch.tensor(flat, dtype=torch.bool, device=device),
                tree_mask_start=torch.tensor(starts, dtype=torch.int64, device=device),
                tree_widths=torch.tensor(widths, dtype=torch.int64, device=device), tree_widths_cpu=tuple(widths))


def build_attn_metadata(
    page_size: int,
    query_lens: list[int],
    seq_lens: list[int],
    page_tables: list[list[int]],
    logits_rows: list[int],
    device: torch.device | str,
    allow_scratch_page: bool = False,
    masks: list[TreeMask | None] | None = None,
    window: int | None = None,
) -> tuple[AttnMetadata, torch.Tensor]:
    """Build metadata and positions ``[T] int64`` for a ragged step, from host lists.

    ``page_tables[b]`` lists seq b's pages in position order and must cover ``seq_lens[b]``
    tokens; rows are padded with page 0 to the longest table. ``logits_rows`` are indices into
    the T new tokens (e.g. the last row of each sampling sequence). ``allow_scratch_page`` lets
    padding sequences (graph padding rows) live on page 0; otherwise that is a bug and asserts.
    ``masks[b]``: seq b's `TreeMask` (None: causal); None: every sequence is causal. ``window``: a
    sliding window on every layer: pages behind it may be page 0 (freed, `KVManager.drop_behind`).
    """
    _check_lengths(page_size, query_lens, seq_lens, page_tables, allow_scratch_page, window)
    masks = masks if masks is not None else [None] * len(query_lens)
    _check_masks(query_lens, seq_lens, masks)
    num_tokens = sum(query_lens)
    assert all(0 <= r < num_tokens for r in logits_rows), f"logits_rows {logits_rows} outside [0, {num_tokens})"
    positions, slots = _positions_and_slots(page_size, query_lens, seq_lens, page_tables, masks)
    max_pages = max((len(p) for p in page_tables), default=0)
    padded = [list(p) + [0] * (max_pages - len(p)) for p in page_tables]

    def as_tensor(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=device)

    meta = AttnMetadata(
        page_size=page_size,
        query_start_loc=as_tensor([0, *accumulate(query_lens)]),
        seq_lens=as_tensor(seq_lens),
        page_table=torch.tensor(padded, dtype=torch.int64, device=device).reshape(len(page_tables), max_pages),
        slot_mapping=as_tensor(slots),
        logits_indices=as_tensor(logits_rows),
        query_lens_cpu=tuple(query_lens),
        seq_lens_cpu=tuple(seq_lens),
        **_flat_masks(query_lens, masks, device),
    )
    return meta, as_tensor(positions)
