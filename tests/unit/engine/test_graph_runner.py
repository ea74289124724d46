"""The graph runner (engine/graphs/runner.py) on CPU: buckets, padding to scratch page 0,
every gate and its fallback count, and the relocation hazard the gates exist for.

The reference for every replayed step is an eager step (`ModelRunner.forward`) over page tables
derived fresh from the requests, and HF greedy output for whole runs.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import pytest
import torch

from common.config import EngineConfig, SamplingParams
from engine.build import build_engine
from engine.graphs.capture import batch_buckets, bucket_for
from engine.graphs.runner import Fallback, GraphCounters, GraphRunner
from engine.graphs.strategy import StepPlan, StepStrategy
from engine.runner import ForwardRow
from engine.scheduler import ScheduledStep
from kernels.kv_layout import KVCacheTensors
from kv_store.copier import Direction, PageCopier
from tests.helpers import hf_greedy, make_engine, make_prompts, tiny_models


def test_buckets_default_to_powers_of_two_then_steps_of_eight_up_to_the_batch_limit():
    assert batch_buckets(64) == (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64)
    assert batch_buckets(6) == (1, 2, 4, 6)
    assert batch_buckets(1) == (1,)
    assert batch_buckets(20, sizes=(3, 12, 50)) == (3, 12, 20)  # given sizes, capped, plus the limit
    buckets = batch_buckets(64)
    assert [bucket_for(buckets, n) for n in (1, 3, 5, 9, 17, 64, 65)] == [1, 4, 8, 16, 24, 64, None]


def _decode_engine(num_prompts=3, **kw):
    """An engine whose next step is pure decode for `num_prompts` requests (prompts prefilled)."""
    engine = make_engine(max_running_requests=8, enable_prefix_cache=False, **kw)
    prompts = make_prompts(num_prompts, min_len=5, max_len=30, seed=7)
    reqs = [engine.add_request(p, SamplingParams(max_tokens=40, ignore_eos=True)) for p in prompts]
    while any(not r.output_token_ids for r in reqs):
        engine.step()
    engine.runner.counters = GraphCounters()
    return engine, reqs


def _fresh_rows(reqs) -> list[ForwardRow]:
    """Each request's next decode row, its page table read from the request now."""
    return [ForwardRow([r.all_token_ids[r.kv.kv_committed_len]], r.kv.kv_committed_len + 1, list(r.kv.pages), True)
            for r in reqs]


def _step(engine, reqs) -> ScheduledStep:
    step = ScheduledStep(requests=list(reqs), rows=_fresh_rows(reqs),
                         relocation_version=engine.device_pool.relocation_version)
    return step


