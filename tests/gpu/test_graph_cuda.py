"""CUDA graphs (engine/graphs/runner.py) on a GPU: captured per bucket, replayed in steady
decode with no fallback, greedy output identical eager vs graph vs HF, and the relocation gate.

Marked `gpu`; skipped where torch sees no CUDA device (CPU CI). Run with `pytest -m gpu`.
"""

import copy

import pytest
import torch

from common.config import EngineConfig
from engine import EngineCore, build_engine
from engine.graphs.runner import Fallback
from tests.helpers import assert_pool_at_rest, greedy, hf_greedy, make_prompts, tiny_models

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _engine(graph: bool, **kw) -> EngineCore:
    ours, _, arch = tiny_models()
    config = EngineConfig(device="cuda", num_pages=512, page_size=4, max_running_requests=16, max_model_len=256,
                          cuda_graph=graph, debug_kv=True, **kw)
    return build_engine(config, copy.deepcopy(ours).to("cuda"), arch)


def test_graphs_are_captured_per_bucket_and_replay_steady_decode_with_hf_output():
    _, ref, _ = tiny_models()
    prompts = make_prompts(12, seed=5)
    expect = [hf_greedy(ref, p, 24) for p in prompts]
    outputs = {}
    for graph in (False, True):
        engine = _engine(graph)
        reqs = engine.generate(prompts, greedy(max_tokens=24))
        outputs[graph] = [r.output_token_ids for r in reqs]
        c = engine.runner.counters
        if graph:
            assert set(engine.runner._graphs) == set(engine.runner.buckets) == {1, 2, 4, 8, 16}
            assert c.replays >= 23 and set(c.fallbacks) <= {Fallback.NOT_DECODE}
        assert_pool_at_rest(engine)
        engine.close()
    assert outputs[True] == outputs[False] == expect


def test_a_relocated_pool_is_never_replayed_with_stale_tables():
    engine = _engine(True)
    prompts = make_prompts(3, seed=9)
    reqs = [engine.add_request(p, greedy(max_tokens=12)) for p in prompts]
    schedule = engine.scheduler.schedule

    def schedule_then_relocate():
        step = schedule()
        engine.device_pool.bump_relocation_version()  # as a load-back finishing mid-step would
        return step

    engine.scheduler.schedule = schedule_then_relocate
    while any(r.status.name != "FINISHED" for r in reqs):
        engine.step()
    c = engine.runner.counters
    assert c.replays == 0 and c.fallbacks[Fallback.RELOCATED] > 0
    _, ref, _ = tiny_models()
    assert [r.output_token_ids for r in reqs] == [hf_greedy(ref, p, 12) for p in prompts]
    assert_pool_at_rest(engine)
    engine.close()
