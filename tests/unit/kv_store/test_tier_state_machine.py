"""A stateful fuzz of the two-tier KV hierarchy (device L1 + host L2, DESIGN §5) under one EngineCore.

`TierMachine` draws a page size (1, 4, 16), a write policy (all three), `write_through_hits`, a chunk
size, an L1 of 48-96 tokens (a request may take all of it, so eviction to L2 and retraction are
routine) and an L2 of 0.5-3x that, then interleaves: new requests (fresh, or extending / forking
earlier prompts, so most share a prefix), next turns of finished conversations (prompt + output + a
new turn: the multi-turn pattern whose prefix is found on the host and loaded back), aborts of live
requests (waiting, loading or running), engine steps, forced L1 eviction and forced L2 eviction.

Sessions (engine/sessions.py): opens (refused exactly when the session budget would be
exceeded), turns (the test's own copy of the history plus new tokens; refused past the session's
capacity), aborted turns (history unchanged), closes, and idling out (the sessions' `clock` is the
monotonic clock plus an offset the machine advances). After every rule each open idle session pins
a page-aligned prefix of its history, on device (or, offloaded for a request that needed its pages,
kept in the tree in any tier); a finished turn reused at least what was pinned
when it was queued; turn outputs are compared with the reference like every request's.

L3 (kv_store/l3), in about half the runs (a drawn prefetch policy, prefetch_min_pages 1 or 2),
against one redis-server for the module, flushed when a run starts: keys dropped, FLUSHALL, a byte
flipped in a cached prefix's stored page (then, drawn, that prefix asked for), and "restart" reads
(an earlier prompt with every unlocked L1 and L2 copy evicted, so only L3 can serve it). After every
rule the corrupt reads counted never exceed the values corrupted; the KV and output checks above
cover what L3 brought in (host-only nodes fetched from L3 are compared with a recompute too).

Copies: in two runs of three the machine drives the copier (`ManualCopier`: the real copy code on
the test's thread), so it decides when copies land, stalls them past `copy_timeout_s`, or makes them
fail; in the third the real copier thread runs them (its timing is not deterministic).

Checked after every rule: `engine.check_integrity()` (pools, tree residency vs page lists, locks,
host pool vs the nodes' host pages). Every KV_CHECK_EVERY rules on a sample of tree nodes, and at
teardown on every node: each valid copy of a node (device when on device, host when its host copy is
valid) and each running request's committed pages hold exactly (atol 1e-5) the K and V of a fresh
recompute of the whole token path (root -> node) in one forward pass. Every request that ran to its
end produced what a reference engine with no hierarchy (prefix cache off, host tier off) produces
for its prompt. At teardown: all requests drained, no page owned, host pool CACHED == the nodes'
host pages, L1 fully evicted returns every device page, L2 fully evicted every host page, and the
tree is then empty.

Size: NUM_EXAMPLES * STEPS_PER_EXAMPLE = 70 * 110 rule steps drawn (a run can stop short when its
draws fill Hypothesis' buffer); `test_tier_machine_covered_enough` checks that at least 5,000 ran
and that loads, retractions, aborts while loading, copy failures and timeouts and L2 evictions
happened, and session turns, reaps, closes, L3 hits, drops and corruptions (asserted for the
derandomized draws; a refused session turn is covered by tests/unit/engine/test_sessions.py). 20-30 s on a shared 2-core
machine (~4 ms per rule step, most of it engine steps with debug_kv on). Knobs for bug hunts: TIER_SEED (another
sequence; by default the draws are derandomized, so runs repeat whatever ran before), TIER_EXAMPLES, TIER_NO_SHRINK=1
(skip shrinking, which can take minutes on a failure).

`test_loaded_requests_behind_the_head_do_not_deadlock_the_queue` is the minimal form of a scheduler
livelock the machine found (load tickets of queued requests locking the pages the head needed).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import os
import time

import pytest
import torch
from hypothesis import HealthCheck, Phase, seed, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from common.config import WRITE_POLICIES, SamplingParams
from engine.request import FinishReason, Request, RequestStatus
from engine.runner import ForwardRow, ModelRunner
from engine.sessions import Session, SessionError, SessionState
from kernels.kv_layout import KVCacheTensors
from kv_store.copier import CopyJob, Direction, PageCopier, _StagedMove
from kv_store.l3.config import L3Config, PrefetchPolicy
from kv_store.stream_order import HostOrder
from kv_store.tree_node import TreeNode
from tests.helpers import make_engine, tiny_models
from tests.redis_server import RedisServer

PHASES = [Phase.explicit, Phase.generate] if os.environ.get("TIER_NO_SHRINK") else list(Phase)
NUM_EXAMPLES = int(os.environ.get("TIER_EXAMPLES", 70))
STEPS_PER_EXAMPLE = 110  # a run may stop a few short when its draws fill Hypothesis' buffer
MIN_RULE_STEPS = 5000
KV_CHECK_EVERY = 10  # rules between sampled KV comparisons
KV_NODES_PER_CHECK = 6
MAX_DRAIN_STEPS = 2000
STUCK_STEPS = 50  # drain steps with requests queued and nothing running or loading before sessions idle out
MAX_LIVE = 10  # requests in flight at most: what a run left unfinished is drained at teardown
VERIFY_BATCH = 16  # finished requests per batched reference generate
ATOL = 1e-5
MAX_PATH_TOKENS = 1024  # the tiny Llama's positions

L3_FLUSH_TIMEOUT_S = 5.0
L3_SETTLE_S = 0.002  # a drain's pause per step while only L3 I/O (another thread) is left

new_tokens = st.lists(st.integers(3, 255), min_size=1, max_size=32)
turn_tokens = st.lists(st.integers(3, 255), min_size=1, max_size=8)
LIVE = (RequestStatus.WAITING, RequestStatus.LOADING, RequestStatus.RUNNING)
coverage: collections.Counter = collections.Counter()  # summed over the machine's runs in this process


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    """The tiny model's ops are far too small to split: a second intra-op thread only spins against
    whatever else shares the cores (10x slower steps on a loaded 2-core machine)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


