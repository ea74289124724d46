"""EAGLE tree drafting in the engine (spec/speculator.py + spec/draft_tree.py) on the tiny Llama.

Lossless: greedy output equals HF transformers' generate token for token with trees of width 2
and 3, page sizes 1 and 16, with the random head's own trees and with scripted trees; sampled
requests' trees give the non-speculative engine's sampled tokens, token for token. A scripted
tree puts the true continuation on a branch chosen at random at each level (the first child or
another one) and random tokens elsewhere, so accepted paths go through later siblings and deeper
levels: the accepted path's K/V must be moved to the slots right after the last token, or the
following tokens go wrong. The seed scenario with trees: page 16, aborts between draft and verify,
retracts of requests holding tree slots, integrity after every step, nothing leaked.
"""

from __future__ import annotations

import random

import pytest
import torch

from cluster.worker_host.build import make_worker
from common.config import ConfigError, EngineConfig
from engine.request import RequestStatus
from engine.spec import speculator as speculator_module
from engine.spec.factory import make_speculator
from kernels.model.eagle import DraftStyle
from tests.helpers import (
    SPEC_MAX_NEW,
    assert_pool_at_rest,
    greedy,
    make_engine,
    make_spec_engine,
    sampled,
    tiny_draft_head,
    tiny_models,
)

MAX_NEW = SPEC_MAX_NEW  # the `reference` fixture's length


def script_trees(engine, reference: dict[tuple, list[int]], accept: float, seed: int = 0) -> list[list[int]]:
    """Replace the head's choice of tree nodes (its K/V and features still come from the real head):
    with probability `accept`, one child of the node on the true path, at a random place among the
    new candidates, gets the true token and its parent's score (so the verify selects it and the
    next level expands it); every other candidate gets a random token. Returns a list that collects
    the accepted paths' rows."""
    rng = random.Random(seed)
    vocab = engine.arch.vocab_size
    speculator = engine.speculator
    grow = speculator._grow

    def scripted(reqs, trees, logits, starts, d):
        sizes = {r: len(trees[r].tokens) for r in reqs}
        parent_rows = grow(reqs, trees, logits, starts, d)  # the real growth, then the tokens rewritten
        for i, req in enumerate(reqs):
            tree = trees[req]
            if tree.width == 1:
                continue
            truth = reference[tuple(req.prompt_token_ids)][len(req.output_token_ids):]
            new = range(sizes[req], len(tree.tokens))
            for n in new:
                tree.tokens[n] = rng.randrange(vocab)
            hits = [n for n in new if _on_true_path(tree, tree.parents[n], truth)]
            if not hits or d - 1 >= len(truth) or rng.random() >= accept:
                continue
            n = rng.choice(hits)
            parent = tree.parents[n]
            tree.tokens[n], tree.scores[n] = truth[d - 1], tree.scores[parent] if parent >= 0 else 0.0
            level = range(tree.width * (d - 1), tree.width * d)
            if n not in tree.frontier:
                j = rng.choice(level)
                tree.frontier[j] = n
                above = tree.frontier[tree.width * (d - 2):tree.width * (d - 1)] if d > 1 else [-1]
                parent_rows[i][j - level.start] = starts[i] + above.index(parent)
        return parent_rows

    speculator._grow = scripted
    paths = []
    verify = speculator.verify

    def spy(req, logits):
        out = verify(req, logits)
        paths.append(speculator._paths.get(req.request_id, []))
        return out
    speculator.verify = spy
    return paths


def _on_true_path(tree, node: int, truth: list[int]) -> bool:
    """Whether `node` (-1: the last token) and its ancestors carry the true continuation."""
    chain = []
    while node >= 0:
        chain.append(node)
        node = tree.parents[node]
    return all(depth < len(truth) and tree.tokens[n] == truth[depth] for depth, n in enumerate(reversed(chain)))


def _outputs(engine, prompts, params=None):
    return [r.output_token_ids for r in engine.generate(prompts, params or greedy(max_tokens=MAX_NEW))]


