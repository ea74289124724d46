"""`tandem bench decode` (cluster/bench/decode.py) on the tiny model: the graph mode's timed steps are all
replays and the eager mode's none, greedy outputs are identical eager / graph / HF's own generate, and
the command prints the table and writes every row as JSON. Timing is measured, never asserted. Each run
ends with its requests aborted and `engine.check_integrity()` inside the bench (`run_tandem`).

Also: `--no-cuda-graph` reaches the engine of `tandem run` and every worker group of `tandem serve`."""

from __future__ import annotations

import dataclasses
import json

from cluster.bench.decode import CPU_BACKENDS, DecodeSpec, bench_decode, compare, make_prompts, summarize
from cluster.cli.args import engine_config_from_args
from cluster.cli.main import build_parser
from cluster.serve.config_load import serve_config_from_args
from common.config import EngineConfig, SamplingParams
from engine import build_engine
from engine.graphs.runner import Fallback
from kernels.attention import BACKEND_NAMES
from tests.helpers import hf_greedy, tiny_models

BASE = EngineConfig(page_size=4, chunk_size=32, debug_kv=True)


class TinyModels:
    """The bench's `Models` over the seeded tiny Llama (torch or cpu attention) and its HF twin."""

    def ours(self, backend: str):
        from kernels.attention import get_backend
        from kernels.model.tiny import make_tiny_llama

        assert backend in CPU_BACKENDS, f"a GPU backend was timed on a CPU: {backend}"
        model, _ = make_tiny_llama(0)  # tiny_models()'s weights, its own instance: the backend is this run's
        model.use_attention_backend(get_backend(backend))
        return model, model.arch

    def hf(self):
        return tiny_models()[1]


def test_graph_steps_are_replays_eager_ones_not_and_outputs_match_hf():
    # batch 3 with chunk 32 and 12-token prompts: requests 0 and 1 decode while 2 still prefills, so the
    # bench must wait for every first token before timing (else a timed step would not be B rows)
    spec = DecodeSpec(batch_sizes=(1, 3), prompt_len=12, steps=5, warmup_steps=1)
    rows, skipped = compare(TinyModels(), BASE, spec, ("torch",))
    assert skipped == {}
    tandem = {(r.mode, r.batch): r for r in rows if r.system == "tandem"}
    hf = {r.batch: r for r in rows if r.system == "hf_transformers"}
    assert sorted(tandem) == [("eager", 1), ("eager", 3), ("graph", 1), ("graph", 3)] and sorted(hf) == [1, 3]
    for batch in spec.batch_sizes:
        eager, graph = tandem[("eager", batch)], tandem[("graph", batch)]
        assert len(eager.step_s) == len(graph.step_s) == len(hf[batch].step_s) == spec.steps
        assert graph.replays == spec.steps and graph.fallbacks == {}
        assert eager.replays == 0 and eager.fallbacks == {Fallback.DISABLED.value: spec.steps}
        assert graph.fallbacks_run.get(Fallback.NOT_DECODE.value, 0) >= 1  # the prefill steps ran eagerly
        assert eager.tokens == graph.tokens and len(eager.tokens) == batch
    _, reference, arch = tiny_models()
    prompts = make_prompts(spec, arch.vocab_size)
    for batch in spec.batch_sizes:
        for i, tokens in enumerate(tandem[("graph", batch)].tokens):
            assert list(tokens) == hf_greedy(reference, prompts[i], len(tokens)), (batch, i)
        assert hf[batch].tokens[0] == tandem[("eager", batch)].tokens[0][:1 + spec.warmup_steps + spec.steps]
    summary = summarize(rows, skipped, BASE, spec)
    assert summary["outputs_identical_eager_graph"] == {"torch/1": True, "torch/3": True}
    assert summary["first_request_identical_to_hf"] == {"1": True, "3": True}


def test_the_command_prints_the_table_and_writes_every_row(tmp_path, capsys):
    path = tmp_path / "decode.json"
    args = build_parser().parse_args([
        "bench", "decode", "--batch-sizes", "1,2", "--prompt-len", "8", "--steps", "4", "--warmup-steps", "1",
        "--page-size", "4", "--chunk-size", "32", "--json", str(path)])
    assert bench_decode(args, TinyModels()) == 0
    printed = capsys.readouterr().out
    for other in set(BACKEND_NAMES) - set(CPU_BACKENDS):  # GPU backends: a note on a CPU device, no rows
        assert f"note: backend {other} skipped: {other} is a GPU backend, not timed on cpu" in printed
    assert "greedy outputs eager vs graph (torch/2, every request): identical" in printed
    assert "request 0 vs HF generate (batch 2): identical" in printed
    summary = json.loads(path.read_text())
    got = [(r["system"], r["backend"], r["mode"], r["batch"]) for r in summary["rows"]]
    hf_backend = summary["rows"][-1]["backend"]
    assert got == [("tandem", backend, mode, batch) for backend in ("torch", "cpu") for batch in (1, 2)
                   for mode in ("eager", "graph")] + [("hf_transformers", hf_backend, "generate", 1),
                                                      ("hf_transformers", hf_backend, "generate", 2)]
    assert hf_backend.startswith("hf:")
    for r in summary["rows"]:
        assert r["steps"] == len(r["step_ms"]) == 4 and r["step_ms_p50"] > 0 and r["tokens_per_s"] > 0
        assert r["speedup_vs_eager"] > 0
        assert r["replays"] == (4 if r["mode"] == "graph" else 0)
        assert len(r["first_request_tokens"]) >= 1 + 1 + 4
    for line in ("torch     eager          1", "torch     graph          2"):
        assert line in printed
    assert set(summary["skipped_backends"]) == set(BACKEND_NAMES) - set(CPU_BACKENDS)


def test_no_cuda_graph_flag_reaches_run_and_every_serve_group():
    parser = build_parser()
    assert engine_config_from_args(parser.parse_args(["run", "--prompt", "x"])).cuda_graph is True
    config = engine_config_from_args(parser.parse_args(["run", "--prompt", "x", "--no-cuda-graph"]))
    assert config.cuda_graph is False
    serve = serve_config_from_args(parser.parse_args(["serve", "--num-colocated", "1", "--no-cuda-graph"]))
    groups = (serve.prefill, serve.decode, serve.colocated)
    assert [g.engine.cuda_graph for g in groups] == [False] * 3
    default = serve_config_from_args(parser.parse_args(["serve", "--num-colocated", "1"]))
    assert [g.engine.cuda_graph for g in (default.prefill, default.decode, default.colocated)] == [True] * 3
    # an engine with `run`'s setting runs every step eagerly: prefill + 3 decode steps, all counted disabled
    model, _, arch = tiny_models()
    engine = build_engine(dataclasses.replace(BASE, cuda_graph=config.cuda_graph, num_pages=32), model, arch)
    engine.generate([[5, 6, 7]], SamplingParams(max_tokens=4, ignore_eos=True))
    assert engine.runner.counters.replays == 0 and engine.runner.counters.fallbacks == {Fallback.DISABLED: 4}
    engine.check_integrity()
