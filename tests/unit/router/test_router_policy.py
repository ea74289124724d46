"""router.policy and router.prefix_tree: pure routing decisions over plain views, and the approximate
prefix tree that cache_aware and kv_cost read."""

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from common.config import ConfigError
from router.policy import (
    NoWorkerAvailable,
    Policy,
    RouterState,
    WorkerRole,
    choose,
)
from router.policy_types import PolicyParams, RequestView, Route, WorkerView
from router.prefix_tree import ApproxPrefixTree

PARAMS = PolicyParams()


def make_workers(prefill: int = 2, decode: int = 1, colocated: int = 0, dead: tuple[str, ...] = (),
                 **overrides: dict) -> list[WorkerView]:
    """Idle alive workers p0.., d0.., c0..; `dead` ids are not alive; `p1=dict(num_running=3)` overrides fields."""
    roles = [("p", WorkerRole.PREFILL, prefill), ("d", WorkerRole.DECODE, decode),
             ("c", WorkerRole.COLOCATED, colocated)]
    workers = []
    for prefix, role, count in roles:
        for i in range(count):
            wid = f"{prefix}{i}"
            fields = dict(worker_id=wid, role=role, alive=wid not in dead, num_running=0, num_waiting=0, kv_usage=0.0)
            fields.update(overrides.pop(wid, {}))
            workers.append(WorkerView(**fields))
    assert not overrides, f"overrides for unknown workers {sorted(overrides)}"
    return workers


def make_request(tokens, rid: str = "r") -> RequestView:
    return RequestView(request_id=rid, prompt_token_ids=tuple(tokens), max_tokens=16)


def route_and_record(policy: Policy, request: RequestView, workers, state: RouterState,
                     params: PolicyParams = PARAMS) -> Route:
    route = choose(policy, request, workers, state, params)
    state.record(request, route)
    state.check_integrity()
    return route


@pytest.fixture
def state():
    s = RouterState(PARAMS.max_tree_tokens)
    yield s
    s.check_integrity()


# ---- round robin -----------------------------------------------------------------------------------


def test_round_robin_alternates_prefill_and_cycles_decode(state):
    workers = make_workers(prefill=2, decode=3)
    routes = [route_and_record(Policy.ROUND_ROBIN, make_request([i, 1, 2]), workers, state) for i in range(5)]
    assert [r.prefill_id for r in routes] == ["p0", "p1", "p0", "p1", "p0"]
    assert [r.decode_id for r in routes] == ["d0", "d1", "d2", "d0", "d1"]


def test_round_robin_is_stable_over_a_worker_death(state):
    req = make_request([1, 2, 3])
    assert route_and_record(Policy.ROUND_ROBIN, req, make_workers(prefill=3), state).prefill_id == "p0"
    one_dead = make_workers(prefill=3, dead=("p1",))
    picks = [route_and_record(Policy.ROUND_ROBIN, req, one_dead, state).prefill_id for _ in range(3)]
    assert picks == ["p2", "p0", "p2"]  # sorted_alive [p0, p2][turn % 2] for turns 1, 2, 3
    assert route_and_record(Policy.ROUND_ROBIN, req, make_workers(prefill=3), state).prefill_id == "p1"  # turn 4 % 3


def test_round_robin_input_order_does_not_matter(state):
    workers = make_workers(prefill=3)
    random.Random(0).shuffle(workers)
    picks = [route_and_record(Policy.ROUND_ROBIN, make_request([1]), workers, state).prefill_id for _ in range(3)]
    assert picks == ["p0", "p1", "p2"]


# ---- least load -----------------------------------------------------------------------------------


def test_least_load_picks_the_lowest_running_plus_waiting(state):
    workers = make_workers(prefill=3, decode=2, p0=dict(num_running=5), p1=dict(num_running=1, num_waiting=1),
                           p2=dict(num_running=3), d0=dict(num_waiting=4), d1=dict(num_running=3))
    route = choose(Policy.LEAST_LOAD, make_request([1, 2]), workers, state, PARAMS)
    assert (route.prefill_id, route.decode_id) == ("p1", "d1")
    assert route.matched_prefix_tokens == 0


