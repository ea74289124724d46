"""Tensor parallelism at TP=2 on the CPU (gloo on loopback): `tandem run --tensor-parallel-size 2` (this
process rank 0, a spawned rank 1) for a tiny model of each family, and `tandem serve` with a colocated
worker over two ranks for SmolLM2 (its 3 KV heads split 2 + 1), against transformers' greedy tokens
and logprobs; KV integrity checked after every step."""

from __future__ import annotations

import json

import pytest

from cluster.cli.main import main as tandem_main
from tests.helpers import hf_greedy, smollm2
from tests.integration.logprobs_check import check_logprobs
from tests.integration.test_serve_families import NEW_TOKENS, PROMPT, write_checkpoint
from tests.unit.engine.test_model_families import FAMILIES

pytestmark = pytest.mark.slow


def run_tp(capsys, args: list[str]) -> list[dict]:
    capsys.readouterr()
    assert tandem_main(["run", "--tensor-parallel-size", "2", "--raw", "--json", *args]) == 0
    return [json.loads(line) for line in capsys.readouterr().out.strip().splitlines()]


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_a_tiny_model_at_tp2_gives_transformers_greedy_tokens(name, capsys, tmp_path):
    expected = write_checkpoint(name, tmp_path)
    (result,) = run_tp(capsys, ["--model", str(tmp_path), "--prompt", PROMPT, "--max-tokens", str(NEW_TOKENS)])
    assert result["token_ids"] == expected


def test_tandem_serve_colocated_at_tp2_gives_transformers_greedy_tokens(tmp_path_factory):
    """`tandem serve` with one colocated worker over 2 ranks (spawned by its actor): three concurrent
    completions give transformers' greedy tokens, a streamed chat completes, logprobs (the output's
    and an echoed prompt's) are transformers'; the ranks listen on loopback only and stop with it."""
    import asyncio
    from pathlib import Path

    import openai

    from cluster.serve.local_ray import session_members
    from kv_store.transfer.listeners import listening_sockets
    from tests.integration.serve_harness import serving

    loaded, reference = smollm2()
    story = "The harbour town was quiet before the boats came in. The fishermen mended their nets, and "
    prompts = [story + "the children", story + "the old captain told them", "A recipe for bread starts with"]
    eos = list(loaded.eos_token_ids)
    expected = [hf_greedy(reference, loaded.tokenizer.encode(p, add_special_tokens=False), 12, eos) for p in prompts]
    args = ["--set", "prefill.count=0", "--set", "decode.count=0", "--set", "colocated.count=1",
            "--set", "colocated.engine.tensor_parallel_size=2", "--set", "engine.num_pages=256"]
    with serving(tmp_path_factory, "serve-tp2", args, env={"TANDEM_DEBUG_KV": "1"}, warm=False) as server:
        client = openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key="none", max_retries=0, timeout=120)

        async def run() -> tuple[list, str]:
            done = await asyncio.gather(*(client.completions.create(
                model="smollm2", prompt=p, max_tokens=12, temperature=0, extra_body={"return_token_ids": True})
                for p in prompts))
            stream = await client.chat.completions.create(model="smollm2",
                                                          messages=[{"role": "user", "content": "Hi!"}],
                                                          max_tokens=8, temperature=0, stream=True)
            text = "".join([chunk.choices[0].delta.content or "" async for chunk in stream if chunk.choices])
            await client.close()
            return [d.choices[0].token_ids for d in done], text
        tokens, chat = asyncio.run(run())
        assert tokens == expected and chat
        sync = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none", max_retries=0, timeout=120)
        again = sync.completions.create(model="smollm2", prompt=prompts[1], max_tokens=12, temperature=0,
                                        extra_body={"return_token_ids": True})
        assert again.choices[0].token_ids == expected[1] and again.usage.prompt_tokens_details.cached_tokens > 0
        # logprobs: the head's vocabulary slices gathered; the echoed prompt's through a head-only pass
        check_logprobs(sync)
        processes = {pid for session in server.sessions() for pid in session_members(session)}
        ranks = [pid for pid in processes if "spawn_main" in Path(f"/proc/{pid}/cmdline").read_text(errors="replace")]
        assert len(ranks) == 1, "rank 1 was not found beside the worker's actor"
        beyond = [str(lst) for pid in processes for lst in listening_sockets(pid) if not lst.is_loopback]
        assert beyond == [], f"listening beyond loopback: {beyond}"


