"""`tandem train-eagle`'s argument errors (before any model loads), and the shipped prompt sets."""

from __future__ import annotations

from pathlib import Path

import pytest

from cluster.cli.main import build_parser, main
from cluster.train.data import DATA_DIR, PROMPT_FILES, load_prompts
from cluster.train.settings import TrainSettings

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize("flags, message", [
    (["--epochs", "0"], "epochs=0"),
    (["--num-prompts", "-3"], "num_prompts=-3"),
    (["--unroll-steps", "9"], "unroll_steps=9"),
    (["--lr", "2"], "lr=2.0"),
    (["--num-prompts", "100000"], "100000 train prompts asked for; the shipped set has"),
    (["--threads", "0"], "--threads must be >= 1"),
    (["--checkpoint-every", "0"], "checkpoint_every must be >= 1"),
])
def test_bad_flags_exit_2_with_a_clear_message(flags, message, tmp_path, capsys):
    assert main(["train-eagle", "--cache-dir", str(tmp_path), *flags]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "eagle").exists(), "nothing is created for a refused run"


def test_non_numbers_are_refused_by_the_parser(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["train-eagle", "--draft-vocab-size", "many"])
    assert "invalid int value: 'many'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        build_parser().parse_args(["train-eagle", "--precision", "fp8"])
    assert "invalid choice: 'fp8'" in capsys.readouterr().err


def test_flags_default_to_the_default_settings():
    from cluster.train.cli import settings_from_args

    assert settings_from_args(build_parser().parse_args(["train-eagle"])) == TrainSettings()


def test_bad_settings_name_every_bad_field():
    with pytest.raises(ValueError, match=r"epochs=0, batch_size=0, precision='fp8'"):
        TrainSettings(epochs=0, batch_size=0, precision="fp8")


def test_the_held_out_prompts_are_not_training_prompts_and_ship_with_the_package():
    train, held_out = load_prompts("train"), load_prompts("eval")
    assert len(held_out) >= 32 and len(train) >= TrainSettings().num_prompts
    as_text = lambda prompts: {m["content"] for messages in prompts for m in messages}  # noqa: E731
    assert not as_text(train) & as_text(held_out)
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    package_data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    assert all(path.match(f"{DATA_DIR.parent}/{package_data['cluster.train'][0]}") for path in PROMPT_FILES.values())
    with pytest.raises(ValueError, match="prompt split 'test'"):
        load_prompts("test")
