"""Log-probabilities a request asked for: of its output tokens (`params.logprobs`) from the rows of
logits they were chosen from, and of its prompt tokens (`params.prompt_logprobs`) from the final
hidden states of its prefill chunks.

Values are the model's own log-softmax: before logit rules (penalties, biases), temperature, top-k/p
and grammar masks (vLLM's `--logprobs-mode raw_logprobs`, its default). With speculative decoding
they come from the target's verify rows, which are the model's logits at those positions.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from common.logprobs import TokenLogprobs
from engine.request import Request
from engine.runner import ForwardRow

PROMPT_ROWS_PER_PASS = 256
"""Prompt positions turned into logits at once (a [256, vocab] float32 block: 50 MB at a 49k vocab)."""


def token_logprobs(logits: torch.Tensor, token_ids: Sequence[int], top: int) -> list[TokenLogprobs]:
    """Row i of `logits` [N, V]: the logprob and rank of `token_ids[i]`, and the `top` best tokens."""
    if not len(token_ids):
        return []
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    ids = torch.tensor(list(token_ids), dtype=torch.int64, device=logprobs.device).unsqueeze(1)
    chosen = logprobs.gather(1, ids)  # [N, 1]
    ranks = (logprobs > chosen).sum(dim=-1) + 1
    best = logprobs.topk(top, dim=-1) if top else None
    out = []
    for i, (value, rank) in enumerate(zip(chosen.squeeze(1).tolist(), ranks.tolist())):
        alternatives = tuple(zip(best.indices[i].tolist(), best.values[i].tolist())) if best is not None else ()
        out.append(TokenLogprobs(value, rank, alternatives))
    return out


def record_output(req: Request, logits: torch.Tensor, rows: Sequence[int], tokens: Sequence[int]) -> None:
    """Append the logprobs of `tokens` (just appended to `req`'s output), token i chosen from
    `logits[rows[i]]`, when `req` asked for them."""
    if req.params.logprobs is None or not tokens:
        return
    picked = logits[torch.tensor(list(rows[:len(tokens)]), dtype=torch.int64, device=logits.device)]
    req.output_logprobs.extend(token_logprobs(picked, tokens, req.params.logprobs))


@torch.inference_mode()
def record_prompt(req: Request, row: ForwardRow, hidden: torch.Tensor,
                  compute_logits: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """`row` computed prompt positions [start, seq_len) of `req` (`hidden`: their final-normed states):
    the logprob of each prompt token those positions predict. Position p predicts token p + 1; the
    prompt's last position predicts the first output token (its logprobs come with that token)."""
    prompt, num_top = req.prompt_token_ids, req.params.prompt_logprobs
    assert num_top is not None, f"request {req.request_id}'s prompt logprobs recorded, but it asked for none"
    if len(req.prompt_logprobs) != len(prompt):
        req.prompt_logprobs = [None] * len(prompt)
    start = row.seq_len - len(row.token_ids)
    end = min(row.seq_len, len(prompt) - 1)  # positions whose next token is in the prompt
    for first in range(start, end, PROMPT_ROWS_PER_PASS):
        last = min(first + PROMPT_ROWS_PER_PASS, end)
        logits = compute_logits(hidden[first - start:last - start])
        values = token_logprobs(logits, prompt[first + 1:last + 1], num_top)
        req.prompt_logprobs[first + 1:last + 1] = values
