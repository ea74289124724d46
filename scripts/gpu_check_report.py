"""`scripts/gpu-check.sh`'s one JSON report: each step's record, its key figures parsed from its
output, the checks those figures must pass, and a short summary (standard library only).

    LOGDIR/steps/NN-NAME.json   one record per step (`record`): kind, command, rc, wall and timeout
                                seconds, its log, the file it wrote (--json, --junitxml, ...)
    LOGDIR/logs/NAME.log        the step's stdout and stderr
    LOGDIR/out/...              the files the steps wrote

A step's status: ok; failed (rc != 0, or a check on its figures failed: e.g. greedy outputs that
differ, a request that failed); timeout (rc 124 or 137 from `timeout`); skipped (no time left in the
budget, or its input is missing). Failed and timed-out steps keep the tail of their log.

    gpu_check_report.py record --logdir D --name N --kind K --rc RC --wall-s W --timeout-s T [--artifact F]
                               [--note TEXT] -- COMMAND...
    gpu_check_report.py report --logdir D --out REPORT [--budget-s B] [--dry-run]
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

from gpu_check_common import last_json_line  # beside this script: on sys.path when it runs

LOG_TAIL_CHARS = 3000
MAX_LISTED = 20
TIMEOUT_RCS = (124, 137)


# ---- parsers: (the step's file or None, its log text) -> figures; checks go in figures["checks"] ----
def parse_setup(data: dict | None, log: str) -> dict:
    return data or {}


def parse_env(data: dict | None, log: str) -> dict:
    return data or {}


def parse_pytest(xml_path: Path | None, log: str) -> dict:
    """Counts and failures from --junitxml; from the log's last summary line when there is none."""
    if xml_path is None or not xml_path.is_file():
        return {"source": "log", **_pytest_counts_from_log(log)}
    root = ET.parse(xml_path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    failures, skips = [], {}
    counts = {"tests": 0, "failed": 0, "errors": 0, "skipped": 0}
    for suite in suites:
        for case in suite.iter("testcase"):
            counts["tests"] += 1
            name = f"{case.get('classname', '')}::{case.get('name', '')}"
            for tag, key in (("failure", "failed"), ("error", "errors")):
                bad = case.find(tag)
                if bad is not None:
                    counts[key] += 1
                    failures.append({"test": name, "kind": tag, "message": (bad.get("message") or "")[:300]})
            skipped = case.find("skipped")
            if skipped is not None:
                counts["skipped"] += 1
                reason = (skipped.get("message") or "")[:120]
                skips[reason] = skips.get(reason, 0) + 1
    counts["passed"] = counts["tests"] - counts["failed"] - counts["errors"] - counts["skipped"]
    time_s = sum(float(s.get("time") or 0) for s in suites)
    interrupted = "KeyboardInterrupt" in log or "Interrupted:" in log
    checks = {"no failures": counts["failed"] + counts["errors"] == 0, "ran to the end": not interrupted}
    return {"source": "junitxml", **counts, "time_s": round(time_s, 1), "interrupted": interrupted,
            "failures": failures[:MAX_LISTED], "skip_reasons": dict(sorted(skips.items(), key=lambda kv: -kv[1])[:5]),
            **_sanitizer(log, checks), "checks": checks}


def _sanitizer(log: str, checks: dict) -> dict:
    """`gpu_check_steps.py pytest`'s last line: "CUDA sanitizer asked, on" (or "not asked" / "off"); where
    it was asked for, a check that it ran (a CPU torch cannot run it: the dry run does not ask)."""
    found = re.findall(r"^pytest: CUDA sanitizer (asked|not asked), (on|off)$", log, re.MULTILINE)
    if not found:
        return {}
    asked, state = found[-1]
    if asked == "asked":
        checks["CUDA sanitizer on"] = state == "on"
    return {"cuda_sanitizer": state if asked == "asked" else "not asked"}


def _pytest_counts_from_log(log: str) -> dict:
    lines = [ln for ln in log.splitlines() if re.search(r"\d+ (passed|failed|skipped|error)", ln)]
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|errors?|deselected)", lines[-1])} \
        if lines else {}
    return {**counts, "checks": {"summary line found": bool(lines),
                                 "no failures": counts.get("failed", 0) + counts.get("error", 0)
                                 + counts.get("errors", 0) == 0}}


