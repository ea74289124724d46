"""The CUDA-graph path of the engine with the Triton backend, on the CPU: a stand-in for
`torch.cuda.CUDAGraph` freezes what a capture freezes, the metadata built at capture (capacity
lengths: what sizes the kernels' grids and splits on the host), the body as it ran (its closure's
values: a capture loop's bucket and buffers) and the output tensors, and each replay re-runs that
body over the refilled static buffers and writes into those outputs. So a replay that depends on
host values of the step it replays (lengths, splits, a batch size), or reads a buffer the runner did
not refill, gives other tokens (or drafts) than the eager engine: the part of a GPU run that is
about the runner, not the device, checked here under the Triton interpreter.

Covered: the decode buckets (`graphs/runner.py`); with EAGLE chains, verify rows replayed as decode
rows and the head's calls (`graphs/draft.py` `HeadGraphs`); with EAGLE trees, full tree verify rows
(`graphs/tree.py`) and the head's tree levels (`HeadTreeGraphs`).
"""

from __future__ import annotations

import contextlib
import random
import types

import torch

import engine.build as engine_build
import engine.graphs.draft as draft_graphs
import engine.graphs.runner as graph_runner
import engine.graphs.tree as tree_graphs
from common.config import EngineConfig, SamplingParams
from engine import build_engine
from engine.graphs.runner import Fallback
from engine.graphs.strategy import StepPlan, StepStrategy
from kernels.model.tiny import make_tiny_llama
from tests.helpers import make_prompts, tiny_draft_head

CAPACITY = 16 * 4
"""Tokens of a captured page table: every engine here has max_model_len 64 at page size 4."""


class StandInGraph:
    """What `torch.cuda.graph` would have captured: `body` as it ran at the capture, over the
    capture's metadata, writing into the outputs the capture returned (a `ForwardOut`, or the
    head's (x, logits))."""

    def __init__(self, body, meta, out):
        self.body, self.meta, self.out = _frozen(body), meta, out
        self.replays = 0

    def replay(self) -> None:
        new = self.body(self.meta)
        with torch.inference_mode():  # the outputs are the capture's (inference) tensors, written in place
            _write(self.out, new)
        self.replays += 1

    def pool(self) -> None:
        return None


def _frozen(body):
    """`body` with its closure's values as they are at the capture: a capture loop's lambda reads the
    loop's last `bucket` when called later, where a graph keeps the kernels its capture launched. A
    `functools.partial` (or any callable without a closure) has bound its values already."""
    if not getattr(body, "__closure__", None):
        return body
    cells = tuple(types.CellType(cell.cell_contents) for cell in body.__closure__)
    return types.FunctionType(body.__code__, body.__globals__, body.__name__, body.__defaults__, cells)


def _write(dst, src) -> None:
    """Copy a replay's outputs into the captured ones (tensors, tuples of them, None)."""
    if isinstance(dst, torch.Tensor):
        dst.copy_(src)
    elif dst is not None:
        for d, s in zip(dst, src, strict=True):
            _write(d, s)


def capture_standin(body, make_meta, backend, device, pool):
    for _ in range(2):  # the warm-ups a capture runs
        body(make_meta())
    meta = make_meta()
    backend.prepare_graph_decode(meta)
    out = body(meta)
    return StandInGraph(body, meta, out), out


@contextlib.contextmanager
def standin_capture(monkeypatch):
    """Every capture path (decode buckets, tree verify, the head's chains and tree levels) captures
    stand-ins."""
    for module in (graph_runner, tree_graphs, draft_graphs):
        monkeypatch.setattr(module, "capture_graph", capture_standin)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (0, 0))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    yield


def build_standin_engine(monkeypatch, config: EngineConfig, model, head=None):
    """An engine built as on CUDA (step plan `cuda_graph`: everything captured at build), capturing stand-ins."""
    monkeypatch.setattr(engine_build, "choose_step_strategy",
                        lambda *args: StepPlan(StepStrategy.CUDA_GRAPH, "stand-in for CUDA graphs"))
    with standin_capture(monkeypatch):
        return build_engine(config, model, model.arch, draft_head=head)


