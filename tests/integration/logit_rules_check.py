"""One check for every served path (imported by the serve test modules): the logit fields of the
OpenAI API (`frequency_penalty`, `presence_penalty`, `logit_bias`) and vLLM's extensions
(`repetition_penalty`, `min_tokens`), sent through the official `openai` SDK at temperature 0, give
exactly the greedy tokens of HF transformers with the same rule on the same weights (its own logits
processors where it has them, a loop over its logits where it does not)."""

from __future__ import annotations

import openai
import torch

from tests.helpers import smollm2

MAX_TOKENS = 12
TEXT = "The capital of France is Paris. The capital of France is"
CHAT = "Hi!"


def hf_greedy_with(prompt: list[int], max_new: int, frequency: float = 0.0, presence: float = 0.0,
                   **generate_kwargs) -> list[int]:
    """HF's greedy tokens, stopping at the model's EOS; `generate_kwargs` go to `generate` (its
    processors), the OpenAI frequency/presence penalties are applied by hand in a loop over its logits."""
    loaded, hf = smollm2()
    eos = list(loaded.eos_token_ids)
    if not (frequency or presence):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new, do_sample=False,
                              eos_token_id=eos, pad_token_id=eos[0], **generate_kwargs)
        return out[0, len(prompt):].tolist()
    out: list[int] = []
    while len(out) < max_new and not (out and out[-1] in eos):
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + out])).logits[0, -1].float()
        for token in set(out):
            logits[token] -= frequency * out.count(token) + presence
        out.append(int(logits.argmax()))
    return out


def _complete(client: openai.OpenAI, chat: bool, max_tokens: int, **fields) -> tuple[list[int], list[int]]:
    """(prompt token ids, output token ids) of one greedy request."""
    extra = {"return_token_ids": True, **fields.pop("extra_body", {})}
    if chat:
        done = client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": CHAT}],
                                              max_tokens=max_tokens, temperature=0, extra_body=extra, **fields)
        choice = done.choices[0]
        return done.prompt_token_ids, choice.token_ids
    done = client.completions.create(model="smollm2", prompt=TEXT, max_tokens=max_tokens, temperature=0,
                                     extra_body=extra, **fields)
    return done.choices[0].prompt_token_ids, done.choices[0].token_ids


def check_logit_rules(client: openai.OpenAI) -> None:
    prompt, plain = _complete(client, False, MAX_TOKENS)
    assert plain == hf_greedy_with(prompt, MAX_TOKENS), "plain greedy differs from HF's: nothing below would tell"
    cases = [
        (dict(frequency_penalty=1.5, presence_penalty=0.5), dict(frequency=1.5, presence=0.5)),
        (dict(extra_body={"repetition_penalty": 1.4}), dict(repetition_penalty=1.4)),
        (dict(logit_bias={str(plain[0]): -100}), dict(sequence_bias={(plain[0],): -100.0})),
    ]
    for fields, reference in cases:
        _, got = _complete(client, False, MAX_TOKENS, **fields)
        want = hf_greedy_with(prompt, MAX_TOKENS, **reference)
        assert got == want, (fields, got, want)
        assert got != plain, f"{fields} changed nothing here: the check proves nothing"
    chat_prompt, answer = _complete(client, True, 48)
    assert answer and answer[-1] in smollm2()[0].eos_token_ids, "the chat answer did not end at EOS within 48"
    at_least = len(answer) + 4
    _, longer = _complete(client, True, at_least + 4, extra_body={"min_tokens": at_least})
    assert longer == hf_greedy_with(chat_prompt, at_least + 4, min_new_tokens=at_least)
    assert len(longer) >= at_least
