"""The fused-experts kernels (`kernels/cuda/fused_moe.py`), at the tiles `default_tiles` launches them
with (decode's 16-row and prefill's 64-row blocks, fp32 and bf16), build ahead of time for sm_80 and
sm_90 on this CPU, and each build fits its target's shared memory and the register and spill budgets
of `kernels/cuda/triton_aot.py`, whose resource reader and `check` these reuse.

The builds run in child processes (this file run as a script, one per target): the kernels compile
only where the Triton interpreter, which this test session turns on, is off when they are imported.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import pytest

from kernels.cuda import triton_aot

REPO = Path(__file__).resolve().parents[3]
DTYPES = ("float32", "bfloat16")  # float16 launches bfloat16's tiles
PAIRS = {"decode": 16, "prefill": 8192}  # T*k over 8 experts: 2 or 1024 pairs an expert
NUM_EXPERTS = 8
KERNELS = {"gate_up_silu", "gate_up_gelu_pytorch_tanh", "down"}


@dataclass(frozen=True)
class MoeBuild:
    """What one build of one fused-experts kernel for one target uses (bytes, except registers)."""

    kernel: str
    target: int
    dtype: str
    phase: str  # whose tiles: "decode" or "prefill"
    block_m: int
    num_warps: int
    registers: int
    local_bytes: int
    shared_bytes: int  # static + dynamic


def _specs(dtype_name: str, phase: str):
    """(name, jit function, signature, constexprs, tiles) of both kernels at `default_tiles`."""
    import torch
    import triton.language as tl

    from kernels.cuda import fused_moe

    tiles = fused_moe.default_tiles(PAIRS[phase], NUM_EXPERTS, getattr(torch, dtype_name), interpreted=False)
    model = {"float32": "fp32", "bfloat16": "bf16"}[dtype_name]
    dot = {"float32": tl.float32, "bfloat16": tl.bfloat16}[dtype_name]
    pointers = {"x_ptr": model, "gate_up_ptr": model, "hidden_ptr": model, "down_ptr": model, "out_ptr": "fp32",
                "weights_ptr": "fp32", "sorted_pairs_ptr": "i64", "block_expert_ptr": "i64", "block_rows_ptr": "i32"}
    blocks = {"BLOCK_M": tiles.block_m, "BLOCK_N": tiles.block_n, "BLOCK_K": tiles.block_k, "DOT_DTYPE": dot}
    # contiguous weights: the launcher specializes a stride of 1 to a constant, as here
    specs = [(f"gate_up_{act}", fused_moe.gate_up_kernel, {**blocks, "ACTIVATION": act, "stride_gu_k": 1})
             for act in fused_moe.ACTIVATIONS]
    specs.append(("down", fused_moe.down_kernel, {**blocks, "stride_d_k": 1}))
    out = []
    for name, fn, constexprs in specs:
        signature = {arg: "constexpr" if arg in constexprs else "*" + pointers[arg] if arg.endswith("_ptr")
                     else "i32" for arg in fn.arg_names}
        out.append((name, fn, signature, constexprs, tiles))
    return out


def build(target: int, dtype_name: str, phase: str, workdir: Path) -> list[MoeBuild]:
    """Both kernels for this dtype and phase, compiled for sm_`target`."""
    builds = []
    for name, fn, signature, constexprs, tiles in _specs(dtype_name, phase):
        cubin = workdir / f"{name}-{target}-{dtype_name}-{phase}.cubin"
        regs, local, shared = triton_aot.compile_kernel(fn, signature, constexprs, target, tiles.num_warps, cubin)
        builds.append(MoeBuild(name, target, dtype_name, phase, tiles.block_m, tiles.num_warps, regs, local, shared))
    return builds


def aot_builds(target: int) -> list[MoeBuild]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    done = subprocess.run([sys.executable, __file__, str(target)], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return [MoeBuild(**json.loads(line)) for line in done.stdout.splitlines() if line.startswith("{")]


@pytest.fixture(scope="module")
def builds() -> list[MoeBuild]:
    with ThreadPoolExecutor(len(triton_aot.TARGETS)) as pool:  # one child per target
        return [b for per_target in pool.map(aot_builds, triton_aot.TARGETS) for b in per_target]


def test_both_kernels_build_for_every_target_dtype_and_phase(builds):
    built = {(b.kernel, b.target, b.dtype, b.phase) for b in builds}
    want = {(k, t, d, p) for k in KERNELS for t in triton_aot.TARGETS for d in DTYPES for p in PAIRS}
    assert built == want, sorted(want - built)
    assert {b.block_m for b in builds if b.phase == "decode"} == {16}
    assert {b.block_m for b in builds if b.phase == "prefill"} == {64}


def test_every_build_fits_its_target_and_the_register_and_spill_budgets(builds):
    over = [(b, why) for b in builds if (why := triton_aot.check(b)) is not None]
    assert over == [], over
    # real builds, not empty shells: the tiles take registers and go through shared memory
    assert all(b.registers > 32 and b.shared_bytes > 0 for b in builds), builds
    spilling = [b for b in builds if b.local_bytes > 0]  # stricter than the budget: the tiles were picked so
    assert spilling == [], spilling


def main(argv: list[str]) -> int:
    """One JSON line per build for the targets in argv (`80,90`), else all."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("TRITON_INTERPRET=1: the interpreter cannot compile for a GPU; unset it", file=sys.stderr)
        return 2
    targets = [int(t) for t in argv[0].split(",")] if argv else list(triton_aot.TARGETS)
    with tempfile.TemporaryDirectory(prefix="tandem-moe-aot-") as tmp:
        for target in targets:
            for dtype_name in DTYPES:
                for phase in PAIRS:
                    for b in build(target, dtype_name, phase, Path(tmp)):
                        print(json.dumps(asdict(b)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