def test_least_load_breaks_ties_by_kv_usage_then_worker_id(state):
    workers = make_workers(prefill=3, p0=dict(kv_usage=0.5), p1=dict(kv_usage=0.2), p2=dict(kv_usage=0.2))
    workers.reverse()
    assert choose(Policy.LEAST_LOAD, make_request([1]), workers, state, PARAMS).prefill_id == "p1"
    assert choose(Policy.LEAST_LOAD, make_request([1]), make_workers(prefill=3)[::-1], state, PARAMS).prefill_id == "p0"


def test_least_load_counts_pending_prefill_tokens(state):
    params = PolicyParams(tokens_per_load_unit=1024)
    workers = make_workers(prefill=2, p0=dict(num_running=1), p1=dict(pending_prefill_tokens=2048))  # loads 1 vs 2
    assert choose(Policy.LEAST_LOAD, make_request([1]), workers, state, params).prefill_id == "p0"
    workers = make_workers(prefill=2, p0=dict(num_running=1), p1=dict(pending_prefill_tokens=512))  # 1 vs 0.5
    assert choose(Policy.LEAST_LOAD, make_request([1]), workers, state, params).prefill_id == "p1"


# ---- cache aware ----------------------------------------------------------------------------------

SHARED = list(range(100, 180))  # 80 tokens


def _warm_p0(state: RouterState) -> None:
    """Route a prompt with the SHARED prefix to p0 (all idle: ties go to p0)."""
    first = route_and_record(Policy.CACHE_AWARE, make_request(SHARED + [1] * 20, "warm"), make_workers(), state)
    assert first.prefill_id == "p0" and first.matched_prefix_tokens == 0


def test_cache_aware_sends_a_long_shared_prefix_to_the_same_worker(state):
    _warm_p0(state)
    busier_p0 = make_workers(p0=dict(num_running=4))  # least load alone would pick p1; still balanced (4 - 0 <= 8)
    route = choose(Policy.CACHE_AWARE, make_request(SHARED + [2] * 20), busier_p0, state, PARAMS)
    assert route.prefill_id == "p0"
    assert route.matched_prefix_tokens == 80  # 80 / 100 >= 0.5


def test_cache_aware_ignores_a_short_shared_prefix_below_threshold(state):
    _warm_p0(state)
    busier_p0 = make_workers(p0=dict(num_running=4))
    route = choose(Policy.CACHE_AWARE, make_request(SHARED[:40] + [2] * 60), busier_p0, state, PARAMS)  # 40/100 < 0.5
    assert route.prefill_id == "p1"
    assert route.matched_prefix_tokens == 0  # p1's tree is empty


def test_cache_aware_falls_back_to_least_load_when_imbalanced(state):
    _warm_p0(state)
    req = make_request(SHARED + [2] * 20)
    at_bound = make_workers(p0=dict(num_running=10), p1=dict(num_running=2))  # 10 - 2 = 8: not > 8
    assert choose(Policy.CACHE_AWARE, req, at_bound, state, PARAMS).prefill_id == "p0"
    past_bound = make_workers(p0=dict(num_running=11), p1=dict(num_running=2))  # 9 > 8 and 11 > 1.5 * 2
    assert choose(Policy.CACHE_AWARE, req, past_bound, state, PARAMS).prefill_id == "p1"
    relative_ok = make_workers(p0=dict(num_running=30), p1=dict(num_running=21))  # 9 > 8 but 30 <= 1.5 * 21
    assert choose(Policy.CACHE_AWARE, req, relative_ok, state, PARAMS).prefill_id == "p0"


