"""The host tier (L2) through the product: `tandem serve` whose prefill worker has a small device pool
(64 pages) and a host tier (4x), KV checked after every scheduler step. Two chat conversations take
turns until their histories outgrow the prefill worker's device pool: each later turn still finds
its history cached (evicted to L2, loaded back), the prefill worker's L2 hits move, and every
answer is HF transformers' greedy one on the same prompt ids."""

from __future__ import annotations

import httpx
import pytest

from tests.helpers import CHAT_PROMPTS, hf_greedy, smollm2
from tests.integration.serve_harness import metric, start_server

pytestmark = pytest.mark.slow

PAGE = 16
PREFILL_PAGES = 64  # 1,008 usable tokens: less than the two conversations' histories together
MAX_NEW = 16
TURNS = 3


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    server = start_server(tmp_path_factory.mktemp("serve-l2"), [
        "--set", f"prefill.engine.num_pages={PREFILL_PAGES}", "--set", "prefill.engine.host_cache_ratio=4"],
        env={"TANDEM_DEBUG_KV": "1"})
    try:
        yield server
    finally:
        assert server.terminate() == 0, server.log_tail()


def user_turn(conversation: int, turn: int) -> str:
    """~220 tokens of English, different for every turn of every conversation."""
    loaded, _ = smollm2()
    text = " ".join(CHAT_PROMPTS[(conversation * TURNS + turn + k) % len(CHAT_PROMPTS)] for k in range(8))
    ids = loaded.tokenizer.encode(f"Conversation {conversation}, turn {turn}. {text}", add_special_tokens=False)
    return loaded.tokenizer.decode(ids[:220])


def test_two_conversations_outgrowing_the_device_pool_reuse_their_history_from_l2(server):
    from kernels.model.tokenizer import apply_chat_template

    loaded, reference = smollm2()
    histories: list[list[dict]] = [[], []]
    last_prompt_len = [0, 0]
    before = server.metrics()
    for turn in range(TURNS):
        for conv in (0, 1):
            messages = histories[conv] + [{"role": "user", "content": user_turn(conv, turn)}]
            ids = apply_chat_template(loaded.tokenizer, messages)
            expected = loaded.tokenizer.decode(hf_greedy(reference, ids, MAX_NEW), skip_special_tokens=True)
            resp = httpx.post(f"{server.base_url}/v1/chat/completions", timeout=300, json={
                "model": "smollm2", "messages": messages, "max_tokens": MAX_NEW, "temperature": 0,
                "ignore_eos": True})
            assert resp.status_code == 200, resp.text
            body = resp.json()
            answer = body["choices"][0]["message"]["content"]
            assert body["usage"]["prompt_tokens"] == len(ids)
            assert answer == expected, (conv, turn)
            cached = (body["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0
            if turn:  # the previous turn's prompt, in whole pages, is this one's cached prefix
                assert cached >= last_prompt_len[conv] // PAGE * PAGE, (conv, turn, cached, last_prompt_len[conv])
            histories[conv] = messages + [{"role": "assistant", "content": answer}]
            last_prompt_len[conv] = len(ids)
    assert sum(last_prompt_len) > (PREFILL_PAGES - 1) * PAGE, "the histories never outgrew the device pool"
    after = server.metrics()
    l2 = metric(after, "tandem:prefix_cache_hit_tokens_total", tier="l2", role="prefill") - \
        metric(before, "tandem:prefix_cache_hit_tokens_total", tier="l2", role="prefill")
    assert l2 > 0, "no prompt token came back from the host tier"
