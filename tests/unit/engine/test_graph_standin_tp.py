"""CUDA graphs under tensor parallelism, on the CPU: two ranks (this process rank 0, a spawned rank 1,
gloo on loopback), both capturing the stand-in graphs of `test_graph_standin.py` (a replay re-runs the
body as captured, all-reduces included, over the refilled static buffers) with the Triton backend
under the interpreter. Rank 0 sends each replay (bucket and rows) and every rank replays its own
capture, so a bucket captured or refilled differently on a rank, or a replay a rank misses, gives
other tokens than transformers' (or leaves the ranks' collectives out of step)."""

from __future__ import annotations

import multiprocessing as mp
import shutil

import pytest
import torch

import engine.build as engine_build
import engine.tp_launch as tp_launch
from common.config import EngineConfig, SamplingParams
from engine.graphs.strategy import StepPlan, StepStrategy
from engine.tp import LeadGraphRunner
from kernels.model.convert import resolve_model_dir
from tests.unit.engine.test_graph_standin import capture_standin, replayed_tokens
from tests.unit.engine.test_model_families import reference

pytestmark = pytest.mark.slow

VOCAB = 49152  # SmolLM2's tokenizer beside the checkpoint
PROMPTS = ["The harbour town was quiet before the boats came in", "A recipe for bread starts with flour,",
           "List the days of the week: Monday,"]
NEW_TOKENS = (9, 6, 11)


def _graph_plan(*args) -> StepPlan:
    return StepPlan(StepStrategy.CUDA_GRAPH, "stand-in for CUDA graphs")


def install_standins() -> None:
    """Every capture of this process makes stand-ins, and its step plan is CUDA graphs."""
    import engine.graphs.draft as draft_graphs
    import engine.graphs.runner as graph_runner
    import engine.graphs.tree as tree_graphs

    for module in (graph_runner, tree_graphs, draft_graphs):
        module.capture_graph = capture_standin
    torch.cuda.mem_get_info = lambda device=None: (0, 0)
    torch.cuda.synchronize = lambda device=None: None
    engine_build.choose_step_strategy = _graph_plan
    tp_launch.choose_step_strategy = _graph_plan


def standin_follower_main(*args) -> None:
    """Rank 1's process: the stand-ins installed, then the real `follower_main`."""
    install_standins()
    tp_launch.follower_main(*args)


def test_tp2_decode_replays_of_captured_graphs_give_transformers_tokens(monkeypatch, tmp_path):
    from kernels.model.tokenizer import load_tokenizer

    model = reference("qwen3", vocab_size=VOCAB, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model.save_pretrained(tmp_path)
    for file in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(resolve_model_dir("smollm2") / file, tmp_path / file)
    tokenizer = load_tokenizer(tmp_path)
    prompts = [tokenizer.encode(p, add_special_tokens=False) for p in PROMPTS]
    expected = []
    with torch.no_grad():
        for ids, n in zip(prompts, NEW_TOKENS):
            out = model.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                 eos_token_id=None, pad_token_id=0)
            expected.append(out[0, len(ids):].tolist())

    for module in ("engine.graphs.runner", "engine.graphs.tree", "engine.graphs.draft"):
        monkeypatch.setattr(f"{module}.capture_graph", capture_standin)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (0, 0))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(engine_build, "choose_step_strategy", _graph_plan)
    monkeypatch.setattr(tp_launch, "follower_main", standin_follower_main)  # what rank 1's process runs
    config = EngineConfig(model=str(tmp_path), tensor_parallel_size=2, page_size=4, num_pages=64, chunk_size=32,
                          debug_kv=True, attention_backend="triton", cuda_graph=True, graph_batch_sizes=(1, 2, 4),
                          max_running_requests=4, max_model_len=64)
    others = set(mp.active_children())  # any that another test left running
    engine = tp_launch.load_tp_engine(config)
    try:
        runner = engine.runner
        assert sorted(runner._graphs) == [1, 2, 4] and isinstance(runner, LeadGraphRunner)
        params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in NEW_TOKENS]
        assert replayed_tokens(engine, prompts, params) == expected
        engine.check_integrity()
        assert set(mp.active_children()) - others, "rank 1 runs beside rank 0"
    finally:
        engine.close()
    assert not set(mp.active_children()) - others  # rank 0's close stopped rank 1 and reaped it
