"""The colocated engine on the seeded tiny Llama, checked against HF transformers' generate."""

import copy

import pytest

import engine.core as core_mod
import engine.stats as stats_mod
from common.config import ConfigError, EngineConfig, SamplingParams
from common.protocol import WorkerRole
from engine import build_engine
from engine.request import FinishReason
from kernels.model.packed_linear import PackedLinear
from tests.helpers import TINY_EOS, assert_pool_at_rest, greedy, hf_greedy, make_engine, make_prompts, tiny_models


@pytest.mark.parametrize("page_size,chunk_size", [(1, 512), (4, 512), (16, 512), (16, 8), (1, 5)])
def test_batched_greedy_matches_hf(prompts, hf_outputs, page_size, chunk_size):
    engine = make_engine(page_size=page_size, chunk_size=chunk_size, num_pages=4096 // page_size)
    out = engine.generate(prompts, greedy(max_tokens=24))
    assert [r.output_token_ids for r in out] == hf_outputs
    assert all(r.finish_reason is FinishReason.LENGTH for r in out)
    assert_pool_at_rest(engine)


@pytest.mark.parametrize("prepack", [True, False])
def test_cpu_engine_packs_weights_for_mkl_unless_told_not_to_and_output_is_hf(prompts, hf_outputs, prepack):
    """A fresh copy of the model: the engine packs every linear (batched decode rows then take MKL's
    packed GEMM) and the output is still HF's; `cpu_prepack=False` leaves the weights alone."""
    ours, _, arch = tiny_models()
    model = copy.deepcopy(ours)  # copies leave any packed copy behind
    linears = [m for m in model.modules() if isinstance(m, PackedLinear)]
    assert linears and not any(m.is_prepacked for m in linears)
    engine = build_engine(EngineConfig(page_size=4, num_pages=1024, debug_kv=True, cpu_prepack=prepack), model, arch)
    assert all(m.is_prepacked == prepack for m in linears)
    out = engine.generate(prompts, greedy(max_tokens=24))
    assert [r.output_token_ids for r in out] == hf_outputs
    assert_pool_at_rest(engine)


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_small_pool_retracts_and_output_is_unchanged(prompts, hf_outputs, page_size):
    # room for roughly two requests at a time: every request still completes, identically
    engine = make_engine(page_size=page_size, num_pages=1 + 200 // page_size, chunk_size=32)
    out = engine.generate(prompts, greedy(max_tokens=24))
    assert engine.num_retractions > 0
    assert [r.output_token_ids for r in out] == hf_outputs
    assert_pool_at_rest(engine)


def test_retract_without_prefix_cache(prompts, hf_outputs):
    engine = make_engine(page_size=4, num_pages=1 + 200 // 4, enable_prefix_cache=False)
    out = engine.generate(prompts, greedy(max_tokens=24))
    assert engine.num_retractions > 0
    assert [r.output_token_ids for r in out] == hf_outputs
    assert engine.kvm.prefix_cache.cached_pages() == 0
    assert_pool_at_rest(engine)


def test_shared_prefix_is_cached_and_output_unchanged():
    shared = make_prompts(1, min_len=200, max_len=200, seed=7)[0]
    first, second = shared + [11, 12, 13], shared + [21, 22]
    cold = make_engine(page_size=16, enable_prefix_cache=False)
    expect = [r.output_token_ids for r in cold.generate([first, second], greedy(max_tokens=12))]
    warm = make_engine(page_size=16)
    [a] = warm.generate([first], greedy(max_tokens=12))
    [b] = warm.generate([second], greedy(max_tokens=12))
    assert a.cached_tokens == 0 and b.cached_tokens == 192
    assert [a.output_token_ids, b.output_token_ids] == expect
    assert_pool_at_rest(warm)


def test_abort_waiting_and_running_releases_everything(prompts):
    engine = make_engine(max_running_requests=2)
    reqs = [engine.add_request(p, greedy(max_tokens=50)) for p in prompts[:4]]
    engine.step()
    engine.step()
    assert engine.kvm.pool.usage().private > 0
    assert engine.abort(reqs[0].request_id) and engine.abort(reqs[3].request_id)  # running, waiting
    assert not engine.abort(reqs[0].request_id)  # already ended
    assert reqs[0].finish_reason is FinishReason.ABORT and reqs[3].finish_reason is FinishReason.ABORT
    while engine.busy():
        engine.step()
    assert [r.finish_reason for r in reqs[1:3]] == [FinishReason.LENGTH] * 2
    assert_pool_at_rest(engine)


def test_stop_on_eos_and_stop_token_ids(prompts, hf_outputs):
    ref_tokens = hf_outputs[0]
    stop_at = ref_tokens[5]
    first = ref_tokens.index(stop_at)
    engine = make_engine(eos=(stop_at,))
    [r] = engine.generate([prompts[0]], greedy(max_tokens=24))
    assert r.output_token_ids == ref_tokens[:first + 1] and r.finish_reason is FinishReason.STOP
    [r] = engine.generate([prompts[0]], greedy(max_tokens=24, ignore_eos=True))
    assert r.output_token_ids == ref_tokens and r.finish_reason is FinishReason.LENGTH
    [r] = make_engine().generate([prompts[0]], greedy(max_tokens=24, stop_token_ids=(stop_at,)))
    assert r.output_token_ids == ref_tokens[:first + 1] and r.finish_reason is FinishReason.STOP
    assert_pool_at_rest(engine)


def test_hf_eos_parity():
    _, ref, _ = tiny_models()
    prompts = make_prompts(6, seed=3)
    engine = make_engine(eos=(TINY_EOS,))
    out = engine.generate(prompts, greedy(max_tokens=30))
    assert [r.output_token_ids for r in out] == [hf_greedy(ref, p, 30, eos_token_id=TINY_EOS) for p in prompts]


def test_seeded_sampling_is_reproducible_and_batch_independent(prompts):
    params = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.9, top_k=50, seed=1234)
    alone = make_engine().generate([prompts[2]], params)[0].output_token_ids
    batched = make_engine().generate(prompts, params)[2].output_token_ids
    squeezed = make_engine(num_pages=1 + 200 // 4)
    retracted = squeezed.generate(prompts, params)[2].output_token_ids
    assert squeezed.num_retractions > 0
    assert alone == batched == retracted
    other = make_engine().generate([prompts[2]], SamplingParams(max_tokens=16, temperature=0.9, seed=99))
    assert other[0].output_token_ids != alone
    unseeded = make_engine().generate([prompts[2]] * 2, SamplingParams(max_tokens=16, temperature=1.0))
    assert unseeded[0].output_token_ids != unseeded[1].output_token_ids


def test_top_k_one_is_greedy(prompts, hf_outputs):
    out = make_engine().generate(prompts[:3], SamplingParams(max_tokens=24, temperature=1.5, top_k=1, seed=5))
    assert [r.output_token_ids for r in out] == hf_outputs[:3]


def test_bad_requests_are_rejected_and_queue_nothing():
    engine = make_engine(num_pages=1 + 64 // 4)
    with pytest.raises(ValueError, match="no room to generate"):
        engine.add_request(list(range(3, 70)), greedy())
    with pytest.raises(ValueError, match=r"token ids must be in \[0, 256\)"):
        engine.add_request([5, 999], greedy())
    with pytest.raises(ValueError, match="empty prompt"):
        engine.add_request([], greedy())
    with pytest.raises(ValueError, match="stop strings need a tokenizer"):
        engine.add_request([5, 6], greedy(stop=("x",)))
    assert not engine.busy()
    for bad in (dict(max_tokens=0), dict(temperature=-1), dict(top_p=0), dict(top_k=-2)):
        with pytest.raises(ConfigError):
            SamplingParams(**bad)
    assert_pool_at_rest(engine)


def test_context_limit_ends_with_length():
    engine = make_engine(max_model_len=40)
    [r] = engine.generate([list(range(3, 33))], greedy(max_tokens=100))
    assert r.finish_reason is FinishReason.LENGTH and r.num_tokens == 40
    assert_pool_at_rest(engine)


def test_heartbeat_integrity_check_runs_every_beat_at_rest_and_at_most_every_interval_while_busy(monkeypatch):
    engine = make_engine()
    checks = []
    real_check = engine.check_integrity

    def counted():
        checks.append(engine.scheduler.has_work())
        real_check()

    monkeypatch.setattr(engine, "check_integrity", counted)
    engine.stats(WorkerRole.COLOCATED), engine.stats(WorkerRole.COLOCATED)
    assert checks == [False, False]  # at rest: every beat
    req = engine.add_request(make_prompts(1)[0], SamplingParams(max_tokens=50, ignore_eos=True))
    engine.step()
    checks.clear()
    for _ in range(3):
        assert engine.stats(WorkerRole.COLOCATED).integrity_error == ""
    assert checks == []  # busy, within the interval of the last check: the verdict stands
    monkeypatch.setattr(stats_mod, "BUSY_INTEGRITY_INTERVAL_S", 0.0)
    engine.stats(WorkerRole.COLOCATED)
    assert checks == [True]  # the interval passed: checked while busy
    engine.abort(req.request_id)
    engine.step()
    real_check()


def test_a_step_with_nothing_to_run_waits_for_a_tier_copy_instead_of_spinning(monkeypatch):
    """Callers step an engine while it is busy; with only a tier copy in flight (a backup to the host
    tier after the last request ended) a spinning caller starved the copier's thread of the GIL."""
    engine = make_engine()
    waits = []
    monkeypatch.setattr(engine.host_cache, "busy", lambda: True)
    monkeypatch.setattr(engine.host_cache, "wait_any", waits.append)
    engine.step()
    assert waits == [core_mod.IDLE_COPY_WAIT_S]  # no request at all: waited once
    engine.add_request(make_prompts(1)[0], SamplingParams(max_tokens=2, ignore_eos=True))
    waits.clear()
    engine.step()
    assert waits == []  # a forward ran: no wait
    monkeypatch.undo()
    while engine.busy():
        engine.step()
    assert_pool_at_rest(engine)


def test_close_hooks_run_in_order_after_the_parts_close_even_when_one_raises(monkeypatch):
    engine = make_engine()
    closed = []
    monkeypatch.setattr(engine.host_cache, "close", lambda: closed.append("host cache"))

    def broken_close():
        closed.append("structured")
        raise RuntimeError("a part's close raised")

    monkeypatch.setattr(engine.structured, "close", broken_close)
    engine.on_close(lambda: closed.append("first hook"))
    engine.on_close(lambda: closed.append("second hook"))
    with pytest.raises(RuntimeError, match="a part's close raised"):
        engine.close()
    assert closed == ["host cache", "structured", "first hook", "second hook"]
    assert_pool_at_rest(engine)