def parse_decode(data: dict | None, log: str) -> dict:
    """`tandem bench decode --json`: tok/s per backend/mode/batch, the best per batch, and the checks."""
    if data is None:
        return {"checks": {"wrote its json": False}}
    rows = [{"system": r["system"], "backend": r["backend"], "mode": r["mode"], "batch": r["batch"],
             "tok_per_s": round(r["tokens_per_s"], 1), "step_ms_p50": round(r["step_ms_p50"], 3),
             "vs_eager": None if r.get("speedup_vs_eager") is None else round(r["speedup_vs_eager"], 2),
             "replayed": f"{r.get('replays', 0)}/{r['steps']}", "fallbacks": r.get("fallbacks") or {}}
            for r in data["rows"]]
    best: dict[str, dict] = {}
    for r in rows:
        if r["system"] == "tandem" and r["tok_per_s"] > best.get(str(r["batch"]), {"tok_per_s": -1})["tok_per_s"]:
            best[str(r["batch"])] = {"tok_per_s": r["tok_per_s"], "backend": r["backend"], "mode": r["mode"]}
    hbm = (data.get("bandwidth") or {}).get("rows", {})
    for b, v in best.items() if hbm else ():  # that row's HBM figures (bench decode's `bandwidth`: roofline.py)
        row = hbm[f"{v['backend']}/{v['mode']}/{b}"]
        fraction = row["fraction_of_peak"]
        v |= {"gb_per_s": round(row["bytes_per_s"] / 1e9, 3),
              "fraction_of_peak": None if fraction is None else round(fraction, 3)}
    hf = {str(r["batch"]): r["tok_per_s"] for r in rows if r["system"] != "tandem"}
    graphs = [r for r in rows if r["system"] == "tandem" and r["mode"] == "graph"]
    checks = {"eager = graph outputs": all(data["outputs_identical_eager_graph"].values()),
              "graph steps all replayed": all(not r["fallbacks"] for r in graphs)}
    if data["first_request_identical_to_hf"]:
        checks["request 0 = HF generate"] = all(data["first_request_identical_to_hf"].values())
    out = {"model": data["config"]["model"], "device": data["config"]["device"], "dtype": data["config"]["dtype"],
           "skipped_backends": data["skipped_backends"], "best_tok_per_s": best, "hf_tok_per_s": hf}
    if data.get("bandwidth"):
        bw = data["bandwidth"]
        out["hbm"] = {"peak_gb_per_s": None if bw["peak_bytes_per_s"] is None else round(bw["peak_bytes_per_s"] / 1e9),
                      "peak_source": bw["peak_source"], "weight_mb_per_step": round(bw["weight_bytes"] / 1e6, 1)}
    return {**out, "rows": rows, "checks": checks}


def parse_h2d(data: dict | None, log: str) -> dict:
    if data is None:
        return {"checks": {"wrote its json": False}}
    return {"device": data["spec"]["device"], "ratio": round(data["ratio"], 3), "target": data["target"],
            "meets_target": data["ratio"] >= data["target"], "copier_gb_per_s": round(data["copier_gb_per_s"], 2),
            "plain_copy_gb_per_s": round(data["plain_copy_gb_per_s"], 2), "pinned_host": data["pinned_host"],
            "mib_per_load": round(data["bytes"] / 2**20, 1)}


def parse_train_eagle(eval_path: Path | None, log: str) -> dict:
    """`tandem train-eagle`: where the head went, whether it was trained here, its held-out acceptance."""
    head = re.search(r"^draft head: (.+?)( \(cached\))?$", log, re.MULTILINE)
    out: dict = {"head": head.group(1) if head else None, "reused": bool(head and head.group(2))}
    for key, pattern in (("train_s", r"draft head trained in (\d+)s"),
                         ("answer_s", r"target answered \d+ prompts \(\d+ tokens\) in (\d+)s")):
        found = re.search(pattern, log)
        if found:
            out[key] = int(found.group(1))
    data = _read_json(eval_path)
    if data:
        out |= {"mean_accepted_len": round(data["mean_accepted_len"], 3),
                "step_accept": [round(x, 3) for x in data["step_accept"]], "num_drafts": data["num_drafts"]}
    out["checks"] = {"head written": head is not None}
    return out