@pytest.mark.parametrize("topk", [2, 3])
@pytest.mark.parametrize("page_size", [1, 16])
def test_greedy_tree_drafting_is_lossless(spec_prompts, reference, topk, page_size):
    expected = [reference[tuple(p)] for p in spec_prompts]
    for scripted in (False, True):
        engine = make_spec_engine(tiny_draft_head(DraftStyle.EAGLE3), page_size=page_size, speculative_topk=topk)
        paths = script_trees(engine, reference, accept=0.8, seed=topk) if scripted else None
        assert _outputs(engine, spec_prompts) == expected
        counters = engine.speculator.counters
        assert counters.verifies > 0 and counters.draft_errors == 0
        if scripted:
            assert {0, 3} <= set(counters.accepted_per_verify), dict(counters.accepted_per_verify)
            moved = [p for p in paths if any(row != m for m, row in enumerate(p))]
            assert moved, "no accepted path went through a later sibling: the K/V move was never exercised"
        assert_pool_at_rest(engine)


def test_without_the_path_move_a_tree_breaks_greedy_output(spec_prompts, reference, monkeypatch):
    """The mutation the test above must catch: accepted K/V left at their tree slots."""
    monkeypatch.setattr(speculator_module.EagleSpeculator, "_move_path", lambda self, req, path: None)
    engine = make_spec_engine(tiny_draft_head(DraftStyle.EAGLE3), page_size=16, speculative_topk=2)
    script_trees(engine, reference, accept=0.8, seed=2)
    assert _outputs(engine, spec_prompts) != [reference[tuple(p)] for p in spec_prompts]


def test_greedy_and_sampled_requests_draft_trees_in_one_batch(spec_prompts, reference):
    """Sampled requests' trees are verified against the sampler's own draw at each row's position, so
    they emit the plain engine's tokens (with the head's trees and with scripted ones that accept
    along later siblings and deeper levels), beside greedy requests in the same batch."""
    params = [greedy(max_tokens=MAX_NEW)] * 3 + sampled(spec_prompts[3:])
    plain = {tuple(r.prompt_token_ids): r.output_token_ids for r in make_engine().generate(spec_prompts, params)}
    assert [plain[tuple(p)] for p in spec_prompts[:3]] == [reference[tuple(p)] for p in spec_prompts[:3]]
    for scripted in (False, True):
        engine = make_spec_engine(tiny_draft_head(DraftStyle.EAGLE), speculative_topk=2)
        paths = script_trees(engine, plain, accept=0.8, seed=7) if scripted else None
        seen = {True: 0, False: 0}  # trees drafted, by greedy

        def spy(running, *args, engine=engine, draft=engine.speculator.draft, seen=seen):  # bound: this iteration's
            draft(running, *args)
            for r in running:
                if r.spec.token_ids:
                    assert r.spec.parents is not None
                    depths, k = _depths(r), engine.config.num_draft_tokens  # parents before children (or it raises)
                    assert max(depths) <= k and len(depths) <= 2 * k
                    seen[r.params.greedy] += 1
        engine.speculator.draft = spy
        assert _outputs(engine, spec_prompts, params) == [plain[tuple(p)] for p in spec_prompts]
        assert seen[True] and seen[False]
        if scripted:
            assert {0, 3} <= set(engine.speculator.counters.accepted_per_verify)
            assert any(any(row != m for m, row in enumerate(p)) for p in paths), "no path through a later sibling"
        assert_pool_at_rest(engine)


def _depths(req) -> list[int]:
    parents = req.spec.parents or list(range(len(req.spec.token_ids)))
    depths = [0]
    for p in parents:
        depths.append(depths[p] + 1)
    return depths[1:]


