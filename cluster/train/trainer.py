"""Training a draft head on CPU: examples from (sample, aux, vocabulary), the deterministic batch
schedule, the optimizer loop with resume state, and its loss.

Determinism: the batch order of epoch e comes from a generator seeded with (seed, e), and the
learning rate is a function of the step, so a run resumed from its state after step N continues
exactly as if it had not stopped (same threads, same machine).
"""

from __future__ import annotations

import contextlib
import logging
import math
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from cluster.train.checkpoint import load_state, save_state, trainable
from cluster.train.data import Sample
from cluster.train.settings import TrainSettings
from cluster.train.unroll import draft_rows, logits, unrolled_forward
from kernels.model.eagle import EagleDraftHead

log = logging.getLogger("tandem.train")

IGNORE = -1
WARMUP_FRACTION = 0.05
FINAL_LR_FRACTION = 0.05
GRAD_CLIP = 0.5
SORT_WINDOW_BATCHES = 8  # batches of similar length are cut from windows this many batches long


@dataclass(frozen=True)
class Example:
    """One sequence's draft rows: row i reads input_ids[i] = t[i+1] and aux[i] = a[i] and should
    predict labels[i], the draft id of t[i+2], or IGNORE (prompt text, no next token, or a token
    outside the draft vocabulary)."""

    input_ids: torch.Tensor  # [m] int64, m = n - 1
    aux: torch.Tensor  # [m, 3h] float32
    labels: torch.Tensor  # [m] int64
    target_hidden: torch.Tensor | None = None
    """[m, h] float32: row i's target final hidden at position i + 1, whose logits are the target's
    distribution over t[i+2] (soft labels); None: hard labels only."""

    @property
    def length(self) -> int:
        return len(self.input_ids)


def make_example(sample: Sample, aux: torch.Tensor, t2d: torch.Tensor, hidden: torch.Tensor | None = None) -> Example:
    """Rows of `sample` (tokens t, aux a ``[n, 3h]``, prompt length P); labelled from row P-1 on,
    the first a speculative round uses (the target itself samples t[P], the first answer token).
    `hidden`: the target's final hidden ``[n, h]`` (`data.target_states`), for soft labels."""
    tokens = torch.tensor(sample.token_ids, dtype=torch.int64)
    input_ids, row_aux = draft_rows(tokens, aux)
    labels = torch.full_like(input_ids, IGNORE)
    first = sample.prompt_len - 1  # row P-1 predicts t[P+1]
    labels[first:len(tokens) - 2] = t2d[tokens[first + 2:]]
    return Example(input_ids, row_aux, labels, None if hidden is None else hidden[1:])


def pad_batch(examples: list[Example]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """input_ids ``[B, L]``, aux ``[B, L, 3h]``, labels ``[B, L]`` (IGNORE past each end)."""
    length = max(e.length for e in examples)
    ids = torch.zeros(len(examples), length, dtype=torch.int64)
    aux = torch.zeros(len(examples), length, examples[0].aux.shape[1])
    labels = torch.full((len(examples), length), IGNORE, dtype=torch.int64)
    for b, e in enumerate(examples):
        ids[b, :e.length], aux[b, :e.length], labels[b, :e.length] = e.input_ids, e.aux, e.labels
    return ids, aux, labels


def pad_hidden(examples: list[Example]) -> torch.Tensor:
    """The examples' target hidden states ``[B, L, h]`` (zeros past each end), as `pad_batch` pads."""
    hidden = [e.target_hidden for e in examples if e.target_hidden is not None]
    assert len(hidden) == len(examples), "an example without the target's hidden states (`target_states`)"
    length = max(e.length for e in examples)
    out = torch.zeros(len(examples), length, hidden[0].shape[1])
    for b, (e, h) in enumerate(zip(examples, hidden)):
        out[b, :e.length] = h
    return out


def epoch_batches(lengths: list[int], batch_size: int, seed: int, epoch: int) -> list[list[int]]:
    """Example indices per batch for `epoch`: a seeded shuffle, cut into windows of
    SORT_WINDOW_BATCHES batches sorted by length (less padding), the batches then shuffled."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    order = torch.randperm(len(lengths), generator=gen).tolist()
    window = batch_size * SORT_WINDOW_BATCHES
    batches = []
    for start in range(0, len(order), window):
        chunk = sorted(order[start:start + window], key=lambda i: lengths[i])
        batches += [chunk[i:i + batch_size] for i in range(0, len(chunk), batch_size)]
    return [batches[i] for i in torch.randperm(len(batches), generator=gen).tolist()]


def steps_per_epoch(num_examples: int, batch_size: int) -> int:
    return -(-num_examples // batch_size)


def lr_at(step: int, total_steps: int, peak: float) -> float:
    """Linear warm-up over WARMUP_FRACTION of the steps, then cosine down to FINAL_LR_FRACTION."""
    warmup = max(1, int(total_steps * WARMUP_FRACTION))
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total_steps - warmup)
    return peak * (FINAL_LR_FRACTION + (1 - FINAL_LR_FRACTION) * 0.5 * (1 + math.cos(math.pi * progress)))


def uses_bf16(precision: str, device: torch.device | str) -> bool:
    """Whether `TrainSettings.precision` means bfloat16 answers and autocast training on `device`."""
    if precision != "auto":
        return precision == "bf16"
    if torch.device(device).type == "cuda":
        return torch.cuda.is_bf16_supported()
    from kernels.model.packed_linear import cpu_native_bf16

    return cpu_native_bf16()


def autocast(device: torch.device | str, bf16: bool) -> contextlib.AbstractContextManager:
    """bfloat16 autocast on `device` when `bf16` (matmuls in bf16, reductions and losses in
    float32, float32 weights), else nothing."""
    return torch.autocast(torch.device(device).type, dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()


def unrolled_loss(head: EagleDraftHead, ids: torch.Tensor, aux: torch.Tensor, labels: torch.Tensor,
                  num_steps: int, step_decay: float, soft: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, list[float]]:
    """Sum over steps s of step_decay**s x the mean cross-entropy of step s's valid rows (i >= s,
    labelled) against the labels, or with `soft` against the target's probabilities: ``[R,
    draft_vocab]`` for the R labelled rows (``labels >= 0``, row-major; `soft_labels`); also each
    step's top-1 accuracy against the labels."""
    total, accuracies = torch.zeros((), device=ids.device), []
    labelled = labels >= 0
    for s, x in enumerate(unrolled_forward(head, ids, aux, num_steps)):
        rows = labelled.clone()
        rows[:, :s] = False  # rows i < s have no step-s feature
        if not rows.any():
            accuracies.append(float("nan"))
            continue
        row_logits = logits(head, x[rows]).float()  # [rows, draft_vocab]
        if soft is None:
            loss = F.cross_entropy(row_logits, labels[rows])
        else:
            loss = -(soft[rows[labelled]] * F.log_softmax(row_logits, -1)).sum(-1).mean()
        total = total + step_decay ** s * loss
        accuracies.append((row_logits.argmax(-1) == labels[rows]).float().mean().item())
    return total, accuracies


