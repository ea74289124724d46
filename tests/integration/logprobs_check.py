"""One check for every served path (imported by the serve test modules): logprobs through the official
`openai` SDK equal HF transformers' log-softmax of the same tokens on the same weights: a chat's
(`logprobs`, `top_logprobs`), whole and streamed (disaggregated, the first token's come from the
prefill worker; the repeat's usage splits its cached tokens by tier), and a completion that echoes its prompt with
`max_tokens: 0` (the prompt scored alone)."""

from __future__ import annotations

import openai
import pytest
import torch

from tests.helpers import smollm2

TOLERANCE = 2e-3  # float32 serving against float32 HF, different kernels and batch shapes
QUESTION = [{"role": "user", "content": "Name three fruits."}]
TEXT = "The quick brown fox jumps over the lazy dog. The quick brown"


def hf_logprobs(ids: list[int]) -> torch.Tensor:
    """[len(ids), vocab]: HF's log-softmax at each position (row p predicts token p + 1)."""
    _, hf = smollm2()
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)


def check_logprobs(client: openai.OpenAI, chat: bool = True) -> None:
    """`chat` False: a path where chat requests do not fit (a session check sends its own turns)."""
    if chat:
        _check_chat(client)
    prompt = smollm2()[0].tokenizer.encode(TEXT, add_special_tokens=False)
    done = client.completions.create(model="smollm2", prompt=[prompt], echo=True, logprobs=1, max_tokens=0,
                                     temperature=0)
    lp, want = done.choices[0].logprobs, hf_logprobs(prompt)
    assert done.usage.completion_tokens == 0 and len(lp.token_logprobs) == len(prompt)
    assert lp.token_logprobs[0] is None
    assert lp.token_logprobs[1:] == pytest.approx([float(want[p - 1, prompt[p]]) for p in range(1, len(prompt))],
                                                  abs=TOLERANCE)


def _check_chat(client: openai.OpenAI) -> None:
    done = client.chat.completions.create(model="smollm2", messages=QUESTION, max_tokens=8, temperature=0,
                                          logprobs=True, top_logprobs=2, extra_body={"return_token_ids": True})
    choice = done.choices[0]
    tokens, content = choice.token_ids, choice.logprobs.content
    want = hf_logprobs(done.prompt_token_ids + tokens)
    start = len(done.prompt_token_ids) - 1
    assert len(content) == len(tokens)
    for i, (token, item) in enumerate(zip(tokens, content)):
        assert item.logprob == pytest.approx(float(want[start + i, token]), abs=TOLERANCE), i
        assert [t.logprob for t in item.top_logprobs] == pytest.approx(want[start + i].topk(2).values.tolist(),
                                                                       abs=TOLERANCE)
    stream = client.chat.completions.create(model="smollm2", messages=QUESTION, max_tokens=8, temperature=0,
                                            logprobs=True, top_logprobs=2, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    streamed = [item for chunk in chunks for c in chunk.choices if c.logprobs for item in c.logprobs.content]
    details = chunks[-1].usage.prompt_tokens_details  # the repeat found the prompt cached, on device
    assert details.cached_tokens > 0 and details.model_extra["cached_tokens_details"] == {
        "device": details.cached_tokens, "host": 0, "l3": 0}
    assert [s.token for s in streamed] == [c.token for c in content]
    assert [s.logprob for s in streamed] == pytest.approx([c.logprob for c in content], abs=TOLERANCE)