def test_a_replayed_step_pads_to_its_bucket_on_scratch_page_0_and_matches_eager():
    engine, reqs = _decode_engine(3)  # 3 rows -> bucket 4: one padding row
    runner = engine.runner
    kv = engine.kv_cache
    before = [t.clone() for t in kv.k + kv.v]
    step = _step(engine, reqs)
    logits = runner.run(step).logits
    assert runner.counters.replays == 1 and not runner.counters.fallbacks
    written = {r.pages[(r.seq_len - 1) // kv.page_size] for r in step.rows}
    for layer_before, layer_after in zip(before, kv.k + kv.v):
        changed = {p for p in range(layer_after.shape[0]) if not torch.equal(layer_before[p], layer_after[p])}
        assert changed <= written | {0}, f"pages {changed - written - {0}} written by a replay"
        assert torch.equal(layer_before[0, 1:], layer_after[0, 1:]), "padding wrote past slot 0 of scratch page 0"
    eager = runner.eager.forward(_fresh_rows(reqs)).logits
    torch.testing.assert_close(logits, eager, rtol=1e-5, atol=1e-5)
    assert logits.shape[0] == 3
    engine.check_integrity()
    engine.close()


@dataclass(frozen=True)
class _FakeLoad:
    dst_pages: tuple[int, ...]


def test_every_gate_counts_its_fallback_and_runs_eagerly():
    engine, reqs = _decode_engine(3)
    runner, pool = engine.runner, engine.device_pool
    expected = runner.eager.forward(_fresh_rows(reqs)).logits

    def run(step) -> torch.Tensor:
        return runner.run(step).logits

    # a load in flight writing one of the batch's pages
    runner.loads_in_flight = lambda: frozenset({_FakeLoad((reqs[1].kv.pages[0],))})
    torch.testing.assert_close(run(_step(engine, reqs)), expected)
    assert runner.counters.fallbacks[Fallback.LOAD_IN_FLIGHT] == 1 and runner.counters.replays == 0
    runner.loads_in_flight = lambda: frozenset({_FakeLoad((10_000,))})  # a load elsewhere: no reason to wait
    run(_step(engine, reqs))
    assert runner.counters.replays == 1
    runner.loads_in_flight = frozenset

    # the pool relocated after the rows were derived: rows derived again, step eager
    step = _step(engine, reqs)
    step.rows = [ForwardRow(r.token_ids, r.seq_len, [0] * len(r.pages), True) for r in step.rows]  # stale tables
    pool.bump_relocation_version()
    torch.testing.assert_close(run(step), expected)
    assert runner.counters.fallbacks[Fallback.RELOCATED] == 1
    assert step.relocation_version == pool.relocation_version and step.rows == _fresh_rows(reqs)

    # a prefill row in the batch
    step = _step(engine, reqs)
    step.rows[0] = ForwardRow(reqs[0].all_token_ids[:3], 3, list(reqs[0].kv.pages), True)
    run(step)
    assert runner.counters.fallbacks[Fallback.NOT_DECODE] == 1

    # more rows than the largest bucket, and a page table wider than the captured width
    small = GraphRunner(runner.eager, pool, max_batch=2, max_model_len=8)
    small.run(_step(engine, reqs))
    small.run(_step(engine, reqs[:1]))  # its table needs more than 8 / page_size pages
    assert small.counters.fallbacks == {Fallback.BATCH_TOO_LARGE: 1, Fallback.CONTEXT_TOO_LONG: 1}

    off = GraphRunner(runner.eager, pool, max_batch=8, max_model_len=128, plan=StepPlan(StepStrategy.EAGER))
    torch.testing.assert_close(off.run(_step(engine, reqs)).logits, expected)
    assert off.counters.fallbacks == {Fallback.DISABLED: 1} and off.counters.replays == 0
    assert runner.counters.replays == 1  # only the step with nothing against it replayed
    engine.check_integrity()
    engine.close()


def test_greedy_output_is_hf_with_graphs_on_and_off_and_steady_decode_never_falls_back():
    _, ref, _ = tiny_models()
    prompts = make_prompts(5, seed=3)
    for graph in (True, False):
        engine = make_engine(cuda_graph=graph, max_running_requests=6)
        reqs = engine.generate(prompts, SamplingParams(max_tokens=10, ignore_eos=True))
        assert [r.output_token_ids for r in reqs] == [hf_greedy(ref, p, 10) for p in prompts]
        c = engine.runner.counters
        if graph:
            assert c.replays >= 9 and set(c.fallbacks) == {Fallback.NOT_DECODE}  # prefill steps only
        else:
            assert c.replays == 0 and set(c.fallbacks) == {Fallback.DISABLED}
        assert engine.graph_stats().replays == c.replays
        engine.check_integrity()
        engine.close()


def test_the_tokens_forwards_compute_are_counted_and_a_cached_prefix_is_not():
    """`GraphStats.computed_tokens`, graphs on and off: a prompt's tokens and each output token but the
    last (never fed back); the same prompt again computes only what its cached prefix leaves."""
    prompt = make_prompts(1, seed=5)[0]
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    for graph in (True, False):
        engine = make_engine(cuda_graph=graph)
        (first,) = engine.generate([prompt], params)
        assert first.cached_tokens == 0 and engine.graph_stats().computed_tokens == len(prompt) + 5
        (again,) = engine.generate([prompt], params)
        assert again.cached_tokens > 0
        assert engine.graph_stats().computed_tokens == 2 * (len(prompt) + 5) - again.cached_tokens
        engine.check_integrity()
        engine.close()


def test_cpu_native_replays_give_hf_greedy_output_and_compile_nothing():
    """By default a CPU float32 engine's decode steps of up to four requests run their layers in C:
    buckets 1, 2 and 4 replay through it (3 requests: bucket 4 with a padding row on scratch page 0),
    nothing is compiled (even with cpu_compile), and every output is HF's greedy."""
    import torch._dynamo

    from kernels.cpu.decode_layer import MAX_ROWS, NativeDecode

    _, ref, _ = tiny_models()
    prompts, max_tokens = [*make_prompts(3, seed=6), [7]], [12, 5, 9, 7]  # [7]: a lone request inside its first page
    graphs_before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    engine = make_engine(cuda_graph=True, cpu_compile=True, max_running_requests=8, graph_batch_sizes=(1, 2, 4, 8))
    try:
        assert MAX_ROWS == 4 and not engine.runner.compiling()
        assert {b for b, f in engine.runner._cpu_replays.items() if isinstance(f, NativeDecode)} == {1, 2, 4}
        calls = {b: _count_calls(engine.runner, b) for b in (1, 2, 4)}
        params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in max_tokens]
        reqs = engine.generate(prompts[:3], params[:3]) + engine.generate(prompts[3:], params[3:])
        assert [r.output_token_ids for r in reqs] == [hf_greedy(ref, p, n) for p, n in zip(prompts, max_tokens)]
        assert calls[4]() >= 3 and calls[2]() >= 3 and calls[1]() >= 9  # 3 rows, then 2, then 1 (and the lone one)
        assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs_before
        engine.check_integrity()
    finally:
        engine.close()


@pytest.mark.isa
def test_cpu_native_bf16_replays_every_bucket_where_onednn_has_no_bf16_and_matches_the_torch_path(monkeypatch):
    """A bfloat16 engine on a CPU without bf16 dot products (forced) replays every decode bucket through
    the C layers (torch's bf16 matmul there: ~14 GFLOP/s), and its greedy tokens are those of the same
    engine stepping through torch's bf16 ops (`--no-cpu-native-decode`), batch sizes 1 to 5."""
    from kernels.cpu.decode_layer import NativeDecode
    from kernels.model import packed_linear
    from kernels.model.loader import make_tiny_llama

    monkeypatch.setitem(packed_linear._cpu_packing, torch.bfloat16, False)
    model, _ = make_tiny_llama(0, dtype=torch.bfloat16)
    arch = tiny_models()[2]
    prompts = make_prompts(5, seed=8)
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (10, 7, 12, 5, 9)]
    outputs = {}
    for native in (True, False):
        config = EngineConfig(page_size=4, num_pages=256, chunk_size=64, debug_kv=True, dtype="bfloat16",
                              cuda_graph=True, cpu_native_decode=native, max_running_requests=8,
                              graph_batch_sizes=(1, 2, 4, 8))
        engine = build_engine(config, model, arch)
        try:
            served = {b for b, f in engine.runner._cpu_replays.items() if isinstance(f, NativeDecode)}
            assert served == ({1, 2, 4, 8} if native else set())
            outputs[native] = [r.output_token_ids for r in engine.generate(prompts, params)]
            assert engine.graph_stats().replays >= 10
            engine.check_integrity()
        finally:
            engine.close()
    assert outputs[True] == outputs[False]