_redis: list[RedisServer] = []  # the one server of this module, started by the fixture below


@pytest.fixture(autouse=True, scope="module")
def redis_server(tmp_path_factory):
    """One real redis-server for every L3 run of the machine (flushed when a run builds its engine).
    A module fixture (not an argument): Hypothesis' state machine test case takes no fixtures."""
    server = RedisServer(tmp_path_factory.mktemp("tier-redis")).start()
    _redis.append(server)
    yield server
    _redis.remove(server)
    server.stop()


# ---- references ----------------------------------------------------------------------------------
@functools.cache
def reference_engine(page_size: int):
    """No hierarchy: prefix cache and host tier off, a roomy pool."""
    return make_engine(page_size=page_size, num_pages=1 + 4096 // page_size, enable_prefix_cache=False,
                       host_cache_pages=0, max_running_requests=VERIFY_BATCH)


_reference_outputs: dict[tuple[int, tuple[int, ...], int], list[int]] = {}


def reference_outputs(page_size: int, requests: list[tuple[tuple[int, ...], int]]) -> list[list[int]]:
    """Greedy outputs of (prompt, max_tokens) `requests` from the reference engine, generated as one
    batch (memoized)."""
    missing = list(dict.fromkeys(r for r in requests if (page_size, *r) not in _reference_outputs))
    if missing:
        params = [SamplingParams(max_tokens=n, temperature=0.0) for _, n in missing]
        done = reference_engine(page_size).generate([list(p) for p, _ in missing], params)
        for key, req in zip(missing, done):
            _reference_outputs[(page_size, *key)] = req.output_token_ids
    return [_reference_outputs[(page_size, *r)] for r in requests]


@functools.cache
def _reference_runner(page_size: int) -> ModelRunner:
    model, _, arch = tiny_models()
    kv = KVCacheTensors.allocate(arch.num_layers, 1 + MAX_PATH_TOKENS // page_size, page_size, arch.num_kv_heads,
                                 arch.head_dim, torch.float32, "cpu")
    return ModelRunner(model, kv, page_size, "cpu")