def test_triton_decode_replays_from_captured_metadata_give_the_eager_engines_tokens(monkeypatch):
    model, _ = make_tiny_llama(7, num_hidden_layers=2)
    prompts = make_prompts(3, min_len=5, max_len=23, seed=4)  # lengths cross the 16-token Triton tiles
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (9, 6, 11)]
    reference = build_engine(EngineConfig(page_size=4, num_pages=64, chunk_size=32, debug_kv=True,
                                          attention_backend="torch", cuda_graph=False), model, model.arch)
    try:
        expected = [r.output_token_ids for r in reference.generate(prompts, params)]
        reference.check_integrity()
    finally:
        reference.close()
    config = EngineConfig(page_size=4, num_pages=64, chunk_size=32, debug_kv=True, attention_backend="triton",
                          cuda_graph=True, graph_batch_sizes=(1, 2, 4), max_running_requests=4, max_model_len=64,
                          cpu_native_decode=False)
    engine = build_standin_engine(monkeypatch, config, model)
    try:
        runner = engine.runner
        assert sorted(runner._graphs) == [1, 2, 4] and model.backend.name == "triton"
        captured_lens = {b: g.graph.meta.seq_lens_cpu for b, g in runner._graphs.items()}
        assert all(lens == (CAPACITY,) * b for b, lens in captured_lens.items())  # capacity, not a step's
        assert replayed_tokens(engine, prompts, params) == expected
        engine.check_integrity()
    finally:
        engine.close()


def replayed_tokens(engine, prompts, params) -> list[list[int]]:
    """Each request's tokens; its decode steps were replays of the stand-in graphs (8 at least)."""
    runner = engine.runner
    got = [r.output_token_ids for r in engine.generate(prompts, params)]
    replays = sum(g.graph.replays for g in runner._graphs.values())
    assert runner.counters.replays == replays >= 8, (runner.counters, replays)
    return got


# ---- speculative decoding ---------------------------------------------------------------------------
ACCEPT = 0.7
"""How often a steered draft is the true token (`_steer_drafts`): runs of every accepted length."""


def _spec_config(**kw) -> EngineConfig:
    """Two requests at most, both prefilled in one step (chunk 64); the policy drafts every step
    (not adaptive: no timing decides which steps verify)."""
    return EngineConfig(**{"page_size": 4, "num_pages": 64, "chunk_size": 64, "debug_kv": True,
                           "max_running_requests": 2, "max_model_len": 64, "cpu_native_decode": False,
                           "speculative": "eagle", "speculative_adaptive": False, **kw})


def _plain_tokens(model, prompts, params) -> list[list[int]]:
    """The independent reference: no speculation, torch attention, every step eager."""
    config = EngineConfig(page_size=4, num_pages=64, chunk_size=64, debug_kv=True, attention_backend="torch",
                          cuda_graph=False)
    engine = build_engine(config, model, model.arch)
    try:
        out = [r.output_token_ids for r in engine.generate(prompts, params)]
        engine.check_integrity()
        return out
    finally:
        engine.close()


def _run_recording(engine, prompts, params) -> tuple[list[list[int]], list, list[tuple[str, bool]]]:
    """(tokens, each step's drafts (tokens, tree parents) per running request, each target step's
    (kind, replayed)): kind "tree" when every row is a full tree verify row (a tree of the engine's
    whole depth), "verify" when a row is a chain verify row, else "other"."""
    full_tree = engine.runner.trees.q if engine.runner.trees is not None else None
    drafts, steps = [], []
    speculator, runner = engine.speculator, engine.runner
    draft, run = speculator.draft, runner.run

    def spy_draft(running, *args):
        draft(running, *args)
        drafts.append([(tuple(r.spec.token_ids), r.spec.parents) for r in running])

    def spy_run(step):
        before = runner.counters.replays
        out = run(step)
        kind = ("tree" if all(r.draft_parents is not None and len(r.token_ids) == full_tree for r in step.rows)
                else "verify" if any(r.num_draft_tokens and r.draft_parents is None for r in step.rows) else "other")
        steps.append((kind, runner.counters.replays > before))
        return out

    speculator.draft, runner.run = spy_draft, spy_run
    tokens = [r.output_token_ids for r in engine.generate(prompts, params)]
    return tokens, drafts, steps


