"""EAGLE speculative decoding (engine/spec/speculator.py) on a GPU: greedy output identical to
the plain CUDA engine and to HF, for both head layouts, with graph replay on (plain decode steps replay
with the features the head needs; verify steps run eagerly), and nothing leaked.

Marked `gpu`; skipped where torch sees no CUDA device (CPU CI). Run with `pytest -m gpu`.
"""

import copy

import pytest
import torch

from common.config import EngineConfig
from engine import build_engine
from engine.graphs.runner import Fallback
from kernels.model.eagle import DraftArch, DraftStyle, EagleDraftHead
from tests.helpers import assert_pool_at_rest, greedy, hf_greedy, make_prompts, tiny_models

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _head(model, arch, style: DraftStyle) -> EagleDraftHead:
    eagle3 = style is DraftStyle.EAGLE3
    head = EagleDraftHead(DraftArch.for_target(arch, style, 64 if eagle3 else None), model.model.embed_tokens,
                          None if eagle3 else model.lm_head, model.backend)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in head.named_parameters():
            if name.startswith("embed") or (name.startswith("lm_head") and not eagle3):
                continue
            noise = 0.1 * torch.randn(param.shape, generator=gen)
            param.copy_(1 + noise if "norm" in name else noise)
    return head.to("cuda")


@pytest.mark.parametrize("style", list(DraftStyle))
@pytest.mark.parametrize("page_size", [1, 16])
def test_speculative_greedy_on_cuda_matches_plain_and_hf(style, page_size):
    ours, ref, arch = tiny_models()
    prompts = make_prompts(8, seed=6)
    expect = [hf_greedy(ref, p, 24) for p in prompts]
    outputs = {}
    for spec in ("none", "eagle"):
        model = copy.deepcopy(ours).to("cuda")
        config = EngineConfig(device="cuda", num_pages=512, page_size=page_size, max_running_requests=8,
                              max_model_len=256, debug_kv=True, speculative=spec, speculative_adaptive=False)
        engine = build_engine(config, model, arch, draft_head=_head(model, arch, style) if spec == "eagle" else None)
        outputs[spec] = [r.output_token_ids for r in engine.generate(prompts, greedy(max_tokens=24))]
        if spec == "eagle":
            assert engine.speculator.counters.verifies > 0 and engine.speculator.counters.draft_errors == 0
            # verify steps replay (as decode rows), only the prefill step runs eagerly; the head replays too
            assert engine.runner.counters.fallbacks[Fallback.NOT_DECODE] <= 2, engine.runner.counters
            assert engine.speculator.graphs.expand and engine.speculator.graphs.replays > 0
        assert engine.runner.counters.replays > 0
        assert_pool_at_rest(engine)
    assert outputs["eagle"] == outputs["none"] == expect


@pytest.mark.parametrize("page_size", [1, 16])
def test_tree_drafting_on_cuda_replays_and_matches_hf(page_size):
    """Trees (topk 2, depth 3) with Triton attention: full tree verify steps replay from the tree
    graphs and the head's level calls from its tree graphs; greedy output is HF's; nothing leaked."""
    ours, ref, arch = tiny_models()
    prompts = make_prompts(8, seed=8)
    model = copy.deepcopy(ours).to("cuda")
    config = EngineConfig(device="cuda", num_pages=512, page_size=page_size, max_running_requests=8,
                          max_model_len=256, debug_kv=True, speculative="eagle", speculative_adaptive=False,
                          speculative_topk=2, attention_backend="triton")
    engine = build_engine(config, model, arch, draft_head=_head(model, arch, DraftStyle.EAGLE3))
    trees = engine.runner.trees
    assert trees is not None and trees.expand and engine.speculator.tree_graphs.expand
    replay = trees.replay
    replayed = []
    trees.replay = lambda rows, bucket: (replayed.append(len(rows)), replay(rows, bucket))[1]
    out = [r.output_token_ids for r in engine.generate(prompts, greedy(max_tokens=24))]
    assert out == [hf_greedy(ref, p, 24) for p in prompts]
    assert replayed and engine.speculator.tree_graphs.replays > 0 and engine.speculator.counters.draft_errors == 0
    assert_pool_at_rest(engine)
