"""EAGLE speculative decoding in the engine (engine/spec/speculator.py) on the tiny Llama.

Lossless: greedy output equals the non-speculative engine's and HF transformers' generate, token for
token, for both head layouts, page sizes 1 and 16, random and scripted drafts (the scripted ones
are the true continuation, corrupted at random, so verify rows accept partially: every accepted
run length occurs). Sampled output is the non-speculative engine's, token for token, with scripted
drafts and the head's own (`kernels/speculative.py`: the sampler's draw is the target's choice). The seed
scenario: many speculative rounds at page size 16 with partial acceptance, aborts between draft and
verify, and retraction of requests holding draft slots, with integrity checked after every step and
no page leaked at the end.
"""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch

from cluster.worker_host.build import make_worker
from common.protocol import WorkerRole
from engine.request import RequestStatus
from engine.spec import speculator as speculator_module
from kernels.model.eagle import DraftStyle
from tests.helpers import (
    SPEC_MAX_NEW,
    assert_pool_at_rest,
    greedy,
    make_engine,
    make_prompts,
    make_spec_engine,
    sampled,
    tiny_draft_head,
    tiny_models,
)

MAX_NEW = SPEC_MAX_NEW  # the `reference` fixture's length


def _script_drafts(engine, reference: dict[tuple, list[int]], accept: float, seed: int = 0) -> None:
    """Greedy drafts from the true continuation (`reference`: prompt -> greedy output), each replaced
    by a wrong token with probability 1 - `accept`. The head still runs (its KV and features are
    real); only its token choice is scripted."""
    rng = random.Random(seed)
    vocab = engine.arch.vocab_size

    def draw(req, logits, j):
        truth = reference[tuple(req.prompt_token_ids)]
        i = len(req.output_token_ids) + j
        token = truth[i] if i < len(truth) else 0
        return token if rng.random() < accept else (token + 1 + rng.randrange(vocab - 1)) % vocab

    engine.speculator._draw_rows = lambda reqs, logits, j: [draw(r, logits[i], j) for i, r in enumerate(reqs)]


def _run(engine, prompts, params, abort_every: int = 0):
    reqs = [engine.add_request(p, params) for p in prompts]
    aborted, steps = set(), 0
    while any(r.status is not RequestStatus.FINISHED for r in reqs):
        engine.step()
        steps += 1
        drafted = [r for r in reqs if r.spec.token_ids]
        if abort_every and steps % abort_every == 0 and drafted:
            victim = drafted[0]  # between its draft and its verify: its draft slots are allocated
            assert victim.kv.kv_allocated_len > victim.kv.kv_committed_len + 1
            assert engine.abort(victim.request_id)
            aborted.add(victim.request_id)
    return reqs, aborted


@pytest.mark.parametrize("style", list(DraftStyle))
@pytest.mark.parametrize("page_size", [1, 16])
def test_greedy_is_lossless_with_random_and_scripted_drafts(spec_prompts, reference, style, page_size):
    base = make_engine(page_size=page_size)
    plain = [r.output_token_ids for r in base.generate(spec_prompts, greedy(max_tokens=MAX_NEW))]
    assert plain == [reference[tuple(p)] for p in spec_prompts]
    for scripted in (False, True):
        engine = make_spec_engine(tiny_draft_head(style), page_size=page_size)
        if scripted:
            _script_drafts(engine, reference, accept=0.7)
        out = [r.output_token_ids for r in engine.generate(spec_prompts, greedy(max_tokens=MAX_NEW))]
        assert out == plain
        counters = engine.speculator.counters
        assert counters.verifies > 0 and counters.draft_errors == 0
        if scripted:  # partial acceptance: short and full runs both happened
            assert {0, 3} <= set(counters.accepted_per_verify) and counters.mean_accepted_length > 1.5
        assert_pool_at_rest(engine)


