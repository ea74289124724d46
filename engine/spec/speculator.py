"""Speculative decoding in the engine (docs/design.md §6): who proposes tokens, and how they are verified.

`EagleSpeculator`: chain or tree drafting with an EAGLE head (`factory.py` chooses it, or
`NullSpeculator` when `engine.speculative` is off). One engine step with EAGLE, for a decoding request whose last token
is ``t`` at position ``c`` (``c = kv_committed_len``) and whose drafts ``d_1 .. d_k`` came from the step before:

    schedule  its verify row: tokens [t, d_1 .. d_k] at positions [c, c + k] (slots allocated already)
    forward   the target scores all k + 1 positions: logits [k + 1, V] and a feature per token
    verify    accept while d_i is the target's choice at its row (greedy: the argmax; sampled: the token
              the sampler would draw there, `kernels/speculative.py`). a drafts accepted -> a + 1
              tokens emitted, stop rules per token
    commit    KV of [c, c + a + 1) is valid (t and the accepted drafts); `free_tail(c + a + 1)` frees the
              pages past it (ceil-aligned: a page holding committed tokens stays)
    catch up  the head runs over every position the step committed, with the target's features
    draft     requests still decoding (and a batch of at most `speculative_max_batch`): slots for
              [c', c' + k + 1) (c' the new committed length), d_1 from the catch-up's last row, then
              k - 1 head decode steps at positions c' .. c' + k - 2

The head's row at position ``i`` is (feature ``f_i``, token ``t_{i+1}``) and writes its K/V to the
slot of position ``i`` in the engine's last KV layer, so every page move carries the draft's KV with
the target's (DESIGN §4 rule 5). Draft KV per request::

    | from target features (catch-up): valid          | this round's drafts: rewritten next round |
    0                                   kv_committed_len                              c' + k - 1

Invariant at the end of every step: every committed position's draft KV was computed from the
target's feature (the catch-up runs for requests that just finished too, before they release), so
pages the prefix tree takes, the host tier copies back, or a transfer ships hold draft KV that is
as good as if the head had run over them alone. (One caveat: the last position of a cached prefix
was computed with its writer's next token, which a request sharing the prefix may not have.)

Tree drafting (`engine.speculative_topk` w > 1): the drafts are a `DraftTree` of w nodes per level
(`draft_tree`; the head's likeliest tokens, for greedy and sampled requests alike), the verify row
scores all of them under a tree mask, verification walks the tree to the child holding the target's
choice at each row, and the accepted path's target K/V are
moved to the slots right after the last token before the commit, so the committed KV is what a chain
would have left; the catch-up reads the path's features.
"""

from __future__ import annotations

import functools
import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import accumulate
from typing import TYPE_CHECKING

import torch

from engine.request import Request, RequestStatus
from engine.spec.draft_tree import DraftTree, SlotMove, move_slots
from engine.spec.policy import AdaptivePolicy, FixedPolicy
from engine.tokens import adjusted_logits
from kernels.attention.metadata import build_attn_metadata, slot_of
from kernels.kv_layout import KVCacheTensors
from kernels.model.eagle import DraftStyle, EagleDraftHead
from kernels.sampling import filtered_probs, race_noise, sample
from kernels.speculative import row_depths, verify_chain, verify_tree

if TYPE_CHECKING:
    from engine.graphs.draft import HeadGraphs, HeadTreeGraphs
    from engine.graphs.runner import GraphRunner
    from engine.tp import LeadHead

log = logging.getLogger("tandem.engine")

DraftSlots = Callable[[Request, int], bool]
"""`Scheduler.reserve_draft_slots`: room for a request's last token and n drafts past it (False: none)."""

CATCH_UP_SPLIT_ROWS = 32
"""A catch-up with more unread rows than this writes their draft K/V alone (`EagleDraftHead.write_kv`)
and runs the whole head layer for the read rows only; fewer cost less than a second call."""


