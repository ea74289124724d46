"""`tandem train-eagle`: distil an EAGLE-3 draft head for a target from the target's own greedy answers,
on CPU, into the cache (`cluster.train.settings` has the layout) or an explicit directory.

    1. the target answers the shipped training and evaluation prompts (colocated engine, greedy;
       the training answers from a bfloat16 copy where `precision` resolves to bf16)
    2. the draft vocabulary: the most frequent answer tokens (`vocab`)
    3. the aux hidden states over prompt + answer, and the final ones (`data.target_states`), from
       the model that answered (the bfloat16 copy too: much faster than float32 on an AMX CPU)
    4. training with 3 unrolled draft steps (`unroll`, `trainer`) against the target's distribution
       over the draft vocabulary (soft labels), resumable from the work dir
    5. greedy chain acceptance at k = 3 on the held-out answers (`evaluate`), saved as eval.json
    6. the head in the published EAGLE-3 format (`checkpoint`), then the completion marker
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from cluster.train.settings import DEFAULT_CHECKPOINT_EVERY, TrainSettings, ensure_head, head_dir, is_complete

log = logging.getLogger("tandem.train")

EVAL_FILE = "eval.json"
GENERATIONS_FILE = "generations.json"
NUM_DRAFTS = 3  # the chain length acceptance is measured at


@dataclass(frozen=True)
class TrainResult:
    path: Path  # the head's directory (load with kernels.model.eagle.load_eagle_checkpoint)
    reused: bool  # a complete head was already there; nothing ran
    acceptance: dict | None  # eval.json: `evaluate.Acceptance.as_dict()`


def train_eagle(settings: TrainSettings, cache_root: Path | None = None, output: Path | None = None,
                force: bool = False, checkpoint_every: int = DEFAULT_CHECKPOINT_EVERY,
                device: str = "cpu") -> TrainResult:
    """The head for `settings` in `output` (default: the cache dir of `settings`), trained unless a
    complete one is there (`force`: retrain from scratch). Raises ValueError for settings the target
    cannot take (a draft vocabulary larger than its own, more prompts than shipped). `device`: where
    the target generates and the head trains (the published head is the same format either way)."""
    from cluster.train.data import load_prompts

    load_prompts("train", settings.num_prompts)  # a bad count fails before the model loads
    if checkpoint_every < 1:
        raise ValueError(f"checkpoint_every must be >= 1, got {checkpoint_every}")
    dest = Path(output) if output is not None else head_dir(settings, cache_root)
    reused = not force and is_complete(dest, settings)
    started = time.perf_counter()
    if torch.device(device).type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r}: torch sees no CUDA device")
    ensure_head(dest, settings, lambda work, out: _build(settings, cache_root, checkpoint_every, work, out, device),
                force)
    if not reused:
        log.info("draft head trained in %.0fs: %s", time.perf_counter() - started, dest)
    eval_path = dest / EVAL_FILE
    acceptance = json.loads(eval_path.read_text()) if eval_path.is_file() else None
    return TrainResult(dest, reused, acceptance)


def _build(settings: TrainSettings, cache_root: Path | None, checkpoint_every: int, work: Path, out: Path,
           device: str) -> None:
    from cluster.train.checkpoint import STATE_FILE, new_head, write_published
    from cluster.train.data import aux_states, target_states
    from cluster.train.evaluate import chain_acceptance
    from cluster.train.trainer import make_example, train_head, uses_bf16
    from cluster.train.vocab import most_frequent
    from kernels.model.loader import load_model

    torch.manual_seed(settings.seed)
    target = load_model(settings.model, device=device, backend="auto", cache_dir=cache_root)
    vocab_size = target.arch.vocab_size
    if settings.draft_vocab_size > vocab_size:
        raise ValueError(f"draft vocabulary {settings.draft_vocab_size} exceeds the target's {vocab_size} tokens")
    bf16 = uses_bf16(settings.precision, device)
    log.info("precision %s: %s answers, states and training", settings.precision, "bfloat16" if bf16 else "float32")
    answerer = _answerer(target, settings, bf16, cache_root, device)
    train_samples, eval_samples = _generations(work / GENERATIONS_FILE, target, answerer, settings)
    vocab = most_frequent([s.answer for s in train_samples], settings.draft_vocab_size, vocab_size)
    head = new_head(target.model, vocab, settings.seed).to(device)
    aux_ids = head.arch.aux_layer_ids
    log.info("aux hidden states (layers %s) of %d training sequences", aux_ids, len(train_samples))
    t2d = vocab.t2d()
    train_states = target_states(answerer.model, train_samples, aux_ids)
    del answerer
    soft = settings.soft_labels
    examples = [make_example(s, a, t2d, h if soft else None) for s, (a, h) in zip(train_samples, train_states)]
    del train_states
    # the target's lm_head columns of the draft ids: its logits over the draft vocabulary (soft labels)
    target_head = target.model.lm_head.weight.detach()[vocab.target_ids.to(device)].t().float() if soft else None
    train_head(head, examples, settings, work / STATE_FILE, checkpoint_every, target_head=target_head)
    del examples
    acceptance = chain_acceptance(head, eval_samples, aux_states(target.model, eval_samples, aux_ids), vocab,
                                  NUM_DRAFTS)
    log.info("held-out: %s", acceptance.summary())
    write_published(out, head, vocab, target.arch)
    (out / EVAL_FILE).write_text(json.dumps(acceptance.as_dict(), indent=2) + "\n")


def _answerer(target, settings: TrainSettings, bf16: bool, cache_root: Path | None, device: str):
    """The model that answers the training prompts and gives the states over them: a bfloat16 copy
    of `target` when `bf16` (what the head learns from, much faster; its states differ slightly from
    the target's: docs/results.md#speculative), else `target` itself."""
    from kernels.model.loader import load_model

    if not bf16:
        return target
    return load_model(settings.model, device=device, dtype=torch.bfloat16, backend="auto", cache_dir=cache_root)


def _generations(path: Path, target, answerer, settings: TrainSettings):
    """(train, eval) samples: read from `path` (an interrupted run's), else generated and saved there.
    `answerer` (`_answerer`) answers the training prompts; the held-out answers, which acceptance
    is measured against, always come from `target`."""
    from cluster.train.data import Sample, generate, load_prompts, tokenize

    if path.is_file():
        saved = json.loads(path.read_text())
        log.info("reusing the target's answers from %s", path)
        return tuple([Sample(tuple(ids), p) for ids, p in saved[split]] for split in ("train", "eval"))
    prompts = {"train": tokenize(target.tokenizer, load_prompts("train", settings.num_prompts)),
               "eval": tokenize(target.tokenizer, load_prompts("eval"))}
    started = time.perf_counter()
    train = generate(answerer.model, answerer.arch, answerer.eos_token_ids, prompts["train"], settings.max_new_tokens)
    held_out = generate(target.model, target.arch, target.eos_token_ids, prompts["eval"], settings.max_new_tokens)
    num_answer = sum(len(s.answer) for s in train + held_out)
    log.info("target answered %d prompts (%d tokens) in %.0fs", len(train) + len(held_out), num_answer,
             time.perf_counter() - started)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({split: [[list(s.token_ids), s.prompt_len] for s in part]
                               for split, part in (("train", train), ("eval", held_out))}))
    tmp.replace(path)
    return train, held_out
