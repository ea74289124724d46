"""The draft head the package ships for smollm2: found with an empty cache, beaten by a head trained on
this machine, absent for other models; stored in bfloat16 and loaded into the engine's float32; and
`export_shipped` / `tandem train-eagle --export-shipped`, which write a trained head into that layout."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest
import torch
from safetensors import safe_open

from cluster.cli.args import with_default_draft
from cluster.cli.main import main
from cluster.train.checkpoint import write_published
from cluster.train.settings import MARKER_FILE, TRAIN_FORMAT_VERSION, TrainSettings, ensure_head, head_dir
from cluster.train.shipped import RECIPE_FILE, SHIPPED_ROOT, default_draft, export_shipped, shipped_dir, shipped_head
from cluster.train.vocab import DraftVocab
from common.config import ConfigError, EngineConfig
from kernels.model.eagle import load_eagle_checkpoint
from tests.helpers import tiny_models
from tests.unit.train.conftest import DRAFT_VOCAB, random_head

SHIPPED = SHIPPED_ROOT / "smollm2"
EAGLE = EngineConfig(speculative="eagle")
ACCEPTANCE = {"num_drafts": 3, "mean_accepted_len": 1.5, "per_position_len": 1.6, "step_accept": [0.4, 0.3, 0.2],
              "num_rounds": 10, "num_positions": 15}


def test_an_empty_cache_resolves_smollm2_to_the_shipped_head(tmp_path, monkeypatch):
    found = default_draft("smollm2", tmp_path)
    assert found is not None and found.path == SHIPPED
    assert found.description.startswith("shipped head for smollm2, recipe v")
    assert with_default_draft(EAGLE, tmp_path).draft_model == str(SHIPPED)
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path))  # what a worker process resolves with
    assert with_default_draft(EAGLE).draft_model == str(SHIPPED)
    assert not (tmp_path / "eagle").exists(), "resolving must not create anything in the cache"


def test_a_head_trained_on_this_machine_wins_over_the_shipped_one(tmp_path):
    def build(work, out):
        (out / "config.json").write_text("{}")

    other = dataclasses.replace(TrainSettings(), epochs=1)  # not the default recipe: not picked
    ensure_head(head_dir(other, tmp_path), other, build)
    assert default_draft("smollm2", tmp_path).path == SHIPPED
    trained = ensure_head(head_dir(TrainSettings(), tmp_path), TrainSettings(), build)
    found = default_draft("smollm2", tmp_path)
    assert found.path == trained and "trained on this machine" in found.description
    assert with_default_draft(EAGLE, tmp_path).draft_model == str(trained)
    assert with_default_draft(dataclasses.replace(EAGLE, draft_model="/x"), tmp_path).draft_model == "/x"


def test_a_local_model_without_a_head_is_still_a_config_error(tmp_path):
    model = tmp_path / "my-model"
    model.mkdir()
    assert shipped_dir(str(model)) is None and default_draft(str(model), tmp_path) is None
    with pytest.raises(ConfigError, match=re.escape(f"tandem train-eagle --model {model}")):
        with_default_draft(dataclasses.replace(EAGLE, model=str(model)), tmp_path)
    assert with_default_draft(EngineConfig(model=str(model)), tmp_path).draft_model == ""


def test_the_shipped_head_is_bfloat16_with_a_small_int_token_map_and_its_recipe():
    with safe_open(str(SHIPPED / "model.safetensors"), "pt") as f:
        dtypes = {name: f.get_slice(name).get_dtype() for name in f.keys()}
    assert dtypes.pop("d2t") == "I32"
    assert set(dtypes.values()) == {"BF16"}, dtypes
    assert "lm_head.weight" in dtypes and not any("optim" in n or "embed" in n for n in dtypes)
    assert (SHIPPED / "model.safetensors").stat().st_size < 32 * 2 ** 20
    assert sorted(p.name for p in SHIPPED.iterdir()) == ["config.json", "model.safetensors", RECIPE_FILE]
    recipe = json.loads((SHIPPED / RECIPE_FILE).read_text())
    assert recipe["settings"]["model"] == "smollm2"
    assert set(recipe["settings"]) == set(dataclasses.asdict(TrainSettings()))
    assert isinstance(recipe["format_version"], int) and recipe["dtype"] == "bfloat16"
    assert recipe["acceptance"]["num_drafts"] == 3 and recipe["acceptance"]["mean_accepted_len"] > 1.5
    assert json.loads((SHIPPED / "config.json").read_text())["torch_dtype"] == "bfloat16"


@pytest.mark.slow
def test_the_shipped_head_loads_into_the_float32_smollm2():
    from safetensors.torch import load_file

    from kernels.model.loader import load_model

    target = load_model("smollm2")
    head = load_eagle_checkpoint(SHIPPED, target.arch, target.model.model.embed_tokens, target.model.lm_head)
    assert {p.dtype for p in head.parameters()} == {torch.float32}
    stored = load_file(str(SHIPPED / "model.safetensors"))
    assert torch.equal(head.fc.weight, stored["fc.weight"].float())  # bf16 values, exactly, in float32
    assert torch.equal(head.norm.weight, stored["norm.weight"].float())
    assert torch.equal(head.token_map, torch.arange(len(stored["d2t"])) + stored["d2t"].long())
    assert int(head.token_map.max()) < target.arch.vocab_size


# ---- export ---------------------------------------------------------------------------------------

def trained_tiny_head(cache_root, settings: TrainSettings):
    """A finished `tandem train-eagle` output for the tiny target in the cache: random weights, a
    draft vocabulary with uneven offsets, eval.json and the marker. Returns (dir, head, vocab)."""
    target, _, arch = tiny_models()
    ids = torch.randperm(arch.vocab_size, generator=torch.Generator().manual_seed(4))[:DRAFT_VOCAB]
    vocab = DraftVocab(ids.sort().values, arch.vocab_size)
    head = random_head(vocab)

    def build(work, out):
        write_published(out, head, vocab, arch)
        (out / "eval.json").write_text(json.dumps(ACCEPTANCE))

    return ensure_head(head_dir(settings, cache_root), settings, build), head, vocab


def test_export_writes_the_shipped_layout_in_bfloat16_and_it_loads_as_the_head_rounded(tmp_path):
    settings = TrainSettings(draft_vocab_size=DRAFT_VOCAB, epochs=1)
    source, head, vocab = trained_tiny_head(tmp_path / "cache", settings)
    dest = tmp_path / "heads" / "smollm2"
    dest.mkdir(parents=True)
    (dest / "stale.bin").write_text("an older head")
    assert export_shipped(source, dest) == dest
    assert sorted(p.name for p in dest.iterdir()) == ["config.json", "model.safetensors", RECIPE_FILE]
    recipe = json.loads((dest / RECIPE_FILE).read_text())
    assert recipe["format_version"] == TRAIN_FORMAT_VERSION and recipe["digest"] == settings.digest()
    assert recipe["settings"] == dataclasses.asdict(settings) and recipe["acceptance"] == ACCEPTANCE
    assert recipe["settings"] == json.loads((source / MARKER_FILE).read_text())["settings"]

    target, _, arch = tiny_models()
    loaded = load_eagle_checkpoint(dest, arch, target.model.embed_tokens, target.lm_head)
    assert torch.equal(loaded.token_map, vocab.target_ids)
    rounded = {n: p for n, p in head.named_parameters() if not n.startswith("embed.")}
    for name, param in loaded.named_parameters():
        if name.startswith("embed."):
            continue
        assert param.dtype == torch.float32
        assert torch.equal(param, rounded[name].detach().to(torch.bfloat16).float()), name
        assert not torch.equal(param, rounded[name].detach()), f"{name}: not rounded to bfloat16"
    assert shipped_dir("smollm2", tmp_path / "heads") == dest
    found = shipped_head("smollm2", tmp_path / "heads")
    assert found.path == dest
    assert found.description.startswith(f"shipped head for smollm2, recipe v{TRAIN_FORMAT_VERSION}, held-out "
                                        "acceptance 1.50 tokens/verify at k=3")


def test_export_refuses_an_unfinished_head(tmp_path):
    source = tmp_path / "half"
    source.mkdir()
    (source / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="not a finished draft head: no readable tandem_train.json"):
        export_shipped(source, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_train_eagle_export_shipped_exports_the_head_it_trained_or_found(tmp_path, monkeypatch, capsys):
    import cluster.train.eagle as eagle

    settings = TrainSettings(draft_vocab_size=DRAFT_VOCAB, epochs=1)
    source, _, _ = trained_tiny_head(tmp_path / "cache", settings)
    calls = []

    def fake_train(settings, **kw):
        calls.append(settings)
        return eagle.TrainResult(source, True, ACCEPTANCE)

    monkeypatch.setattr(eagle, "train_eagle", fake_train)
    dest = tmp_path / "shipped"
    assert main(["train-eagle", "--cache-dir", str(tmp_path / "cache"), "--export-shipped", str(dest)]) == 0
    assert calls == [TrainSettings()]
    assert f"shipped head (bfloat16): {dest}" in capsys.readouterr().out
    assert json.loads((dest / RECIPE_FILE).read_text())["acceptance"] == ACCEPTANCE


def test_export_shipped_without_a_dir_is_refused_for_a_model_the_package_ships_no_head_for(tmp_path, capsys):
    assert main(["train-eagle", "--cache-dir", str(tmp_path), "--model", str(tmp_path / "m"), "--export-shipped"]) == 2
    assert "ships a head only for smollm2" in capsys.readouterr().err
    assert not (tmp_path / "eagle").exists()