@pytest.mark.parametrize("page_size", [1, 16])
def test_verify_and_head_replayed_as_decode_rows_give_the_same_tokens_and_drafts(spec_prompts, reference, page_size):
    """What CUDA replays, "replayed" over the static buffers on the CPU: each verify row as k + 1
    decode rows in a bucket (`graphs/runner.py`), and every draft-head call likewise (`graphs/draft.py`).
    Tokens equal HF's; the drafts (which read the replayed features and head KV) accept exactly as
    with the eager extend and eager head."""
    counts = []
    for expand in (False, True):
        engine = make_spec_engine(tiny_draft_head(DraftStyle.EAGLE3), page_size=page_size, max_running_requests=4)
        engine.runner.expand_verify = engine.speculator.graphs.expand = expand
        replayed: list[tuple[int, int]] = []
        drafts: list[list[tuple[int, ...]]] = []

        def replay_spy(rows, bucket, replay=engine.runner._replay, replayed=replayed):
            replayed.append((len(rows), bucket))
            return replay(rows, bucket)

        def spy(running, *args, draft=engine.speculator.draft, drafts=drafts):  # bound: this iteration's engine
            draft(running, *args)
            drafts.append([tuple(r.spec.token_ids) for r in running])
        engine.runner._replay = replay_spy
        engine.speculator.draft = spy
        out = [r.output_token_ids for r in engine.generate(spec_prompts, greedy(max_tokens=MAX_NEW))]
        assert out == [reference[tuple(p)] for p in spec_prompts]
        counts.append((engine.speculator.counters.accepted_per_verify, drafts))
        assert engine.runner.buckets[-1] == 4 * (engine.config.num_draft_tokens + 1)
        assert any(n > 4 for n, _ in replayed) == expand  # more rows than requests: verify rows expanded
        assert all(n <= bucket for n, bucket in replayed)
        assert (engine.speculator.graphs.replays > 0) == expand  # the head's calls went through its buffers
        assert_pool_at_rest(engine)
    assert counts[0] == counts[1] and sum(counts[0][0].values()) > 0


def test_seed_scenario_page_16_partial_acceptance_aborts_and_retracts_leak_nothing(reference, spec_prompts):
    prompts = spec_prompts * 3  # 18 requests share 6 prompts: prefix hits on pages with draft KV
    engine = make_spec_engine(page_size=16, num_pages=14, speculative_max_batch=64)
    _script_drafts(engine, reference, accept=0.6, seed=3)
    retracted_with_drafts = []
    retract = engine.scheduler._retract

    def spy(req, step):
        retracted_with_drafts.append(bool(req.spec.token_ids))
        retract(req, step)
    engine.scheduler._retract = spy
    reqs, aborted = _run(engine, prompts, greedy(max_tokens=MAX_NEW), abort_every=5)
    assert aborted and any(retracted_with_drafts), "no abort between draft and verify, or no retract mid-speculation"
    for req in reqs:
        if req.request_id not in aborted:
            assert req.output_token_ids == reference[tuple(req.prompt_token_ids)]
    assert {0, 1, 2, 3} <= set(engine.speculator.counters.accepted_per_verify)
    assert_pool_at_rest(engine)


def test_drafts_stop_at_max_tokens_and_eos_inside_an_accepted_run(spec_prompts, reference):
    prompt = spec_prompts[0]
    truth = reference[tuple(prompt)]
    eos = truth[5]  # a token the accepted run passes through: the output must end exactly there
    engine = make_spec_engine(eos=(eos,))
    _script_drafts(engine, reference, accept=1.0)
    req, = engine.generate([prompt], greedy(max_tokens=MAX_NEW))
    assert req.output_token_ids == truth[:truth.index(eos) + 1]
    req, = engine.generate([prompt], greedy(max_tokens=7, ignore_eos=True))
    assert req.output_token_ids == truth[:7]
    assert_pool_at_rest(engine)


def test_above_the_batch_cutoff_nothing_is_drafted_and_drafting_resumes_below_it(spec_prompts, reference):
    engine = make_spec_engine(speculative_max_batch=2)
    _script_drafts(engine, reference, accept=1.0)
    reqs = [engine.add_request(p, greedy(max_tokens=MAX_NEW)) for p in spec_prompts[:2]]
    engine.step()
    assert all(r.spec.token_ids for r in reqs)
    reqs += [engine.add_request(p, greedy(max_tokens=MAX_NEW)) for p in spec_prompts[2:4]]
    engine.step()  # the first two verify their drafts; with four running, none drafts again
    assert len(engine.scheduler.running) == 4 and not any(r.spec.token_ids for r in reqs)
    assert all(r.kv.kv_allocated_len == r.kv.kv_committed_len for r in reqs[:2])  # no slot left for a draft
    for r in reqs[2:]:
        engine.abort(r.request_id)
    engine.step()
    assert all(r.spec.token_ids for r in reqs[:2])
    while engine.busy():
        engine.step()
    assert [r.output_token_ids for r in reqs[:2]] == [reference[tuple(p)] for p in spec_prompts[:2]]
    assert_pool_at_rest(engine)


