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
                    workers only ever take this shape; so does a prompt longer than every decode
                    worker's landing (`landing_tokens`): the context is never capped by a landing
    A disaggregated decode worker is chosen among those whose landing holds the prompt.

The views, the route and the knobs are `router.policy_types` (re-exported here), shared with
`router.state`, the router's memory. Imports stdlib, `common.protocol`, `router.policy_types` and
`router.state` only.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from common.protocol import WorkerRole
from router.policy_types import PolicyParams, RequestView, Route, WorkerView
from router.state import RouterState, Stage


class Policy(enum.Enum):
    ROUND_ROBIN = "round_robin"
    LEAST_LOAD = "least_load"
    CACHE_AWARE = "cache_aware"
    KV_COST = "kv_cost"


class NoWorkerAvailable(Exception):
    """No alive worker can serve the request; the message says which role is missing."""


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
    landable = tuple(w for w in pools.serving if not w.landing_tokens or len(prompt) <= w.landing_tokens)
    if (pools.shape is _RouteShape.DISAGGREGATED and landable
            and not (local_max and len(prompt) - matched <= local_max)):
        p = strategy.prefill(pools.prefill, request, state, params)
        d = strategy.decode(landable, request, state, params)
        return Route(prefill_id=p.worker.worker_id, decode_id=d.worker.worker_id,
                     matched_prefix_tokens=state.match_len(p.worker.worker_id, prompt),
                     reason=f"prefill {p.why}; decode {d.why}")
    short = ""  # prefill workers are alive: the prompt is short where it lands, or too long to land
    if pools.shape is _RouteShape.DISAGGREGATED and not landable:
        short = f" ({len(prompt)} tokens: longer than every decode worker's landing)"
    elif pools.shape is _RouteShape.DISAGGREGATED:
        short = f" ({len(prompt) - matched} uncached tokens <= {local_max})"
    return Route(prefill_id=None, decode_id=s.worker.worker_id, matched_prefix_tokens=matched,
                 reason=f"local prefill{short} {s.why}")
