"""What a draft-head training run is: its settings, their digest, and where its result is cached.

No torch here: `default_draft_dir` is cheap enough to call at engine start-up, and `tandem`'s argument
parser imports this module for every command.

Cache layout (``cache_root`` as the model conversion's, `kernels.model.convert.default_cache_root`)::

    cache_root/eagle/<model>-<digest>/          config.json, model.safetensors (the published EAGLE-3
                                                format), eval.json, tandem_train.json (written last: complete)
    cache_root/eagle/.<model>-<digest>.work/    resume state: generations.json, state.pt (every N steps)
    cache_root/eagle/.<model>-<digest>.lock     flock held while training
    cache_root/eagle/.<model>-<digest>.tmp-XXXX the finished head, renamed into place

``<model>`` is the converted model's cache name for ``smollm2``, else the model directory's name;
``<digest>`` hashes every setting that changes the trained weights (not threads or checkpoint cadence).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

MARKER_FILE = "tandem_train.json"
TRAIN_FORMAT_VERSION = 2
DEFAULT_MODEL = "smollm2"
PRECISIONS = ("auto", "bf16", "fp32")
DEFAULT_CHECKPOINT_EVERY = 50  # optimizer steps between resume states (not a setting: no effect on weights)


@dataclass(frozen=True)
class TrainSettings:
    """Everything that decides the trained head's weights. Bounds are checked on construction."""

    model: str = DEFAULT_MODEL
    """`smollm2` or a local HF directory (the target the head drafts for)."""
    num_prompts: int = 2582
    """Training prompts taken, in order, from the shipped set (`cluster/train/data/train_prompts.jsonl`;
    the default is all of them: topic variety is what a small head generalises from)."""
    max_new_tokens: int = 96
    """Target tokens generated per prompt (greedy; fewer when it stops). Shorter answers to more
    prompts beat longer answers to fewer at the same token budget."""
    draft_vocab_size: int = 8192
    """The most frequent target tokens of the generations; capped at the target's vocabulary."""
    epochs: int = 4
    """Passes over the training sequences."""
    unroll_steps: int = 3
    """Draft steps unrolled in training (EAGLE-3's training-time test); the chain length trained for."""
    batch_size: int = 8
    """Sequences per optimizer step."""
    lr: float = 2e-3
    """AdamW peak learning rate: linear warm-up over the first 5% of steps, cosine down to 5% of it."""
    step_decay: float = 0.8
    """Loss weight of unrolled step s is step_decay ** s."""
    soft_labels: bool = True
    """Train against the target's whole distribution over the draft vocabulary at each position (its
    softmax, EAGLE-3's loss) instead of only its greedy token: more signal per position, which is
    what a head trained on a few thousand answers lacks. False: cross-entropy on the greedy tokens."""
    precision: str = "auto"
    """`bf16`: a bfloat16 copy of the target answers the training prompts and gives the aux states
    and soft labels over them, and the head trains under bfloat16 autocast (float32 weights and
    optimizer); the held-out answers, which acceptance is measured against, always come from the
    target as it serves (its own dtype). `fp32`: all float32. `auto`: bf16 where the device
    multiplies bfloat16 natively (AMX or AVX512-BF16 CPUs, CUDA with bf16), else fp32, so heads
    trained on different machines may differ (the cache is per machine). Where it is native, bf16
    answers, computes the states and trains several times faster (docs/results.md#speculative)."""
    seed: int = 0

    def __post_init__(self):
        checks = {"num_prompts": self.num_prompts >= 1, "max_new_tokens": self.max_new_tokens >= 1,
                  "draft_vocab_size": self.draft_vocab_size >= 1, "epochs": self.epochs >= 1,
                  "unroll_steps": 1 <= self.unroll_steps <= 8, "batch_size": self.batch_size >= 1,
                  "lr": 0 < self.lr < 1, "step_decay": 0 < self.step_decay <= 1,
                  "precision": self.precision in PRECISIONS}
        bad = [name for name, ok in checks.items() if not ok]
        if bad:
            got = ", ".join(f"{name}={getattr(self, name)!r}" for name in bad)
            raise ValueError(f"bad training settings: {got} (counts >= 1, unroll_steps in [1, 8], lr in (0, 1), "
                             "step_decay in (0, 1], precision in " + "/".join(PRECISIONS) + ")")

    def digest(self) -> str:
        """12 hex digits over the settings (a local model by its resolved path) and the format version."""
        fields = dataclasses.asdict(self) | {"model": model_key(self.model), "format": TRAIN_FORMAT_VERSION}
        return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:12]


def model_key(spec: str) -> str:
    return spec if spec == DEFAULT_MODEL else str(Path(spec).expanduser().resolve())


def model_cache_name(spec: str) -> str:
    if spec == DEFAULT_MODEL:
        from kernels.model.convert import SMOLLM2_CACHE_NAME

        return SMOLLM2_CACHE_NAME
    return Path(model_key(spec)).name


def cache_root_or_default(cache_root: Path | None) -> Path:
    from kernels.model.convert import default_cache_root

    return Path(cache_root) if cache_root is not None else default_cache_root()


def head_dir(settings: TrainSettings, cache_root: Path | None = None) -> Path:
    """Where `settings`' head is cached (complete or not)."""
    root = cache_root_or_default(cache_root) / "eagle"
    return root / f"{model_cache_name(settings.model)}-{settings.digest()}"


def is_complete(path: Path, settings: TrainSettings | None = None) -> bool:
    """True when `path` holds a finished head (its marker; for `settings` when given)."""
    try:
        marker = json.loads((path / MARKER_FILE).read_text())
    except (OSError, ValueError):
        return False
    return settings is None or marker.get("settings") == dataclasses.asdict(settings)


def default_draft_dir(model_spec: str, cache_root: Path | None = None) -> Path | None:
    """The cached head `tandem train-eagle --model model_spec` trains with default settings, or None
    when it has not been trained (or did not finish). Loads nothing: give the path to
    `kernels.model.eagle.load_eagle_checkpoint`."""
    settings = TrainSettings(model=model_spec)
    path = head_dir(settings, cache_root)
    return path if is_complete(path, settings) else None


def ensure_head(dest: Path, settings: TrainSettings, build: Callable[[Path, Path], None], force: bool = False) -> Path:
    """`dest` holding the head for `settings`: reused when complete (unless `force`), else built.

    `build(work, out)` writes the head into the empty dir `out`, keeping resume state in `work`
    (kept across an interrupted build, emptied by `force`). Under a lock beside `dest`: the marker
    is written last, `out` is renamed into place (an incomplete `dest` is replaced), then `work`
    is removed. Two processes building at once serialise; the second finds the head complete."""
    from kernels.model.convert import file_lock, make_world_readable, publish_dir, sweep_tmp_dirs

    if not force and is_complete(dest, settings):
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with file_lock(dest.parent / f".{dest.name}.lock"):
        if not force and is_complete(dest, settings):  # another process finished while we waited
            return dest
        work = dest.parent / f".{dest.name}.work"
        if force:
            shutil.rmtree(work, ignore_errors=True)
        work.mkdir(exist_ok=True)
        sweep_tmp_dirs(dest)
        tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.tmp-", dir=dest.parent))
        try:
            build(work, tmp)
            marker = {"format_version": TRAIN_FORMAT_VERSION, "settings": dataclasses.asdict(settings)}
            (tmp / MARKER_FILE).write_text(json.dumps(marker, indent=2) + "\n")
            make_world_readable(tmp)
            publish_dir(tmp, dest)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)
    return dest