def test_cpu_compiled_replays_give_hf_greedy_output_with_no_compile_after_start_up():
    import torch._dynamo

    _, ref, _ = tiny_models()
    # the batch shrinks 3 -> 2 -> 1, so every bucket replays; the last request runs alone from inside
    # its first page (4 tokens), a page count the warm-up (2 pages) did not see
    prompts = [*make_prompts(3, seed=4), [7]]
    max_tokens = [14, 9, 4, 6]
    torch._dynamo.reset()
    engine = make_engine(cuda_graph=True, cpu_compile=True, cpu_native_decode=False, max_running_requests=3,
                         graph_batch_sizes=(1, 2, 3))
    try:
        # bucket 1 (where compiling pays on a CPU) replays through the compiled forward; 2 and 3 eagerly
        assert set(engine.runner._cpu_replays) == {1}
        frames_after_warm_up = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        compiled_calls = _count_calls(engine.runner, 1)
        params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in max_tokens]
        reqs = engine.generate(prompts[:3], params[:3]) + engine.generate(prompts[3:], params[3:])
        assert [r.output_token_ids for r in reqs] == [hf_greedy(ref, p, n) for p, n in zip(prompts, max_tokens)]
        c = engine.runner.counters
        assert c.replays >= 18 and set(c.fallbacks) == {Fallback.NOT_DECODE}
        assert compiled_calls() >= 10  # the single-row tail of the longest request, and the lone one
        # the start-up warm-up compiled what decode needed: no graph was compiled while serving
        assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == frames_after_warm_up
        engine.check_integrity()
    finally:
        engine.close()
        torch._dynamo.reset()