def parse_spec_decode(data: dict | None, log: str) -> dict:
    """`tandem bench decode --speculative eagle --json`: per batch, tok/s, speed-up, tokens per verify."""
    if data is None:
        return {"checks": {"wrote its json": False}}
    batches = {b: {"plain_tok_per_s": round(v["plain_tok_per_s"], 1), "eagle_tok_per_s": round(v["eagle_tok_per_s"], 1),
                   "speedup": round(v["speedup"], 3), "tokens_per_verify": round(v["mean_accepted_length"], 3),
                   "acceptance_per_position": [round(x, 3) for x in v["acceptance_rate_per_position"].values()],
                   "identical_outputs": v["identical_outputs"]} for b, v in data["batches"].items()}
    return {"device": data["device"], "dtype": data["dtype"], "draft_model": data["draft_model"],
            "num_draft_tokens": data["num_draft_tokens"], "batches": batches,
            "checks": {"eagle = plain outputs": all(v["identical_outputs"] for v in batches.values())}}


SERVE_KEYS = ("completed", "failed", "duration", "request_throughput", "output_throughput", "total_token_throughput",
              "max_concurrency", "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "mean_itl_ms", "median_itl_ms",
              "p99_itl_ms", "mean_tpot_ms", "median_tpot_ms", "mean_e2el_ms")


def parse_serve(data: dict | None, log: str) -> dict:
    """The serve driver's JSON (ready, stop) and `bench serve --json`'s last line in its log (`log`)."""
    data = data or {}
    bench = data.get("bench") or last_json_line(log)
    out = {k: data.get(k) for k in ("ready", "start_to_ready_s", "gpu_memory_used_mib", "bench_rc", "bench_wall_s")}
    out["stop"] = data.get("stop")
    out["bench"] = {k: _round(bench.get(k)) for k in SERVE_KEYS if k in bench} if bench else None
    split = (bench or {}).get("ttft_phases")  # the server's own timelines: where the first tokens went
    if split:
        out["ttft_phases_p50_ms"] = {name: _round(st.get("p50_ms")) for name, st in
                                     [("server", split["server_ttft"]), *split["phases"].items(),
                                      *((f"worker {k}", v) for k, v in split["worker_spans"].items())]}
    errors = re.search(r"requests failed; first distinct errors:\n((?:  .*\n?)+)", log)
    if errors:
        out["errors"] = [e.strip() for e in errors.group(1).splitlines()][:5]
    stop = data.get("stop") or {}
    greedy = data.get("greedy") or {}
    prompts = greedy.get("prompts") or []
    out["greedy"] = {"verdicts": {p["prompt"]: p["verdict"] for p in prompts},
                     "reference": greedy.get("reference")} if greedy else None
    out["checks"] = {"ready": data.get("ready") == "ready", "bench result": bool(bench),
                     "no failed requests": bool(bench) and bench.get("failed") == 0 and bench.get("completed", 0) > 0,
                     "greedy = HF's (to a near-tie)": bool(prompts) and all(
                         p["verdict"] == "equal" or p["verdict"].startswith("near-tie") for p in prompts),
                     "greedy prompt ids = HF's": bool(prompts) and all(p.get("prompt_ids_equal") for p in prompts),
                     "stopped cleanly": stop.get("rc") == 0 and stop.get("how") == "SIGTERM"}
    return out


def parse_tp(data: dict | None, log: str) -> dict:
    if not data:
        return {}
    return {k: v for k, v in data.items() if k in ("equal", "parted", "prompts", "error") or k.endswith("_wall_s")}


PARSERS = {"setup": (parse_setup, "json"), "env": (parse_env, "json"), "pytest": (parse_pytest, "path"),
           "decode": (parse_decode, "json"), "h2d": (parse_h2d, "json"), "train_eagle": (parse_train_eagle, "path"),
           "spec_decode": (parse_spec_decode, "json"), "serve": (parse_serve, "json"), "tp": (parse_tp, "json")}


def _read_json(path: Path | None) -> dict | None:
    try:
        return json.loads(path.read_text()) if path is not None else None
    except (OSError, ValueError):
        return None


def _round(value):
    return round(value, 3) if isinstance(value, float) else value