def test_cache_aware_decode_is_least_load(state):
    workers = make_workers(prefill=1, decode=2, d0=dict(num_running=3), d1=dict(num_running=1))
    assert choose(Policy.CACHE_AWARE, make_request([1]), workers, state, PARAMS).decode_id == "d1"


# ---- kv cost --------------------------------------------------------------------------------------


def test_kv_cost_prefers_the_cached_prefix_unless_its_backlog_outweighs_it(state):
    route_and_record(Policy.KV_COST, make_request(SHARED + [1] * 20), make_workers(), state)  # -> p0 (tie by id)
    req = make_request(SHARED + [2] * 20)  # p0: 20 uncached tokens; p1: 100
    light = make_workers(p0=dict(pending_prefill_tokens=79))  # 20 + 79 = 99 < 100
    route = choose(Policy.KV_COST, req, light, state, PARAMS)
    assert (route.prefill_id, route.matched_prefix_tokens) == ("p0", 80)
    heavy = make_workers(p0=dict(pending_prefill_tokens=81))  # 20 + 81 = 101 > 100
    route = choose(Policy.KV_COST, req, heavy, state, PARAMS)
    assert (route.prefill_id, route.matched_prefix_tokens) == ("p1", 0)


# ---- L3: a prefix routed anywhere is near for every worker that shares the store --------------------


def l3_workers(**overrides) -> list[WorkerView]:
    ids = ("p0", "p1", "d0")
    return make_workers(**{w: dict(shares_l3=True, **overrides.pop(w, {})) for w in ids}, **overrides)


def prefilled_on_p0(policy: Policy, state: RouterState) -> None:
    first = make_request(SHARED + [1] * 20)
    assert route_and_record(policy, first, l3_workers(), state).prefill_id == "p0"
    state.record_prefilled(first.prompt_token_ids)


def test_kv_cost_credits_l3_at_its_load_cost_so_a_backlog_spreads_a_shared_prefix(state):
    first = make_request(SHARED + [1] * 20)
    route_and_record(Policy.KV_COST, first, l3_workers(), state)  # -> p0
    req = make_request(SHARED + [2] * 20)
    busy_p0 = l3_workers(p0=dict(pending_prefill_tokens=17))
    # routed, not yet prefilled: no store has the prefix, so p1 would prefill all of it
    assert choose(Policy.KV_COST, req, busy_p0, state, PARAMS).prefill_id == "p0"
    state.record_prefilled(first.prompt_token_ids)  # p0: 20 to prefill; p1: 20 + 80 from L3 at 0.2 = 36
    assert choose(Policy.KV_COST, req, l3_workers(p0=dict(pending_prefill_tokens=15)), state, PARAMS).prefill_id == "p0"
    route = choose(Policy.KV_COST, req, busy_p0, state, PARAMS)
    assert (route.prefill_id, route.matched_prefix_tokens) == ("p1", 0)  # 20 + 17 > 36: p1 fetches the prefix
    assert "prefill cost 36 tokens" in route.reason
    # without L3 the same backlog keeps the request on p0 (p1 would prefill all 100 tokens)
    plain = make_workers(p0=dict(pending_prefill_tokens=17))
    assert choose(Policy.KV_COST, req, plain, state, PARAMS).prefill_id == "p0"
    free_l3 = PolicyParams(l3_load_cost=0.0)
    assert state.effective_match(l3_workers()[1], req.prompt_token_ids, free_l3) == 80


def test_cache_aware_counts_an_l3_prefix_toward_the_threshold_and_survives_the_worker_that_made_it(state):
    prefilled_on_p0(Policy.CACHE_AWARE, state)
    state.forget_worker("p0")  # p0 restarted: its cache is gone, L3 still holds the prefix
    req = make_request(SHARED + [2] * 20)
    route = choose(Policy.CACHE_AWARE, req, l3_workers(p1=dict(num_running=3)), state, PARAMS)
    assert route.prefill_id == "p0" and "64/100 prompt tokens cached" in route.reason  # 0.8 * 80 >= 0.5 * 100
    plain = choose(Policy.CACHE_AWARE, req, make_workers(p1=dict(num_running=3)), state, PARAMS)
    assert "below threshold, least load" in plain.reason  # no L3: nothing cached anywhere now