def _background_engine(monkeypatch, first_call=lambda: None):
    """A served worker's engine (its compile started later, on a thread) whose compiled forward runs
    `first_call()` first."""
    from common.config import EngineConfig
    from engine import build_engine
    from kernels.cpu import compiled as compiled_module

    class Gated(compiled_module.CompiledLayers):
        made: list = []  # one entry a compiled forward made

        def __init__(self, model):
            Gated.made.append(model)
            super().__init__(model)

        def forward_with_aux(self, *args):
            first_call()
            return super().forward_with_aux(*args)

    monkeypatch.setattr(compiled_module, "CompiledLayers", Gated)  # the runner imports it when it compiles
    ours, _, arch = tiny_models()
    config = EngineConfig(page_size=4, num_pages=256, chunk_size=64, debug_kv=True, cuda_graph=True,
                          cpu_compile=True, cpu_native_decode=False, max_running_requests=2, graph_batch_sizes=(1, 2))
    return build_engine(config, ours, arch, compile_in_background=True)


def test_a_served_worker_decodes_eagerly_while_compiling_then_compiled_with_hf_greedy_output(monkeypatch):
    """The compile waits for `start_compile` (a served worker's loop, once ready): requests replay
    bucket 1 eagerly before it, run while it compiles on its thread (for the loop's torch thread
    count and another), and replay compiled once it is done, on either count with no compile while
    serving. Every output is HF's greedy."""
    import torch._dynamo

    _, ref, _ = tiny_models()
    torch._dynamo.reset()
    graphs_at_start = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    engine = _background_engine(monkeypatch)
    try:
        prompts, params = make_prompts(2, seed=9), [SamplingParams(max_tokens=n, ignore_eos=True) for n in (5, 12)]
        want = [hf_greedy(ref, p, sp.max_tokens) for p, sp in zip(prompts, params)]
        eager = engine.generate(prompts, params)  # the compile has not begun: bucket 1 replays eagerly
        assert not engine.runner._cpu_replays and engine.runner.counters.replays >= 10
        # not even set up before the loop starts it (torch.compile's imports would delay "ready")
        assert not _compiled_made()
        assert [r.output_token_ids for r in eager] == want
        assert engine.graph_stats().compiling  # to start: the heartbeat says so
        mine = torch.get_num_threads()
        other = 1 if mine > 1 else 2  # a step on borrowed cores runs on another count
        engine.runner.start_compile(thread_counts=(other,))
        during = engine.generate(prompts, params)  # most likely while it compiles: one thread each
        assert [r.output_token_ids for r in during] == want
        assert engine.runner.wait_compiled(120)
        assert set(engine.runner._cpu_replays) == {1} and not engine.graph_stats().compiling
        assert len(_compiled_made()) == 1
        graphs_when_compiled = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        compiled_calls = _count_calls(engine.runner, 1)
        again = engine.generate(prompts, params)
        torch.set_num_threads(other)
        try:
            on_other = engine.generate(prompts, params)
        finally:
            torch.set_num_threads(mine)
        assert [r.output_token_ids for r in again] == want and [r.output_token_ids for r in on_other] == want
        assert compiled_calls() >= 12  # the longer request's single-row tail, on each thread count
        # compiled for both counts beside serving: neither compiles again while serving, not even the
        # first compiled step, whenever it came (one graph a thread count, all made by the compile)
        assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs_when_compiled == graphs_at_start + 2
        engine.check_integrity()
    finally:
        engine.runner.wait_compiled(120)
        engine.close()
        torch._dynamo.reset()


