"""The routing policy: which worker prefills a request and which one decodes it (DESIGN §8).

Pure: `choose` reads plain views of the request and the workers plus a `RouterState`, and returns a
`Route`. It never mutates anything and never does I/O; the caller refreshes the worker views from
worker stats, and after acting on a route calls `state.record(request, route)` so the round-robin
turns and the approximate prefix trees evolve. A worker that dies or restarts loses its cache; the
caller then calls `state.forget_worker(worker_id)`.

Route shapes:

    disaggregated   at least one alive PREFILL and one alive DECODE worker, and more than
                    `local_prefill_max_tokens` of the prompt uncached on the decode worker the local
                    pick would take: prefill among PREFILL workers, decode among DECODE workers
    local prefill   otherwise: one alive DECODE or COLOCATED worker computes the prompt itself
                    (prefill_id None; a short uncached part: among the DECODE workers); COLOCATED
                    workers only ever take this shape

Imports stdlib, `common.config`, `common.protocol` and `router.state` (the router's memory) only.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from common.config import require
from common.protocol import WorkerRole
from router.state import DEFAULT_MAX_TREE_TOKENS, RouterState, Stage


class Policy(enum.Enum):
    ROUND_ROBIN = "round_robin"
    LEAST_LOAD = "least_load"
    CACHE_AWARE = "cache_aware"
    KV_COST = "kv_cost"


class NoWorkerAvailable(Exception):
    """No alive worker can serve the request; the message says which role is missing."""


@dataclass(frozen=True)
class RequestView:
    """What routing needs to know about one request."""

    request_id: str
    prompt_token_ids: tuple[int, ...]  # at least one token: a prefill needs something to compute
    max_tokens: int  # completion tokens at most (>= 1)

    def __post_init__(self):
        object.__setattr__(self, "prompt_token_ids", tuple(self.prompt_token_ids))
        if not self.prompt_token_ids:
            raise ValueError(f"request {self.request_id!r} has an empty prompt: the gateway should reject it")
        if self.max_tokens < 1:
            raise ValueError(f"request {self.request_id!r} has max_tokens {self.max_tokens} < 1")


@dataclass(frozen=True)
class WorkerView:
    """One worker as last reported, plus what the caller routed to it since."""

    worker_id: str
    role: WorkerRole
    alive: bool
    num_running: int
    num_waiting: int
    kv_usage: float  # device KV pages in use / usable, in [0, 1]
    pending_prefill_tokens: int = 0  # prompt tokens routed here whose prefill has not completed (caller-tracked)
    shares_l3: bool = False  # its host tier reads the cluster's L3 store: any prefix prefilled anywhere is near
    device_tokens: int = 0  # tokens its device pool holds (0: unknown, its tree is not bounded by it)
    host_tokens: int = 0  # tokens its prefix-cache host tier (L2) holds

    def __post_init__(self):
        if not isinstance(self.role, WorkerRole):
            raise ValueError(
                f"worker {self.worker_id!r} role {self.role!r} is not a WorkerRole: passed the wire string?")
        if min(self.num_running, self.num_waiting, self.pending_prefill_tokens) < 0:
            raise ValueError(f"worker {self.worker_id!r} reports a negative count: {self}")
        if not 0.0 <= self.kv_usage <= 1.0:
            raise ValueError(f"worker {self.worker_id!r} kv_usage {self.kv_usage} outside [0, 1]")


@dataclass(frozen=True)
class Route:
    """Where one request goes. `prefill_id is None` means local prefill: `decode_id` computes the prompt."""

    prefill_id: str | None
    decode_id: str
    matched_prefix_tokens: int  # prompt prefix found in the chosen prefill-capable worker's tree (0: unknown)
    reason: str  # human-readable: which rule picked these workers (for logs and debugging)

    @property
    def local_prefill(self) -> bool:
        return self.prefill_id is None


@dataclass(frozen=True)
class PolicyParams:
    """Knobs of the policies. Loads are counted in requests; prompt work in tokens."""

    cache_threshold: float = 0.5
    """cache_aware takes the best-matching worker only if matched / prompt_len >= this, in [0, 1]."""
    balance_abs_threshold: int = 8
    """Load is imbalanced when max_load - min_load > this (>= 0) AND max_load > rel * min_load;
    cache_aware then ignores the cache and picks the least loaded worker (as SGLang's router)."""
    balance_rel_threshold: float = 1.5
    """The relative half of the imbalance test (>= 1)."""
    max_tree_tokens: int = DEFAULT_MAX_TREE_TOKENS
    """Token budget of each worker's approximate prefix tree (>= 1); pass it to `RouterState`."""
    tokens_per_load_unit: int = 1024
    """Prompt tokens of pending prefill that weigh as much as one running request (>= 1): the exchange
    rate between token work and request counts in least_load and in kv_cost's local-prefill sum."""
    decode_waiting_weight: float = 2.0
    """kv_cost: a waiting request costs this many running ones on a decode worker (>= 0); it is queued
    behind the batch, usually because KV is short."""
    decode_kv_usage_weight: float = 8.0
    """kv_cost: cost, in running requests, of a decode worker's device KV being full (>= 0); scaled by
    kv_usage, since a full pool means retraction or preemption ahead."""
    host_load_cost: float = 0.1
    """What a prompt token costs a worker to load back from its own host tier instead of prefilling it
    (in [0, 1]): a prefix that the router's picture of that worker's device pool lost, but its host
    tier still holds, counts as cached at 1 - this. A memory copy, far cheaper than a forward, but
    the request waits for it."""
    l3_load_cost: float = 0.2
    """What a prompt token costs a worker that shares L3 to fetch from there instead of prefilling it
    (in [0, 1]; device hits cost 0, prefill 1), for a prefix the router routed to any worker: cache_aware
    and kv_cost count such a prefix as cached at 1 - this. On a CPU a 1k-token prefix came back from
    Redis in ~0.5 s against ~4 s to prefill it (0.12); a little dearer here for a store shared by many."""

    local_prefill_max_tokens: int | None = None
    """Conditional disaggregation: with prefill and decode workers alive, a prompt whose uncached part on
    the decode worker the policy's local pick chooses (its length less that worker's match: a
    conversation's next turn finds its history where it was decoded) is at most this many tokens is
    prefilled by that decode worker (a local-prefill route: no KV transfer, the decode worker's own
    chunked prefill) instead of by a prefill worker (>= 0; 0 or None here: every prompt goes to a
    prefill worker; `tandem serve` resolves None by the decode workers' device, cluster/serve/config.py).
    A short prefill costs the decode batch it joins less than the transfer and hand-off; a long one
    is worth a worker of its own."""

    def __post_init__(self):
        value = self.local_prefill_max_tokens
        require(value is None or (isinstance(value, int) and not isinstance(value, bool) and value >= 0),
                f"local_prefill_max_tokens must be an integer >= 0 or null, got {value!r}")
        require(0.0 <= self.cache_threshold <= 1.0, f"cache_threshold must be in [0, 1], got {self.cache_threshold}")
        require(isinstance(self.balance_abs_threshold, int) and self.balance_abs_threshold >= 0,
                 f"balance_abs_threshold must be an integer >= 0, got {self.balance_abs_threshold!r}")
        require(self.balance_rel_threshold >= 1.0,
                 f"balance_rel_threshold must be >= 1, got {self.balance_rel_threshold}")
        require(isinstance(self.max_tree_tokens, int) and self.max_tree_tokens >= 1,
                 f"max_tree_tokens must be an integer >= 1, got {self.max_tree_tokens!r}")
        require(isinstance(self.tokens_per_load_unit, int) and self.tokens_per_load_unit >= 1,
                 f"tokens_per_load_unit must be an integer >= 1, got {self.tokens_per_load_unit!r}")
        require(self.decode_waiting_weight >= 0,
                 f"decode_waiting_weight must be >= 0, got {self.decode_waiting_weight}")
        require(self.decode_kv_usage_weight >= 0,
                 f"decode_kv_usage_weight must be >= 0, got {self.decode_kv_usage_weight}")
        require(0.0 <= self.l3_load_cost <= 1.0, f"l3_load_cost must be in [0, 1], got {self.l3_load_cost}")
        require(0.0 <= self.host_load_cost <= 1.0, f"host_load_cost must be in [0, 1], got {self.host_load_cost}")



# ---- candidate pools --------------------------------------------------------------------------------


class _RouteShape(enum.Enum):
    DISAGGREGATED = "disaggregated"
    LOCAL_PREFILL = "local_prefill"


@dataclass(frozen=True)
class _Pools:
    """Alive candidates, each pool sorted by worker_id (the round-robin order and the last tie-break)."""

    shape: _RouteShape
    prefill: tuple[WorkerView, ...]  # alive PREFILL workers; empty for LOCAL_PREFILL
    serving: tuple[WorkerView, ...]  # DISAGGREGATED: alive DECODE; LOCAL_PREFILL: alive DECODE + COLOCATED


def _pools(workers: Sequence[WorkerView]) -> _Pools:
    ids = [w.worker_id for w in workers]
    if len(set(ids)) != len(ids):
        raise ValueError(f"worker ids listed twice in {sorted(ids)}: stale views merged with fresh ones?")
    alive = sorted((w for w in workers if w.alive), key=lambda w: w.worker_id)
    prefill = tuple(w for w in alive if w.role is WorkerRole.PREFILL)
    decode = tuple(w for w in alive if w.role is WorkerRole.DECODE)
    if prefill and decode:
        return _Pools(_RouteShape.DISAGGREGATED, prefill, decode)
    local = tuple(w for w in alive if w.role is not WorkerRole.PREFILL)
    if not local:
        num_dead = len(workers) - len(alive)
        raise NoWorkerAvailable(
            f"no alive decode or colocated worker ({len(prefill)} prefill alive, {num_dead} of "
            f"{len(workers)} workers dead): a prefill worker cannot decode")
    return _Pools(_RouteShape.LOCAL_PREFILL, (), local)


# ---- per-policy pickers -----------------------------------------------------------------------------


@dataclass(frozen=True)
class _Pick:
    worker: WorkerView
    why: str


_Pool = tuple[WorkerView, ...]  # alive candidates of one role, sorted by worker_id
_Picker = Callable[[_Pool, RequestView, RouterState, PolicyParams], _Pick]


def _load(w: WorkerView, params: PolicyParams) -> float:
    """least_load's load, in requests: num_running + num_waiting + pending_prefill_tokens / tokens_per_load_unit.

    The pending term covers work routed since the worker last reported; it may double count a request
    already visible in num_waiting, which errs toward spreading load."""
    return w.num_running + w.num_waiting + w.pending_prefill_tokens / params.tokens_per_load_unit


def _least_loaded(pool: _Pool, params: PolicyParams) -> WorkerView:
    return min(pool, key=lambda w: (_load(w, params), w.kv_usage, w.worker_id))


def _is_imbalanced(pool: _Pool, params: PolicyParams) -> bool:
    loads = [_load(w, params) for w in pool]
    hi, lo = max(loads), min(loads)
    return hi - lo > params.balance_abs_threshold and hi > params.balance_rel_threshold * lo


def _rr_prefill(pool: _Pool, request: RequestView, state: RouterState, params: PolicyParams) -> _Pick:
    return _Pick(pool[state.turn(Stage.PREFILL) % len(pool)], "round_robin")


def _rr_decode(pool: _Pool, request: RequestView, state: RouterState, params: PolicyParams) -> _Pick:
    return _Pick(pool[state.turn(Stage.DECODE) % len(pool)], "round_robin")


def _least_load(pool: _Pool, request: RequestView, state: RouterState, params: PolicyParams) -> _Pick:
    return _Pick(_least_loaded(pool, params), "least_load")


def _cache_aware(pool: _Pool, request: RequestView, state: RouterState, params: PolicyParams) -> _Pick:
    """Longest (effective) prefix match if it covers >= cache_threshold of the prompt and load is
    balanced; otherwise least load. Equal matches go to the less loaded worker."""
    if _is_imbalanced(pool, params):
        return _Pick(_least_loaded(pool, params), "cache_aware: load imbalanced, least load")
    prompt = request.prompt_token_ids
    matched = {w.worker_id: state.effective_match(w, prompt, params) for w in pool}
    best = min(pool, key=lambda w: (-matched[w.worker_id], _load(w, params), w.kv_usage, w.worker_id))
    hit = f"{matched[best.worker_id]:.0f}/{len(prompt)} prompt tokens cached"
    if matched[best.worker_id] / len(prompt) >= params.cache_threshold:
        return _Pick(best, f"cache_aware: {hit}")
    return _Pick(_least_loaded(pool, params), f"cache_aware: best {hit}, below threshold, least load")


def _prefill_cost_tokens(w: WorkerView, request: RequestView, state: RouterState, params: PolicyParams) -> float:
    """kv_cost's prefill cost: prompt tokens w would prefill (its L3 fetches at l3_load_cost each) +
    w.pending_prefill_tokens."""
    prompt = request.prompt_token_ids
    return len(prompt) - state.effective_match(w, prompt, params) + w.pending_prefill_tokens


def _decode_cost(w: WorkerView, params: PolicyParams) -> float:
    """kv_cost's decode cost, in running requests:
    num_running + decode_waiting_weight * num_waiting + decode_kv_usage_weight * kv_usage."""
    return w.num_running + params.decode_waiting_weight * w.num_waiting + params.decode_kv_usage_weight * w.kv_usage


def _kv_cost_prefill(pool: _Pool, request: RequestView, state: RouterState, params: PolicyParams) -> _Pick:
    best = min(pool, key=lambda w: (_prefill_cost_tokens(w, request, state, params), _load(w, params), w.kv_usage,
                                    w.worker_id))
    return _Pick(best, f"kv_cost: prefill cost {_prefill_cost_tokens(best, request, state, params):.0f} tokens")


def _kv_cost_decode(pool: _Pool, request: RequestView, state: RouterState, params: PolicyParams) -> _Pick:
    best = min(pool, key=lambda w: (_decode_cost(w, params), w.worker_id))
    return _Pick(best, f"kv_cost: decode cost {_decode_cost(best, params):.2f}")


def _kv_cost_local(pool: _Pool, request: RequestView, state: RouterState, params: PolicyParams) -> _Pick:
    """One worker does both: prefill cost + tokens_per_load_unit * decode cost, in tokens."""
    def cost(w: WorkerView) -> float:
        return _prefill_cost_tokens(w, request, state, params) + params.tokens_per_load_unit * _decode_cost(w, params)
    best = min(pool, key=lambda w: (cost(w), w.worker_id))
    return _Pick(best, f"kv_cost: local cost {cost(best):.1f} tokens")


@dataclass(frozen=True)
class _Strategy:
    prefill: _Picker  # among alive PREFILL workers (disaggregated route)
    decode: _Picker  # among alive DECODE workers (disaggregated route)
    local: _Picker  # among alive DECODE + COLOCATED workers that prefill the prompt themselves


_STRATEGIES: dict[Policy, _Strategy] = {
    Policy.ROUND_ROBIN: _Strategy(prefill=_rr_prefill, decode=_rr_decode, local=_rr_decode),
    Policy.LEAST_LOAD: _Strategy(prefill=_least_load, decode=_least_load, local=_least_load),
    Policy.CACHE_AWARE: _Strategy(prefill=_cache_aware, decode=_least_load, local=_cache_aware),
    Policy.KV_COST: _Strategy(prefill=_kv_cost_prefill, decode=_kv_cost_decode, local=_kv_cost_local),
}


def choose(policy: Policy, request: RequestView, workers: Sequence[WorkerView], state: RouterState,
           params: PolicyParams) -> Route:
    """Pick the workers for `request` under `policy`. Pure: reads `state`, mutates nothing.

    Only alive workers count; each pool is ordered by worker_id. Per policy (loads in requests):

      round_robin  prefill: PREFILL pool[prefill turn % n]; decode (or local): pool[decode turn % n]
      least_load   argmin load = num_running + num_waiting + pending_prefill_tokens / tokens_per_load_unit,
                   ties by kv_usage, then worker_id
      cache_aware  prefill-capable worker with the longest match if matched / prompt_len >=
                   cache_threshold and load is balanced, else least_load; decode: least_load
      kv_cost      prefill: argmin (prompt_len - matched) + pending_prefill_tokens  [tokens]

    matched (`RouterState.effective_match`): the worker's device match, what its host tier adds at
    (1 - host_load_cost) a token, and, for a worker that shares L3, what any worker prefilled beyond
    both at (1 - l3_load_cost) a token.
                   decode:  argmin num_running + decode_waiting_weight * num_waiting
                                   + decode_kv_usage_weight * kv_usage              [requests]
                   local:   argmin prefill cost + tokens_per_load_unit * decode cost [tokens]

    Raises NoWorkerAvailable when no alive DECODE or COLOCATED worker exists.
    """
    pools = _pools(workers)
    strategy = _STRATEGIES[policy]
    prompt = request.prompt_token_ids
    s = strategy.local(pools.serving, request, state, params)
    matched = state.match_len(s.worker.worker_id, prompt)
    local_max = params.local_prefill_max_tokens or 0  # 0: every prompt crosses, even one wholly cached
    if pools.shape is _RouteShape.DISAGGREGATED and not (local_max and len(prompt) - matched <= local_max):
        p = strategy.prefill(pools.prefill, request, state, params)
        d = strategy.decode(pools.serving, request, state, params)
        return Route(prefill_id=p.worker.worker_id, decode_id=d.worker.worker_id,
                     matched_prefix_tokens=state.match_len(p.worker.worker_id, prompt),
                     reason=f"prefill {p.why}; decode {d.why}")
    short = ""  # prefill workers are alive: what the decode worker lacks of the prompt is short
    if pools.shape is _RouteShape.DISAGGREGATED:
        short = f" ({len(prompt) - matched} uncached tokens <= {local_max})"
    return Route(prefill_id=None, decode_id=s.worker.worker_id, matched_prefix_tokens=matched,
                 reason=f"local prefill{short} {s.why}")
