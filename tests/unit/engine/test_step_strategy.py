"""The step strategy is chosen once, at build, from the config, the device, the model and the
resolved attention backend (`engine/graphs/strategy.py`), logged, and the graph runner does what it
says: C layers, a compile, CUDA graphs, the buffers, or nothing."""

from __future__ import annotations

import logging

import pytest
import torch

from common.config import EngineConfig, SamplingParams
from engine import build_engine
from engine.graphs.strategy import StepPlan, StepStrategy, choose_step_strategy
from kernels.cpu import native
from kernels.cpu.decode_layer import NativeDecode
from kernels.model.tiny import make_tiny_llama
from tests.helpers import hf_greedy

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


@pytest.fixture(scope="module")
def models():
    return make_tiny_llama(seed=11)


@pytest.fixture(scope="module")
def model(models):
    return models[0]


def choose(model, device=CPU, backend="cpu", **config) -> StepPlan:
    return choose_step_strategy(EngineConfig(**config), model, device, backend)


def test_the_table(model):
    assert native.kernel() is not None, "the C kernels did not build: no C compiler?"
    c_layers = choose(model)
    assert c_layers.strategy is StepStrategy.C_LAYERS and isinstance(c_layers.native, NativeDecode)
    assert choose(model, cpu_compile=True).strategy is StepStrategy.C_LAYERS  # C layers take precedence
    assert choose(model, cpu_native_decode=False, cpu_compile=True).strategy is StepStrategy.COMPILED
    assert choose(model, cpu_native_decode=False).strategy is StepStrategy.BUFFERS
    torch_backend = choose(model, backend="torch", cpu_compile=True)
    assert torch_backend.strategy is StepStrategy.COMPILED and "need the cpu attention backend" in torch_backend.why
    assert choose(model, cuda_graph=False).strategy is StepStrategy.EAGER
    cuda = choose(model, CUDA, "triton", cpu_compile=True)  # nothing here looks at a GPU: the device's kind only
    assert cuda.strategy is StepStrategy.CUDA_GRAPH and cuda.captures and cuda.native is None
    assert not choose(model, CUDA, "triton", cuda_graph=False).replays


def test_the_c_layers_need_the_kernels_and_a_model_they_take(model, monkeypatch):
    monkeypatch.setattr(native, "_loaded", [None])  # a machine without a C compiler
    plan = choose(model, cpu_compile=True)
    assert plan.strategy is StepStrategy.COMPILED and "the C layers do not take this model" in plan.why
    monkeypatch.undo()
    wrapped = torch.nn.Sequential(model)  # not a LlamaForCausalLM: keeps its own forward
    assert choose(wrapped).strategy is StepStrategy.BUFFERS


@pytest.mark.parametrize("config, backend, strategy, replayed_by", [
    (dict(), "cpu", StepStrategy.C_LAYERS, NativeDecode),
    (dict(attention_backend="torch"), "torch", StepStrategy.BUFFERS, None),
    (dict(cuda_graph=False), "cpu", StepStrategy.EAGER, None),
])
def test_build_engine_chooses_logs_and_the_runner_follows(models, caplog, config, backend, strategy, replayed_by):
    model, hf = models
    engine_config = EngineConfig(page_size=4, num_pages=64, chunk_size=32, max_running_requests=4, debug_kv=True,
                                 graph_batch_sizes=(1, 2, 4), **config)
    with caplog.at_level(logging.INFO, logger="engine.build"):
        engine = build_engine(engine_config, model, model.arch)
    try:
        runner = engine.runner
        assert model.backend.name == backend and runner.plan.strategy is strategy
        assert f"decode steps: {strategy.value}" in caplog.text
        assert {type(f) for f in runner._cpu_replays.values()} == ({replayed_by} if replayed_by else set())
        prompts = [[5, 6, 7, 8, 9], [3, 1, 4, 1, 5, 9, 2, 6]]
        out = engine.generate(prompts, [SamplingParams(max_tokens=6, ignore_eos=True)] * 2)
        assert [r.output_token_ids for r in out] == [hf_greedy(hf, p, 6) for p in prompts]
        assert (runner.counters.replays > 0) is (strategy is not StepStrategy.EAGER)
        engine.check_integrity()
    finally:
        engine.close()
