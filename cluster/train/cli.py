"""`tandem train-eagle`'s flags and entry point (the flags import no torch: `tandem` parses every
command's flags at start-up)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from cluster.train.settings import DEFAULT_CHECKPOINT_EVERY, PRECISIONS, TrainSettings

_DEFAULTS = TrainSettings()


def add_train_eagle_args(p: argparse.ArgumentParser) -> None:
    p.description = ("Distil an EAGLE-3 draft head for --model from its own greedy answers to the shipped chat "
                     "prompts, on CPU, into the cache (reused when complete; an interrupted run resumes), then "
                     "print its greedy chain acceptance at k=3 on held-out prompts.")
    p.add_argument("--model", default=_DEFAULTS.model,
                   help="target: 'smollm2' or a local HF dir (default %(default)s)")
    p.add_argument("--cache-dir", type=Path, help="tandem cache root (default $TANDEM_CACHE_DIR or ~/.cache/tandem)")
    p.add_argument("--output", type=Path, help="write the head to this directory instead of the cache")
    p.add_argument("--num-prompts", type=int, default=_DEFAULTS.num_prompts,
                   help="training prompts, of the shipped set (default %(default)s)")
    p.add_argument("--max-new-tokens", type=int, default=_DEFAULTS.max_new_tokens,
                   help="target tokens generated per prompt (default %(default)s)")
    p.add_argument("--draft-vocab-size", type=int, default=_DEFAULTS.draft_vocab_size,
                   help="the head's vocabulary: the most frequent target tokens (default %(default)s)")
    p.add_argument("--epochs", type=int, default=_DEFAULTS.epochs, help="passes over the data (default %(default)s)")
    p.add_argument("--unroll-steps", type=int, default=_DEFAULTS.unroll_steps,
                   help="draft steps unrolled in training (default %(default)s)")
    p.add_argument("--batch-size", type=int, default=_DEFAULTS.batch_size,
                   help="sequences per step (default %(default)s)")
    p.add_argument("--lr", type=float, default=_DEFAULTS.lr, help="peak learning rate (default %(default)s)")
    p.add_argument("--hard-labels", dest="soft_labels", action="store_false",
                   help="train on the target's greedy tokens only, not its distribution over the draft vocabulary")
    p.add_argument("--precision", choices=PRECISIONS, default=_DEFAULTS.precision,
                   help="bf16: training answers, aux states and labels from a bfloat16 copy of the target and "
                        "bfloat16 autocast training (held-out answers stay the target's); auto: bf16 where the device "
                        "multiplies bfloat16 natively (default %(default)s)")
    p.add_argument("--seed", type=int, default=_DEFAULTS.seed, help="default %(default)s")
    p.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--device", default="cpu",
                   help="where the target answers and the head trains: cpu (default) or cuda; the same settings "
                        "make the same head directory either way")
    p.add_argument("--checkpoint-every", type=int, default=DEFAULT_CHECKPOINT_EVERY,
                   help="save resume state every N steps (default %(default)s)")
    p.add_argument("--force", action="store_true", help="retrain from scratch even when a complete head exists")
    p.add_argument("--export-shipped", nargs="?", const="", metavar="DIR",
                   help="then write the head in bfloat16, with its recipe and acceptance, as the head the package "
                        "ships for --model (cluster/train/heads/smollm2/ for smollm2), replacing it; or into DIR")


def settings_from_args(args: argparse.Namespace) -> TrainSettings:
    """Raises ValueError naming the bad flags."""
    return TrainSettings(model=args.model, num_prompts=args.num_prompts, max_new_tokens=args.max_new_tokens,
                         draft_vocab_size=args.draft_vocab_size, epochs=args.epochs, unroll_steps=args.unroll_steps,
                         batch_size=args.batch_size, lr=args.lr, soft_labels=args.soft_labels,
                         precision=args.precision, seed=args.seed)


def run_train_eagle(args: argparse.Namespace) -> int:
    import torch

    from cluster.train.eagle import train_eagle

    settings = settings_from_args(args)
    export_to = _export_dir(args.export_shipped, settings.model)
    if args.threads is not None:
        if args.threads < 1:
            raise ValueError(f"--threads must be >= 1, got {args.threads}")
        torch.set_num_threads(args.threads)
    result = train_eagle(settings, cache_root=args.cache_dir, output=args.output, force=args.force,
                         checkpoint_every=args.checkpoint_every, device=args.device)
    print(f"draft head: {result.path}{' (cached)' if result.reused else ''}")
    if result.acceptance:
        from cluster.train.evaluate import Acceptance

        acc = result.acceptance
        print("held-out " + Acceptance(**{**acc, "step_accept": tuple(acc["step_accept"])}).summary())
    if export_to is not None:
        from cluster.train.shipped import export_shipped

        print(f"shipped head (bfloat16): {export_shipped(result.path, export_to)}")
    sys.stdout.flush()
    return 0


def _export_dir(flag: str | None, model: str) -> Path | None:
    """Where --export-shipped writes (None: not asked); ValueError before any training when the
    package has no shipped head for `model` and no DIR was given."""
    from cluster.train.shipped import shipped_dir

    if flag is None:
        return None
    if flag:
        return Path(flag)
    dest = shipped_dir(model)
    if dest is None:
        raise ValueError(f"--export-shipped: the package ships a head only for smollm2, not {model!r}; "
                         "give a directory (--export-shipped DIR)")
    return dest