# ---- sampling: the plain sampler's own tokens --------------------------------------------------
def test_sampled_speculation_emits_the_plain_samplers_tokens(spec_prompts):
    """Each verify row chooses the token the plain sampler draws at that output position, so a seeded
    request's output does not depend on its drafts: scripted drafts (the plain run's tokens, 70% of
    them) accept partially and the head's own drafts (drawn with the sampler's noise) accept some,
    and both give the non-speculative engine's tokens (a rejection-sampling verifier, exact only in
    distribution, gives other tokens)."""
    plain = {tuple(r.prompt_token_ids): r.output_token_ids
             for r in make_engine().generate(spec_prompts, sampled(spec_prompts))}
    for scripted in (True, False):
        engine = make_spec_engine()
        if scripted:
            _script_drafts(engine, plain, accept=0.7, seed=4)
        out = [r.output_token_ids for r in engine.generate(spec_prompts, sampled(spec_prompts))]
        assert out == [plain[tuple(p)] for p in spec_prompts]
        accepted = engine.speculator.counters.accepted_per_verify
        assert ({0, 3} <= set(accepted)) if scripted else sum(n * v for n, v in accepted.items()) > 0
        assert_pool_at_rest(engine)


def test_acceptance_reaches_metrics_per_verify_and_per_draft_position(spec_prompts, reference):
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from router.backend import WorkerGauge
    from router.gateway.metrics import _spec_metrics

    engine = make_spec_engine()
    _script_drafts(engine, reference, accept=0.6, seed=1)
    engine.generate(spec_prompts, greedy(max_tokens=MAX_NEW))
    stats = engine.stats(WorkerRole.COLOCATED).spec
    hist = Counter(dict(stats.accepted_per_verify))
    assert stats.verifies == sum(hist.values()) > 0 and len(hist) == 4  # 0 .. 3 accepted all occurred

    class Collector:
        def collect(self):
            return _spec_metrics([WorkerGauge("w0", WorkerRole.COLOCATED, True, 0, 0, 0.0, None, 0, spec=stats)])
    registry = CollectorRegistry()
    registry.register(Collector())
    samples = {(s.name, s.labels.get("le", s.labels.get("position"))): s.value for f in
               text_string_to_metric_families(generate_latest(registry).decode()) for s in f.samples}
    for bound in range(4):  # cumulative buckets
        assert samples[("tandem:spec_accepted_drafts_per_verify_bucket", str(bound))] == sum(
            n for a, n in hist.items() if a <= bound)
    assert samples[("tandem:spec_accepted_drafts_per_verify_count", None)] == stats.verifies
    assert samples[("tandem:spec_accepted_drafts_per_verify_sum", None)] == sum(a * n for a, n in hist.items())
    for position in (1, 2, 3):  # a draft is accepted only after every earlier one was
        accepted = sum(n for a, n in hist.items() if a >= position)
        assert samples[("tandem:spec_accepted_tokens_total", str(position))] == accepted
        rate = samples[("tandem:spec_acceptance_rate", str(position))]
        assert rate == accepted / samples[("tandem:spec_draft_tokens_total", str(position))]
    assert_pool_at_rest(engine)


def _draft_kv_of_prompt(engine, prompt: list[int]) -> list[torch.Tensor]:
    """The draft layer's K and V of the cached whole pages of `prompt` (the engine's last KV layer)."""
    match = engine.kvm.prefix_cache.match(prompt, len(prompt))
    assert match.num_tokens >= engine.config.page_size, "the prompt's pages were not cached"
    return [engine.kv_cache.k[-1][match.pages].clone(), engine.kv_cache.v[-1][match.pages].clone()]


