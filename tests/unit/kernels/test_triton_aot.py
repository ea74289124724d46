"""Every Triton kernel, at the tiles the backend launches it with, builds ahead of time for sm_80 and
sm_90 on this CPU (`kernels/cuda/triton_aot.py`), and each build fits its target's shared memory
and stays within the register and spill budgets. The builds run in child processes: the kernels
compile only where the Triton interpreter, which this test session turns on, is off."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from kernels.cuda import triton_aot
from kernels.cuda.triton_aot import Build, check

REPO = Path(__file__).resolve().parents[3]
DTYPES = ("float32", "bfloat16")  # float16 launches bfloat16's tiles
KERNELS = {"decode_combine", "write_kv", "copy_pages", "extend_tree",
           *(kernel + rule for kernel in ("decode_split", "extend") for rule in triton_aot.SCORE_RULES)}
PLAIN_ONLY = {"float32"}  # CUDA's reference dtype: no window or soft-cap builds


def aot_builds(target: int) -> list[Build]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-m", "kernels.cuda.triton_aot", str(target), ",".join(DTYPES),
                           ",".join(map(str, triton_aot.HEAD_DIMS))],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return [Build(**json.loads(line)) for line in done.stdout.splitlines() if line.startswith("{")]


@pytest.fixture(scope="module")
def builds() -> list[Build]:
    with ThreadPoolExecutor(len(triton_aot.TARGETS)) as pool:  # one child per target
        return [b for per_target in pool.map(aot_builds, triton_aot.TARGETS) for b in per_target]


def test_every_kernel_builds_for_every_target_dtype_and_head_size(builds):
    built = {(b.kernel, b.target, b.dtype, b.head_dim) for b in builds}
    want = {(k, t, d, h) for k in KERNELS for t in triton_aot.TARGETS for d in DTYPES for h in triton_aot.HEAD_DIMS
            if d not in PLAIN_ONLY or not k.endswith(("_window", "_softcap"))}
    assert built == want, sorted(want - built)


def test_every_build_fits_its_target_and_the_register_and_spill_budgets(builds):
    over = [(b, why) for b in builds if (why := check(b)) is not None]
    assert over == [], over
    # the attention kernels are real builds, not empty shells: they take registers and shared memory
    assert all(b.registers > 32 and b.shared_bytes > 0 for b in builds
               if b.kernel.startswith(("decode_split", "extend")))


def test_the_budgets_catch_what_would_not_launch_or_would_spill():
    ok = Build("extend", 90, "bfloat16", 128, 8, registers=255, local_bytes=40, shared_bytes=33_792)
    assert check(ok) is None
    assert "shared memory" in check(Build(**{**ok.__dict__, "target": 80, "shared_bytes": 200_000}))
    assert "spilled" in check(Build(**{**ok.__dict__, "local_bytes": triton_aot.SPILL_BUDGET_BYTES + 8}))