def make_optimizer(head: EagleDraftHead, lr: float) -> torch.optim.Optimizer:
    return torch.optim.AdamW(list(trainable(head).values()), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)


def soft_labels(target_hidden: torch.Tensor, target_head: torch.Tensor) -> torch.Tensor:
    """The target's distribution over the draft vocabulary: softmax of its logits at the draft
    tokens, ``[..., h]`` hidden x ``[h, draft_vocab]`` (its lm_head's columns of the draft ids)."""
    return (target_hidden @ target_head).float().softmax(-1)


def train_head(head: EagleDraftHead, examples: list[Example], settings: TrainSettings, state_path: Path,
               checkpoint_every: int, stop_after: int | None = None,
               target_head: torch.Tensor | None = None) -> list[float]:
    """Train `head` in place (resuming from `state_path` when it holds a state); the state is saved
    every `checkpoint_every` steps and at the end. `stop_after`: stop once this many steps are done
    (an interrupted run, for tests). With `settings.soft_labels`, `target_head` ``[h, draft_vocab]``
    (the target lm_head's columns of the draft ids) and every example's `target_hidden` give the
    labels; `settings.precision` decides bfloat16 autocast (`uses_bf16`). Returns the loss of each
    step this call ran."""
    if settings.soft_labels and (target_head is None or any(e.target_hidden is None for e in examples)):
        raise ValueError("soft labels need the target's lm_head columns and every example's target hidden states")
    from tqdm import tqdm

    optimizer = make_optimizer(head, settings.lr)
    per_epoch = steps_per_epoch(len(examples), settings.batch_size)
    total = per_epoch * settings.epochs
    done = load_state(state_path, head, optimizer)
    if done:
        log.info("resuming draft-head training after step %d of %d", done, total)
    end = total if stop_after is None else min(total, stop_after)
    losses: list[float] = []
    bf16 = uses_bf16(settings.precision, head.lm_head.weight.device)
    head.train()
    with tqdm(total=total, initial=done, desc="training", unit="step", file=sys.stderr, disable=None) as bar:
        for step in range(done, end):
            epoch, index = divmod(step, per_epoch)
            batch = epoch_batches([e.length for e in examples], settings.batch_size, settings.seed, epoch)[index]
            loss, accuracies = _step(head, optimizer, [examples[i] for i in batch], settings,
                                     lr_at(step, total, settings.lr), target_head, bf16)
            losses.append(loss)
            bar.set_postfix(loss=f"{loss:.3f}", acc="/".join(f"{a:.2f}" for a in accuracies), refresh=False)
            bar.update(1)
            if (step + 1) % checkpoint_every == 0 or step + 1 == end:
                save_state(state_path, step + 1, head, optimizer)
    head.eval()
    return losses


def _step(head: EagleDraftHead, optimizer: torch.optim.Optimizer, batch: list[Example], settings: TrainSettings,
          lr: float, target_head: torch.Tensor | None, bf16: bool) -> tuple[float, list[float]]:
    for group in optimizer.param_groups:
        group["lr"] = lr
    device = head.lm_head.weight.device
    ids, aux, labels = (t.to(device) for t in pad_batch(batch))
    # labels in float32 whatever the precision, for the labelled rows only (prompt rows and padding
    # are a third or more of a batch of short answers)
    soft = None
    if settings.soft_labels:
        assert target_head is not None, "soft labels without the target's head (`train` checks it)"
        soft = soft_labels(pad_hidden(batch).to(device)[labels >= 0], target_head)
    with autocast(device, bf16):
        loss, accuracies = unrolled_loss(head, ids, aux, labels, settings.unroll_steps, settings.step_decay, soft)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(list(trainable(head).values()), GRAD_CLIP)
    optimizer.step()
    return loss.item(), accuracies
