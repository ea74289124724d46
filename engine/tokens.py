"""Which tokens one engine step emits: sampled for plain rows, verified drafts for verify rows, cut by
the stop rules token by token. A fault here is one request's: it comes back as that row's exception,
never raised for the batch (the engine fails that request alone)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Protocol

import torch

from common.grammar_spec import GrammarError
from engine.request import FinishReason, Request
from engine.scheduler import ScheduledStep
from kernels.sampling import adjust_logits, sample


class Verifier(Protocol):
    """What verifies a row's drafts: the engine's speculator (`engine/spec/speculator.py:EagleSpeculator`;
    `engine/spec/factory.py:NullSpeculator` when speculation is off, which no row with drafts reaches)."""

    def verify(self, req: Request, logits: torch.Tensor) -> list[int]: ...

    def emitted_rows(self, req: Request, num_emitted: int) -> list[int]: ...


def row_tokens(scheduled: ScheduledStep, logits: torch.Tensor, speculator: Verifier,
               ) -> list[tuple[list[int] | Exception | None, list[int]]]:
    """Per row: (the tokens it emits before stop rules, None for a row without logits (a prefill
    chunk), or the exception that fails its request; the row of `logits` each token was chosen from).
    Plain rows are sampled as one batch; a verify row's drafts are verified by `speculator`.
    `logits`: each row's `num_logits` rows, in row order."""
    out: list = [(None, [])] * len(scheduled.rows)
    plain, plain_at, at = [], [], 0
    for i, (req, row) in enumerate(zip(scheduled.requests, scheduled.rows)):
        if row.num_draft_tokens:
            try:
                tokens = speculator.verify(req, logits[at:at + row.num_logits])
                out[i] = tokens, [at + r for r in speculator.emitted_rows(req, len(tokens))]
            except Exception as exc:  # noqa: BLE001 - returned: the caller fails this request alone
                out[i] = exc, []
        elif row.num_logits:
            plain.append(i)
            plain_at.append(at)
        at += row.num_logits
    rows = logits if len(plain_at) == logits.shape[0] else logits[plain_at]
    for i, at, token in zip(plain, plain_at, sample_rows([scheduled.requests[i] for i in plain], rows)):
        out[i] = (token, []) if isinstance(token, Exception) else ([token], [at])
    return out


def sample_rows(reqs: list[Request], logits: torch.Tensor) -> Sequence[int | Exception]:
    """One token per request, or the exception its row raised. The batch is sampled at once; only
    when that raises is each row sampled alone (the sampler's draws do not depend on the batch)."""
    try:
        return _sample(reqs, logits)
    except Exception:  # noqa: BLE001 - some request's values broke the batch: find which
        return [_sample_alone(req, logits[i:i + 1]) for i, req in enumerate(reqs)]


def _sample_alone(req: Request, logits: torch.Tensor) -> int | Exception:
    try:
        return _sample([req], logits)[0]
    except Exception as exc:  # noqa: BLE001 - returned: the caller fails this request alone
        return exc


def _sample(reqs: list[Request], logits: torch.Tensor) -> list[int]:
    adjusted = [i for i, r in enumerate(reqs) if r.params.adjusts_logits or r.params.grammar is not None]
    if adjusted:
        logits = logits.float().clone()
        for i in adjusted:
            logits[i:i + 1] = adjusted_logits(reqs[i], logits[i:i + 1])
    return sample(logits, [r.params.temperature for r in reqs], [r.params.top_k for r in reqs],
                  [r.params.top_p for r in reqs], [r.sample_seed for r in reqs],
                  [len(r.output_token_ids) for r in reqs], [r.params.min_p for r in reqs]).tolist()


def adjusted_logits(req: Request, logits: torch.Tensor, drafts: list[int] | tuple = ()) -> torch.Tensor:
    """`req`'s logits rows with its rules (`kernels.sampling.adjust_logits`), then its grammar's mask
    (row j: after `drafts[:j]`; `engine/structured.py`), as a new tensor; `logits` itself without either."""
    if not req.params.adjusts_logits and req.params.grammar is None:
        return logits
    if req.params.grammar is not None and req.grammar is None:
        raise RuntimeError("its grammar has no matcher (it did not compile; see the log)")
    if req.params.adjusts_logits:
        stops = req.stop_rules.token_ids if req.stop_rules is not None else req.params.stop_token_ids
        logits = adjust_logits(logits, req.params, req.prompt_token_ids, req.output_token_ids, stops, drafts)
    else:
        logits = logits.float().clone()
    if req.grammar is not None:
        if drafts:
            req.grammar.fill_draft_masks(logits, drafts)
        else:
            req.grammar.fill_mask(logits)
        # row 0: where the output is now (a verify row's later ones follow drafts)
        if not torch.isfinite(logits[0]).any():
            raise GrammarError(f"its grammar allows no token after {len(req.output_token_ids)} output tokens "
                               "(a grammar with no finite completion?)")
    return logits


def apply_stop_rules(req: Request, tokens: list[int] | None,
                     computed_here: bool = True) -> tuple[list[int], FinishReason | None]:
    """Append `tokens` to `req`'s output one by one until a stop rule ends it; returns those appended
    and the reason it ended (None: still running). None tokens: a prefill chunk, nothing to append.
    The one place a request's output grows (`EngineCore.accept_first_token` too, `computed_here`
    False: a prefill worker sampled it, so it is not this engine's `first_token` mark)."""
    rules, applied = req.stop_rules, []
    if tokens and computed_here and "first_token" not in req.timings:
        req.timings["first_token"] = time.monotonic()  # the first this engine computed
    for token in tokens or ():
        assert rules is not None, f"request {req.request_id} has no stop rules: admitted by no engine?"
        req.output_token_ids.append(token)
        applied.append(token)
        reason = rules.check(req.output_token_ids, req.num_tokens)
        if reason is not None:
            return applied, reason
    return applied, None