@pytest.mark.parametrize("page_size", [1, 16])
def test_disaggregated_is_lossless_and_ships_the_prompts_draft_kv(spec_prompts, reference, page_size):
    """Through a prefill worker -> transfer -> decode worker: HF's tokens; the prompt's draft KV that
    arrived equals a colocated engine's; and the head's feature at the prompt's end travels in
    KVComplete, so every request's first decode step verifies drafts."""
    from common.config import EngineConfig
    from kv_store.transfer.local import LocalTransport
    from tests.step_pair import StepPair

    ours, _, arch = tiny_models()
    head = tiny_draft_head()
    config = EngineConfig(page_size=page_size, num_pages=512, chunk_size=16, debug_kv=True, speculative="eagle",
                          speculative_adaptive=False)
    clock = lambda: 0.0  # noqa: E731
    prefill = make_worker("prefill", config, ours, arch, LocalTransport(), clock=clock, draft_head=head)
    decode = make_worker("decode", config, ours, arch, LocalTransport(), host_pages=512, clock=clock, draft_head=head)
    _script_drafts(decode.engine, reference, accept=0.7)
    first_step_drafts = []  # requests that arrived carrying the prefill worker's head feature, drafted at once
    draft_arrived = decode.engine.speculator.draft_arrived

    def spy(arrived, *args):
        with_feature = [bool(r.spec.feature) for r in arrived]
        draft_arrived(arrived, *args)
        first_step_drafts.extend(f and len(r.spec.token_ids) == 3 for f, r in zip(with_feature, arrived))
    decode.engine.speculator.draft_arrived = spy
    pair = StepPair(prefill, decode)
    results = pair.generate(spec_prompts, greedy(max_tokens=MAX_NEW))
    assert [r.token_ids for r in results] == [reference[tuple(p)] for p in spec_prompts]
    assert {0, 3} <= set(decode.engine.speculator.counters.accepted_per_verify)
    assert first_step_drafts == [True] * len(spec_prompts)

    colocated = make_spec_engine(head, page_size=page_size, chunk_size=16)
    colocated.generate(spec_prompts, greedy(max_tokens=MAX_NEW))
    longest = max(spec_prompts, key=len)  # its draft KV came from the prefill worker's catch-up, over the wire
    for shipped, local in zip(_draft_kv_of_prompt(decode.engine, longest), _draft_kv_of_prompt(colocated, longest)):
        assert shipped.abs().sum() > 0
        torch.testing.assert_close(shipped, local, rtol=1e-5, atol=1e-5)
    for engine in (prefill.engine, decode.engine, colocated):
        assert_pool_at_rest(engine)


def _record_drafts(engine) -> list:
    seen, verify = [], engine.speculator.verify

    def recording(req, logits):
        seen.append(tuple(req.spec.token_ids))
        return verify(req, logits)
    engine.speculator.verify = recording
    return seen


def test_a_prefix_loaded_back_from_the_host_tier_brings_its_draft_kv(reference):
    from kv_store.residency import Residency

    [history] = make_prompts(1, min_len=40, max_len=40, seed=4)
    runs = {}
    for evict in (False, True):
        engine = make_spec_engine(page_size=4, num_pages=64, host_cache_pages=128)
        [first] = engine.generate([history], greedy(max_tokens=8))
        while engine.busy():
            engine.step()
        saved = _draft_kv_of_prompt(engine, history)
        if evict:
            engine.kvm.prefix_cache.evict(1000)  # L1 empty: the history lives in the host tier only
            assert all(n.residency is Residency.HOST for n in engine.kvm.prefix_cache.nodes())
            engine.kv_cache.k[-1].zero_()  # nothing on device holds the draft KV now: the load must bring it
            engine.kv_cache.v[-1].zero_()
        drafts = _record_drafts(engine)
        [turn2] = engine.generate([history + first.output_token_ids + [7, 8, 9]], greedy(max_tokens=16))
        assert (turn2.tier.host_hit_tokens > 0) == evict
        for before, after in zip(saved, _draft_kv_of_prompt(engine, history)):
            assert torch.equal(before, after)  # the draft layer came back with the target's
        runs[evict] = (turn2.output_token_ids, drafts)
        assert_pool_at_rest(engine)
    assert runs[True] == runs[False]  # same tokens, and the head drafted the same after the load-back