def test_a_served_worker_maps_its_kv_pool_in_once_its_compile_is_over(monkeypatch):
    """Populating the pool holds the process's address space a chunk at a time, and the compile's
    allocations waited on it (~1.5x the compile's time): a served worker starts it after the compile.
    The pool stays unmapped while the compile is held, and is mapped in whole once it ends. While it
    compiles, the worker holds a core (lends its threads to no other worker) and the interpreter
    hands the GIL back to the serving loop within 0.1 ms (not Python's 5 ms), and neither after."""
    import sys
    import threading

    from engine.worker_base import EngineWorker
    from tests.unit.kernels.test_kv_layout import _pool_kib

    compiling, release = threading.Event(), threading.Event()

    def hold():
        compiling.set()
        assert release.wait(60), "the test never released the compile"

    engine = _background_engine(monkeypatch, hold)
    try:
        whole_kib = sum(t.numel() * t.element_size() for t in engine.kv_cache.k + engine.kv_cache.v) // 1024
        worker = EngineWorker(engine)
        worker.start()
        assert compiling.wait(120), "the compile never ran its first step"
        assert worker.holds_a_core() and sys.getswitchinterval() == pytest.approx(1e-4)
        time.sleep(0.5)  # a populate started beside the compile would be well under way
        assert _pool_kib(engine.kv_cache) < whole_kib // 4, "populating began before the compile ended"
        release.set()
        assert engine.runner.wait_compiled(120) and set(engine.runner._cpu_replays) == {1}
        assert not worker.holds_a_core() and sys.getswitchinterval() == pytest.approx(0.005)
        deadline = time.monotonic() + 30
        while _pool_kib(engine.kv_cache) < whole_kib:
            assert time.monotonic() < deadline, f"{_pool_kib(engine.kv_cache)} of {whole_kib} KiB mapped in"
            time.sleep(0.1)
        engine.check_integrity()
    finally:
        release.set()
        engine.runner.wait_compiled(120)
        engine.close()


def test_an_engine_made_alone_is_mapped_in_unless_told_not_to():
    """A bench's engine runs at full speed at once (its pool mapped in before `build_engine` returns);
    `tandem run`'s (populate=False) leaves the pool to fault in as it is written: a one-shot run
    writes a small part of it, and mapping SmolLM2's whole default pool in took ~3 s."""
    from tests.unit.kernels.test_kv_layout import _pool_kib

    for populate in (True, False):
        ours, _, arch = tiny_models()
        engine = build_engine(EngineConfig(page_size=4, num_pages=4096, debug_kv=True), ours, arch, populate=populate)
        try:
            whole_kib = sum(t.numel() * t.element_size() for t in engine.kv_cache.k + engine.kv_cache.v) // 1024
            mapped = _pool_kib(engine.kv_cache)
            assert mapped >= whole_kib * 9 // 10 if populate else mapped < whole_kib // 4, (populate, mapped, whole_kib)
            engine.check_integrity()
        finally:
            engine.close()


def test_start_compile_runs_then_at_once_where_nothing_compiles():
    engine = make_engine(max_running_requests=2)
    try:
        ran = []
        engine.runner.start_compile(then=lambda: ran.append(1))
        assert ran == [1] and not engine.graph_stats().compiling
        engine.check_integrity()
    finally:
        engine.close()


def test_a_failed_background_compile_leaves_the_step_eager(monkeypatch, caplog):
    def fail():
        raise RuntimeError("inductor broke")

    _, ref, _ = tiny_models()
    engine = _background_engine(monkeypatch, fail)
    try:
        engine.runner.start_compile()
        assert engine.runner.wait_compiled(60) and not engine.runner._cpu_replays and not engine.graph_stats().compiling
        assert "compiling the CPU decode step failed: batch size 1 stays eager" in caplog.text
        prompt = make_prompts(1, seed=10)[0]
        (req,) = engine.generate([prompt], [SamplingParams(max_tokens=6, ignore_eos=True)])
        assert req.output_token_ids == hf_greedy(ref, prompt, 6)
        engine.check_integrity()
    finally:
        engine.close()


def _compiled_made() -> list:
    from kernels.cpu import compiled as compiled_module

    return compiled_module.CompiledLayers.made


