"""Disaggregation across tensor-parallel degrees on the CPU: `tandem serve` with a prefill worker at
TP=2 and a decode worker at TP=1, and the reverse with EAGLE (its head sharded on both ranks of the
decode worker). Every prompt crosses (no local prefill), each prefill rank writing its KV heads into
the decode rank(s) holding them over Mooncake TCP, each rank digesting its part of every landing
page; the tokens are transformers' greedy tokens, again from the prefix cache, and through a session's
two turns (its history kept by the decode worker's ranks); KV integrity checked after every step."""

from __future__ import annotations

import asyncio

import pytest

from tests.helpers import hf_greedy, smollm2
from tests.integration.serve_harness import eventually, metric, serving

pytestmark = pytest.mark.slow

STORY = "The harbour town was quiet before the boats came in. The fishermen mended their nets, and "
PROMPTS = [STORY + "the children", STORY + "the old captain told them", "A recipe for bread starts with"]
NEW_TOKENS = 10


@pytest.mark.parametrize("prefill_tp,decode_tp,eagle", [(2, 1, False), (1, 2, True)])
def test_prefill_and_decode_at_different_tp_degrees_give_transformers_greedy_tokens(prefill_tp, decode_tp, eagle,
                                                                                     tmp_path_factory):
    import openai

    loaded, reference = smollm2()
    eos = list(loaded.eos_token_ids)
    prompt_ids = [loaded.tokenizer.encode(p, add_special_tokens=False) for p in PROMPTS]
    expected = [hf_greedy(reference, ids, NEW_TOKENS, eos) for ids in prompt_ids]
    args = ["--set", "prefill.count=1", "--set", "decode.count=1", "--set", "colocated.count=0",
            "--set", f"prefill.engine.tensor_parallel_size={prefill_tp}",
            "--set", f"decode.engine.tensor_parallel_size={decode_tp}",
            "--set", "router.local_prefill_max_tokens=0", "--set", "engine.num_pages=256",
            *(["--set", "engine.speculative=eagle"] if eagle else [])]
    name = f"serve-tp{prefill_tp}to{decode_tp}"
    with serving(tmp_path_factory, name, args, env={"TANDEM_DEBUG_KV": "1"}, warm=False) as server:
        before = server.metrics()
        client = openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key="none", max_retries=0, timeout=120)

        async def run() -> list:
            done = await asyncio.gather(*(client.completions.create(
                model="smollm2", prompt=p, max_tokens=NEW_TOKENS, temperature=0,
                extra_body={"return_token_ids": True}) for p in PROMPTS))
            await client.close()
            return [d.choices[0].token_ids for d in done]
        assert asyncio.run(run()) == expected
        sync = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none", max_retries=0, timeout=120)
        again = sync.completions.create(model="smollm2", prompt=PROMPTS[1], max_tokens=NEW_TOKENS, temperature=0,
                                        extra_body={"return_token_ids": True})
        assert again.choices[0].token_ids == expected[1] and again.usage.prompt_tokens_details.cached_tokens > 0
        check_a_session(server.base_url, loaded, reference, eos)
        after = server.metrics()
        moved = lambda name: metric(after, name) - metric(before, name)  # noqa: E731
        moved_now = lambda name: metric(server.metrics(), name) - metric(before, name)  # noqa: E731
        assert moved("tandem:kv_transfer_bytes_total") > 0
        # every landing's pages checked against the digests the prefill rank(s) sent, each rank's part
        # by the rank holding it, and none failed (a wrong sum would have re-routed and failed requests)
        eventually(lambda: moved_now("tandem:kv_checksum_verified_pages_total") > 0, "landed pages verified")
        assert moved("tandem:kv_checksum_failures_total") == 0
        if eagle:  # the decode worker's sharded head drafted, and the target took some of its drafts
            assert moved("tandem:spec_draft_tokens_total") > 0 and moved("tandem:spec_accepted_tokens_total") > 0


def check_a_session(base_url: str, loaded, reference, eos: list[int]) -> None:
    """Two turns of a session: each transformers' greedy continuation of the whole conversation, the
    second finding the first's history cached."""
    import httpx

    session = httpx.post(f"{base_url}/v1/sessions", timeout=60, json={"capacity_tokens": 256}).json()["id"]
    history: list[int] = []
    for turn, text in enumerate(["A session about rivers. The longest river", " And the widest one"]):
        new = loaded.tokenizer.encode(text, add_special_tokens=False)
        resp = httpx.post(f"{base_url}/v1/completions", timeout=300, json={
            "model": "smollm2", "prompt": new if turn else history + new, "max_tokens": NEW_TOKENS, "temperature": 0,
            "session_id": session, "return_token_ids": True})
        assert resp.status_code == 200, resp.text
        choice, usage = resp.json()["choices"][0], resp.json()["usage"]
        history = history + new
        assert choice["token_ids"] == hf_greedy(reference, history, NEW_TOKENS, eos)
        if turn:
            assert usage["prompt_tokens_details"]["cached_tokens"] > 0
        history += choice["token_ids"]
    assert httpx.delete(f"{base_url}/v1/sessions/{session}", timeout=60).status_code == 200
