"""Model directory resolution, the one-time GGUF conversion cache, tokenizer and chat template."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest

from kernels.model import convert
from kernels.model.loader import load_model, resolve_model_dir
from kernels.model.tokenizer import apply_chat_template, load_tokenizer


@pytest.fixture(scope="module")
def smollm2_dir() -> Path:
    """Converted SmolLM2 in the shared cache ($TANDEM_CACHE_DIR or ~/.cache/tandem): ~30 s once."""
    return resolve_model_dir("smollm2")


def _refuse_conversion(*_args, **_kwargs):
    raise AssertionError("conversion ran although the cache was complete")


def _fake_convert(calls: list[int], delay_s: float = 0.0):
    def fake(gguf: Path, out_dir: Path) -> None:
        calls.append(1)
        time.sleep(delay_s)
        (out_dir / "config.json").write_text("{}")

    return fake


@pytest.mark.slow
def test_second_resolve_is_a_cache_hit(smollm2_dir, monkeypatch):
    """A cached load neither reconverts the GGUF nor builds a transformers model (the slow paths);
    its speed is reported by `tandem run`'s load log, not asserted here."""
    import transformers

    def refuse_hf_model(*args, **kwargs):
        raise AssertionError("cached load built a transformers model")

    monkeypatch.setattr(convert, "convert_gguf", _refuse_conversion)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", refuse_hf_model)
    assert resolve_model_dir("smollm2") == smollm2_dir
    loaded = load_model("smollm2")
    assert loaded.arch.num_layers == 30 and loaded.arch.tie_word_embeddings
    assert 2 in loaded.eos_token_ids


@pytest.mark.slow
def test_converted_config_has_no_quantization_config(smollm2_dir):
    config = json.loads((smollm2_dir / "config.json").read_text())
    assert "quantization_config" not in config
    assert config["model_type"] == "llama"
    assert list(smollm2_dir.glob("*.safetensors")) == [smollm2_dir / "model.safetensors"]


@pytest.mark.slow
def test_chat_template_applies(smollm2_dir):
    tokenizer = load_tokenizer(smollm2_dir)
    ids = apply_chat_template(tokenizer, "Hello there")
    text = tokenizer.decode(ids)
    assert text.startswith("<|im_start|>system\n")
    assert text.endswith("<|im_start|>user\nHello there<|im_end|>\n<|im_start|>assistant\n")
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert tokenizer.decode(apply_chat_template(tokenizer, messages)).startswith("<|im_start|>system\nBe brief.")


def test_missing_local_dir_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="neither a known name"):
        resolve_model_dir(str(tmp_path / "no-such-model"))


def test_dir_without_config_or_weights_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="no config.json"):
        resolve_model_dir(str(tmp_path))
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match=r"no \*.safetensors"):
        resolve_model_dir(str(tmp_path))


def test_crash_mid_conversion_leaves_no_cache(tmp_path, monkeypatch):
    def crash(gguf: Path, out_dir: Path) -> None:
        (out_dir / "config.json").write_text("{}")
        raise RuntimeError("killed mid-conversion")

    monkeypatch.setattr(convert, "convert_gguf", crash)
    with pytest.raises(RuntimeError, match="killed"):
        convert.ensure_smollm2(tmp_path)
    models = tmp_path / "models"
    assert [p.name for p in models.iterdir() if not p.name.endswith(".lock")] == []

    calls: list[int] = []
    monkeypatch.setattr(convert, "convert_gguf", _fake_convert(calls))
    final = convert.ensure_smollm2(tmp_path)
    assert final == models / convert.SMOLLM2_CACHE_NAME and (final / convert.MARKER_FILE).is_file()
    assert convert.ensure_smollm2(tmp_path) == final and calls == [1]


def test_incomplete_cache_dir_is_replaced(tmp_path, monkeypatch):
    stale = tmp_path / "models" / convert.SMOLLM2_CACHE_NAME
    stale.mkdir(parents=True)
    (stale / "model.safetensors").write_text("truncated")
    calls: list[int] = []
    monkeypatch.setattr(convert, "convert_gguf", _fake_convert(calls))
    assert convert.ensure_smollm2(tmp_path) == stale
    assert calls == [1] and not (stale / "model.safetensors").exists()


def test_concurrent_conversions_run_once(tmp_path, monkeypatch):
    calls: list[int] = []
    monkeypatch.setattr(convert, "convert_gguf", _fake_convert(calls, delay_s=0.3))
    results: list[Path] = []
    threads = [threading.Thread(target=lambda: results.append(convert.ensure_smollm2(tmp_path))) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert calls == [1] and len(set(results)) == 1 and len(results) == 3


def test_a_worker_loads_the_same_model_without_importing_transformers(smollm2_dir, tmp_path):
    """`load_for_serving` (what a worker builds from) reads config.json and the fast tokenizer
    directly: the same architecture, eos ids and weights as `load_model`, and neither transformers (~2.5 s
    of a worker's start) nor torch's compiler (~2 s, imported by initialising a model made on meta) is
    imported; a config that lacks a field falls back to AutoConfig."""
    import subprocess
    import sys

    import torch

    from kernels.model.loader import load_for_serving, read_config

    code = ("import sys; from kernels.model.loader import load_for_serving; m = load_for_serving('smollm2'); "
            "print('transformers' in sys.modules, 'torch._dynamo' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parents[3]).stdout.split()
    full, light = load_model("smollm2"), load_for_serving("smollm2")
    assert out == ["False", "False"], out  # nor the compiler (~2 s): a prefill worker never needs it
    assert light.arch == full.arch and light.eos_token_ids == full.eos_token_ids
    assert all(torch.equal(a, b) for a, b in zip(light.model.state_dict().values(), full.model.state_dict().values()))
    ids = full.tokenizer.encode("Hello there, how are you?")
    assert light.tokenizer.decode(ids, skip_special_tokens=True) == full.tokenizer.decode(ids, skip_special_tokens=True)
    raw = json.loads((smollm2_dir / "config.json").read_text())
    del raw["rms_norm_eps"]
    (tmp_path / "config.json").write_text(json.dumps(raw))
    assert type(read_config(tmp_path)).__name__ == "LlamaConfig"  # transformers fills the default