def test_seed_scenario_with_trees_page_16_aborts_and_retracts_leak_nothing(spec_prompts, reference):
    """Pools of 13..17 pages: which step retracts whom depends on the tree shapes, so the scenario runs
    on each, and must retract a request holding tree slots on at least one."""
    retracted_trees = 0
    for num_pages in range(13, 18):
        retracted_trees += _seed_scenario(spec_prompts * 3, reference, num_pages)  # shared prompts: prefix hits
    assert retracted_trees, "no retract of a request holding tree slots on any pool size"


def _seed_scenario(prompts, reference, num_pages: int) -> int:
    """Run it; returns how many retracted requests held tree drafts."""
    engine = make_spec_engine(page_size=16, num_pages=num_pages, speculative_max_batch=64, speculative_topk=3)
    script_trees(engine, reference, accept=0.6, seed=num_pages)
    retracted_with_drafts = []
    retract = engine.scheduler._retract

    def spy(req, step):
        retracted_with_drafts.append(req.spec.parents is not None)
        retract(req, step)
    engine.scheduler._retract = spy
    reqs = [engine.add_request(p, greedy(max_tokens=MAX_NEW)) for p in prompts]
    aborted, steps = set(), 0
    while any(r.status is not RequestStatus.FINISHED for r in reqs):
        engine.step()  # debug_kv: integrity checked after every step
        steps += 1
        drafted = [r for r in reqs if r.spec.parents is not None]
        if steps % 8 == 0 and drafted:
            victim = drafted[0]  # between its draft and its verify: its tree slots are allocated
            assert victim.kv.kv_allocated_len >= victim.kv.kv_committed_len + 1 + len(victim.spec.token_ids)
            assert engine.abort(victim.request_id)
            aborted.add(victim.request_id)
    assert aborted, "no abort between draft and verify"
    for req in reqs:
        if req.request_id not in aborted:
            assert req.output_token_ids == reference[tuple(req.prompt_token_ids)]
    assert_pool_at_rest(engine)
    return sum(retracted_with_drafts)


def test_tree_drafting_needs_a_backend_that_takes_tree_masks():
    head = tiny_draft_head()
    head.self_attn.backend.supports_tree_mask = False  # an instance attribute: FlashInfer's answer
    config = EngineConfig(speculative="eagle", speculative_topk=2, num_pages=64)
    with pytest.raises(ConfigError, match="tree drafting"):
        make_speculator(config, head, torch.device("cpu"))
    assert make_speculator(EngineConfig(speculative="eagle"), head, torch.device("cpu")).topk == 1


@pytest.mark.parametrize("bad", [0, 9, 2.5])
def test_topk_is_validated(bad):
    with pytest.raises(ConfigError, match="speculative_topk"):
        EngineConfig(speculative="eagle", speculative_topk=bad)
    with pytest.raises(ConfigError, match="64 tree nodes"):
        EngineConfig(speculative="eagle", speculative_topk=8, num_draft_tokens=9)


@pytest.mark.parametrize("bad", [-1, 65, 2.5])
def test_tree_nodes_is_validated_and_needs_a_tree(bad):
    with pytest.raises(ConfigError, match="speculative_tree_nodes"):
        EngineConfig(speculative="eagle", speculative_tree_nodes=bad, speculative_topk=2)
    with pytest.raises(ConfigError, match="takes a tree"):
        EngineConfig(speculative="eagle", speculative_tree_nodes=6)