def test_the_l3_credit_never_beats_a_worker_s_own_device_match(state):
    prefilled_on_p0(Policy.CACHE_AWARE, state)
    req = make_request(SHARED + [2] * 20)
    busier_p0 = l3_workers(p0=dict(num_running=4))
    assert choose(Policy.CACHE_AWARE, req, busier_p0, state, PARAMS).prefill_id == "p0"  # 80 > 64
    assert state.effective_match(busier_p0[0], req.prompt_token_ids, PARAMS) == 80


# ---- the host tier: what a worker's device pool lost but its host tier keeps -----------------------


def test_a_prefix_pushed_out_of_the_device_pool_counts_at_the_host_tier_load_cost(state):
    """p0 reports room for 100 device tokens and 400 in its host tier: after two other 100-token
    prompts the first one's 80-token prefix is only in its host tier, and counts at 1 - 0.1."""
    sized = make_workers(p0=dict(device_tokens=100, host_tokens=400), p1=dict(device_tokens=100, host_tokens=400))
    first = make_request(SHARED + [1] * 20, "a")
    route = choose(Policy.KV_COST, first, sized, state, PARAMS)
    state.record(first, route, sized[0])
    req = make_request(SHARED + [2] * 20)
    assert state.effective_match(sized[0], req.prompt_token_ids, PARAMS) == 80  # still on device
    for i in (3, 4):
        other = make_request([i] * 100, f"o{i}")
        state.record(other, Route("p0", "d0", 0, "test"), sized[0])
    assert state.device_match_len("p0", req.prompt_token_ids) == 0 and state.match_len("p0", req.prompt_token_ids) == 80
    assert state.effective_match(sized[0], req.prompt_token_ids, PARAMS) == pytest.approx(72)
    # kv_cost: p0 would prefill 100 - 72 = 28 tokens; p1 all 100, so p0 wins until its backlog passes 72
    assert choose(Policy.KV_COST, req, sized, state, PARAMS).prefill_id == "p0"
    for i in (5, 6, 7, 8, 9):  # past the host tier too: gone from p0 altogether
        state.record(make_request([i] * 100, f"o{i}"), Route("p0", "d0", 0, "test"), sized[0])
    assert state.match_len("p0", req.prompt_token_ids) == 0
    state.check_integrity()


def test_a_worker_without_a_host_tier_keeps_one_tree_sized_to_its_device_pool(state):
    view = make_workers(p0=dict(device_tokens=100))[0]
    state.record(make_request(SHARED + [1] * 20), Route("p0", "d0", 0, "test"), view)
    state.record(make_request([3] * 100), Route("p0", "d0", 0, "test"), view)
    assert state.match_len("p0", SHARED) == 0  # 200 tokens routed to a 100-token pool
    assert state.effective_match(view, tuple(SHARED), PARAMS) == 0


def test_kv_cost_decode_weighs_waiting_and_kv_usage(state):
    params = PolicyParams(decode_waiting_weight=2.0, decode_kv_usage_weight=10.0)
    workers = make_workers(prefill=1, decode=3,
                           d0=dict(num_running=3, kv_usage=0.05),  # 3 + 0.5 = 3.5
                           d1=dict(num_running=1, num_waiting=1, kv_usage=0.1),  # 1 + 2 + 1 = 4 (3 if unweighted)
                           d2=dict(kv_usage=0.38))  # 3.8
    assert choose(Policy.KV_COST, make_request([1]), workers, state, params).decode_id == "d0"
    workers = make_workers(prefill=1, decode=2, d0=dict(num_running=3), d1=dict(num_waiting=1))  # 3 vs 2
    assert choose(Policy.KV_COST, make_request([1]), workers, state, params).decode_id == "d1"