def test_eagle_at_tp2_drafts_with_a_sharded_head_and_gives_transformers_greedy_tokens():
    """SmolLM2's shipped EAGLE head sharded over two ranks (its heads and MLP columns, the target's
    vocabulary-parallel embedding and head): tree drafting (tree verify replays, and the accepted
    path's K/V moved, on every rank) gives transformers' greedy tokens, with drafts accepted. (Chain
    drafting: the served 1 -> 2 test.)"""
    import dataclasses

    from cluster.cli.args import with_default_draft
    from common.config import EngineConfig, SamplingParams
    from engine.tp_launch import load_tp_engine
    from tests.helpers import assert_pool_at_rest

    loaded, reference = smollm2()
    prompts = ["List the days of the week: Monday, Tuesday,", "The harbour town was quiet before the boats came in."]
    ids = [loaded.tokenizer.encode(p, add_special_tokens=False) for p in prompts]
    expected = [hf_greedy(reference, p, 16, list(loaded.eos_token_ids)) for p in ids]
    config = with_default_draft(EngineConfig(tensor_parallel_size=2, speculative="eagle", num_pages=128))
    engine = load_tp_engine(dataclasses.replace(config, speculative_topk=2, debug_kv=True))
    try:
        reqs = engine.generate(ids, SamplingParams(max_tokens=16, temperature=0.0))
        assert [r.output_token_ids for r in reqs] == expected
        counters = engine.speculator.counters
        assert counters.verifies > 0 and counters.mean_accepted_length > 1.2, counters
        while engine.busy():
            engine.step()
        assert_pool_at_rest(engine)
    finally:
        engine.close()


def test_tp2_engines_bring_a_history_back_from_every_ranks_host_tier_and_l3(redis_server):
    """Rank 0 decides; each rank backs up, loads, puts and fetches its own heads' part. A history
    evicted from the device pool, whose device pages another prompt then overwrote, comes back from
    the host tiers of both ranks (rank 1 loading nothing would attend over the other prompt's KV); a
    second engine, with nothing on its device or host, fetches it from L3 (each rank its part, under
    keys of its own; the pages every rank got): transformers' greedy tokens both times."""
    from common.config import EngineConfig, SamplingParams
    from engine.tp_launch import load_tp_engine
    from kv_store.l3.config import L3Config
    from kv_store.residency import Residency
    from tests.helpers import assert_pool_at_rest

    client = redis_server.client()
    client.flushall()
    l3 = L3Config(url=redis_server.url, prefetch_policy="wait_complete", prefetch_min_pages=2, error_backoff_s=0.0)
    loaded, reference = smollm2()
    encode = lambda text: loaded.tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    history = encode("The harbour town was quiet before the boats came in. The fishermen mended their nets, "
                     "and the children ran along the pier to watch the gulls circle over the water.")
    other = encode("A recipe for bread starts with flour, water, salt and yeast; the dough rests for an hour "
                   "in a warm place until it doubles, then it is shaped, proofed again and baked hot.")
    question = history + encode(" Then the old captain")
    expected = hf_greedy(reference, question, 6, list(loaded.eos_token_ids))
    config = EngineConfig(tensor_parallel_size=2, page_size=16, num_pages=1 + 8, host_cache_pages=1 + 16,
                          chunk_size=64)
    first, greedy = load_tp_engine(config, l3=l3), SamplingParams(max_tokens=1, temperature=0.0)
    try:
        first.generate([history], greedy)
        while first.busy():
            first.step()
        assert first.kvm.prefix_cache.evict(1000) > 0
        assert all(n.residency is Residency.HOST for n in first.kvm.prefix_cache.nodes())
        first.generate([other], greedy)  # its pages are the ones the history left
        [again] = first.generate([question], SamplingParams(max_tokens=6, temperature=0.0))
        assert again.tier.host_hit_tokens > 0 and again.output_token_ids == expected
        while first.busy():
            first.step()
        assert first.host_cache.l3.flush(10.0)
        assert_pool_at_rest(first)
    finally:
        first.close()  # the other rank's L3 writes drain as its L3 part closes
    keys = [k.decode() for k in client.keys("*")]
    parts = {prefix: sum(prefix in k for k in keys) for prefix in ("tp2h0-2:", "tp2h2-3:")}
    assert parts["tp2h0-2:"] == parts["tp2h2-3:"] >= len(history) // 16, (parts, keys)
    second = load_tp_engine(config, l3=l3)
    try:
        [again] = second.generate([question], SamplingParams(max_tokens=6, temperature=0.0))
        assert again.tier.l3_hit_tokens > 0 and again.output_token_ids == expected
    finally:
        second.close()
