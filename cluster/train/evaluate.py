"""Offline greedy chain acceptance of a draft head on the target's own greedy answers.

For a verify at position n (the target has produced t[0..n]; real features exist up to n-1) the head
drafts d1 = step 0 at row n-1, d2 = step 1 at row n, d3 = step 2 at row n+1 (`unroll`): exactly what
inference computes while every earlier draft matched, which is all acceptance looks at. Accepted
drafts are the matching prefix of (d1, d2, d3) against (t[n+1], t[n+2], t[n+3]); a verify yields
accepted + 1 tokens (the target's bonus token). Positions run over the answer, n in [P, N-1).

    mean_accepted_len   rounds as the engine runs them: from n = P, each verify moves n by accepted + 1
    per_position_len    the mean over every answer position n (each a round's start)
    step_accept         P(d_k matches | d_1..d_{k-1} matched), over every position
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from cluster.train.data import Sample
from cluster.train.unroll import draft_rows, logits, unrolled_forward
from cluster.train.vocab import DraftVocab
from kernels.model.eagle import EagleDraftHead


@dataclass(frozen=True)
class Acceptance:
    num_drafts: int  # k
    mean_accepted_len: float  # tokens per verify, bonus included, in engine-like rounds
    per_position_len: float
    step_accept: tuple[float, ...]  # [k] conditional acceptance of draft 1..k
    num_rounds: int
    num_positions: int

    def as_dict(self) -> dict:
        return asdict(self)

    def summary(self) -> str:
        rates = ", ".join(f"{r:.2f}" for r in self.step_accept)
        return (f"mean accepted length {self.mean_accepted_len:.3f} tokens/verify at k={self.num_drafts} "
                f"({self.num_rounds} verifies; every-position mean {self.per_position_len:.3f}; "
                f"per-draft acceptance {rates})")


@torch.no_grad()
def chain_acceptance(head: EagleDraftHead, samples: list[Sample], aux: list[torch.Tensor], vocab: DraftVocab,
                     num_drafts: int = 3) -> Acceptance:
    """Greedy chain acceptance of `head` at k = `num_drafts` over `samples` (the target's greedy
    answers) with their aux states; see the module docstring."""
    accepted: list[list[int]] = []  # per sample, per answer position n: drafts accepted
    for sample, sample_aux in zip(samples, aux):
        accepted.append(_accepted_per_position(head, sample, sample_aux, vocab, num_drafts))
    positions = [a for per_sample in accepted for a in per_sample]
    rounds = [a for per_sample in accepted for a in _rounds(per_sample)]
    reached = [sum(a >= k for a in positions) for k in range(num_drafts + 1)]
    return Acceptance(
        num_drafts=num_drafts,
        mean_accepted_len=sum(a + 1 for a in rounds) / max(1, len(rounds)),
        per_position_len=sum(a + 1 for a in positions) / max(1, len(positions)),
        step_accept=tuple(reached[k + 1] / max(1, reached[k]) for k in range(num_drafts)),
        num_rounds=len(rounds), num_positions=len(positions))


def _accepted_per_position(head: EagleDraftHead, sample: Sample, aux: torch.Tensor, vocab: DraftVocab,
                           num_drafts: int) -> list[int]:
    """For each n in [P, N-1): how many of the chain's drafts match t[n+1..n+k] in a row."""
    tokens = torch.tensor(sample.token_ids, dtype=torch.int64)
    n_tokens, first = len(tokens), sample.prompt_len
    if n_tokens - 1 <= first:
        return []
    input_ids, row_aux = draft_rows(tokens, aux)
    xs = unrolled_forward(head, input_ids[None], row_aux[None], num_drafts)
    drafts = [vocab.target_ids[logits(head, x[0]).argmax(-1).cpu()] for x in xs]  # [k] x [N-1]: row i's guess of t[i+2]
    out = []
    for n in range(first, n_tokens - 1):
        count = 0
        while count < num_drafts and n + count + 1 < n_tokens and (
                drafts[count][n - 1 + count] == tokens[n + count + 1]):
            count += 1
        out.append(count)
    return out


def _rounds(per_position: list[int]) -> list[int]:
    """Accepted drafts of each verify when the target advances by accepted + 1 from the first position."""
    out, n = [], 0
    while n < len(per_position):
        out.append(per_position[n])
        n += per_position[n] + 1
    return out