def _steer_drafts(engine, truth: dict[tuple, list[int]], accept: float, seed: int = 0) -> None:
    """Drafts the verify accepts: with probability `accept` a draft the head made becomes the true
    continuation (`truth`: prompt -> greedy output), a chain's drawn token or, in a tree, a frontier
    node under the true path (at random: accepted paths through later siblings move their K/V).
    The head still runs every call and makes every other choice, a tree's shape included, so what
    its replays compute still decides the drafts; and the verify rows' later logits now decide tokens."""
    rng = random.Random(seed)
    speculator = engine.speculator
    draw_rows, grow = speculator._draw_rows, speculator._grow

    def draw(reqs, logits, j):
        drawn = draw_rows(reqs, logits, j)
        for i, req in enumerate(reqs):
            true, n = truth[tuple(req.prompt_token_ids)], len(req.output_token_ids) + j
            if n < len(true) and rng.random() < accept:
                drawn[i] = true[n]
        return drawn

    def grow_steered(reqs, trees, logits, starts, d):
        parent_rows = grow(reqs, trees, logits, starts, d)
        for req in reqs:
            tree, true = trees[req], truth[tuple(req.prompt_token_ids)][len(req.output_token_ids):]
            level = tree.frontier[tree.width * (d - 1):tree.width * d]
            hits = [n for n in level if _on_true_path(tree, tree.parents[n], true)]
            if tree.width > 1 and d <= len(true) and hits and rng.random() < accept:
                tree.tokens[rng.choice(hits)] = true[d - 1]
        return parent_rows

    speculator._draw_rows, speculator._grow = draw, grow_steered


def _on_true_path(tree, node: int, true: list[int]) -> bool:
    """Whether `node` (-1: the last token) and its ancestors carry the true continuation."""
    chain = []
    while node >= 0:
        chain.append(node)
        node = tree.parents[node]
    return all(d < len(true) and tree.tokens[n] == true[d] for d, n in enumerate(reversed(chain)))


def _eager_spec_run(model, head, prompts, params, truth, **kw):
    """The same speculative engine (drafts steered as the replayed one's) with every step and head
    call eager, torch attention: the tokens and drafts a replayed engine must reproduce."""
    engine = build_engine(_spec_config(attention_backend="torch", cuda_graph=False, **kw), model, model.arch,
                          draft_head=head)
    try:
        assert engine.speculator.graphs is None
        _steer_drafts(engine, truth, ACCEPT)
        tokens, drafts, _ = _run_recording(engine, prompts, params)
        engine.check_integrity()
        return tokens, drafts
    finally:
        engine.close()


def _captured(graphs: dict) -> dict:
    """key -> the stand-in of each captured graph (runner: `_Captured`; the others: (graph, out))."""
    return {key: getattr(g, "graph", None) or g[0] for key, g in graphs.items()}