def test_kv_cost_local_adds_prefill_tokens_and_decode_load(state):
    params = PolicyParams(tokens_per_load_unit=10)
    route_and_record(Policy.KV_COST, make_request(SHARED), make_workers(prefill=0, decode=2), state, params)
    req = make_request(SHARED + [5] * 20)  # d0: 20 uncached; d1: 100
    workers = make_workers(prefill=0, decode=2, d0=dict(num_running=7))  # d0: 20 + 70 = 90 < 100
    assert choose(Policy.KV_COST, req, workers, state, params).decode_id == "d0"
    workers = make_workers(prefill=0, decode=2, d0=dict(num_running=9))  # d0: 20 + 90 = 110 > 100
    assert choose(Policy.KV_COST, req, workers, state, params).decode_id == "d1"


# ---- route shapes ---------------------------------------------------------------------------------


@pytest.mark.parametrize("policy", list(Policy))
def test_local_prefill_when_no_prefill_worker_is_alive(policy, state):
    workers = make_workers(prefill=2, decode=2, dead=("p0", "p1"))
    route = route_and_record(policy, make_request(SHARED), workers, state)
    assert route.prefill_id is None and route.local_prefill
    assert route.decode_id in ("d0", "d1")
    assert state.match_len(route.decode_id, SHARED) == 80  # the decode worker's own cache now holds the prompt
    assert state.match_len("p0", SHARED) == 0


@pytest.mark.parametrize("policy", list(Policy))
def test_a_prompt_longer_than_every_landing_is_prefilled_where_it_decodes(policy, state):
    """The context is not capped by a landing: a prompt no decode worker can land is prefilled on a
    decode worker; one that some can land decodes among those only; an unreported landing (0) takes
    any prompt."""
    workers = make_workers(prefill=1, decode=2, d0=dict(landing_tokens=64), d1=dict(landing_tokens=96))
    too_long = route_and_record(policy, make_request(range(100, 200)), workers, state)
    assert too_long.local_prefill and too_long.decode_id in ("d0", "d1")
    assert "longer than every decode worker's landing" in too_long.reason
    for i in range(4):
        mid = route_and_record(policy, make_request(range(1000 * (i + 1), 1000 * (i + 1) + 80), f"m{i}"), workers,
                               state)
        assert mid.prefill_id == "p0" and mid.decode_id == "d1"
    unknown = make_workers(prefill=1, decode=1)
    assert choose(policy, make_request(range(5000, 5400)), unknown, state, PARAMS).prefill_id == "p0"


def test_local_cache_aware_follows_the_decode_workers_own_caches(state):
    workers = make_workers(prefill=0, decode=2)
    assert route_and_record(Policy.CACHE_AWARE, make_request(SHARED), workers, state).decode_id == "d0"
    busier_d0 = make_workers(prefill=0, decode=2, d0=dict(num_running=3))
    route = choose(Policy.CACHE_AWARE, make_request(SHARED + [9]), busier_d0, state, PARAMS)
    assert (route.prefill_id, route.decode_id, route.matched_prefix_tokens) == (None, "d0", 80)


@pytest.mark.parametrize("policy", list(Policy))
def test_a_short_prompt_prefills_on_its_decode_worker_and_a_longer_one_on_a_prefill_worker(policy, state):
    """Conditional disaggregation (`local_prefill_max_tokens`): at the threshold the decode worker
    computes the prompt itself; one token past it, a prefill worker does; 0 or None: always remote."""
    workers = make_workers(prefill=2, decode=2, colocated=1)
    params = PolicyParams(local_prefill_max_tokens=len(SHARED))
    short = route_and_record(policy, make_request(SHARED, "short"), workers, state, params)
    assert short.local_prefill and short.decode_id in ("d0", "d1"), short  # never the colocated worker
    assert "80 uncached tokens <= 80" in short.reason
    assert state.match_len(short.decode_id, SHARED) == 80 and state.match_len("p0", SHARED) == 0
    longer = route_and_record(policy, make_request(list(range(300, 381)), "longer"), workers, state, params)
    assert longer.prefill_id in ("p0", "p1") and longer.decode_id in ("d0", "d1"), longer
    for off in (PolicyParams(local_prefill_max_tokens=0), PolicyParams()):
        assert choose(policy, make_request([1, 2]), workers, state, off).prefill_id in ("p0", "p1")
        assert choose(policy, make_request(SHARED), workers, state, off).prefill_id in ("p0", "p1")  # cached


