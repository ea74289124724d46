"""A stateful fuzz of the two-tier KV hierarchy (device L1 + host L2, DESIGN §5) under one EngineCore.

`TierMachine` draws a page size (1, 4, 16), a write policy (all three), `write_through_hits`, a chunk
size, an L1 of 48-96 tokens (a request may take all of it, so eviction to L2 and retraction are
routine) and an L2 of 0.5-3x that, then interleaves: new requests (fresh, or extending / forking
earlier prompts, so most share a prefix), next turns of finished conversations (prompt + output + a
new turn: the multi-turn pattern whose prefix is found on the host and loaded back), aborts of live
requests (waiting, loading or running), engine steps, forced L1 eviction and forced L2 eviction.

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

Size: NUM_EXAMPLES * STEPS_PER_EXAMPLE = 55 * 110 rule steps drawn (a run can stop short when its
draws fill Hypothesis' buffer); `test_tier_machine_covered_enough` checks that at least 5,000 ran
and that loads, retractions, aborts while loading, copy failures and timeouts and L2 evictions
happened (asserted for the default seed). 20-30 s on a shared 2-core machine (~4 ms per rule step,
most of it engine steps with debug_kv on). Knobs for bug hunts: TIER_SEED (fixed by default, so runs
repeat), TIER_EXAMPLES, TIER_NO_SHRINK=1 (skip shrinking, which can take minutes on a failure).

`test_loaded_requests_behind_the_head_do_not_deadlock_the_queue` is the minimal form of a scheduler
livelock the machine found (load tickets of queued requests locking the pages the head needed).
"""

from __future__ import annotations

import collections
import functools
import os

import pytest
import torch
from hypothesis import HealthCheck, Phase, seed, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from cluster.config import WRITE_POLICIES, SamplingParams
from kernels.kv_layout import KVCacheTensors
from kv_store.copier import CopyJob, Direction, PageCopier
from kv_store.radix_cache import TreeNode
from prefill_worker.engine.request import FinishReason, Request, RequestStatus
from prefill_worker.engine.runner import ForwardRow, ModelRunner
from tests.helpers import make_engine, tiny_models

PHASES = [Phase.explicit, Phase.generate] if os.environ.get("TIER_NO_SHRINK") else list(Phase)
NUM_EXAMPLES = int(os.environ.get("TIER_EXAMPLES", 55))
STEPS_PER_EXAMPLE = 110  # a run may stop a few short when its draws fill Hypothesis' buffer
MIN_RULE_STEPS = 5000
KV_CHECK_EVERY = 10  # rules between sampled KV comparisons
KV_NODES_PER_CHECK = 6
MAX_DRAIN_STEPS = 2000
MAX_LIVE = 10  # requests in flight at most: what a run left unfinished is drained at teardown
VERIFY_BATCH = 16  # finished requests per batched reference generate
ATOL = 1e-5
MAX_PATH_TOKENS = 1024  # the tiny Llama's positions

new_tokens = st.lists(st.integers(3, 255), min_size=1, max_size=32)
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


# ---- references ----------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
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


