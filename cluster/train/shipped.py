"""The draft heads the package ships, where `--speculative eagle` finds a head when none is named,
and `export_shipped`, which writes a trained head into the shipped layout.

Resolution (`default_draft`), for an engine with `speculative` set and no `draft_model`:

    1. the head `tandem train-eagle --model M` cached on this machine with the default settings
       (`settings.default_draft_dir`: its digest names the current recipe)
    2. the head shipped for M, for the bundled `smollm2` only (`cluster/train/heads/smollm2/`)
    3. none: the caller raises ConfigError

Shipped layout, one fixed artifact per model, stored once (a later recipe change, which changes
the cache's digest, does not touch it; `--export-shipped` replaces it deliberately)::

    heads/<model>/config.json        the published EAGLE-3 config, torch_dtype bfloat16
    heads/<model>/model.safetensors  the published tensors in bfloat16, d2t as int32 (no optimizer state)
    heads/<model>/recipe.json        what made it: the training settings, TRAIN_FORMAT_VERSION, the
                                     settings digest, the held-out acceptance (the cache's eval.json)

No torch at import: `default_draft` runs at every engine start-up.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from cluster.train import settings as train_settings
from common.config import ConfigError, EngineConfig

log = logging.getLogger("tandem.speculative")

SHIPPED_ROOT = Path(__file__).resolve().parent / "heads"
SHIPPED_MODELS = {train_settings.DEFAULT_MODEL: "smollm2"}  # model spec -> its directory under SHIPPED_ROOT
RECIPE_FILE = "recipe.json"
HEAD_FILES = ("config.json", "model.safetensors", RECIPE_FILE)


@dataclass(frozen=True)
class DefaultDraft:
    """A head found for a model without a `draft_model`: where it is and, for the log, what it is
    ("shipped head for smollm2, recipe v2, held-out acceptance ... (path)")."""

    path: Path
    description: str


def shipped_dir(model_spec: str, root: Path = SHIPPED_ROOT) -> Path | None:
    """Where the package ships (or would ship) `model_spec`'s head; None for a model it has no slot for."""
    name = SHIPPED_MODELS.get(model_spec)
    return root / name if name is not None else None


def shipped_head(model_spec: str, root: Path = SHIPPED_ROOT) -> DefaultDraft | None:
    """The head shipped for `model_spec`, or None (another model, or the package data is missing)."""
    path = shipped_dir(model_spec, root)
    if path is None or not all((path / f).is_file() for f in HEAD_FILES):
        return None
    recipe = json.loads((path / RECIPE_FILE).read_text())
    acceptance = recipe.get("acceptance") or {}
    accepted = (f"held-out acceptance {acceptance['mean_accepted_len']:.2f} tokens/verify at "
                f"k={acceptance['num_drafts']}") if acceptance else "acceptance not recorded"
    return DefaultDraft(path, f"shipped head for {model_spec}, recipe v{recipe.get('format_version')}, "
                              f"{accepted} ({path})")


def default_draft(model_spec: str, cache_root: Path | None = None, root: Path = SHIPPED_ROOT) -> DefaultDraft | None:
    """The head `--speculative` uses for `model_spec` when none is named (see the module docstring),
    or None. Loads nothing. `cache_root`: the tandem cache (default $TANDEM_CACHE_DIR or ~/.cache/tandem)."""
    cached = train_settings.default_draft_dir(model_spec, cache_root)
    if cached is not None:
        return DefaultDraft(cached, f"head trained on this machine by `tandem train-eagle` ({cached})")
    return shipped_head(model_spec, root)


def export_shipped(source: Path, dest: Path) -> Path:
    """Write the complete trained head in `source` (a `tandem train-eagle` output: config.json,
    model.safetensors, eval.json, the marker) into `dest` in the shipped layout, replacing what is
    there: floating tensors as bfloat16, d2t as int32. Raises ValueError when `source` is not a
    finished head. Returns `dest`."""
    from safetensors.torch import load_file, save_file

    from cluster.train.eagle import EVAL_FILE
    from kernels.model.convert import make_world_readable, publish_dir

    marker = _read_json(source / train_settings.MARKER_FILE, "its completion marker (training unfinished?)")
    acceptance = _read_json(source / EVAL_FILE, "its held-out acceptance")
    config = _read_json(source / "config.json", "its config")
    stored = load_file(str(source / "model.safetensors"))
    tensors = {name: _shipped_tensor(name, tensor) for name, tensor in stored.items()}
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.tmp-", dir=dest.parent))
    try:
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(config | {"torch_dtype": "bfloat16"}, indent=2) + "\n")
        (tmp / RECIPE_FILE).write_text(json.dumps(_recipe(marker, acceptance), indent=2) + "\n")
        make_world_readable(tmp)
        publish_dir(tmp, dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def _shipped_tensor(name: str, tensor):
    import torch

    if tensor.is_floating_point():
        return tensor.to(torch.bfloat16).contiguous()
    if name == "d2t":  # offsets below the target's vocabulary size: int32 holds any real one
        assert tensor.abs().max() < 2 ** 31, "d2t offsets do not fit int32: not a token map?"
        return tensor.to(torch.int32).contiguous()
    return tensor.contiguous()


def _recipe(marker: dict, acceptance: dict) -> dict:
    """The shipped head's record of what made it. `digest` names the cache directory the same
    settings train into today (None when the head predates the current TRAIN_FORMAT_VERSION)."""
    fmt, settings = marker.get("format_version"), marker.get("settings") or {}
    digest = None
    if fmt == train_settings.TRAIN_FORMAT_VERSION:
        digest = train_settings.TrainSettings(**settings).digest()
    return {"made_by": "tandem train-eagle", "format_version": fmt, "settings": settings, "digest": digest,
            "dtype": "bfloat16", "acceptance": acceptance}


def _read_json(path: Path, what: str) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path.parent} is not a finished draft head: no readable {path.name}, {what} ({exc})") \
            from None


def with_default_draft(config: EngineConfig, cache_root: Path | None = None) -> EngineConfig:
    """`config` with `draft_model` resolved: speculation without a head named uses the one
    `tandem train-eagle` cached for the model on this machine, else the head the package ships for
    it (`cluster.train.shipped.default_draft`; ConfigError when there is neither). Logs which."""
    if config.speculative == "none":
        return config
    if config.draft_model:
        log.info("speculative %s uses the head in %s (engine.draft_model)", config.speculative, config.draft_model)
        return config
    found = default_draft(config.model, cache_root)
    if found is None:
        raise ConfigError(f"--speculative {config.speculative}: no draft head for {config.model!r} on this machine; "
                          f"train one with `tandem train-eagle --model {config.model}` or pass --draft-model PATH")
    log.info("speculative %s uses the %s", config.speculative, found.description)
    return dataclasses.replace(config, draft_model=str(found.path))