def test_the_threshold_counts_what_the_decode_worker_lacks(state):
    """A conversation's next turn: its history is on the decode worker that decoded it, so only the new
    tokens count against `local_prefill_max_tokens`; more new tokens than that cross."""
    workers = make_workers(prefill=1, decode=1)
    params = PolicyParams(local_prefill_max_tokens=40)
    route_and_record(Policy.CACHE_AWARE, make_request(SHARED, "turn-1"), workers, state)  # disaggregated
    state.record_cached(workers[1], SHARED)  # finished: its prompt (and answer) join the decoder's tree
    turn = route_and_record(Policy.CACHE_AWARE, make_request(SHARED + list(range(500, 540)), "turn-2"),
                            workers, state, params)
    assert (turn.prefill_id, turn.decode_id, turn.matched_prefix_tokens) == (None, "d0", 80), turn
    long_turn = choose(Policy.CACHE_AWARE, make_request(SHARED + list(range(600, 641)), "turn-3"), workers, state,
                       params)
    assert long_turn.prefill_id == "p0", long_turn


@pytest.mark.parametrize("policy", list(Policy))
def test_colocated_workers_never_take_a_disaggregated_route(policy, state):
    workers = make_workers(prefill=1, decode=1, colocated=1, p0=dict(num_running=5), d0=dict(num_running=5))
    route = choose(policy, make_request([1, 2]), workers, state, PARAMS)
    assert (route.prefill_id, route.decode_id) == ("p0", "d0")  # the idle c0 is not a decode candidate
    no_decode = make_workers(prefill=1, decode=1, colocated=1, dead=("d0",))
    route = choose(policy, make_request([1, 2]), no_decode, state, PARAMS)
    assert (route.prefill_id, route.decode_id) == (None, "c0")


def test_colocated_only_cluster_round_robins_local_routes(state):
    workers = make_workers(prefill=0, decode=0, colocated=3)
    routes = [route_and_record(Policy.ROUND_ROBIN, make_request([i]), workers, state) for i in range(4)]
    assert [(r.prefill_id, r.decode_id) for r in routes] == [(None, "c0"), (None, "c1"), (None, "c2"), (None, "c0")]


@pytest.mark.parametrize("workers", [
    [],
    make_workers(prefill=2, decode=0),
    make_workers(prefill=1, decode=1, colocated=1, dead=("d0", "c0")),
], ids=["none", "prefill_only", "serving_dead"])
def test_no_worker_available(workers, state):
    with pytest.raises(NoWorkerAvailable, match="no alive decode or colocated worker"):
        choose(Policy.LEAST_LOAD, make_request([1]), workers, state, PARAMS)


def test_duplicate_worker_ids_are_rejected(state):
    workers = make_workers(prefill=1, decode=1)
    with pytest.raises(ValueError, match="listed twice"):
        choose(Policy.LEAST_LOAD, make_request([1]), workers + workers[:1], state, PARAMS)


# ---- state ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("policy", list(Policy))
def test_choose_does_not_mutate_state(policy, state):
    for i, workers in enumerate([make_workers(), make_workers(prefill=0, decode=2), make_workers(colocated=1)]):
        route_and_record(policy, make_request(SHARED + [i] * 5, f"warm{i}"), workers, state)
    before = state.snapshot()
    for workers in [make_workers(p0=dict(num_running=3)), make_workers(prefill=0, decode=2)]:
        for tokens in [SHARED, SHARED[:10] + [7] * 50, [42]]:
            choose(policy, make_request(tokens), workers, state, PARAMS)
    assert state.snapshot() == before