@functools.lru_cache(maxsize=None)
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
        self._stream = None
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
class TierMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.engine = None
        self.live: list[Request] = []
        self.finished: list[Request] = []  # ran to their end (LENGTH): multi-turn candidates
        self.unverified: list[Request] = []  # finished, output not yet compared with the reference
        self.prompts: list[list[int]] = []
        self.rules_run = 0

    @initialize(page_size=st.sampled_from([1, 4, 16]), policy=st.sampled_from(WRITE_POLICIES),
                l1_tokens=st.sampled_from([48, 64, 96]), l2_ratio=st.sampled_from([0.5, 2, 3]),
                chunk_size=st.sampled_from([4, 8, 32]), hits=st.sampled_from([1, 2]),
                copier=st.sampled_from(["manual", "manual", "thread"]))
    def build(self, page_size, policy, l1_tokens, l2_ratio, chunk_size, hits, copier):
        num_pages = 1 + l1_tokens // page_size
        self.page_size = page_size
        self.engine = make_engine(page_size=page_size, num_pages=num_pages, chunk_size=chunk_size,
                                  max_running_requests=6, host_cache_pages=max(2, int(num_pages * l2_ratio)),
                                  write_policy=policy, write_through_hits=hits)
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

    # ---- invariants --------------------------------------------------------------------------------
    @invariant()
    def kv_consistent(self):
        if self.engine is None:
            return
        self.engine.check_integrity()
        self.rules_run += 1
        if self.rules_run % KV_CHECK_EVERY == 0:
            nodes = sorted(self.engine.kvm.prefix_cache.nodes(), key=lambda n: n.id)
            self._check_kv(nodes[-KV_NODES_PER_CHECK // 2:] + nodes[:KV_NODES_PER_CHECK // 2])

    def teardown(self):
        if self.engine is None:
            return
        try:
            self._drain()
            self._verify_outputs()
            self._check_kv(list(self.engine.kvm.prefix_cache.nodes()))
            self._check_at_rest()
            self._count_coverage()
        finally:
            self.engine.close()

    # ---- helpers -----------------------------------------------------------------------------------
    def _step(self, really: bool = True) -> None:
        """One engine step (rules other than the stepping ones draw whether they take one too, so the
        engine moves on in runs where Hypothesis' swarm testing switched the stepping rules off)."""
        if not really:
            return
        self.engine.step()
        self._collect_finished()

    def _send(self, prompt: list[int], max_tokens: int) -> None:
        """Queue `prompt` cut so that it and its output fit one request's limit (the output is then
        exactly `max_tokens` long, like the reference's); nothing when MAX_LIVE requests are live."""
        if len(self.live) >= MAX_LIVE:
            return
        prompt = prompt[:self.max_request_tokens - max_tokens]
        req = self.engine.add_request(prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0))
        self.live.append(req)
        self.prompts.append(prompt)

    def _collect_finished(self) -> None:
        for req in [r for r in self.live if r.status is RequestStatus.FINISHED]:
            self.live.remove(req)
            assert req.finish_reason is FinishReason.LENGTH, f"request {req.request_id} ended {req.finish_reason}"
            self.finished.append(req)
            self.unverified.append(req)
            coverage["finished"] += 1
            coverage["finished_after_load"] += req.host_hit_tokens > 0
        if len(self.unverified) >= VERIFY_BATCH:
            self._verify_outputs()

    def _verify_outputs(self) -> None:
        """Finished requests produced what the reference produces for their prompts (batched: one
        reference generate per VERIFY_BATCH requests)."""
        reqs, self.unverified = self.unverified, []
        wants = reference_outputs(self.page_size, [(tuple(r.prompt_token_ids), r.params.max_tokens) for r in reqs])
        for req, want in zip(reqs, wants):
            assert req.output_token_ids == want, (
                f"request {req.request_id} (cached {req.cached_tokens}, from host {req.host_hit_tokens}, "
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
        copier = self.engine.host_cache.copier
        for _ in range(MAX_DRAIN_STEPS):
            if isinstance(copier, ManualCopier):
                copier.stalled, copier.fail_next = False, 0
                copier.land(len(copier.pending))  # as the copier's thread would, given time
            if not self.engine.busy():
                break
            self._step()
        assert not self.engine.busy(), (
            f"engine still busy after {MAX_DRAIN_STEPS} steps: livelock between retract, load and admit? "
            f"running {len(self.engine.scheduler.running)}, waiting {len(self.engine.scheduler.waiting)}, "
            f"loading {len(self.engine.scheduler.loading)}")
        assert not self.live, f"requests never finished: {[r.request_id for r in self.live]}"

    def _count_coverage(self) -> None:
        counters, copier = self.engine.host_cache.counters, self.engine.host_cache.copier
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


TierMachine = seed(int(os.environ.get("TIER_SEED", 20261123)))(TierMachine)
TierMachine.TestCase.settings = settings(
    max_examples=NUM_EXAMPLES, stateful_step_count=STEPS_PER_EXAMPLE, deadline=None,
    database=None, phases=PHASES, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
test_tier_machine = TierMachine.TestCase


def test_tier_machine_covered_enough():
    """Runs after the machine (file order): the runs reached every path they are meant to."""
    if coverage["steps"] == 0:
        pytest.skip("run together with test_tier_machine")
    assert coverage["steps"] >= MIN_RULE_STEPS * NUM_EXAMPLES // 55, coverage
    for key in ("finished", "finished_after_load", "retractions", "loaded_tokens", "aborted_loading",
                "aborted_running", "l2_evicted_pages", "copy_errors", "copy_timeouts"):
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
    for _ in range(100):
        if not engine.busy():
            break
        engine.step()
    engine.check_integrity()
    statuses = [r.status.value for r in turns]
    for req in turns:
        engine.abort(req.request_id)
    engine.close()
    assert statuses == ["finished", "finished"], f"after 100 steps the turns are {statuses}"
    wants = reference_outputs(4, [(tuple(r.prompt_token_ids), 2) for r in turns])
    assert [r.output_token_ids for r in turns] == wants