def test_draft_tree_expands_the_best_candidates_and_verifies_the_best_of_all_levels():
    from engine.spec.draft_tree import DraftTree

    def logprobs(*rows):
        return torch.tensor(rows, dtype=torch.float32).log()

    tree = DraftTree(depth=3, width=2)
    assert tree.grow(logprobs([0.5, 0.3, 0.2, 0.0]), lambda ids: ids + 100) == [0, 0]
    assert (tree.tokens, tree.parents, tree.frontier) == ([100, 101], [-1, -1], [0, 1])
    assert tree.head_mask(1).visible == ((True, False), (False, True)) and tree.head_mask(1).offsets == (0, 0)
    # children: of node 0 (0.5): 0.5 x {0.6, 0.4}; of node 1 (0.3): 0.3 x {0.9, 0.1}
    rows = tree.grow(logprobs([0.6, 0.4, 0.0, 0.0], [0.9, 0.0, 0.1, 0.0]), lambda ids: ids + 100)
    assert tree.tokens[2:] == [100, 101, 100, 102] and tree.parents[2:] == [0, 0, 1, 1]
    assert tree.frontier[2:] == [2, 4] and rows == [0, 1]  # 0.30 and 0.27 beat 0.20 and 0.03
    assert tree.head_mask(2).visible == ((True, False, True, False), (False, True, False, True))
    assert tree.head_mask(2).offsets == (1, 1)
    tokens, parents = tree.select(4)  # 0.5, 0.3, 0.30, 0.27 (candidate 3: 0.20 and 5: 0.03 left out)
    assert tokens == [100, 101, 100, 100] and parents == [0, 0, 1, 2]
    assert tree.select(6)[1] == [0, 0, 1, 1, 2, 2]


def test_a_chain_tree_is_the_chain():
    from engine.spec.draft_tree import DraftTree

    tree = DraftTree(depth=3, width=1)
    for token in (7, 8, 9):
        tree.append(token)
    assert tree.select(2) == ([7, 8, 9], None) and tree.head_mask(2) is None
    assert tree.level_tokens(2) == [8] and tree.parents == [-1, 0, 1]


@pytest.mark.parametrize("page_size", [1, 16])
def test_tree_verify_replayed_over_the_tree_buffers_gives_the_same_tokens_and_acceptance(spec_prompts, reference,
                                                                                         page_size):
    """What CUDA replays from the tree graphs (`graphs/tree.py`), run over the same static buffers on
    the CPU: full tree verify rows of a batch go through `TreeBuffers` (padding requests included),
    and each such step's logits and features equal the eager tree verify's over the same rows; so do
    the head's tree level calls (`HeadTreeGraphs`) against the eager masked head call;
    tokens equal HF's and every verify accepts exactly what the eager tree verify accepts."""
    results = []
    for expand in (False, True):
        engine = make_spec_engine(tiny_draft_head(DraftStyle.EAGLE3), page_size=page_size, max_running_requests=5,
                                  speculative_topk=2)
        assert engine.runner.trees is not None and engine.runner.trees.q == 2 * 3 + 1
        engine.runner.trees.expand = expand
        engine.runner.trees.buckets = (2, 5)  # a lone request (the tail of the run) replays with a padding one
        script_trees(engine, reference, accept=0.7, seed=page_size)
        replayed: list[tuple[int, int]] = []

        def checked(rows, bucket, engine=engine, replay=engine.runner.trees.replay, replayed=replayed):
            """The replay's logits and features are the eager tree verify's."""
            out = replay(rows, bucket)
            again = engine.runner.eager.forward(rows)  # rewrites the same K/V into the same slots
            for got, want in zip(out, again):
                torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
            replayed.append((len(rows), bucket))
            return out
        engine.runner.trees.replay = checked
        head_replays = _check_head_levels(engine.speculator, expand)
        assert _outputs(engine, spec_prompts) == [reference[tuple(p)] for p in spec_prompts]
        assert bool(replayed) == expand and all(n <= bucket for n, bucket in replayed)
        assert any(n < bucket for n, bucket in replayed) == expand  # padding requests rode along
        assert bool(head_replays) == expand and set(head_replays) <= {1, 2}  # levels 1 and 2 of 3
        results.append(engine.speculator.counters.accepted_per_verify)
        assert_pool_at_rest(engine)
    assert results[0] == results[1] and sum(results[0].values()) > 0