def test_record_inserts_into_the_prefill_worker_tree_and_forget_drops_it(state):
    route = route_and_record(Policy.ROUND_ROBIN, make_request(SHARED), make_workers(), state)
    assert (route.prefill_id, route.decode_id) == ("p0", "d0")
    assert state.match_len("p0", SHARED + [1]) == 80
    assert state.match_len("d0", SHARED) == 0  # decode never computed the prompt
    state.forget_worker("p0")
    assert state.match_len("p0", SHARED) == 0
    state.forget_worker("never-seen")  # no-op


def test_record_advances_prefill_turn_only_on_disaggregated_routes(state):
    route_and_record(Policy.ROUND_ROBIN, make_request([1]), make_workers(prefill=0, decode=2), state)  # local
    route = choose(Policy.ROUND_ROBIN, make_request([1]), make_workers(prefill=2, decode=2), state, PARAMS)
    assert (route.prefill_id, route.decode_id) == ("p0", "d1")


# ---- validation -----------------------------------------------------------------------------------


@pytest.mark.parametrize("field,value", [
    ("cache_threshold", 1.5), ("cache_threshold", -0.1), ("balance_abs_threshold", -1),
    ("balance_rel_threshold", 0.9), ("max_tree_tokens", 0), ("tokens_per_load_unit", 0),
    ("decode_waiting_weight", -1.0), ("decode_kv_usage_weight", -1.0), ("l3_load_cost", 1.5), ("l3_load_cost", -0.1),
    ("host_load_cost", 1.5), ("host_load_cost", -0.1), ("local_prefill_max_tokens", -1),
    ("local_prefill_max_tokens", 2.5), ("local_prefill_max_tokens", True),
])
def test_policy_params_bounds_name_the_field(field, value):
    with pytest.raises(ConfigError, match=field):
        PolicyParams(**{field: value})


def test_views_reject_bad_values():
    with pytest.raises(ValueError, match="not a WorkerRole"):
        WorkerView("p0", "prefill", True, 0, 0, 0.0)
    with pytest.raises(ValueError, match="kv_usage"):
        WorkerView("p0", WorkerRole.PREFILL, True, 0, 0, 1.5)
    with pytest.raises(ValueError, match="empty prompt"):
        make_request([])
    assert make_request([3, 4]).prompt_token_ids == (3, 4)


# ---- approximate prefix tree ----------------------------------------------------------------------


def test_tree_insert_and_match_share_prefixes():
    tree = ApproxPrefixTree(max_tokens=100)
    tree.insert([1, 2, 3, 4])
    tree.insert([1, 2, 5])  # splits [1,2,3,4] into [1,2] + [3,4], adds [5]
    tree.insert([1, 2, 3, 4])  # already present
    assert tree.num_tokens == 5
    queries = ([1, 2, 5, 9], [1, 2, 3], [1, 2, 3, 4, 5], [1, 7], [7], [])
    assert [tree.match_len(q) for q in queries] == [3, 3, 4, 1, 0, 0]
    tree.check_integrity()


def test_tree_trims_the_lru_leaf_to_exactly_the_budget():
    tree = ApproxPrefixTree(max_tokens=10)
    a, b, c, d = list(range(1, 7)), [10, 11, 12, 13], [20, 21, 22], [30, 31, 32, 33, 34]
    tree.insert(a)
    tree.insert(b)
    assert tree.num_tokens == 10
    tree.insert(c)  # 13 > 10: a (oldest) loses its last 3 tokens
    assert tree.num_tokens == 10
    assert [tree.match_len(x) for x in (a, b, c)] == [3, 4, 3]
    tree.insert(d)  # 15: a's remaining 3 go, then b loses 2
    assert tree.num_tokens == 10
    assert [tree.match_len(x) for x in (a, b, c, d)] == [0, 2, 3, 5]
    tree.check_integrity()