# ---- one step, the report --------------------------------------------------------------------------
def step_entry(record: dict, logdir: Path) -> dict:
    """A record plus its figures, checks and status (the log's tail unless it is ok)."""
    log_path = logdir / record["log"] if record.get("log") else None
    log = log_path.read_text(errors="replace") if log_path and log_path.is_file() else ""
    artifact = logdir / record["artifact"] if record.get("artifact") else None
    entry = dict(record)
    if record["rc"] is None:
        entry["status"] = "skipped"
        return entry
    parser, takes = PARSERS[record["kind"]]
    try:
        figures = parser(_read_json(artifact) if takes == "json" else artifact, log)
    except (KeyError, TypeError, ValueError, ET.ParseError) as err:
        figures = {"parse_error": f"{type(err).__name__}: {err}", "checks": {"output parsed": False}}
    checks = figures.pop("checks", {})
    entry |= {"figures": figures, "checks": checks}
    if record["rc"] in TIMEOUT_RCS:
        entry["status"] = "timeout"
    else:
        entry["status"] = "ok" if record["rc"] == 0 and all(checks.values()) else "failed"
    if entry["status"] != "ok":
        entry["failed_checks"] = [name for name, ok in checks.items() if not ok]
        entry["log_tail"] = log[-LOG_TAIL_CHARS:]
    return entry


def git_state(repo: Path) -> dict | None:
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=repo,
                               capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return {"commit": head.stdout.strip(), "dirty": bool(dirty.stdout.strip())} if head.returncode == 0 else None


def build_report(logdir: Path, budget_s: float | None, dry_run: bool, started_at: float | None) -> dict:
    records = [json.loads(p.read_text()) for p in sorted((logdir / "steps").glob("*.json"))]
    steps = [step_entry(r, logdir) for r in records]
    bad = [s["name"] for s in steps if s["status"] != "ok"]
    env = next((s.get("figures") or {} for s in steps if s["kind"] == "env"), {})
    return {"schema": 1, "dry_run": dry_run, "device": env.get("device_name") or ("cpu" if env else None),
            "torch": env.get("torch"), "budget_s": budget_s,
            "wall_s": round(time.time() - started_at, 1) if started_at else None,
            "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "git": git_state(Path(__file__).resolve().parents[1]),
            "ok": not bad and bool(steps), "not_ok": bad, "steps": steps}


# ---- the summary -----------------------------------------------------------------------------------
def headline(step: dict) -> str:
    """One line of a step's key figures."""
    f = step.get("figures") or {}
    kind = step["kind"]
    if step.get("status") == "skipped":
        return step.get("note", "")
    if kind == "env":
        return f"torch {f.get('torch')} cuda {f.get('cuda_available')} {f.get('device_name', '')}; " \
               f"triton {f.get('triton')} flashinfer {f.get('flashinfer')}"
    if kind == "setup":
        return f"venv {f.get('venv')}; still unmet: {', '.join(f.get('still_unmet') or []) or 'none'}"
    if kind == "pytest":
        return f"{f.get('passed', '?')} passed, {f.get('failed', 0)} failed, {f.get('errors', 0)} errors, " \
               f"{f.get('skipped', '?')} skipped" + (" (interrupted)" if f.get("interrupted") else "") + \
               (f"; CUDA sanitizer {f['cuda_sanitizer']}" if f.get("cuda_sanitizer") else "")
    if kind == "decode" and "best_tok_per_s" in f:
        best = ", ".join(f"b{b} {v['tok_per_s']:.0f} ({v['backend']} {v['mode']}"
                         + (f", {v['fraction_of_peak']:.2f} of HBM peak)" if v.get("fraction_of_peak") else ")")
                         for b, v in f["best_tok_per_s"].items())
        return f"{f['dtype']} tok/s {best}"
    if kind == "h2d" and "ratio" in f:
        return f"copier / plain copy_ {f['ratio']:.2f} (target {f['target']}), {f['copier_gb_per_s']} GB/s"
    if kind == "train_eagle":
        how = "reused" if f.get("reused") else f"trained in {f.get('train_s', '?')}s"
        return f"head {how}, held-out {f.get('mean_accepted_len', '?')} tokens/verify"
    if kind == "spec_decode" and "batches" in f:
        return "; ".join(f"b{b} {v['speedup']:.2f}x plain, {v['tokens_per_verify']:.2f} tokens/verify"
                         for b, v in f["batches"].items())
    if kind == "tp" and "equal" in f:
        parted = {name: rows for name, rows in (f.get("parted") or {}).items() if rows}
        walls = ", ".join(f"{k[:-len('_wall_s')]} {v}s" for k, v in f.items() if k.endswith("_wall_s"))
        return (f"TP=2 runs' greedy = TP=1's on {f.get('prompts')} prompts: {f['equal']}"
                + (f" (parted: {parted})" if parted else "") + f"; wall {walls}")
    if kind == "serve":
        b = f.get("bench") or {}
        if f.get("ready") != "ready":
            how = (f.get("stop") or {}).get("how")
            return f"not ready: {f.get('ready')} after {f.get('start_to_ready_s')}s; stop {how}"
        verdicts = list(((f.get("greedy") or {}).get("verdicts") or {}).values())
        same, near = sum(v == "equal" for v in verdicts), sum(v.startswith("near-tie") for v in verdicts)
        return f"ready in {f.get('start_to_ready_s')}s; {b.get('completed', 0)} ok, {b.get('failed', '?')} failed, " \
               f"{b.get('output_throughput', 0):.0f} out tok/s, TTFT p50 {b.get('median_ttft_ms', 0):.0f} ms, " \
               f"ITL p50 {b.get('median_itl_ms', 0):.1f} ms" + _split_text(f.get("ttft_phases_p50_ms")) + \
               f"; greedy = HF {same}/{len(verdicts)}" \
               + (f" (+{near} near-tie)" if near else "") + "; " \
               f"stop {(f.get('stop') or {}).get('how')}"
    return step.get("note", "")


