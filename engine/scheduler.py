"""Continuous batching with chunked prefill, prefix reuse and retract-on-OOM.

Every running request advances by `num_uncomputed` tokens per step — 1 while decoding, a chunk
while prefilling — so a step is one ragged forward. Policy per step:

1. Running requests, oldest first: a decode row each; a prefill chunk from the shared budget of
   `chunk_size` tokens, one more `chunk_size` for each `prefill_age_boost_s` the longest-waiting
   prompt (running or queued) has waited since the engine received it, up to `MAX_BUDGET_CHUNKS`:
   under a backlog the step grows, so prompts stop waiting behind decode steps (a longer step for
   the decoding streams while it lasts). When the pool cannot supply a page (after evicting the
   prefix cache), the newest running request is retracted: its KV is released (committed pages go
   to the prefix cache, so resuming is mostly a cache hit) and it returns to the front of the
   waiting queue.
2. Waiting requests, in arrival order, while budget, batch slots and pages last (none in a step that
   retracted): a request whose cached prefix continues below L1 (in the host tier) starts loading it
   and waits in `loading` (not holding up the queue) until the copy is done (a copy that is done
   at once, as a CPU pool's are, goes on in the same step); otherwise match the prefix cache and
   allocate the first chunk.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from common.config import EngineConfig
from engine.request import FinishReason, Request, RequestStatus
from engine.runner import ForwardRow
from engine.sessions import NullSessions, SessionManager
from kv_store.host_cache import HostCache, NullHostCache
from kv_store.kv_manager import KVManager, ReleaseReason, ReqKV

MAX_BUDGET_CHUNKS = 4
"""A step's prefill budget at most, in `chunk_size`s (the age boost's cap)."""


@dataclass
class ScheduledStep:
    """One prepared batch. `relocation_version` and `loads_in_flight` are what the device pool
    looked like when it was prepared: the CUDA-graph runner replays only if neither changed."""

    requests: list[Request] = field(default_factory=list)  # row order
    rows: list[ForwardRow] = field(default_factory=list)
    retracted: list[Request] = field(default_factory=list)
    relocation_version: int = 0
    loads_in_flight: frozenset = frozenset()

    def add(self, req: Request, num_new_tokens: int) -> None:
        self.requests.append(req)
        self.rows.append(_row(req, req.held_kv().kv_committed_len + num_new_tokens))

    def refresh_rows(self, relocation_version: int) -> None:
        """Derive the rows' page tables again from their requests: the pool relocated since."""
        self.rows = [_row(req, row.seq_len) for req, row in zip(self.requests, self.rows)]
        self.relocation_version = relocation_version


def _row(req: Request, seq_len: int) -> ForwardRow:
    """`req`'s tokens up to `seq_len`; past its last token come its drafts (a verify row)."""
    kv, drafts = req.held_kv(), req.spec.token_ids
    tokens = req.all_token_ids + drafts if drafts else req.all_token_ids
    wants_logits = seq_len == len(tokens)
    tree = tuple(req.spec.parents) if wants_logits and req.spec.parents else None
    return ForwardRow(token_ids=tokens[kv.kv_committed_len:seq_len], seq_len=seq_len, pages=list(kv.pages),
                      wants_logits=wants_logits, num_draft_tokens=len(drafts) if wants_logits else 0,
                      draft_parents=tree)


