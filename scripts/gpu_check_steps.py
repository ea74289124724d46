"""The Python parts of `scripts/gpu-check.sh`'s steps (what a shell does badly), a subcommand each.

Each writes one JSON file (`--out`) that `gpu_check_report.py` reads, and prints what it does. Standard
library at import (setup runs on the system python3, before the venv exists).

    setup             (system python3) the venv, what `.[gpu,bench,test]` lacks, the model (gpu_check_setup.py)
    env               (venv python) torch / CUDA / GPU / kernel-library versions as JSON (+ nvidia-smi)
    pytest            (venv python) pytest.main with SIGTERM as KeyboardInterrupt, so a `timeout` still gets
                      pytest's summary and its --junitxml of what ran; says whether torch's CUDA
                      sanitizer was asked for (TORCH_CUDA_SANITIZER) and whether it ran
    serve             (venv python) `tandem serve`, ready, the greedy check, `bench serve`, stop (gpu_check_serve.py)
    greedy-reference  (venv python) HF's greedy tokens of the served model, the serve step's child
                      (gpu_check_greedy.py)
    tp                (venv python) `tandem run` at tensor-parallel size 1 and 2 on the same prompts
                      (float32, greedy): the same tokens, and each run's wall time
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import signal
import subprocess
import sys

from gpu_check_common import interrupt_on_signals, write_json
from gpu_check_greedy import add_reference_args, reference
from gpu_check_serve import add_serve_args, serve
from gpu_check_setup import add_setup_args, setup

SANITIZER_ENV = "TORCH_CUDA_SANITIZER"


# ---- env -------------------------------------------------------------------------------------------
def module_version(name: str) -> str | None:
    """The version of an importable module, "import failed: ..." when it raises, None when absent."""
    if importlib.util.find_spec(name) is None:
        return None
    try:
        module = __import__(name)
    except Exception as err:  # noqa: BLE001 - a broken install is a finding, not a crash
        return f"import failed: {type(err).__name__}: {err}"[:300]
    return str(getattr(module, "__version__", "installed"))


def dist_version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def nvidia_smi() -> str | None:
    query = "name,driver_version,memory.total,memory.used,utilization.gpu,temperature.gpu,power.draw"
    try:
        done = subprocess.run(["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader"], capture_output=True,
                              text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired) as err:
        return f"unavailable: {err}"
    return done.stdout.strip() or done.stderr.strip()


def env(args: argparse.Namespace) -> int:
    import torch

    cuda = torch.cuda.is_available()
    info = {"python": sys.version.split()[0], "torch": torch.__version__, "torch_cuda": torch.version.cuda,
            "cuda_available": cuda, "device_count": torch.cuda.device_count() if cuda else 0,
            "nvidia_smi": nvidia_smi(), "cpu_count": os.cpu_count()}
    if cuda:
        props = torch.cuda.get_device_properties(0)
        info |= {"device_name": props.name, "capability": f"{props.major}.{props.minor}",
                 "memory_gib": round(props.total_memory / 2**30, 1), "bf16_supported": torch.cuda.is_bf16_supported()}
    for name in ("triton", "flashinfer", "flashinfer_jit_cache", "flashinfer_cubin", "mooncake"):
        info[name] = module_version(name)  # imported: an install that fails to import is the finding
    for dist in ("ray", "transformers", "aiohttp", "pytest", "mooncake-transfer-engine-cuda13",
                 "mooncake-transfer-engine", "mooncake-transfer-engine-non-cuda"):
        info[dist] = dist_version(dist)  # metadata only: cheap
    write_json(args.out, info)
    print(json.dumps(info, indent=1))
    return 0 if cuda or args.allow_cpu else 1


# ---- pytest ----------------------------------------------------------------------------------------
def run_pytest(args: argparse.Namespace) -> int:
    """pytest.main; SIGTERM (what `timeout` sends) becomes KeyboardInterrupt, which pytest turns into
    a summary of what ran and a written --junitxml (a SIGINT may be ignored in a background job). With
    TORCH_CUDA_SANITIZER set, torch enables its CUDA sanitizer when first imported (conftest's import):
    the last line says whether it was asked for and whether it ran (gpu_check_report.py checks both)."""
    import pytest

    interrupt_on_signals(signal.SIGTERM, signal.SIGINT)
    rc = int(pytest.main(args.pytest_args))
    print(f"pytest: CUDA sanitizer {sanitizer_state()}", flush=True)
    return rc


def sanitizer_state() -> str:
    """"asked, on" / "asked, off" / "not asked, off" (TORCH_CUDA_SANITIZER, and torch's own flag)."""
    csan = sys.modules.get("torch.cuda._sanitizer")
    running = bool(csan is not None and csan.cuda_sanitizer.enabled)
    return f"{'asked' if SANITIZER_ENV in os.environ else 'not asked'}, {'on' if running else 'off'}"


# ---- tp ----------------------------------------------------------------------------------------------
TP_PROMPTS = ("The harbour town was quiet before the boats came in, and", "A recipe for bread starts with",
              "def fibonacci(n):", "The three largest planets of the solar system are")


TP_RUNS = {"tp1": ["--no-cuda-graph"], "tp2": ["--tensor-parallel-size", "2", "--no-cuda-graph"],
           "tp2_graphs": ["--tensor-parallel-size", "2"],
           "tp2_to_tp1": ["--mode", "disaggregated", "--prefill-tensor-parallel-size", "2"]}
"""The runs of `tp_check`, each against "tp1": eager at TP=2, CUDA graphs replayed at TP=2 (NCCL inside
every graph), a prefill worker at TP=2 shipping into a decode worker at TP=1 (a transfer per rank pair)."""


def tp_check(args: argparse.Namespace) -> int:
    """Greedy tokens of `TP_PROMPTS` for each of `TP_RUNS` (float32: summation order moves a logit by
    ~1e-6, far below any gap a greedy choice makes here); 0 when every run has TP=1's tokens."""
    import time

    prompts = [arg for prompt in TP_PROMPTS for arg in ("--prompt", prompt)]
    out: dict = {"prompts": len(TP_PROMPTS), "device": args.device}
    tokens = {}
    for name, extra in TP_RUNS.items():
        started = time.monotonic()
        done = subprocess.run([sys.executable, "-m", "cluster.cli", "run", "--device", args.device, "--dtype",
                               "float32", "--raw", "--json", "--max-tokens", "16", *extra, *prompts],
                              capture_output=True, text=True, timeout=args.timeout_s)
        print(done.stderr[-3000:], flush=True)
        out[f"{name}_wall_s"] = round(time.monotonic() - started, 2)
        if done.returncode != 0:
            out["error"] = f"{name} exited {done.returncode}"
            write_json(args.out, out)
            return 1
        tokens[name] = [json.loads(line)["token_ids"] for line in done.stdout.splitlines() if line.startswith("{")]
    out["parted"] = {name: [i for i, (a, b) in enumerate(zip(tokens["tp1"], got)) if a != b]
                     for name, got in tokens.items() if name != "tp1"}
    out["equal"] = all(got == tokens["tp1"] for got in tokens.values())
    write_json(args.out, out)
    return 0 if out["equal"] else 1


# ---- the command -----------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="step", required=True)
    add_setup_args(sub.add_parser("setup"))
    e = sub.add_parser("env")
    e.add_argument("--out", required=True)
    e.add_argument("--allow-cpu", action="store_true", help="exit 0 without CUDA (the CPU dry run)")
    t = sub.add_parser("pytest")
    t.add_argument("pytest_args", nargs=argparse.REMAINDER)
    add_serve_args(sub.add_parser("serve"))
    add_reference_args(sub.add_parser("greedy-reference"))
    tp = sub.add_parser("tp")
    tp.add_argument("--out", required=True)
    tp.add_argument("--device", default="cuda")
    tp.add_argument("--timeout-s", type=float, default=120.0, help="each run's")
    args = p.parse_args(argv)
    for name in ("pytest_args", "rest", "serve_args"):  # REMAINDER keeps the `--` that introduced it
        if getattr(args, name, None) and getattr(args, name)[0] == "--":
            setattr(args, name, getattr(args, name)[1:])
    steps = {"setup": setup, "env": env, "pytest": run_pytest, "serve": serve, "greedy-reference": reference,
             "tp": tp_check}
    return steps[args.step](args)


if __name__ == "__main__":
    sys.exit(main())
