"""The head cache: layout by model and settings digest, reuse of a complete head only, the marker
written last, resume state kept across a failed build, and `default_draft_dir`."""

from __future__ import annotations

import dataclasses

import pytest

from cluster.train.settings import MARKER_FILE, TrainSettings, default_draft_dir, ensure_head, head_dir, is_complete


class Builds:
    """A stand-in for training: writes one file into `out`, counts calls, can fail."""

    def __init__(self, fail: bool = False):
        self.calls, self.fail, self.works = 0, fail, []

    def __call__(self, work, out):
        self.calls += 1
        self.works.append(work)
        (work / "state.pt").write_text(f"step {self.calls}")
        if self.fail:
            raise RuntimeError("killed mid-training")
        (out / "model.safetensors").write_text(f"build {self.calls}")


def test_the_cache_dir_is_named_by_model_and_settings_digest(tmp_path):
    settings = TrainSettings()
    path = head_dir(settings, tmp_path)
    assert path.parent == tmp_path / "eagle"
    assert path.name == f"smollm2-135m-instruct-{settings.digest()}"
    for change in (dict(num_prompts=10), dict(draft_vocab_size=100), dict(epochs=2), dict(lr=1e-3), dict(seed=1)):
        assert dataclasses.replace(settings, **change).digest() != settings.digest(), change
    assert head_dir(TrainSettings(model=str(tmp_path / "my-model")), tmp_path).name.startswith("my-model-")


def test_a_complete_head_is_reused_and_force_rebuilds_it(tmp_path):
    settings, build = TrainSettings(), Builds()
    dest = head_dir(settings, tmp_path)
    assert ensure_head(dest, settings, build) == dest
    assert build.calls == 1 and is_complete(dest, settings)
    assert (dest / "model.safetensors").read_text() == "build 1"
    ensure_head(dest, settings, build)
    assert build.calls == 1, "a complete head was trained again"
    assert not is_complete(dest, dataclasses.replace(settings, seed=5)), "the marker must name its settings"
    ensure_head(dest, settings, build, force=True)
    assert build.calls == 2 and (dest / "model.safetensors").read_text() == "build 2"
    assert not build.works[-1].exists(), "the resume state outlived a finished build"
    assert sorted(p.name for p in dest.parent.iterdir()) == [f".{dest.name}.lock", dest.name]


def test_a_head_without_its_marker_is_rebuilt(tmp_path):
    settings, build = TrainSettings(), Builds()
    dest = head_dir(settings, tmp_path)
    dest.mkdir(parents=True)
    (dest / "model.safetensors").write_text("half written")  # a crash before the marker
    assert default_draft_dir("smollm2", tmp_path) is None
    ensure_head(dest, settings, build)
    assert build.calls == 1 and (dest / "model.safetensors").read_text() == "build 1"
    assert (dest / MARKER_FILE).is_file()


def test_a_failed_build_publishes_nothing_and_keeps_its_resume_state(tmp_path):
    settings = TrainSettings()
    dest = head_dir(settings, tmp_path)
    with pytest.raises(RuntimeError, match="killed"):
        ensure_head(dest, settings, Builds(fail=True))
    assert not dest.exists()
    work = dest.parent / f".{dest.name}.work"
    assert (work / "state.pt").read_text() == "step 1"  # the next run resumes from here
    assert not list(dest.parent.glob(f".{dest.name}.tmp-*"))
    build = Builds()
    ensure_head(dest, settings, build)
    assert build.works == [work] and is_complete(dest, settings)


def test_default_draft_dir_finds_only_the_default_settings_head(tmp_path):
    assert default_draft_dir("smollm2", tmp_path) is None
    other = dataclasses.replace(TrainSettings(), epochs=1)
    ensure_head(head_dir(other, tmp_path), other, Builds())
    assert default_draft_dir("smollm2", tmp_path) is None
    dest = ensure_head(head_dir(TrainSettings(), tmp_path), TrainSettings(), Builds())
    assert default_draft_dir("smollm2", tmp_path) == dest