class Scheduler:
    """Owns the waiting queue, the running batch, and (through `kvm`) their KV: the only caller of
    `KVManager`'s request methods in the workers (`test_kv_owner.py`). The engine commits through it,
    the speculator reserves draft slots through it, a connector reaches it as `ConnectorKV`."""

    def __init__(self, config: EngineConfig, kvm: KVManager,
                 host_cache: HostCache | NullHostCache | None = None,
                 sessions: SessionManager | NullSessions | None = None,
                 relocation_version: Callable[[], int] = lambda: 0, kv_window: int | None = None):
        """`kv_window`: a model whose every layer has a sliding window, the widest: when pages run
        short, decoding requests' pages behind it are freed first (`_drop_behind_windows`)."""
        assert config.num_pages is not None and config.max_model_len is not None, "config not resolved"
        self.config = config
        self.kvm = kvm
        self.kv_window = kv_window
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.loading: list[Request] = []
        """Requests whose prefix is being loaded from the host tier (each holds a `tier.load_ticket`)."""
        self.host_cache = host_cache or NullHostCache()
        self.sessions = sessions or NullSessions()
        self.hit_tokens_l1 = 0
        """Prompt tokens found on device at first admission, summed (those loaded back count in L2)."""
        self.relocation_version = relocation_version
        """The device pool's relocation version now: a step records it before deriving its rows."""

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.loading)

    def schedule(self) -> ScheduledStep:
        self._poll_loads()
        step = ScheduledStep(relocation_version=self.relocation_version())
        budget = self.prefill_budget(time.monotonic())
        for req in sorted(self.running, key=lambda r: r.arrival):
            if req.status is RequestStatus.RUNNING:
                budget -= self._schedule_running(req, budget, step)
        if not step.retracted:
            self._admit_waiting(budget, step)
        return step

    def prefill_budget(self, now: float) -> int:
        """Prompt tokens this step may compute: `chunk_size`, plus one per `prefill_age_boost_s` the
        longest-waiting prompt has waited (module docstring)."""
        chunk, boost_s = self.config.chunk_size, self.config.prefill_age_boost_s
        waits = [now - r.timings["received"] for r in (*self.running, *self.waiting)
                 if r.status is RequestStatus.WAITING or r.num_uncomputed > 1]
        if not boost_s or not waits:
            return chunk
        return chunk * min(MAX_BUDGET_CHUNKS, 1 + int(max(waits) // boost_s))

    def finish(self, req: Request, reason: FinishReason) -> None:
        """End a request for any reason: its KV goes through the single release path."""
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
            self._release(req, ReleaseReason.ABORTED if reason is FinishReason.ABORT else ReleaseReason.FINISHED)
        else:
            (self.waiting if req.status is RequestStatus.WAITING else self.loading).remove(req)
            if req.session_id:
                self.sessions.abandon_turn(req.session_id, req.request_id)
        self._drop_ticket(req)
        req.finish(reason)

    def admit_loaded(self, req: Request, kv: ReqKV) -> None:
        """Join `req`, whose KV is already on device (loaded from the host tier), to the batch."""
        req.admit(kv)
        self.running.append(req)
        self.share_prompt(req)

    def share_prompt(self, req: Request) -> None:
        """Once all of a running request's prompt is in its KV, a request that asks (`share_prompt`)
        has the prompt's whole pages enter the prefix tree (as SGLang caches unfinished requests), so
        a request with the same prompt admitted while it still decodes reuses them: the sibling
        choices of `n`, which the gateway starts after choice 0's first token. Not for session turns
        (their history is the session's) nor a request that ends at its first token (a prefill
        worker's: its pages enter the tree when it ends, at once)."""
        if (not req.params.share_prompt or req.prompt_shared or req.session_id or not self.config.enable_prefix_cache
                or req.params.max_tokens <= 1 or req.held_kv().kv_committed_len < len(req.prompt_token_ids)):
            return
        req.prompt_shared = True
        self.kvm.cache_unfinished(req.held_kv(), req.prompt_token_ids)

    def detach(self, req: Request) -> None:
        """Take a RUNNING request out of the batch but keep its KV (pages still in flight);
        `release_detached` ends it later."""
        self.running.remove(req)

    def release_detached(self, req: Request, reason: FinishReason) -> None:
        assert req not in self.running, f"request {req.request_id} is still in the batch: detach it first"
        self._release(req, ReleaseReason.ABORTED if reason is FinishReason.ABORT else ReleaseReason.FINISHED)
        req.finish(reason)

    # ---- KV of requests in the batch (the engine's and the speculator's) ---------------------------
    def commit(self, req: Request, end: int) -> None:
        """`req`'s KV is valid up to `end`; the slots allocated past it (rejected drafts) are freed,
        whole pages back to the pool."""
        kv = req.held_kv()
        self.kvm.commit(kv, end)
        if kv.kv_allocated_len > end:
            self.kvm.free_tail(kv, end)
        self.share_prompt(req)

    def reserve_draft_slots(self, req: Request, num_slots: int) -> bool:
        """Slots for `req`'s next verify row: its last token and `num_slots` drafted past it. False:
        no room (it decodes plainly)."""
        kv = req.held_kv()
        return self.kvm.try_allocate(kv, max(kv.kv_allocated_len, kv.kv_committed_len + num_slots + 1))

    # ---- KV of requests outside the batch (the connector's `ConnectorKV` port) --------------------
    def open_for_load(self, request_id: str, num_tokens: int) -> ReqKV | None:
        """Device pages for `num_tokens` of KV that arrives whole (idle sessions' histories go to the
        host tier first when the pool is full); None: no room yet."""
        kv = self.kvm.try_open(request_id, num_tokens)
        while kv is None and self.sessions.offload_idle():
            kv = self.kvm.try_open(request_id, num_tokens)
        return kv

    def commit_loaded(self, kv: ReqKV, num_tokens: int) -> None:
        self.kvm.commit(kv, num_tokens)

    def release_kv(self, kv: ReqKV, reason: ReleaseReason, token_ids: list[int] | None) -> None:
        """Release KV that no request in the batch holds; with `token_ids`, its whole pages are
        offered to the prefix cache (when it is on)."""
        cache = token_ids is not None and self.config.enable_prefix_cache
        self.kvm.release(kv, reason, token_ids or [], cache=cache)

    def pin_for_transfer(self, kv: ReqKV, first_page: int, end_page: int, handle: object) -> object:
        return self.kvm.pin_for_transfer(kv, first_page, end_page, handle)

    def unpin_transfer(self, handle: object) -> list[int]:
        return self.kvm.unpin_transfer(handle)

    def lent_pages(self, kv: ReqKV) -> list[int]:
        return self.kvm.lent_pages(kv)

    # ---- running ---------------------------------------------------------------------------------
    def _schedule_running(self, req: Request, budget: int, step: ScheduledStep) -> int:
        """Allocate and add `req`'s next tokens (a decode row carries its drafts, whose slots the
        speculator allocated); returns the prefill budget used."""
        n = req.num_uncomputed
        used = 0
        if n == 1:
            n += len(req.spec.token_ids)
        elif n > 1:
            n = used = min(n, budget)
            if n == 0:
                return 0
        kv = req.held_kv()
        while not self.kvm.try_allocate(kv, max(kv.kv_allocated_len, kv.kv_committed_len + n)):
            if self._drop_behind_windows() or self.sessions.offload_idle():  # pages no token sees again, then
                continue  # an idle session's history to the host tier
            candidates = [r for r in self.running if r is req or self._retractable(r)]
            victim = max(candidates, key=lambda r: r.arrival)
            if victim is req and not self._retractable(req):
                return 0  # wait for in-flight pages to come back
            self._retract(victim, step)
            if victim is req:
                return 0
        step.add(req, n)
        return used

    def _drop_behind_windows(self) -> int:
        """Pages running requests' later tokens cannot see (a sliding window on every layer), freed;
        how many. Decoding requests only: a prefill worker ships its pages whole, and a session's
        history is its next turn's prefix. Only when pages run short: a request that dropped pages
        offers nothing more to the prefix cache. The next token, at `end`, sees from
        `end - window + 1` on (one position of margin here)."""
        if not self.kv_window:
            return 0
        window = self.kv_window
        return sum(len(self.kvm.drop_behind(r.held_kv(), r.held_kv().kv_committed_len - window)) for r in self.running
                   if r.held_kv().kv_committed_len > len(r.prompt_token_ids) and not r.session_id)

    def _retractable(self, req: Request) -> bool:
        """A request whose own pages are lent to a transfer (a prefill worker's write) cannot release
        them yet. Its cached pages never stop a retract: every write reading them pins them itself."""
        return not self.kvm.lent_pages(req.held_kv())

    def _retract(self, req: Request, step: ScheduledStep) -> None:
        self.running.remove(req)
        self._release(req, ReleaseReason.RETRACTED)
        req.retract()
        self.waiting.appendleft(req)
        step.retracted.append(req)

    def _release(self, req: Request, reason: ReleaseReason) -> None:
        """The one release of a request's KV. A session turn frees exactly its unaligned tail and
        releases the rest into the tree, where the session pins its new history."""
        kv, tokens = req.held_kv(), req.all_token_ids
        if not req.session_id:
            self.kvm.release(kv, reason, tokens, cache=self.config.enable_prefix_cache)
            return
        ps = self.config.page_size
        aligned = max(kv.cache_protected_len, kv.kv_committed_len // ps * ps)
        self.kvm.free_tail(kv, aligned)
        self.kvm.release(kv, reason, tokens, cache=True)
        self.sessions.turn_released(req.session_id, req.request_id, reason, tokens[:aligned])

    # ---- loading ---------------------------------------------------------------------------------
    def _poll_loads(self) -> None:
        """Loads that finished put their requests back in the queue, in arrival order (the engine
        polled the tier at the start of the step: once per step)."""
        for req in [r for r in self.loading if self.host_cache.ready(r.tier.ticket())]:
            self._requeue_loaded(req)

    def _requeue_loaded(self, req: Request) -> None:
        self.loading.remove(req)
        req.loaded()
        later = next((i for i, r in enumerate(self.waiting) if r.arrival > req.arrival), len(self.waiting))
        self.waiting.insert(later, req)

    def _loaded_at_once(self, req: Request) -> bool:
        """Whether `req`'s load finished as it started (a CPU pool's copies run inline, and no L3 fetch
        is awaited): then it is back in the queue, in its place, to be admitted in this step rather
        than the next (on a CPU a step is long; on CUDA the copy overlaps the step)."""
        self.host_cache.poll()
        if not self.host_cache.ready(req.tier.ticket()):
            return False
        self._requeue_loaded(req)
        return True

    def _start_loading(self, req: Request) -> bool:
        """When `req`'s cached prefix continues in the host tier, start bringing it to device and park
        `req` in `loading`; False when there is nothing (more) to load."""
        ticket = self.host_cache.start_load(req.all_token_ids, req.num_tokens - 1, fetch_l3=not req.tier.l3_checked,
                                            who=req.request_id)
        req.tier.l3_checked = True
        if ticket is None:
            return False
        self.waiting.remove(req)
        self._drop_ticket(req)
        req.start_loading(ticket)
        if req.num_retractions == 0:
            req.tier.host_hit_tokens += ticket.num_tokens
            req.tier.l3_hit_tokens += ticket.from_l3
        self.loading.append(req)
        return True

    def _yield_tickets(self, head: Request) -> bool:
        """`head` cannot be admitted: the requests queued behind it give up the loaded pages their
        tickets keep on device (they load again when their turn comes), so two half-loaded requests
        never wait for each other's pages. Whether any did (then `head` may fit next step)."""
        holders = [req for req in self.waiting if req is not head and req.tier.load_ticket is not None]
        for req in holders:
            self._drop_ticket(req)
        return bool(holders)

    def _drop_ticket(self, req: Request) -> None:
        if req.tier.load_ticket is not None:
            self.host_cache.release_ticket(req.tier.load_ticket)
            req.tier.load_ticket = None

    # ---- waiting ---------------------------------------------------------------------------------
    def _admit_waiting(self, budget: int, step: ScheduledStep) -> None:
        """First come, first served: the head of the queue waits for pages, and so does everyone
        behind it, while anything runs or loads (they free pages as they end) or while requests
        behind it just gave up loaded pages (`_yield_tickets`). Past that, the head can only be
        waiting for pages that session pins hold, and one of those sessions' next turn may be queued
        behind it: then the requests behind the head may go first (the head drops its loaded pages
        too), or that would never resolve."""
        skipped = 0  # requests at the front that cannot be admitted before something frees pages
        while len(self.waiting) > skipped and budget > 0 and len(self.running) < self.config.max_running_requests:
            req = self.waiting[skipped]
            reuse = not req.wants_prompt_logprobs  # its whole prompt is computed, for every position's logits
            if reuse and self._start_loading(req):
                self._loaded_at_once(req)  # if so, the loop comes back to it with its prefix on device
                continue
            kv = self.kvm.try_open(req.request_id, budget, req.all_token_ids, reuse)
            if kv is None and (self._drop_behind_windows() or self.sessions.offload_idle()):  # (as in running)
                continue
            if kv is None:
                if self._yield_tickets(req) or self.running or self.loading:
                    return
                self._drop_ticket(req)
                skipped += 1
                continue
            self._drop_ticket(req)  # the loaded pages are locked by the request's own match now
            cached, n = kv.cache_protected_len, kv.kv_allocated_len - kv.cache_protected_len
            del self.waiting[skipped]
            if req.num_retractions == 0:
                req.cached_tokens = cached
                self.hit_tokens_l1 += max(0, cached - req.tier.host_hit_tokens)
            req.admit(kv)
            self.running.append(req)
            step.add(req, n)
            budget -= n

    def max_request_tokens(self) -> int:
        """Tokens one request may hold at most: the context limit, and the whole pool."""
        num_pages, max_model_len = self.config.num_pages, self.config.max_model_len
        assert num_pages is not None and max_model_len is not None, "config not resolved (`EngineConfig.resolve`)"
        return min(max_model_len, (num_pages - 1) * self.config.page_size)