def _split_text(split: dict | None) -> str:
    """" (TTFT p50 by phase: queued 1 ms, ...)" from `parse_serve`'s split, or ""."""
    if not split:
        return ""
    return " (TTFT p50 by phase: " + ", ".join(f"{k} {v:.0f} ms" for k, v in split.items() if v is not None) + ")"


def summary_text(report: dict) -> str:
    lines = [f"gpu-check{' (dry run)' if report['dry_run'] else ''}: {len(report['steps'])} steps, "
             f"{report['wall_s']}s of a {report['budget_s']}s budget"]
    for s in report["steps"]:
        wall = f"{s['wall_s']:.0f}/{s['timeout_s']}s" if s.get("wall_s") is not None else f"-/{s['timeout_s']}s"
        lines.append(f"  {s['name']:<14}{s['status']:<9}{wall:>10}  {headline(s)}")
        if s.get("failed_checks"):
            lines.append(f"  {'':<14}failed checks: {', '.join(s['failed_checks'])}")
    lines.append("all ok" if report["ok"] else f"NOT OK: {', '.join(report['not_ok']) or 'no steps ran'}")
    return "\n".join(lines)


# ---- the command -----------------------------------------------------------------------------------
def record(args: argparse.Namespace) -> int:
    """One step's record; its file name keeps the order the steps started in."""
    steps = Path(args.logdir) / "steps"
    steps.mkdir(parents=True, exist_ok=True)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    entry = {"name": args.name, "kind": args.kind, "command": shlex.join(command),
             "rc": None if args.rc == "" else int(args.rc), "timeout_s": args.timeout_s,
             "wall_s": None if args.wall_s == "" else round(float(args.wall_s), 2), "log": args.log,
             "artifact": args.artifact or None}
    if args.note:
        entry["note"] = args.note
    (steps / f"{args.order:02d}-{args.name}.json").write_text(json.dumps(entry, indent=1) + "\n")
    return 0


def report(args: argparse.Namespace) -> int:
    result = build_report(Path(args.logdir), args.budget_s, args.dry_run, args.started_at)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(summary_text(result))
    print(f"report: {args.out}")
    return 0 if result["ok"] else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="what", required=True)
    r = sub.add_parser("record")
    r.add_argument("--logdir", required=True)
    r.add_argument("--order", type=int, required=True)
    r.add_argument("--name", required=True)
    r.add_argument("--kind", required=True, choices=sorted(PARSERS))
    r.add_argument("--rc", default="", help="empty: the step did not run")
    r.add_argument("--wall-s", default="")
    r.add_argument("--timeout-s", type=int, required=True)
    r.add_argument("--log", default="", help="relative to --logdir")
    r.add_argument("--artifact", default="", help="relative to --logdir")
    r.add_argument("--note", default="")
    r.add_argument("command", nargs=argparse.REMAINDER)
    o = sub.add_parser("report")
    o.add_argument("--logdir", required=True)
    o.add_argument("--out", required=True)
    o.add_argument("--budget-s", type=float)
    o.add_argument("--started-at", type=float, help="epoch seconds the run began")
    o.add_argument("--dry-run", action="store_true")
    args = p.parse_args(argv)
    return record(args) if args.what == "record" else report(args)


if __name__ == "__main__":
    sys.exit(main())