def _check_head_levels(speculator, expand: bool) -> list[int]:
    """Route the head's level calls through its tree buffers (`expand`) and compare each replayed one
    with the eager masked call over the same inputs; returns the levels replayed."""
    graphs = speculator.tree_graphs
    graphs.expand, graphs.buckets = expand, (2, 5)
    run_level, levels = graphs.run, []

    def checked(level, ids, features, seq_lens, pages, masks):
        out = run_level(level, ids, features, seq_lens, pages, masks)
        if out is not None:
            speculator.tree_graphs = None  # the eager head call; it rewrites the same draft K/V
            want = speculator._run(ids, features, [len(m.offsets) for m in masks], seq_lens, pages, masks, level)
            speculator.tree_graphs = graphs
            for got, expected in zip(out, want):
                torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
            levels.append(level)
        return out
    graphs.run = checked
    return levels


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_every_tree_node_scores_what_hf_gives_its_branch(page_size):
    """The target over one tree verify row (tree mask, RoPE by depth): each row's logits equal HF's
    last logits over the prompt plus that row's branch (its ancestors and itself), run densely."""
    from engine.runner import ForwardRow

    _, ref, _ = tiny_models()
    engine = make_engine(page_size=page_size)
    parents, drafts = [0, 0, 1, 1, 2, 3, 5], [40, 41, 42, 43, 44, 45, 46]
    req = engine.add_request(list(range(3, 22)), greedy(max_tokens=4))
    while not req.output_token_ids:  # prefilled, one token out: the next step would decode it
        engine.step()
    c = req.kv.kv_committed_len
    assert engine.kvm.try_allocate(req.kv, c + len(drafts) + 1)
    row = ForwardRow([req.all_token_ids[c]] + drafts, c + len(drafts) + 1, list(req.kv.pages), True,
                     num_draft_tokens=len(drafts), draft_parents=tuple(parents))
    logits = engine.runner.eager.forward([row]).logits  # [8, vocab]
    for r in range(len(drafts) + 1):
        branch, node = [], r
        while node > 0:
            branch.append(drafts[node - 1])
            node = parents[node - 1]
        ids = torch.tensor([req.all_token_ids[:c + 1] + branch[::-1]])
        with torch.no_grad():
            want = ref(ids).logits[0, -1]
        torch.testing.assert_close(logits[r], want, atol=1e-4, rtol=1e-4)
    engine.abort(req.request_id)
    assert_pool_at_rest(engine)


@pytest.mark.parametrize("page_size", [1, 16])
def test_disaggregated_trees_are_lossless_from_the_first_decode_step(spec_prompts, reference, page_size):
    """Prefill worker -> transfer -> decode worker drafting trees: HF's tokens, and each request's
    first decode step (drafted from the head feature that came in KVComplete) verifies a tree."""
    from kv_store.transfer.local import LocalTransport
    from tests.step_pair import StepPair

    ours, _, arch = tiny_models()
    head = tiny_draft_head()
    config = EngineConfig(page_size=page_size, num_pages=512, chunk_size=16, debug_kv=True, speculative="eagle",
                          speculative_adaptive=False, speculative_topk=3)
    clock = lambda: 0.0  # noqa: E731
    prefill = make_worker("prefill", config, ours, arch, LocalTransport(), clock=clock, draft_head=head)
    decode = make_worker("decode", config, ours, arch, LocalTransport(), host_pages=512, clock=clock, draft_head=head)
    script_trees(decode.engine, reference, accept=0.7, seed=page_size)
    first_trees = []
    draft_arrived = decode.engine.speculator.draft_arrived

    def spy(arrived, *args):
        draft_arrived(arrived, *args)
        first_trees.extend(r.spec.parents is not None for r in arrived)
    decode.engine.speculator.draft_arrived = spy
    results = StepPair(prefill, decode).generate(spec_prompts, greedy(max_tokens=MAX_NEW))
    assert [r.token_ids for r in results] == [reference[tuple(p)] for p in spec_prompts]
    assert first_trees == [True] * len(spec_prompts)
    assert {0, 3} <= set(decode.engine.speculator.counters.accepted_per_verify)
    for engine in (prefill.engine, decode.engine):
        assert_pool_at_rest(engine)
