"""Streaming sessions in the engine (engine/sessions.py): a turn prefills only its new
tokens, the pinned history stays page-aligned, the unaligned tail is freed exactly, and retract,
abort and idle reaping leak nothing. Reference: the same tiny model with no cache at all."""

from __future__ import annotations

import time

import pytest

from cluster.worker_host.build import make_worker
from common import protocol as p
from common.config import EngineConfig
from engine.request import RequestStatus
from engine.sessions import SessionError, SessionState
from kv_store.kv_manager import ceil_div
from kv_store.transfer.local import LocalTransport
from tests.helpers import assert_pool_at_rest, greedy, make_engine, make_prompts, tiny_models


def run(engine, req):
    while req.status is not RequestStatus.FINISHED:
        engine.step()
    return req


def spy_free_tail(engine) -> list:
    """Record what every free_tail call freed (the engine's own calls, unchanged)."""
    calls, real = [], engine.kvm.free_tail

    def free_tail(kv, new_len):
        before = (kv.kv_allocated_len, len(kv.pages))
        freed = real(kv, new_len)
        calls.append((before, new_len, freed))
        return freed

    engine.kvm.free_tail = free_tail
    return calls


@pytest.mark.parametrize("page_size", [1, 16])
def test_turns_prefill_only_new_tokens_and_match_the_reference(page_size):
    engine = make_engine(page_size=page_size, num_pages=1 + 2048 // page_size, chunk_size=64)
    reference = make_engine(page_size=page_size, num_pages=1 + 2048 // page_size, enable_prefix_cache=False)
    calls = spy_free_tail(engine)
    engine.open_session("s", capacity_tokens=1024, idle_timeout_s=60)
    history: list[int] = []
    for turn, new in enumerate(make_prompts(4, min_len=5, max_len=23, seed=3)):  # unaligned lengths
        prompt = history + new
        req = run(engine, engine.add_request(prompt, greedy(max_tokens=7), f"t{turn}", session_id="s"))
        [expect] = reference.generate([prompt], greedy(max_tokens=7))
        assert req.output_token_ids == expect.output_token_ids, f"turn {turn}"
        committed_before = max(len(history) - 1, 0)
        assert req.cached_tokens == committed_before // page_size * page_size, f"turn {turn} recomputed history"
        history = prompt + req.output_token_ids
        session = engine.sessions.sessions["s"]
        aligned = (len(history) - 1) // page_size * page_size
        assert session.state is SessionState.IDLE and session.pinned_tokens == aligned
        assert session.pinned_tokens % page_size == 0
        (allocated, num_pages), new_len, freed = calls[-1]
        assert new_len == aligned and len(freed) == num_pages - ceil_div(aligned, page_size), "not exactly the tail"
        engine.check_integrity()
    assert engine.tier_stats().session_pages == engine.sessions.sessions["s"].pinned_tokens // page_size
    assert engine.kvm.prefix_cache.evict(10**6) >= 0
    assert engine.sessions.sessions["s"].pinned_tokens == len(engine.kvm.prefix_cache.path_pages(
        engine.kvm.prefix_pins["s"])) * page_size, "eviction took pinned history"
    assert engine.close_session("s") and not engine.kvm.prefix_pins
    assert_pool_at_rest(engine)
    reference.check_integrity()


def test_abort_mid_turn_keeps_the_history_and_the_next_turn_works():
    engine = make_engine(page_size=4, num_pages=256)
    engine.open_session("s", capacity_tokens=400, idle_timeout_s=60)
    [first, second] = make_prompts(2, min_len=21, max_len=21, seed=4)
    req = run(engine, engine.add_request(first, greedy(max_tokens=5), "t0", session_id="s"))
    pinned = engine.sessions.sessions["s"].pinned_tokens
    history = first + req.output_token_ids
    doomed = engine.add_request(history + second, greedy(max_tokens=50), "t1", session_id="s")
    for _ in range(3):
        engine.step()
    assert engine.abort("t1") and doomed.status is RequestStatus.FINISHED
    session = engine.sessions.sessions["s"]
    assert session.state is SessionState.IDLE and session.pinned_tokens == pinned
    with pytest.raises(SessionError, match="not open"):
        engine.add_request(second, greedy(max_tokens=2), "x", session_id="nope")
    req = run(engine, engine.add_request(history + second, greedy(max_tokens=5), "t2", session_id="s"))
    assert req.cached_tokens >= pinned  # the aborted turn's committed pages were cached too
    engine.close_session("s")
    assert_pool_at_rest(engine)


def test_a_turn_aborted_while_queued_frees_the_session():
    engine = make_engine(page_size=4, num_pages=256, max_running_requests=1)
    engine.open_session("s", capacity_tokens=400, idle_timeout_s=60)
    blocker = engine.add_request(make_prompts(1, seed=5)[0], greedy(max_tokens=30))
    engine.step()
    queued = engine.add_request([5, 6, 7], greedy(max_tokens=3), "t0", session_id="s")
    with pytest.raises(SessionError, match="one turn at a time"):
        engine.add_request([5, 6, 7, 8], greedy(max_tokens=3), "t1", session_id="s")
    assert queued.status is RequestStatus.WAITING and engine.abort("t0")
    assert engine.sessions.sessions["s"].state is SessionState.IDLE
    run(engine, blocker)
    engine.close_session("s")
    assert_pool_at_rest(engine)


def test_retract_and_resume_in_the_middle_of_a_session():
    prompts = make_prompts(5, min_len=30, max_len=40, seed=6)
    engine = make_engine(page_size=4, num_pages=1 + 64, chunk_size=32, host_cache_pages=0)
    reference = make_engine(page_size=4, num_pages=512, chunk_size=32, enable_prefix_cache=False)
    engine.open_session("s", capacity_tokens=120, idle_timeout_s=60)
    turn0 = run(engine, engine.add_request(prompts[0], greedy(max_tokens=4), "t0", session_id="s"))
    history = prompts[0] + turn0.output_token_ids
    others = [engine.add_request(p, greedy(max_tokens=40)) for p in prompts[1:]]
    turn1 = engine.add_request(history + [9, 9, 9], greedy(max_tokens=40), "t1", session_id="s")  # newest: the victim
    while turn1.status is not RequestStatus.FINISHED or any(o.status is not RequestStatus.FINISHED for o in others):
        engine.step()
        assert engine.sessions.sessions["s"].pinned_tokens % 4 == 0
    assert engine.num_retractions > 0 and turn1.num_retractions > 0, "the session turn was never retracted"
    expect = reference.generate(prompts[1:] + [history + [9, 9, 9]], greedy(max_tokens=40))
    assert [r.output_token_ids for r in [*others, turn1]] == [r.output_token_ids for r in expect]
    assert engine.sessions.sessions["s"].pinned_tokens == (len(history) + 3 + 40 - 1) // 4 * 4
    engine.close_session("s")
    assert_pool_at_rest(engine)
    reference.check_integrity()


def test_idle_sessions_are_reaped_and_budget_and_capacity_are_enforced():
    engine = make_engine(page_size=4, num_pages=1 + 100, session_kv_fraction=0.5)  # 200 tokens of budget
    engine.open_session("a", capacity_tokens=150, idle_timeout_s=0.05)
    with pytest.raises(SessionError, match="budget full"):
        engine.open_session("b", capacity_tokens=51, idle_timeout_s=60)
    engine.open_session("b", capacity_tokens=50, idle_timeout_s=60)
    with pytest.raises(SessionError, match="exceeds its capacity_tokens 50"):
        engine.add_request(list(range(3, 43)), greedy(max_tokens=11), "big", session_id="b")
    run(engine, engine.add_request(list(range(3, 43)), greedy(max_tokens=3), "t0", session_id="a"))
    assert engine.kvm.prefix_pins and engine.tier_stats().sessions_open == 2
    time.sleep(0.06)
    assert engine.busy(), "a session past its idle timeout must wake the loop"
    engine.step()
    assert list(engine.sessions.sessions) == ["b"] and not engine.kvm.prefix_pins
    engine.close_session("b")
    assert_pool_at_rest(engine)


def test_a_decode_worker_serves_session_turns_through_the_worker_contract():
    ours, _, arch = tiny_models()
    worker = make_worker("decode", EngineConfig(page_size=4, num_pages=257, debug_kv=True), ours, arch,
                         LocalTransport(), host_pages=64)
    assert "exceeds the 1024 tokens" in worker.handle(p.OpenSession("s", 10**6, 60.0))[0].error
    assert worker.handle(p.OpenSession("s", 600, 60.0))[0].error.startswith("session KV budget full")
    assert worker.handle(p.OpenSession("s", 300, 60.0)) == [p.SessionOpened("s", "")]
    prompt = make_prompts(1, min_len=30, max_len=30, seed=9)[0]
    assert worker.handle(p.Generate("t0", tuple(prompt), greedy(max_tokens=4), session_id="s")) == []
    out = []
    while worker.busy():
        out += [m for m in worker.step() if isinstance(m, p.TokenOutput)]
    assert out[-1].finish_reason is p.FinishReason.LENGTH and worker.engine.sessions.sessions["s"].pinned_tokens == 32
    [rejected] = worker.handle(p.Generate("t1", tuple(prompt), greedy(max_tokens=4), session_id="gone"))
    assert rejected.failure is p.Failure.REJECTED and "not open" in rejected.error
    # a session opened again here (its worker died) with no room: its turn, right behind, is told to retry
    assert "budget full" in worker.handle(p.OpenSession("moved", 300, 60.0))[0].error
    [busy] = worker.handle(p.Generate("t2", tuple(prompt), greedy(max_tokens=4), session_id="moved"))
    assert busy.failure is p.Failure.BUSY and "retry later" in busy.error
    worker.handle(p.CloseSession("s"))
    assert not worker.engine.sessions.sessions and not worker.engine.kvm.prefix_pins
    worker.check_integrity()


def test_a_sessions_next_turn_is_not_stuck_behind_a_request_its_pins_keep_out():
    """A request that cannot fit while an idle session pins its history, queued before that
    session's next turn, with nothing running: first come, first served would wait forever (the
    turn keeps the session pinned, the request keeps the turn queued). The turn goes first; the
    request runs once the session closes. Outputs equal a cacheless engine's."""
    engine = make_engine(page_size=1, num_pages=1 + 24, session_kv_fraction=0.6)
    reference = make_engine(page_size=1, num_pages=1 + 64, enable_prefix_cache=False)
    engine.open_session("s", capacity_tokens=13, idle_timeout_s=600)
    first = run(engine, engine.add_request(list(range(3, 9)), greedy(max_tokens=3), "t0", session_id="s"))
    assert engine.sessions.sessions["s"].pinned_tokens == 8
    big_prompt = list(range(20, 38))  # 18 tokens; the pool has 24, the session pins 8, the tree gives up the rest
    big = engine.add_request(big_prompt, greedy(max_tokens=2), "big")
    turn_prompt = first.prompt_token_ids + first.output_token_ids + [40, 41]
    turn = engine.add_request(turn_prompt, greedy(max_tokens=2), "t1", session_id="s")
    for _ in range(100):
        if turn.status is RequestStatus.FINISHED:
            break
        engine.step()
    assert turn.status is RequestStatus.FINISHED, "the session's turn stayed queued behind a request it kept out"
    assert big.status is RequestStatus.WAITING  # still kept out by the pins: it waited, nothing failed
    engine.close_session("s")
    run(engine, big)
    expect = reference.generate([turn_prompt, big_prompt], [greedy(max_tokens=2), greedy(max_tokens=2)])
    assert [turn.output_token_ids, big.output_token_ids] == [r.output_token_ids for r in expect]
    assert_pool_at_rest(engine)


def test_an_idle_sessions_history_goes_to_the_host_tier_for_other_requests_and_comes_back_for_its_turn():
    """Pages are short and an idle session pins its history: with a host tier the session is offloaded
    (its history written to L2, the device pages given to the others) instead of the others waiting;
    its next turn loads the history back from L2 (nothing recomputed) and is pinned on device again.
    Outputs equal a cacheless engine's."""
    engine = make_engine(page_size=4, num_pages=1 + 24, chunk_size=32, host_cache_pages=1 + 48,
                         session_kv_fraction=0.6)
    reference = make_engine(page_size=4, num_pages=512, enable_prefix_cache=False)
    engine.open_session("s", capacity_tokens=56, idle_timeout_s=600)
    first = run(engine, engine.add_request(list(range(3, 35)), greedy(max_tokens=5), "t0", session_id="s"))
    history = first.prompt_token_ids + first.output_token_ids
    assert engine.sessions.sessions["s"].pinned_tokens == 36 and engine.tier_stats().session_pages == 9
    others = [engine.add_request(list(range(40 + 50 * i, 40 + 50 * i + 60)), greedy(max_tokens=4), f"o{i}")
              for i in range(2)]  # 64 tokens each: neither fits beside the pinned history (24 pages in all)
    for _ in range(200):  # bounded: without the offload they would wait for the session forever
        if all(o.status is RequestStatus.FINISHED for o in others):
            break
        engine.step()
    assert all(o.status is RequestStatus.FINISHED for o in others), "the others waited for the idle session"
    stats = engine.tier_stats()
    assert stats.session_offloads == 1 and stats.session_pages == 0 and engine.sessions.is_offloaded("s")
    l2_before = stats.hit_tokens_l2
    turn_prompt = history + [7, 8, 9]
    turn = run(engine, engine.add_request(turn_prompt, greedy(max_tokens=5), "t1", session_id="s"))
    assert turn.cached_tokens == 36 and engine.tier_stats().hit_tokens_l2 - l2_before == 36  # all from L2
    session = engine.sessions.sessions["s"]
    assert not engine.sessions.is_offloaded("s") and session.pinned_tokens == (len(turn_prompt) + 5 - 1) // 4 * 4
    expect = reference.generate([first.prompt_token_ids, *(o.prompt_token_ids for o in others), turn_prompt],
                                [greedy(max_tokens=5), greedy(max_tokens=4), greedy(max_tokens=4),
                                 greedy(max_tokens=5)])
    assert [r.output_token_ids for r in (first, *others, turn)] == [r.output_token_ids for r in expect]
    engine.close_session("s")
    assert_pool_at_rest(engine)
    reference.check_integrity()