def test_tree_insert_refreshes_recency():
    tree = ApproxPrefixTree(max_tokens=6)
    a, b, c = [1, 1, 1], [2, 2, 2], [3, 3, 3]
    tree.insert(a)
    tree.insert(b)
    tree.insert(a)  # a is now newer than b
    tree.insert(c)
    assert [tree.match_len(x) for x in (a, b, c)] == [3, 0, 3]
    tree.check_integrity()


def test_tree_evicts_a_parent_after_its_last_child():
    tree = ApproxPrefixTree(max_tokens=6)
    tree.insert([1, 2, 3, 4])
    tree.insert([1, 2, 5, 6])  # [1,2] -> {[3,4], [5,6]}: 6 tokens
    tree.insert([9, 9])  # [3,4] is the LRU leaf
    assert tree.num_tokens == 6 and tree.match_len([1, 2, 3, 4]) == 2 and tree.match_len([1, 2, 5, 6]) == 4
    tree.insert([8, 8, 8])  # [5,6] goes, then its now-leaf parent [1,2] is trimmed to [1]
    assert tree.num_tokens == 6
    assert [tree.match_len(x) for x in ([1, 2, 5, 6], [9, 9], [8, 8, 8])] == [1, 2, 3]
    tree.check_integrity()


def test_tree_truncates_a_sequence_longer_than_the_budget():
    tree = ApproxPrefixTree(max_tokens=4)
    tree.insert([5, 6])
    tree.insert(list(range(10)))
    assert tree.num_tokens == 4 and tree.match_len(list(range(10))) == 4 and tree.match_len([5, 6]) == 0
    tree.check_integrity()


def test_tree_match_is_read_only():
    tree = ApproxPrefixTree(max_tokens=6)
    tree.insert([1, 1, 1])
    tree.insert([2, 2, 2])
    before = tree.snapshot()
    assert tree.match_len([1, 1, 1]) == 3
    assert tree.snapshot() == before
    tree.insert([3, 3, 3])  # the match did not refresh [1,1,1]: it is still the LRU leaf
    assert tree.match_len([1, 1, 1]) == 0 and tree.match_len([2, 2, 2]) == 3


def test_tree_check_integrity_catches_a_miscount():
    tree = ApproxPrefixTree(max_tokens=10)
    tree.insert([1, 2, 3])
    tree._num_tokens += 1
    with pytest.raises(AssertionError, match="edges hold 3 tokens"):
        tree.check_integrity()


def _lcp(a, b) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


_seqs = st.lists(st.lists(st.integers(0, 3), max_size=12), min_size=1, max_size=20)


@settings(max_examples=200, deadline=None)
@given(inserted=_seqs, queries=_seqs)
def test_tree_match_is_the_longest_common_prefix_without_eviction(inserted, queries):
    tree = ApproxPrefixTree(max_tokens=10_000)
    for seq in inserted:
        tree.insert(seq)
    tree.check_integrity()
    for q in queries + inserted:
        assert tree.match_len(q) == max(_lcp(q, s) for s in inserted)


@settings(max_examples=200, deadline=None)
@given(inserted=_seqs, queries=_seqs, max_tokens=st.integers(1, 20))
def test_tree_under_eviction_keeps_budget_and_the_newest_insert(inserted, queries, max_tokens):
    tree = ApproxPrefixTree(max_tokens=max_tokens)
    for seq in inserted:
        tree.insert(seq)
        tree.check_integrity()
        assert tree.num_tokens <= max_tokens
        assert tree.match_len(seq) == min(len(seq), max_tokens)
    for q in queries:
        assert tree.match_len(q) <= max(_lcp(q, s) for s in inserted)