@functools.lru_cache(maxsize=4096)
def reference_kv(page_size: int, path: tuple[int, ...]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per layer K and V of `path` computed in one forward pass: [len(path), num_kv_heads, head_dim] each."""
    runner = _reference_runner(page_size)
    num_pages = -(-len(path) // page_size)
    runner.forward([ForwardRow(list(path), len(path), list(range(1, num_pages + 1)), wants_logits=True)])
    kv = runner.kv_cache
    flat = lambda t: t[1:num_pages + 1].reshape(-1, *t.shape[2:])[:len(path)].clone()  # noqa: E731
    return [flat(k) for k in kv.k], [flat(v) for v in kv.v]


def path_tokens(node: TreeNode) -> list[int]:
    chunks = []
    while node.parent is not None:
        chunks.append(node.key)
        node = node.parent
    return [t for chunk in reversed(chunks) for t in chunk]


def assert_pages_hold(kv: KVCacheTensors, pages: list[int], path: list[int], start: int, what: str) -> None:
    """`kv`'s `pages` hold the reference KV of `path[start:start + len(pages) * page_size]`."""
    ps = kv.k[0].shape[1]
    end = start + len(pages) * ps
    ref_k, ref_v = reference_kv(ps, tuple(path))
    index = torch.tensor(pages, dtype=torch.int64)
    for layer in range(len(kv.k)):
        for name, ours, ref in (("K", kv.k[layer], ref_k[layer]), ("V", kv.v[layer], ref_v[layer])):
            got = ours.index_select(0, index).reshape(-1, *ours.shape[2:])
            assert torch.allclose(got, ref[start:end], atol=ATOL, rtol=0), (
                f"{what}: layer {layer} {name} of tokens [{start}, {end}) differs from a recompute by "
                f"{(got - ref[start:end]).abs().max().item():.3g}: a copy landed on the wrong page or too late?")


# ---- a copier the machine drives ----------------------------------------------------------------
class ManualCopier(PageCopier):
    """The real copy code (`PageCopier._copy`) run on the test's thread when the machine says so:
    a job lands when `land` reaches it, or as soon as anyone waits for it (then every job queued
    before it lands first, keeping submission order) unless the copier is `stalled`: then a wait
    runs out (as if `copy_timeout_s` passed) and nothing lands. The next `fail_next` jobs to land
    fail (`job.error` set, nothing copied). Makes the interleaving of copy completions with steps a
    drawn choice instead of a race."""

    def __init__(self, device: KVCacheTensors, host: KVCacheTensors):
        self.device, self.host = device, host
        self.bytes_per_page = device.layout.page_bytes
        self._order = HostOrder()
        self._move = _StagedMove(device, host)
        self.pending: list[CopyJob] = []
        self.stalled = False
        self.timeouts = 0
        self.fail_next = 0  # jobs that will land with an error instead of copying

    def submit(self, direction: Direction, src_pages: list[int], dst_pages: list[int]) -> CopyJob:
        job = _ManualJob(direction, tuple(src_pages), tuple(dst_pages), len(src_pages) * self.bytes_per_page)
        job.copier = self
        self.pending.append(job)
        return job

    def land(self, num_jobs: int) -> None:
        for job in self.pending[:num_jobs]:
            self._land_one(job)

    def land_through(self, job: CopyJob) -> None:
        while not job.done():
            self._land_one(self.pending[0])

    def close(self, timeout_s: float = 5.0) -> None:
        self.land(len(self.pending))

    def _land_one(self, job: CopyJob) -> None:
        self.pending.remove(job)
        if self.fail_next > 0:
            self.fail_next -= 1
            job.error = RuntimeError("injected copy failure")
        else:
            self._copy(job)
        job._done.set()


class _ManualJob(CopyJob):
    copier: ManualCopier

    def wait(self, timeout_s: float) -> bool:
        if self.copier.stalled and not self.done():
            self.copier.timeouts += 1
            return False
        self.copier.land_through(self)
        return True


# ---- the machine ---------------------------------------------------------------------------------
@dataclasses.dataclass(eq=False)
class SessionModel:
    """What the test knows of one open session: its history (prompts + outputs of finished turns),
    the engine's Session object (read after a reap, to tell it was due) and the running turn."""

    state: Session
    history: list[int] = dataclasses.field(default_factory=list)
    turn: Request | None = None
    pinned_at_submit: int = 0  # the session's pinned tokens when the running turn was queued


class TierMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.engine = None
        self.redis = None  # a client of the L3 server, when this run has L3
        self.clock_offset_s = 0.0  # the sessions' clock: monotonic time + this (the idle-out rule advances it)
        self.sessions: dict[str, SessionModel] = {}
        self.num_sessions = 0
        self.l3_corruptions = 0
        self.live: list[Request] = []
        self.finished: list[Request] = []  # ran to their end (LENGTH): multi-turn candidates
        self.unverified: list[Request] = []  # finished, output not yet compared with the reference
        self.prompts: list[list[int]] = []
        self.rules_run = 0

    @initialize(page_size=st.sampled_from([1, 4, 16]), policy=st.sampled_from(WRITE_POLICIES),
                l1_tokens=st.sampled_from([48, 64, 96]), l2_ratio=st.sampled_from([0.5, 2, 3]),
                chunk_size=st.sampled_from([4, 8, 32]), hits=st.sampled_from([1, 2]),
                copier=st.sampled_from(["manual", "manual", "thread"]), session_fraction=st.sampled_from([0.5, 0.75]),
                l3=st.sampled_from([None, None, *(p.value for p in PrefetchPolicy)]),
                l3_min_pages=st.sampled_from([1, 2]))
    def build(self, page_size, policy, l1_tokens, l2_ratio, chunk_size, hits, copier, session_fraction, l3,
              l3_min_pages):
        num_pages = 1 + l1_tokens // page_size
        self.page_size = page_size
        l3_config = None
        if l3 is not None:
            server = _redis[0]
            self.redis = server.client()
            self.redis.flushall()
            l3_config = L3Config(url=server.url, prefetch_policy=l3, prefetch_min_pages=l3_min_pages,
                                 error_backoff_s=0.0, op_timeout_s=0.2)
            self.key_prefix = l3_config.key_prefix
        self.engine = make_engine(page_size=page_size, num_pages=num_pages, chunk_size=chunk_size,
                                  max_running_requests=6, host_cache_pages=max(2, int(num_pages * l2_ratio)),
                                  write_policy=policy, write_through_hits=hits, session_kv_fraction=session_fraction,
                                  l3=l3_config)
        self.engine.sessions.clock = lambda: time.monotonic() + self.clock_offset_s
        host = self.engine.host_cache
        if copier == "manual":  # the real copier's thread is idle: nothing was submitted yet
            host.copier.close()
            host.copier = ManualCopier(self.engine.kv_cache, host.kv)
        self.max_request_tokens = self.engine.max_request_tokens()

    # ---- rules -------------------------------------------------------------------------------------
    # Which earlier prompt / request a rule picks is drawn as a plain index, never from the machine's
    # lists: what is live or finished depends on the engine, and the draws must not.
    @rule(kind=st.sampled_from(["fresh", "extend", "fork", "fork"]), pick=st.integers(0, 2**16),
          cut=st.floats(0, 1), suffix=new_tokens, max_tokens=st.integers(1, 16), then_step=st.booleans())
    def add_request(self, kind, pick, cut, suffix, max_tokens, then_step):
        prompt = suffix
        if kind != "fresh" and self.prompts:
            earlier = self.prompts[pick % len(self.prompts)]
            end = len(earlier) if kind == "extend" else max(1, round(cut * len(earlier)))
            prompt = earlier[:end] + suffix
        self._send(prompt, max_tokens)
        self._step(then_step)

    @rule(pick=st.integers(0, 2**16), turn=new_tokens, max_tokens=st.integers(1, 16), then_step=st.booleans())
    def next_turn(self, pick, turn, max_tokens, then_step):
        """The multi-turn pattern: a finished conversation so far, plus a new user turn."""
        if self.finished:
            done = self.finished[pick % len(self.finished)]
            self._send(done.all_token_ids + turn, max_tokens)
        self._step(then_step)

    @rule(status=st.sampled_from(list(LIVE)), pick=st.integers(0, 2**16))
    def abort(self, status, pick):
        """Abort a live request, one in `status` when there is one."""
        candidates = [r for r in self.live if r.status is status] or self.live
        if not candidates:
            return
        req = candidates[pick % len(candidates)]
        coverage[f"aborted_{req.status.value}"] += 1
        assert self.engine.abort(req.request_id), f"live request {req.request_id} ({req.status.value}) not aborted"
        assert req.status is RequestStatus.FINISHED and req.finish_reason is FinishReason.ABORT
        self.live.remove(req)
        model = self.sessions.get(req.session_id)
        if model is not None and model.turn is req:  # an aborted turn leaves the history as it was
            model.turn = None
            assert model.state.state is SessionState.IDLE, f"session {req.session_id} still busy after its turn's abort"
            coverage["session_turns_aborted"] += 1

    @rule(pick=st.integers(0, 2**16))
    def step_then_abort_loading(self, pick):
        """One step (which may start loads), then abort a request while its prefix is loading."""
        self._step()
        loading = [r for r in self.live if r.status is RequestStatus.LOADING]
        if loading:
            self.abort(RequestStatus.LOADING, pick)

    @rule(num_jobs=st.integers(1, 4))
    def copies_land(self, num_jobs):
        copier = self.engine.host_cache.copier
        if isinstance(copier, ManualCopier):
            copier.land(num_jobs)

    @rule(num_jobs=st.integers(1, 3))
    def fail_copies(self, num_jobs):
        """The next `num_jobs` copies to land fail (a backup stays DEVICE, a load goes back to HOST)."""
        copier = self.engine.host_cache.copier
        if isinstance(copier, ManualCopier):
            copier.fail_next = num_jobs

    @rule(stalled=st.booleans())
    def stall_copier(self, stalled):
        """Copies slower than `copy_timeout_s` (every wait for one times out), or back to normal."""
        copier = self.engine.host_cache.copier
        if isinstance(copier, ManualCopier):
            copier.stalled = stalled

    @rule(num_steps=st.integers(1, 12))
    def step(self, num_steps):
        for _ in range(num_steps):
            self._step()

    @rule(max_steps=st.integers(8, 40))
    def run_a_while(self, max_steps):
        """Steps until nothing is left to do or `max_steps` ran: lets conversations finish."""
        for _ in range(max_steps):
            if not self.engine.busy():
                return
            self._step()

    @rule(num_pages=st.integers(1, 16), then_step=st.booleans())
    def evict_l1(self, num_pages, then_step):
        self.engine.kvm.prefix_cache.evict(num_pages)
        self._step(then_step)

    @rule(num_pages=st.integers(1, 4), then_step=st.booleans())
    def evict_l2(self, num_pages, then_step):
        # No public "shrink L2" call exists: this is what a backup needing host room does mid-step.
        self.engine.host_cache.evict(num_pages)
        self._step(then_step)

    # ---- sessions (engine/sessions.py) ------------------------------------------------
    @rule(share=st.sampled_from([0.3, 0.5, 1.0, 1.2]), idle_timeout_s=st.sampled_from([10.0, 30.0, 100.0]))
    def open_session(self, share, idle_timeout_s):
        """Opened unless the session budget (or one request's limit) would be exceeded: then refused."""
        manager = self.engine.sessions
        capacity_tokens = max(1, round(share * manager.budget_tokens))
        session_id = f"s{self.num_sessions}"
        self.num_sessions += 1
        fits = (manager.reserved_tokens + capacity_tokens <= manager.budget_tokens
                and capacity_tokens <= self.max_request_tokens)
        if not fits:
            with pytest.raises(SessionError):
                self.engine.open_session(session_id, capacity_tokens, idle_timeout_s)
            coverage["sessions_refused"] += 1
            return
        self.engine.open_session(session_id, capacity_tokens, idle_timeout_s)
        self.sessions[session_id] = SessionModel(manager.sessions[session_id])
        coverage["sessions_opened"] += 1

    @rule(pick=st.integers(0, 2**16), turn=turn_tokens, max_tokens=st.integers(1, 6), then_step=st.booleans())
    def session_turn(self, pick, turn, max_tokens, then_step):
        """The next turn of an idle session: its history plus new tokens. Refused (SessionError, the
        session unchanged) when the turn would exceed the session's capacity."""
        idle = [sid for sid, m in self.sessions.items() if m.turn is None]
        if idle and len(self.live) < MAX_LIVE:
            session_id = idle[pick % len(idle)]
            model = self.sessions[session_id]
            prompt = model.history + turn
            params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
            if len(prompt) + max_tokens > model.state.capacity_tokens:
                with pytest.raises(SessionError):
                    self.engine.add_request(prompt, params, session_id=session_id)
                assert model.state.state is SessionState.IDLE, f"a refused turn left session {session_id} busy"
                coverage["session_turns_refused"] += 1
            else:
                model.pinned_at_submit = model.state.pinned_tokens
                model.turn = self.engine.add_request(prompt, params, session_id=session_id)
                self.live.append(model.turn)
                self.prompts.append(prompt)
                coverage["session_turns"] += 1
        self._step(then_step)

    @rule(pick=st.integers(0, 2**16), steps_first=st.integers(0, 3))
    def abort_session_turn(self, pick, steps_first):
        """A running session turn aborted (queued, loading or mid-prefill/decode): its history stays."""
        for _ in range(steps_first):
            self._step()
        turns = [m.turn for _, m in sorted(self.sessions.items()) if m.turn is not None]
        if turns:
            req = turns[pick % len(turns)]
            self.abort(req.status, pick)  # one of this status; the turn itself when it is the only one
            self._step()

    @rule(pick=st.integers(0, 2**16))
    def close_session(self, pick):
        """Close a session (idle or in a turn: the turn then finishes as a plain request)."""
        if self.sessions:
            session_id = sorted(self.sessions)[pick % len(self.sessions)]
            assert self.engine.close_session(session_id), f"open session {session_id} not closed"
            del self.sessions[session_id]
            assert session_id not in self.engine.kvm.prefix_pins, f"closed session {session_id} still pins"
            assert not self.engine.close_session(session_id), f"session {session_id} closed twice"
            coverage["sessions_closed"] += 1

    @rule(pick=st.integers(0, 2**16))
    def session_idles_out(self, pick):
        """The sessions' clock passes an idle session's timeout; the next step reaps it."""
        idle = sorted(sid for sid, m in self.sessions.items() if m.turn is None)
        if not idle:
            return
        session_id = idle[pick % len(idle)]
        state = self.sessions[session_id].state
        self.clock_offset_s += state.last_used + state.idle_timeout_s - self.engine.sessions.clock() + 1e-3
        self._step()
        assert session_id not in self.sessions, f"session {session_id} idle past its timeout but not reaped"

    # ---- L3 (kv_store/l3): the store's faults, and prefixes only L3 can serve ----------------------------
    @rule(pick=st.integers(0, 2**16), fraction=st.sampled_from([0.1, 0.5, 1.0]))
    def l3_drop(self, pick, fraction):
        """Redis loses keys (evicted under maxmemory, expired): a prefetch of them is a miss."""
        keys = self._l3_keys()
        if keys:
            doomed = [k for i, k in enumerate(keys) if (i + pick) % round(1 / fraction) == 0] or keys[:1]
            self.redis.delete(*doomed)
            coverage["l3_dropped_keys"] += len(doomed)

    @rule()
    def l3_flush(self):
        if self.redis is not None:
            self.redis.flushall()
            coverage["l3_flushes"] += 1

    @rule(pick=st.integers(0, 2**16), byte=st.integers(0, 2**16), then_read=st.booleans(),
          max_tokens=st.integers(1, 4))
    def l3_corrupt(self, pick, byte, then_read, max_tokens):
        """One flipped byte in a stored page of a cached prefix: a read must count it corrupt and never
        use it. `then_read`: that prefix is asked for next with L1 and L2 emptied, so L3 serves it."""
        if self.redis is None:
            return
        assert self.engine.host_cache.l3.flush(L3_FLUSH_TIMEOUT_S), "L3 writes did not drain"
        nodes = sorted((n for n in self.engine.kvm.prefix_cache.nodes() if n.in_l3), key=lambda n: n.id)
        if not nodes:
            return
        node = nodes[pick % len(nodes)]
        keys = self.engine.host_cache.l3.node_keys(node)
        key = self.key_prefix + keys[byte % len(keys)]
        value = self.redis.get(key)
        if not value:
            return
        i = byte % len(value)
        self.redis.set(key, value[:i] + bytes([value[i] ^ 0xFF]) + value[i + 1:])
        self.l3_corruptions += 1
        coverage["l3_corruptions"] += 1
        if then_read:
            coverage["l3_corrupt_then_read"] += 1
            self._evict_l1_and_l2()
            self._send(path_tokens(node) + [3], max_tokens, always=True)

    @rule(pick=st.integers(0, 2**16), suffix=st.lists(st.integers(3, 255), max_size=8),
          max_tokens=st.integers(1, 8))
    def l3_only_prefix(self, pick, suffix, max_tokens):
        """As after a restart: an earlier prompt whose pages this engine wrote to L3, with L1 and L2
        emptied of every unlocked copy, so only L3 can serve it."""
        if self.redis is None or not self.prompts:
            return
        self._evict_l1_and_l2()
        self._send(self.prompts[pick % len(self.prompts)] + suffix, max_tokens)

    def _evict_l1_and_l2(self) -> None:
        """Every unlocked copy out of L1 (write-back backups land in L2, and from there go to L3), then
        out of L2: what a restarted worker has is neither, only L3."""
        engine, host = self.engine, self.engine.host_cache
        engine.kvm.prefix_cache.evict(engine.kvm.pool.usage().total)
        deadline = time.monotonic() + L3_FLUSH_TIMEOUT_S
        while time.monotonic() < deadline:  # the copier catches up (no step runs: no new load starts)
            if isinstance(host.copier, ManualCopier):
                host.copier.land(len(host.copier.pending))
            host.poll()
            if not host.busy():
                break
            time.sleep(L3_SETTLE_S)
        assert host.l3.flush(L3_FLUSH_TIMEOUT_S), "L3 writes did not drain"
        engine.kvm.prefix_cache.evict(engine.kvm.pool.usage().total)
        host.evict(host.pool.usage().total)

    # ---- invariants --------------------------------------------------------------------------------
    @invariant()
    def kv_consistent(self):
        if self.engine is None:
            return
        self.engine.check_integrity()
        self._check_sessions()
        if self.redis is not None:
            corrupt = self.engine.tier_stats().l3_corrupt
            assert corrupt <= self.l3_corruptions, (
                f"{corrupt} corrupt L3 reads but only {self.l3_corruptions} values were corrupted: a torn write?")
        self.rules_run += 1
        if self.rules_run % KV_CHECK_EVERY == 0:
            nodes = sorted(self.engine.kvm.prefix_cache.nodes(), key=lambda n: n.id)
            self._check_kv(nodes[-KV_NODES_PER_CHECK // 2:] + nodes[:KV_NODES_PER_CHECK // 2])

    def teardown(self):
        if self.engine is None:
            return
        try:
            self._drain()
            self._check_sessions()
            for session_id in list(self.sessions):  # their pins would keep the tree from emptying
                assert self.engine.close_session(session_id)
            self.sessions.clear()
            self._verify_outputs()
            self._check_kv(list(self.engine.kvm.prefix_cache.nodes()))
            self._check_at_rest()
            self._count_coverage()
        finally:
            self.engine.close()
            if self.redis is not None:
                self.redis.close()

    # ---- helpers -----------------------------------------------------------------------------------
    def _step(self, really: bool = True) -> None:
        """One engine step (rules other than the stepping ones draw whether they take one too, so the
        engine moves on in runs where Hypothesis' swarm testing switched the stepping rules off)."""
        if not really:
            return
        self.engine.step()
        self._collect_finished()
        self._collect_reaped()

    def _collect_reaped(self) -> None:
        """Sessions the step closed were idle past their timeout (by the sessions' clock)."""
        now = self.engine.sessions.clock()
        for session_id in [sid for sid in self.sessions if sid not in self.engine.sessions.sessions]:
            model = self.sessions.pop(session_id)
            assert model.turn is None and now - model.state.last_used >= model.state.idle_timeout_s, (
                f"session {session_id} closed by the engine while {'in a turn' if model.turn else 'not yet due'}")
            assert session_id not in self.engine.kvm.prefix_pins, f"reaped session {session_id} still pins"
            coverage["sessions_reaped"] += 1

    def _send(self, prompt: list[int], max_tokens: int, always: bool = False) -> None:
        """Queue `prompt` cut so that it and its output fit one request's limit (the output is then
        exactly `max_tokens` long, like the reference's); nothing when MAX_LIVE requests are live
        (unless `always`)."""
        if len(self.live) >= MAX_LIVE and not always:
            return
        prompt = prompt[:self.max_request_tokens - max_tokens]
        req = self.engine.add_request(prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0))
        self.live.append(req)
        self.prompts.append(prompt)

    def _collect_finished(self) -> None:
        for req in [r for r in self.live if r.status is RequestStatus.FINISHED]:
            self.live.remove(req)
            assert req.finish_reason is FinishReason.LENGTH, f"request {req.request_id} ended {req.finish_reason}"
            model = self.sessions.get(req.session_id)
            if model is not None and model.turn is req:
                assert req.cached_tokens >= model.pinned_at_submit, (
                    f"turn {req.request_id} of session {req.session_id} reused {req.cached_tokens} tokens, but "
                    f"{model.pinned_at_submit} were pinned on device when it was queued")
                model.history, model.turn = req.all_token_ids, None
                coverage["session_turns_finished"] += 1
            self.finished.append(req)
            self.unverified.append(req)
            coverage["finished"] += 1
            coverage["finished_after_load"] += req.tier.host_hit_tokens > 0
        if len(self.unverified) >= VERIFY_BATCH:
            self._verify_outputs()

    def _verify_outputs(self) -> None:
        """Finished requests produced what the reference produces for their prompts (batched: one
        reference generate per VERIFY_BATCH requests)."""
        reqs, self.unverified = self.unverified, []
        wants = reference_outputs(self.page_size, [(tuple(r.prompt_token_ids), r.params.max_tokens) for r in reqs])
        for req, want in zip(reqs, wants):
            assert req.output_token_ids == want, (
                f"request {req.request_id} (cached {req.cached_tokens}, from host {req.tier.host_hit_tokens}, "
                f"retracted {req.num_retractions}x) generated {req.output_token_ids}, reference {want}")

    def _check_kv(self, nodes: list[TreeNode]) -> None:
        engine, ps = self.engine, self.page_size
        for node in nodes:
            path = path_tokens(node)
            start = len(path) - len(node.key)
            if node.residency.on_device:
                assert_pages_hold(engine.kv_cache, node.pages, path, start, f"device copy of tree node {node.id}")
            if node.residency.on_host:
                assert_pages_hold(engine.host_cache.kv, node.host_pages, path, start,
                                  f"host copy of tree node {node.id}")
            coverage["kv_nodes_checked"] += 1
        for req in engine.scheduler.running:
            committed = req.kv.kv_committed_len // ps * ps
            if committed:
                assert_pages_hold(engine.kv_cache, req.kv.pages[:committed // ps], req.all_token_ids[:committed], 0,
                                  f"committed pages of running request {req.request_id}")

    def _drain(self) -> None:
        copier, scheduler = self.engine.host_cache.copier, self.engine.scheduler
        stuck = 0
        for _ in range(MAX_DRAIN_STEPS):
            if isinstance(copier, ManualCopier):
                copier.stalled, copier.fail_next = False, 0
                copier.land(len(copier.pending))  # as the copier's thread would, given time
            if not self.engine.busy():
                break
            if self.engine.host_cache.l3.busy() and not self.engine.scheduler.running:
                time.sleep(L3_SETTLE_S)  # a prefetch on the L3 threads: give them the core
            stuck = stuck + 1 if scheduler.waiting and not (scheduler.running or scheduler.loading) else 0
            if stuck == STUCK_STEPS:  # the queue waits for pages idle sessions pin: let their timeouts pass
                idle = [m.state for m in self.sessions.values() if m.turn is None]
                if idle:
                    self.clock_offset_s += (max(s.last_used + s.idle_timeout_s for s in idle)
                                            - self.engine.sessions.clock() + 1e-3)
            self._step()
        assert not self.engine.busy(), (
            f"engine still busy after {MAX_DRAIN_STEPS} steps: livelock between retract, load and admit? "
            f"running {len(self.engine.scheduler.running)}, waiting {len(self.engine.scheduler.waiting)}, "
            f"loading {len(self.engine.scheduler.loading)}")
        assert not self.live, f"requests never finished: {[r.request_id for r in self.live]}"

    def _check_sessions(self) -> None:
        """Every open idle session pins exactly a page-aligned prefix of its history, on device."""
        engine, ps = self.engine, self.page_size
        assert set(engine.sessions.sessions) == set(self.sessions), (
            f"engine sessions {sorted(engine.sessions.sessions)}, the test's {sorted(self.sessions)}")
        for session_id, model in self.sessions.items():
            state = model.state
            assert state.pinned_tokens % ps == 0, f"session {session_id} pins {state.pinned_tokens} tokens"
            if model.turn is not None:
                continue
            assert state.state is SessionState.IDLE, f"session {session_id} {state.state} with no turn running"
            assert state.pinned_tokens <= max(len(model.history) - 1, 0), (
                f"session {session_id} pins {state.pinned_tokens} tokens of a {len(model.history)}-token history")
            if not state.pinned_tokens:
                assert session_id not in engine.kvm.prefix_pins and session_id not in engine.kvm.offloaded_pins
                continue
            if engine.sessions.is_offloaded(session_id):  # let go to the host tier for a request that needed pages
                node = engine.kvm.offloaded_pins[session_id]
                assert session_id not in engine.kvm.prefix_pins and engine.kvm.prefix_cache.holds(node), (
                    f"offloaded session {session_id}'s history left the tree (node {node.id} {node.residency})")
                assert path_tokens(node) == model.history[:state.pinned_tokens], (
                    f"session {session_id}'s offloaded path is not its history")
                coverage["sessions_offloaded_checked"] += 1
                continue
            node = engine.kvm.prefix_pins[session_id]
            pages = engine.kvm.prefix_cache.path_pages(node)
            assert len(pages) * ps == state.pinned_tokens and node.residency.on_device, (
                f"session {session_id} pins {state.pinned_tokens} tokens but its pinned path holds {len(pages)} "
                f"device pages (node {node.id} {node.residency})")
            assert path_tokens(node) == model.history[:state.pinned_tokens], (
                f"session {session_id}'s pinned path is not its history")

    def _l3_keys(self) -> list[bytes]:
        if self.redis is None:
            return []
        return sorted(self.redis.keys(self.key_prefix + "*"))

    def _count_coverage(self) -> None:
        counters, copier = self.engine.host_cache.counters, self.engine.host_cache.copier
        if self.redis is not None:
            stats = self.engine.tier_stats()
            coverage.update(l3_runs=1, l3_hit_tokens=stats.hit_tokens_l3, l3_corrupt_reads=stats.l3_corrupt,
                            l3_put_pages=stats.l3_put_pages, l3_errors=stats.l3_errors)
            coverage.update({f"l3_prefetch_{outcome}": n for outcome, n in stats.prefetches})
        coverage.update(steps=self.rules_run, retractions=self.engine.num_retractions,
                        loaded_tokens=counters.l2_hit_tokens, l1_evicted_pages=counters.l1_evicted_pages,
                        l2_evicted_pages=counters.l2_evicted_pages, copy_errors=counters.copy_errors,
                        copy_timeouts=getattr(copier, "timeouts", 0))

    def _check_at_rest(self) -> None:
        engine = self.engine
        tree, device, host = engine.kvm.prefix_cache, engine.kvm.pool, engine.host_cache
        engine.check_integrity()
        assert not engine.kvm.live and device.usage().private == 0 and device.usage().in_flight == 0, (
            f"device pages still owned after every request ended: {device.usage()}")
        host_usage = host.pool.usage()
        listed = sum(len(n.host_pages) for n in tree.nodes())
        assert host_usage.cached == listed and host_usage.in_flight == 0 and host_usage.private == 0, (
            f"host pool {host_usage} but tree nodes list {listed} host pages: a copy leaked?")
        assert all(n.lock_ref == 0 for n in tree.nodes()), "a tree node is still locked with nothing running"
        tree.evict(device.usage().total)
        assert device.num_free == device.usage().total, f"L1 fully evicted but the device pool is {device.usage()}"
        host.evict(host_usage.total)
        assert host.pool.num_free == host_usage.total, f"L2 fully evicted but the host pool is {host.pool.usage()}"
        assert not list(tree.nodes()), "both tiers empty but the tree still has nodes"
        engine.check_integrity()


# Derandomized by default: the draws then depend on nothing outside this test (a seed alone did not
# survive other tests running first in the same process); TIER_SEED picks another sequence for bug hunts.
if "TIER_SEED" in os.environ:
    TierMachine = seed(int(os.environ["TIER_SEED"]))(TierMachine)
TierMachine.TestCase.settings = settings(
    max_examples=NUM_EXAMPLES, stateful_step_count=STEPS_PER_EXAMPLE, deadline=None,
    derandomize="TIER_SEED" not in os.environ, database=None, phases=PHASES,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
test_tier_machine = TierMachine.TestCase


def test_tier_machine_covered_enough():
    """Runs after the machine (file order): the runs reached every path they are meant to."""
    if coverage["steps"] == 0:
        pytest.skip("run together with test_tier_machine")
    assert coverage["steps"] >= MIN_RULE_STEPS * NUM_EXAMPLES // 70, coverage
    # Only paths every run reaches by a wide margin: the rest (copy timeouts, L3 drops, flushes and
    # corruptions, refusals) depend on how the copier thread is scheduled (a CI run drew none of the
    # corruptions a local run drew), and have deterministic tests of their own (test_l3_tier.py,
    # test_sessions.py, tests/integration/test_l3_cluster.py).
    for key in ("finished", "finished_after_load", "retractions", "loaded_tokens", "l2_evicted_pages",
                "sessions_opened", "session_turns", "session_turns_finished", "sessions_closed",
                "sessions_reaped", "l3_runs", "l3_put_pages"):
        assert coverage[key] > 0, (key, coverage)


# ---- bugs the machine found (minimal reproductions) ------------------------------------------------
def test_loaded_requests_behind_the_head_do_not_deadlock_the_queue():
    """Two conversations go to L2; their next turns both start loading in one step and come back to
    `waiting` holding their tickets. The first needs its chunk's pages beyond its loaded prefix; the
    only other device pages are the second's loaded prefix, locked by the second's ticket, while the
    second waits behind the first. Before the fix (2789d4a) no step ever admitted either."""
    engine = make_engine(page_size=4, num_pages=17, chunk_size=64, host_cache_pages=33)
    first, second = [10 + i for i in range(24)], [100 + i for i in range(24)]  # 6 pages each
    engine.generate([first, second], SamplingParams(max_tokens=1, temperature=0.0))
    while engine.busy():
        engine.step()
    engine.kvm.prefix_cache.evict(16)  # both conversations now only on the host (write_through)
    params = SamplingParams(max_tokens=2, temperature=0.0)
    turns = [engine.add_request(first + [200 + i for i in range(20)], params),
             engine.add_request(second + [201 + i for i in range(20)], params)]  # 11 pages each, 16 in L1
    deadline = time.monotonic() + 60  # steps of an idle engine are fast: bound by time, not by count
    while engine.busy() and time.monotonic() < deadline and any(r.status.value != "finished" for r in turns):
        engine.step()
    engine.check_integrity()
    statuses = [r.status.value for r in turns]
    for req in turns:
        engine.abort(req.request_id)
    engine.close()
    assert statuses == ["finished", "finished"], f"after 60 s the turns are {statuses}"
    wants = reference_outputs(4, [(tuple(r.prompt_token_ids), 2) for r in turns])
    assert [r.output_token_ids for r in turns] == wants