def test_eagle_verify_rows_and_head_calls_replay_from_captured_metadata(monkeypatch):
    """Chains (top-k 1): each verify row of k + 1 tokens replays as k + 1 decode rows of a captured
    bucket (`expand_verify`), and each head call from the head's own buckets (`HeadGraphs`)."""
    model, _ = make_tiny_llama(7, num_hidden_layers=2)
    head = tiny_draft_head(target=model, seed=3)
    prompts = make_prompts(2, min_len=5, max_len=23, seed=4)
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    expected = _plain_tokens(model, prompts, params)
    truth = {tuple(p): out for p, out in zip(prompts, expected)}
    eager_tokens, eager_drafts = _eager_spec_run(model, head, prompts, params, truth)
    assert eager_tokens == expected
    engine = build_standin_engine(monkeypatch, _spec_config(attention_backend="triton", cuda_graph=True,
                                                            graph_batch_sizes=(1, 2, 4)), model, head)
    try:
        runner, speculator = engine.runner, engine.speculator
        _steer_drafts(engine, truth, ACCEPT)
        assert model.backend.name == head.self_attn.backend.name == "triton"
        assert runner.expand_verify and speculator.graphs.expand and runner.trees is None
        assert runner.buckets == (1, 2, 4, 8)  # 2 requests x (3 drafts + 1)
        decode, heads = _captured(runner._graphs), _captured(speculator.graphs._graphs)
        assert sorted(decode) == sorted(heads) == [1, 2, 4, 8]
        for b, graph in [*decode.items(), *heads.items()]:
            assert graph.meta.seq_lens_cpu == (CAPACITY,) * b  # capacity, not a step's
        tokens, drafts, steps = _run_recording(engine, prompts, params)
        assert tokens == expected
        assert drafts == eager_drafts  # the replayed head reads the replayed features and its own KV
        verify_steps = [replayed for kind, replayed in steps if kind == "verify"]
        assert verify_steps and all(verify_steps), steps
        assert runner.counters.fallbacks == {Fallback.NOT_DECODE: 1}, runner.counters  # the prefill
        assert runner.counters.replays == sum(g.replays for g in decode.values()) == len(steps) - 1
        assert speculator.graphs.replays == sum(g.replays for g in heads.values()) > 0
        assert 3 in speculator.counters.accepted_per_verify  # whole runs: every verify row's logits decided
        assert speculator.counters.draft_errors == 0
        engine.check_integrity()
    finally:
        engine.close()


def test_eagle_tree_verify_rows_and_head_tree_levels_replay_from_captured_metadata(monkeypatch):
    """Trees (top-k 2, depth 2): each full tree verify row replays from `TreeVerifyGraphs`, each head
    tree level from `HeadTreeGraphs`, the head's chains (catch-up, root) from `HeadGraphs`."""
    model, _ = make_tiny_llama(7, num_hidden_layers=2)
    head = tiny_draft_head(target=model, seed=3)
    prompts = make_prompts(2, min_len=5, max_len=23, seed=4)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    tree = dict(speculative_topk=2, num_draft_tokens=2)
    expected = _plain_tokens(model, prompts, params)
    truth = {tuple(p): out for p, out in zip(prompts, expected)}
    eager_tokens, eager_drafts = _eager_spec_run(model, head, prompts, params, truth, **tree)
    assert eager_tokens == expected
    engine = build_standin_engine(monkeypatch, _spec_config(attention_backend="triton", cuda_graph=True,
                                                            graph_batch_sizes=(1, 2, 4), **tree), model, head)
    try:
        runner, speculator = engine.runner, engine.speculator
        _steer_drafts(engine, truth, ACCEPT)
        trees, levels = runner.trees, speculator.tree_graphs
        assert trees.expand and levels.expand and trees.q == 2 * 2 + 1
        verify, level = _captured(trees._graphs), _captured(levels._graphs)
        assert sorted(verify) == [1, 2] and sorted(level) == [(1, 1), (1, 2)]  # 2 requests; level 1 of depth 2
        for b, graph in verify.items():
            assert graph.meta.seq_lens_cpu == (CAPACITY,) * b and graph.meta.tree_widths_cpu == (trees.q,) * b
        for (d, b), graph in level.items():
            assert graph.meta.seq_lens_cpu == (CAPACITY,) * b and graph.meta.tree_widths_cpu == (2 * d,) * b
        paths = []
        move_path = speculator._move_path
        speculator._move_path = lambda req, path: (paths.append(path), move_path(req, path))[1]
        tokens, drafts, steps = _run_recording(engine, prompts, params)
        assert tokens == expected
        assert drafts == eager_drafts
        assert any(path != list(range(1, len(path) + 1)) for path in paths), paths  # a later sibling's K/V moved
        tree_steps = [replayed for kind, replayed in steps if kind == "tree"]
        assert tree_steps and all(tree_steps), steps
        assert sum(g.replays for g in verify.values()) == len(tree_steps)
        assert levels.replays == sum(g.replays for g in level.values()) > 0
        assert speculator.graphs.replays > 0  # catch-ups and roots: decode rows of the head's buckets
        assert 2 in speculator.counters.accepted_per_verify  # whole paths
        assert speculator.counters.draft_errors == 0
        engine.check_integrity()
    finally:
        engine.close()
