"""The host tier (L2) through the product: `tandem serve` whose prefill worker has a small device pool
(32 pages) and a host tier (4x), KV checked after every scheduler step. Two chat conversations take
turns until their histories outgrow the prefill worker's device pool: each later turn still finds
its whole history cached, the previous answer included (decoded on the decode worker, prefilled on
the prefill worker after the turn: `PrefillAnswer`), evicted to L2 and loaded back; asked again, the
two last prompts (too big for the device pool together) move the prefill worker's L2 hits, and every answer is HF
transformers' greedy one on the same prompt ids."""

from __future__ import annotations

import httpx
import pytest

from tests.helpers import CHAT_PROMPTS, hf_greedy, smollm2
from tests.integration.serve_harness import eventually, metric, serving

pytestmark = pytest.mark.slow

PAGE = 16
PREFILL_PAGES = 32  # 496 usable tokens: less than the two conversations' histories together
MAX_NEW = 16
TURNS = 2
TURN_TOKENS = 160


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with serving(tmp_path_factory, "serve-l2", ["--set", f"prefill.engine.num_pages={PREFILL_PAGES}",
                                                "--set", "prefill.engine.host_cache_ratio=4",
                                                # every turn goes to the prefill worker, whose L2 this tests
                                                "--set", "router.local_prefill_max_tokens=0"],
                 env={"TANDEM_DEBUG_KV": "1"}) as server:
        yield server


def user_turn(conversation: int, turn: int) -> str:
    """`TURN_TOKENS` tokens of English, different for every turn of every conversation."""
    loaded, _ = smollm2()
    text = " ".join(CHAT_PROMPTS[(conversation * TURNS + turn + k) % len(CHAT_PROMPTS)] for k in range(8))
    ids = loaded.tokenizer.encode(f"Conversation {conversation}, turn {turn}. {text}", add_special_tokens=False)
    return loaded.tokenizer.decode(ids[:TURN_TOKENS])


def ask(server, messages: list[dict]) -> tuple[list[int], list[int], str, int]:
    """One greedy turn: (prompt ids, HF's greedy ids, the answer, cached tokens); the answer is HF's."""
    from kernels.model.tokenizer import apply_chat_template

    loaded, reference = smollm2()
    ids = apply_chat_template(loaded.tokenizer, messages)
    expected_ids = hf_greedy(reference, ids, MAX_NEW)
    resp = httpx.post(f"{server.base_url}/v1/chat/completions", timeout=300, json={
        "model": "smollm2", "messages": messages, "max_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True})
    assert resp.status_code == 200, resp.text
    body = resp.json()
    answer = body["choices"][0]["message"]["content"]
    assert body["usage"]["prompt_tokens"] == len(ids)
    assert answer == loaded.tokenizer.decode(expected_ids, skip_special_tokens=True)
    cached = (body["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return ids, expected_ids, answer, cached


def test_two_conversations_outgrowing_the_device_pool_reuse_their_history_from_l2(server):
    histories: list[list[dict]] = [[], []]
    last_history: list[list[int]] = [[], []]  # the previous turn's prompt ids + its answer's ids but the last
    last_turn: list[list[dict]] = [[], []]
    beyond_prompt = 0  # turns whose cached prefix reached past the previous prompt's whole pages
    before = server.metrics()
    for turn in range(TURNS):
        for conv in (0, 1):
            messages = histories[conv] + [{"role": "user", "content": user_turn(conv, turn)}]
            ids, expected_ids, answer, cached = ask(server, messages)
            if turn:  # the previous prompt and answer, as far as this prompt repeats them, in whole pages
                prev = last_history[conv]
                same = next((i for i, (a, b) in enumerate(zip(prev, ids)) if a != b), min(len(prev), len(ids)))
                assert cached >= same // PAGE * PAGE, (conv, turn, cached, same)
                beyond_prompt += cached > (len(prev) - MAX_NEW + 1) // PAGE * PAGE
            last_turn[conv] = messages
            histories[conv] = messages + [{"role": "assistant", "content": answer}]
            last_history[conv] = ids + expected_ids[:-1]
    assert sum(map(len, last_history)) > (PREFILL_PAGES - 1) * PAGE, "the histories never outgrew the device pool"
    assert beyond_prompt == 2 * (TURNS - 1), "a turn found only the previous prompt cached, not its answer"
    answers = metric(server.metrics(), "tandem:answer_prefills_total") - metric(before, "tandem:answer_prefills_total")
    assert answers == 2 * TURNS
    # Which pages the turns above evicted depends on when each answer was prefilled. Asked again, the
    # two last prompts cannot both be on device: the second asked comes back, in part, from L2.
    for conv in (0, 1):
        ids, _, _, cached = ask(server, last_turn[conv])
        assert cached >= (len(ids) - 1) // PAGE * PAGE, (conv, cached, len(ids))
    assert 2 * (len(ids) - 1) > (PREFILL_PAGES - 1) * PAGE, "the last prompts fit the device pool together"

    def l2_hits() -> float:
        return metric(server.metrics(), "tandem:prefix_cache_hit_tokens_total", tier="l2", role="prefill") - \
            metric(before, "tandem:prefix_cache_hit_tokens_total", tier="l2", role="prefill")

    eventually(lambda: l2_hits() > 0, "a prompt token came back from the host tier")