def _count_calls(runner, bucket: int):
    """Wraps the compiled forward of `bucket`; returns a function giving how often it ran."""
    compiled, calls = runner._cpu_replays[bucket], []

    def counting(*args):
        calls.append(1)
        return compiled(*args)

    runner._cpu_replays[bucket] = counting
    return lambda: len(calls)


class _Relocator:
    """Moves one running request's KV to other device pages on the background copy path (device ->
    host -> device on a `PageCopier` thread, as an eviction and a load-back would), scribbles over
    the pages it left, frees them, and bumps the pool's relocation version — after the scheduler
    derived the step's rows and before the runner runs them."""

    def __init__(self, engine):
        self.engine = engine
        self.host = KVCacheTensors.allocate(len(engine.kv_cache.k), 64, engine.kv_cache.page_size,
                                            engine.kv_cache.k[0].shape[2], engine.kv_cache.k[0].shape[3],
                                            engine.kv_cache.k[0].dtype, "cpu")
        self.copier = PageCopier(engine.kv_cache, self.host, name="test-relocator")
        self.moves = 0

    def relocate(self, req) -> None:
        pool, kv = self.engine.kvm.pool, req.kv
        old = list(kv.pages)
        new = pool.alloc(len(old), kv.req_id)
        host = list(range(1, len(old) + 1))
        for job in (self.copier.submit(Direction.TO_HOST, old, host),
                    self.copier.submit(Direction.TO_DEVICE, host, new)):
            assert job.wait(10.0) and job.error is None
        kv.pages[:] = new  # test-only: a relocation the KVManager does not know
        for t in self.engine.kv_cache.k + self.engine.kv_cache.v:
            t[old] = 7.0  # what a later owner of those pages might write
        pool.free(old, kv.req_id)
        self.engine.device_pool.bump_relocation_version()
        self.moves += 1


def _run_with_relocations(gated: bool) -> tuple[int, int, int]:
    """(steps compared, steps whose logits differ from a fresh eager step, relocations)."""
    engine, reqs = _decode_engine(3, num_pages=96)
    engine.runner.gated = gated
    relocator = _Relocator(engine)
    schedule, run = engine.scheduler.schedule, engine.runner.run
    compared, wrong = [0], [0]

    def schedule_then_relocate():
        step = schedule()
        if step.rows and compared[0] % 2 == 0:
            relocator.relocate(step.requests[compared[0] // 2 % len(step.requests)])
        return step

    def run_and_compare(step):
        logits = run(step).logits
        fresh = engine.runner.eager.forward([ForwardRow(r.token_ids, r.seq_len, list(q.kv.pages), r.wants_logits)
                                             for q, r in zip(step.requests, step.rows)])
        compared[0] += 1
        wrong[0] += not torch.allclose(logits, fresh.logits, rtol=1e-4, atol=1e-4)
        return fresh

    engine.scheduler.schedule, engine.runner.run = schedule_then_relocate, run_and_compare
    for _ in range(12):
        engine.step()
    relocator.copier.close()
    engine.check_integrity()
    engine.close()
    return compared[0], wrong[0], relocator.moves


def test_relocation_hazard_gated_steps_match_a_fresh_eager_step():
    compared, wrong, moves = _run_with_relocations(gated=True)
    assert compared == 12 and moves == 6 and wrong == 0


def test_relocation_hazard_without_the_gate_replays_stale_page_tables():
    compared, wrong, moves = _run_with_relocations(gated=False)
    assert compared == 12 and moves == 6
    assert wrong >= moves, f"only {wrong} of {compared} steps read stale KV without the gate"


@pytest.mark.parametrize("page_size", [1, 16])
def test_replay_over_page_sizes_matches_hf(page_size):
    _, ref, _ = tiny_models()
    prompts = make_prompts(3, seed=11)
    engine = make_engine(page_size=page_size, max_running_requests=4)
    reqs = engine.generate(prompts, SamplingParams(max_tokens=8, ignore_eos=True))
    assert [r.output_token_ids for r in reqs] == [hf_greedy(ref, p, 8) for p in prompts]
    assert engine.runner.counters.replays > 0
    engine.check_integrity()
    engine.close()