@dataclass
class SpecCounters:
    """Acceptance, for /metrics: verifies, accepted drafts per verify, and per draft position."""

    verifies: int = 0
    accepted_per_verify: Counter = field(default_factory=Counter)  # accepted drafts -> verifies
    drafted_at: Counter = field(default_factory=Counter)  # draft position (1-based) -> drafts verified
    accepted_at: Counter = field(default_factory=Counter)  # draft position -> drafts accepted
    draft_errors: int = 0

    def count(self, num_drafts: int, num_accepted: int) -> None:
        self.verifies += 1
        self.accepted_per_verify[num_accepted] += 1
        for i in range(1, num_drafts + 1):
            self.drafted_at[i] += 1
            self.accepted_at[i] += i <= num_accepted

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per verify (accepted drafts + the target's own token); 0 before any."""
        total = sum(a * n for a, n in self.accepted_per_verify.items())
        return 1 + total / self.verifies if self.verifies else 0.0


@dataclass(frozen=True)
class Committed:
    """One request's share of a step, once its tokens are emitted: KV positions [start, end) were
    committed, and their target features are rows [feature_row, feature_row + end - start) of the step."""

    req: Request
    start: int
    end: int
    feature_row: int


class EagleSpeculator:
    """Chain and tree drafting with an EAGLE head (see the module docstring). `kv`: its draft KV, one
    layer (the engine's last KV layer); `target_kv`: the target's (a tree's accepted path moves
    there); `runner`: the engine's `GraphRunner`, whose buckets the head's calls replay from (when it
    replays at all; captured here)."""

    def __init__(self, head: EagleDraftHead | LeadHead, page_size: int, device: torch.device, num_draft_tokens: int,
                 max_batch: int, policy: AdaptivePolicy | FixedPolicy | None = None, topk: int = 1,
                 tree_nodes: int = 0, kv: KVCacheTensors | None = None, target_kv: KVCacheTensors | None = None,
                 runner: GraphRunner | None = None):
        assert kv is None or kv.num_layers == 1, f"the draft head's KV is one layer, got {kv.num_layers}"
        self.head, self.page_size, self.device = head, page_size, device
        self.k, self.max_batch, self.topk = num_draft_tokens, max_batch, topk
        self.tree_nodes = tree_nodes  # nodes a tree's verify takes (0: topk x its depth)
        self.kv, self.target_kv = kv, target_kv
        self.move_kv: SlotMove = functools.partial(move_slots, target_kv)  # (src, dst) slots; a TP rank 0 sends it on
        self._paths: dict[str, list[int]] = {}  # request id -> rows of its verified tree path (row 0 first)
        self.policy = policy or FixedPolicy()
        self._step = (0, 0, 0)  # this step's (decode rows, decode tokens, verifies before it), for the policy
        self.counters = SpecCounters()
        self._last: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # request id -> (x, draft logits) of its last row
        self.graphs: HeadGraphs | None = None  # while the runner replays
        self.tree_graphs: HeadTreeGraphs | None = None  # ... and the engine drafts trees
        if runner is not None and runner.enabled:
            self._capture(runner)

    def _capture(self, runner: GraphRunner) -> None:
        """Replay the head's calls from graphs of the target's buckets (`graphs/draft.py`)."""
        from engine.graphs.draft import HeadGraphs, HeadTreeGraphs

        head, kv = self.head, self._draft_kv()
        assert isinstance(head, EagleDraftHead), "a tensor-parallel rank 0's head (LeadHead) replays no graphs"
        hidden = head.arch.layer.hidden_size
        self.graphs = HeadGraphs(head, kv, self.page_size, self.device, runner.buckets,
                                 runner.bufs.max_pages, hidden, self._dtype, runner.plan.captures)
        if runner.trees is not None:
            self.tree_graphs = HeadTreeGraphs(head, kv, self.page_size, self.device, runner.trees.buckets,
                                              runner.bufs.max_pages, hidden, self._dtype, self.topk, self.k,
                                              runner.plan.captures)

    @property
    def _dtype(self) -> torch.dtype:
        return self.head.post_attention_layernorm.weight.dtype

    # ---- across a prefill -> decode transfer ---------------------------------------------------------
    def export_feature(self, request_id: str) -> bytes:
        """The head's feature at `request_id`'s last committed position this step (float32 bytes; b""
        when it has none): a prefill worker ships it, so the decode worker drafts the first step."""
        last = self._last.get(request_id)
        return b"" if last is None else last[0].detach().float().cpu().numpy().tobytes()

    @torch.inference_mode()
    def draft_arrived(self, arrived: list[Request], running: list[Request], reserve: DraftSlots,
                      max_request_tokens: int) -> None:
        """Drafts for requests that just arrived with a prefill worker's feature (`export_feature`),
        under the same batch cutoff and policy as `draft`: their first decode step verifies too."""
        seeded = []
        for req in arrived:
            feature, req.spec.feature = req.spec.feature, b""
            if feature:
                x = torch.frombuffer(bytearray(feature), dtype=torch.float32).to(self.device, self._dtype)
                self._last[req.request_id] = (x, self.head.draft_logits(x[None])[0])
                seeded.append(req)
        if seeded and len(running) <= self.max_batch and self.policy.want_drafts(len(running)):
            self._draft(seeded, reserve, max_request_tokens)

    def begin_step(self) -> None:
        """A step starts (its time is measured from here to the end of `draft`)."""
        self.policy.begin_step()
        self._step = (0, 0, self.counters.verifies)

    # ---- verify ------------------------------------------------------------------------------------
    def verify(self, req: Request, logits: torch.Tensor) -> list[int]:
        """The tokens `req`'s verify row emits (1 .. k + 1). logits [k + 1, V] float32: the target's at
        its last token and each draft. The drafts are used up: `req` has none after this."""
        drafts, parents = req.spec.token_ids, req.spec.parents
        req.spec.clear()
        if parents is None:
            logits = adjusted_logits(req, logits, drafts)  # row j: after the output and drafts[:j]
            out = verify_chain(self._choices(req, logits, list(range(len(drafts) + 1))), drafts)
            self.counters.count(len(drafts), len(out) - 1)
            return out
        depths = row_depths(parents)
        out, path = verify_tree(self._choices(req, logits, depths), drafts, parents)
        self._move_path(req, path)
        self._paths[req.request_id] = [0, *path]
        self.counters.count(max(depths), len(out) - 1)
        return out

    @staticmethod
    def _choices(req: Request, logits: torch.Tensor, depths: list[int]) -> list[int]:
        """The target's token at each verify row (logits [rows, V]; a row at depth d chooses output
        position len(output) + d): its argmax, or for a sampled request the sampler's own draw there."""
        if req.params.greedy:
            return logits.argmax(dim=-1).tolist()
        p, n, rows = req.params, len(req.output_token_ids), len(depths)
        return sample(logits, [p.temperature] * rows, [p.top_k] * rows, [p.top_p] * rows, [req.sample_seed] * rows,
                      [n + d for d in depths], [p.min_p] * rows).tolist()

    def emitted_rows(self, req: Request, num_emitted: int) -> list[int]:
        """The rows of `req`'s last verify its tokens came from: a chain's first, a tree's accepted path."""
        return self._paths.get(req.request_id, list(range(num_emitted)))[:num_emitted]

    def _move_path(self, req: Request, path: list[int]) -> None:
        """Move the target K/V of the accepted tree rows `path` to the slots right after the last token
        (row r sits at position c + r; the m-th accepted goes to c + m + 1), so the committed KV is a chain."""
        kv = req.held_kv()
        c, moves = kv.kv_committed_len, [(row, m + 1) for m, row in enumerate(path) if row != m + 1]
        if not moves:
            return
        src, dst = ([slot_of(kv.pages, c + r, self.page_size) for r in rows] for rows in zip(*moves))
        self.move_kv(self._longs(src), self._longs(dst))

    # ---- catch up ----------------------------------------------------------------------------------
    @torch.inference_mode()
    def catch_up(self, committed: list[Committed], hidden: torch.Tensor, aux: torch.Tensor | None,
                 num_running: int) -> None:
        """Run the head over every committed position of the step: row i is (the target's feature at i,
        token i + 1). Every row writes its draft K/V. Only each request's last row is ever read, and
        only by `draft` (at most `max_batch` of `num_running` requests run) or by `export_feature` (a
        prefill just ended): with more than CATCH_UP_SPLIT_ROWS rows nothing reads, those rows write
        their K/V alone and the whole layer and the draft logits run for the read rows only. Keeps
        the last rows' (x, draft logits) for `draft`."""
        self._last.clear()
        paths, self._paths = self._paths, {}
        rows = [c for c in committed if c.end > c.start]
        if all(c.start >= len(c.req.prompt_token_ids) for c in rows):  # a decode-only step: the policy counts it
            self._step = (len(rows), sum(c.end - c.start for c in rows), self._step[2])
        if not rows:
            return
        features = hidden  # [T, h]
        if self.head.arch.style is DraftStyle.EAGLE3:
            assert aux is not None, "an EAGLE-3 head caught up without aux features: runner made without its layers?"
            features = self.head.combine(aux)
        feats = torch.cat([features[_feature_rows(c, paths.get(c.req.request_id))] for c in rows])
        ids = [t for c in rows for t in c.req.all_token_ids[c.start + 1:c.end + 1]]
        drafting = num_running <= self.max_batch
        read = [drafting or c.start < len(c.req.prompt_token_ids) for c in rows]  # each request's last row
        ends = list(accumulate(c.end - c.start for c in rows))
        lasts = [end - 1 for end, r in zip(ends, read) if r]
        if lasts and (len(ids) - len(lasts) <= CATCH_UP_SPLIT_ROWS or self._replays(len(ids))):
            x, logits = self._run(ids, feats, [c.end - c.start for c in rows], [c.end for c in rows],
                                  [c.req.held_kv().pages for c in rows])
            for i, (c, end) in enumerate(zip(rows, ends)):
                self._last[c.req.request_id] = (x[end - 1], logits[i])
            return
        positions = [p for c in rows for p in range(c.start, c.end)]  # row r's position, r indexing ids
        tables = [c.req.held_kv().pages for c in rows for _ in range(c.start, c.end)]
        unread = sorted(set(range(len(ids))) - set(lasts))
        slots = [slot_of(tables[r], positions[r], self.page_size) for r in unread]
        self.head.write_kv(self._longs([ids[r] for r in unread]), feats[unread],
                           self._longs([positions[r] for r in unread]), self._longs(slots), self._draft_kv())
        if lasts:
            readers = [c for c, r in zip(rows, read) if r]
            x, logits = self._run([ids[r] for r in lasts], feats[lasts], [1] * len(lasts), [c.end for c in readers],
                                  [c.req.held_kv().pages for c in readers])
            self._last.update((c.req.request_id, (x[i], logits[i])) for i, c in enumerate(readers))

    def _replays(self, num_rows: int) -> bool:
        """Whether a head call of `num_rows` rows replays from a CUDA graph (one launch, whatever it computes)."""
        return self.graphs is not None and self.graphs.expand and num_rows <= self.graphs.buckets[-1]

    # ---- draft -------------------------------------------------------------------------------------
    @torch.inference_mode()
    def draft(self, running: list[Request], reserve: DraftSlots, max_request_tokens: int) -> None:
        """Drafts for the next step of every request in `running` that decodes next, whose catch-up
        row ran this step, and whose draft slots can be allocated (else it decodes plainly), while at
        most `max_batch` run and the policy finds drafting pays at this batch size (`spec/policy.py`)."""
        try:
            if len(running) <= self.max_batch and self.policy.want_drafts(len(running)):
                self._draft(running, reserve, max_request_tokens)
        finally:
            rows, tokens, verifies_before = self._step
            self.policy.end_step(rows, tokens, self.counters.verifies > verifies_before)

    def _draft(self, running: list[Request], reserve: DraftSlots, max_request_tokens: int) -> None:
        """Grow every request's `DraftTree` (width `topk`; 1 is a chain) one level per head call; the
        slots for the verify (and the head rows) are allocated first."""
        trees: dict[Request, DraftTree] = {}
        for req in running:
            # a request whose logits follow its own history (penalties, min_tokens, a grammar) drafts a
            # chain: a chain's rows have one history each, a tree's rows one per path
            own = req.params.adjusts_logits or req.params.grammar is not None
            depth, width = self._chain_length(req, max_request_tokens), 1 if own else self.topk
            slots = depth * width if width == 1 else max(depth * width, self._num_nodes(depth))
            if depth and req.request_id in self._last and reserve(req, slots):
                trees[req] = DraftTree(depth, width)
        active = list(trees)
        if not active:
            return
        x = torch.stack([self._last[r.request_id][0] for r in active])  # [B, h]: one row per request
        logits = torch.stack([self._last[r.request_id][1] for r in active])  # [B, draft vocab]
        starts = list(range(len(active)))  # each request's first row in x / logits
        d = 1
        while True:
            parent_rows = self._grow(active, trees, logits, starts, d)
            keep = [i for i, r in enumerate(active) if d < trees[r].depth]
            if not keep:
                break
            active = [active[i] for i in keep]  # level d's head rows: (x of each node's parent, its token)
            ids = [t for r in active for t in trees[r].level_tokens(d)]
            feats = x[torch.tensor([row for i in keep for row in parent_rows[i]], device=x.device)]
            widths = [trees[r].width for r in active]
            kvs = [r.held_kv() for r in active]
            x, logits = self._run(ids, feats, widths, [kv.kv_committed_len + len(trees[r].frontier)
                                                       for kv, r in zip(kvs, active)],
                                  [kv.pages for kv in kvs], [trees[r].head_mask(d) for r in active], level=d)
            starts = [0, *torch.tensor(widths).cumsum(0).tolist()[:-1]]
            d += 1
        for req, tree in trees.items():
            req.spec.token_ids, req.spec.parents = tree.select(self._num_nodes(tree.depth))

    def _num_nodes(self, depth: int) -> int:
        """Nodes a tree of `depth` levels verifies: `tree_nodes`, or topk per level."""
        return self.tree_nodes or self.topk * depth

    def _grow(self, reqs: list[Request], trees: dict[Request, DraftTree], logits: torch.Tensor,
              starts: list[int], d: int) -> list[list[int]]:
        """Level d of each tree, from the rows of level d - 1 (one row at the root) starting at
        `starts[i]` of `logits`; returns, per request, the row of each new node's parent."""
        chains = [i for i, r in enumerate(reqs) if trees[r].width == 1]
        drawn = self._draw_rows([reqs[i] for i in chains], logits[[starts[i] for i in chains]], d - 1)
        parent_rows: list[list[int]] = [[starts[i]] for i in range(len(reqs))]
        for i, token in zip(chains, drawn):
            trees[reqs[i]].append(token)
        for i, req in enumerate(reqs):
            tree = trees[req]
            if tree.width > 1:
                rows = logits[starts[i]:starts[i] + (1 if d == 1 else tree.width)]
                grown = tree.grow(torch.log_softmax(rows.float(), dim=-1), self.head.to_target_ids)
                parent_rows[i] = [starts[i] + r for r in grown]
        return parent_rows

    def _chain_length(self, req: Request, max_request_tokens: int) -> int:
        """Drafts worth making for `req`: at most k, no more than its remaining tokens can use, and
        none past the context (the verify writes positions up to c + k)."""
        if req.status is not RequestStatus.RUNNING or req.num_uncomputed != 1:
            return 0
        left = min(req.params.max_tokens - len(req.output_token_ids), max_request_tokens - req.num_tokens)
        return max(0, min(self.k, left - 1))

    def _draw_rows(self, reqs: list[Request], logits: torch.Tensor, j: int) -> list[int]:
        """Draft j + 1 of each of `reqs` from the head's logits [B, draft vocab] (`_draw`); the greedy
        ones in one argmax and one device -> host copy."""
        greedy = [i for i, r in enumerate(reqs) if r.params.greedy]
        ids = dict(zip(greedy, self.head.to_target_ids(logits[greedy].argmax(-1)).tolist())) if greedy else {}
        return [ids[i] if i in ids else self._draw(r, logits[i], j) for i, r in enumerate(reqs)]

    def _draw(self, req: Request, logits: torch.Tensor, j: int) -> int:
        """Sampled draft j + 1 of `req` (a target id) from the head's logits [draft vocab]: drawn from the
        head's filtered distribution with the noise the sampler races at that output position, so it is
        the target's own draw wherever the two distributions pick the same winner."""
        head, p = self.head, req.params
        q = filtered_probs(logits.unsqueeze(0), p.temperature, p.top_k, p.top_p, p.min_p)[0]  # [draft vocab]
        noise = race_noise(req.sample_seed, len(req.output_token_ids) + j, head.arch.layer.vocab_size, logits.device)
        return int(head.to_target_ids((q / noise[head.token_map]).argmax()))

    def _longs(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=self.device)

    def _run(self, ids: list[int], features: torch.Tensor, query_lens: list[int], seq_lens: list[int],
             pages: list[list[int]], masks: list | None = None, level: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """The head over one ragged batch; logits for each sequence's last row, or with `masks` (draft
        level `level`: `DraftTree.head_mask` per sequence) for every row."""
        masked = masks is not None and any(m is not None for m in masks)
        if masks is not None and masked and self.tree_graphs is not None:
            replayed = self.tree_graphs.run(level, ids, features, seq_lens, pages, masks)
            if replayed is not None:
                return replayed
        if self.graphs is not None and not masked:
            replayed = self.graphs.run(ids, features, query_lens, seq_lens, pages)
            if replayed is not None:
                return replayed
        logits_rows = list(range(len(ids))) if masks is not None else (torch.tensor(query_lens).cumsum(0) - 1).tolist()
        meta, positions = build_attn_metadata(self.page_size, query_lens, seq_lens, pages, logits_rows, self.device,
                                              masks=masks if masked else None)
        input_ids = torch.tensor(ids, dtype=torch.int64, device=self.device)
        return self.head(input_ids, features, positions, meta, self._draft_kv())

    def _draft_kv(self) -> KVCacheTensors:
        assert self.kv is not None, "the draft head writes K/V, but this speculator was made without its layer (kv)"
        return self.kv


def _feature_rows(c: Committed, path: list[int] | None) -> slice | list[int]:
    """Rows of the step's features that `c` committed: its row's first n, or along a tree's path."""
    n = c.end - c.start
    return slice(c.feature_row, c.feature_row + n) if path is None else [c.feature_row + r for r in path[:n]]