def test_speculation_without_a_head_is_a_clear_config_error(monkeypatch, tmp_path):
    import cluster.train.settings as train_settings
    from cluster.cli.args import with_default_draft
    from common.config import ConfigError, EngineConfig
    from engine import build_engine

    ours, _, arch = tiny_models()
    with pytest.raises(ConfigError, match="draft_model"):
        build_engine(EngineConfig(num_pages=64, speculative="eagle"), ours, arch)
    with pytest.raises(ConfigError, match="num_draft_tokens"):
        EngineConfig(speculative="eagle", num_draft_tokens=0)
    monkeypatch.setattr(train_settings, "default_draft_dir", lambda model, cache_root=None: None)
    with pytest.raises(ConfigError, match="tandem train-eagle --model /no-head"):  # smollm2 has a shipped head
        with_default_draft(EngineConfig(speculative="eagle", model="/no-head"))
    monkeypatch.setattr(train_settings, "default_draft_dir", lambda model, cache_root=None: tmp_path / model)
    assert with_default_draft(EngineConfig(speculative="eagle")).draft_model == str(tmp_path / "smollm2")
    assert with_default_draft(EngineConfig(speculative="eagle", draft_model="/x")).draft_model == "/x"
    assert with_default_draft(EngineConfig()).draft_model == ""


@pytest.mark.parametrize("style", list(DraftStyle))
@pytest.mark.parametrize("max_batch", [1, 8], ids=["no-drafts-above-1", "drafting"])
def test_every_committed_positions_draft_kv_is_the_heads_over_the_whole_sequence(spec_prompts, reference, style,
                                                                                 max_batch):
    """The catch-up runs the whole layer only for rows something reads (each request's last, when it
    may draft or its prefill just ended) and, past a few rows, writes the others' K/V alone; what
    it leaves in the draft layer is what the head computes over the whole sequence in one pass,
    from the target's features over it (reference: one prefill, `target_states`). Chunked prefills, decode rows above
    the batch cutoff and accepted drafts all included."""
    from cluster.train.data import Sample, target_states
    from kernels.attention.metadata import build_attn_metadata
    from kernels.kv_layout import KVCacheTensors

    head = tiny_draft_head(style)
    engine = make_spec_engine(head, chunk_size=128, speculative_max_batch=max_batch)
    _script_drafts(engine, reference, accept=0.7)
    written = []  # rows of each call that wrote K/V alone
    write_kv = head.write_kv
    head.write_kv = lambda ids, *args: (written.append(len(ids)), write_kv(ids, *args))[1]
    prompts = sorted(spec_prompts, key=len)[-3:]  # their prefill step has more rows than a split needs
    assert sum(map(len, prompts)) - 3 > speculator_module.CATCH_UP_SPLIT_ROWS
    outputs = [r.output_token_ids for r in engine.generate(prompts, greedy(max_tokens=MAX_NEW))]
    assert outputs == [reference[tuple(p)] for p in prompts]
    assert written[0] == sum(map(len, prompts)) - 3  # the prefill: all but each prompt's last row
    assert (len(written) > 1) == (max_batch == 1)  # decode rows above the cutoff: no row is read
    assert (engine.speculator.counters.verifies > 0) == (max_batch > 1)
    ours, _, arch = tiny_models()
    size = engine.config.page_size
    for prompt, output in zip(prompts, outputs):
        tokens = prompt + output
        n = len(tokens) - 1  # committed positions: the last token was never run
        [(aux, hidden)] = target_states(ours, [Sample(tuple(tokens[:n]), len(prompt))], head.arch.aux_layer_ids)
        features = head.combine(aux) if style is DraftStyle.EAGLE3 else hidden
        pages = list(range(1, 1 + -(-n // size)))
        kv = KVCacheTensors.allocate(1, pages[-1] + 1, size, arch.num_kv_heads, arch.head_dim, torch.float32, "cpu")
        meta, positions = build_attn_metadata(size, [n], [n], [pages], [n - 1], "cpu")
        head(torch.tensor(tokens[1:n + 1]), features, positions, meta, kv)
        whole = engine.kvm.prefix_cache.match(tokens[:n], n)
        assert whole.num_tokens >= n - size + 1
        for ours_kv, ref_kv in ((engine.kv_cache.k[-1], kv.k[0]), (engine.kv_cache.v[-1], kv.v[0])):
            got = ours_kv[whole.pages].flatten(0, 1)[:whole.num_tokens]
            torch.testing.assert_close(got, ref_kv[pages].flatten(0, 1)[:whole.num_tokens], rtol=1e-4, atol=1e-4)
    assert_pool_at_rest(engine)
