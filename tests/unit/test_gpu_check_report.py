"""scripts/gpu_check_report.py: the figures and checks it reads from each step's output, a step's
status, the assembled report and its exit status. The sample outputs in tests/data/gpu_check are
real CPU runs of the same commands with tiny sizes (the decode, random-weights decode, h2d, speculative
and train-eagle ones, the serve step's greedy check), cut short; the junit XML and the rest of the
serve result are in the format those tools write."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "tests" / "data" / "gpu_check"


def _load_reporter():
    """The reporter as its script runs it: with scripts/ on the path (it imports `gpu_check_common`)."""
    spec = importlib.util.spec_from_file_location("gpu_check_report", ROOT / "scripts" / "gpu_check_report.py")
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    return module


rep = _load_reporter()


def _json(name: str) -> dict:
    return json.loads((DATA / name).read_text())


def make_logdir(tmp_path: Path, steps: list[dict], logs: dict[str, str] | None = None) -> Path:
    """A LOGDIR with one record per step (via `record`, as the shell script writes them) and its logs."""
    for order, step in enumerate(steps, 1):
        log = f"logs/{step['name']}.log"
        (tmp_path / "logs").mkdir(parents=True, exist_ok=True)
        (tmp_path / log).write_text((logs or {}).get(step["name"], ""))
        args = ["record", "--logdir", str(tmp_path), "--order", str(order), "--name", step["name"], "--kind",
                step["kind"], "--rc", step.get("rc", "0"), "--wall-s", "1.5", "--timeout-s", "40", "--log", log,
                "--artifact", step.get("artifact", ""), "--", "tandem", "bench", step["name"]]
        assert rep.main(args) == 0
    return tmp_path


def test_decode_rows_best_per_batch_and_checks():
    f = rep.parse_decode(_json("decode-fp32-cpu.json"), "")
    assert (f["device"], f["dtype"]) == ("cpu", "float32")
    assert sorted(f["best_tok_per_s"]) == ["1", "2"]
    assert f["best_tok_per_s"]["1"] == {"tok_per_s": 2.7, "backend": "torch", "mode": "eager"}
    assert f["best_tok_per_s"]["2"] == {"tok_per_s": 2.4, "backend": "torch", "mode": "graph"}
    assert f["hf_tok_per_s"] == {"1": 2.4, "2": 0.5}
    assert [(r["mode"], r["batch"], r["replayed"]) for r in f["rows"][:2]] == [("eager", 1, "0/4"), ("graph", 1, "4/4")]
    assert f["checks"] == {"eager = graph outputs": True, "graph steps all replayed": True,
                           "request 0 = HF generate": True}


def test_decode_outputs_that_differ_fail_the_step():
    data = _json("decode-fp32-cpu.json")
    data["outputs_identical_eager_graph"]["torch/2"] = False
    assert rep.parse_decode(data, "")["checks"]["eager = graph outputs"] is False
    assert rep.parse_decode(None, "")["checks"] == {"wrote its json": False}


def test_decode_of_random_weights_names_the_hbm_fraction_of_each_batchs_best_row():
    data = _json("decode-8b-tiny-cpu.json")  # a CPU run: no peak, no fraction
    f = rep.parse_decode(data, "")
    assert (f["model"], f["dtype"]) == ("random:tiny", "bfloat16") and f["hf_tok_per_s"] == {}
    assert f["hbm"] == {"peak_gb_per_s": None, "peak_source": "no HBM figure for a cpu device",
                        "weight_mb_per_step": 0.2}
    assert all(v["fraction_of_peak"] is None and v["gb_per_s"] > 0 for v in f["best_tok_per_s"].values())
    assert "request 0 = HF generate" not in f["checks"] and all(f["checks"].values())
    best = f["best_tok_per_s"]["2"]
    data["bandwidth"]["peak_bytes_per_s"] = 4.8e12
    data["bandwidth"]["rows"][f"torch/{best['mode']}/2"] |= {"bytes_per_s": 3.9e12, "fraction_of_peak": 0.8125}
    f = rep.parse_decode(data, "")
    assert f["best_tok_per_s"]["2"]["fraction_of_peak"] == 0.812 and f["best_tok_per_s"]["2"]["gb_per_s"] == 3900.0
    assert f["hbm"]["peak_gb_per_s"] == 4800
    assert ", 0.81 of HBM peak)" in rep.headline({"kind": "decode", "figures": f})


def test_pytest_under_the_sanitizer_fails_unless_it_ran():
    log = "1 failed, 2 passed, 2 skipped in 41.25s\npytest: CUDA sanitizer {}\n"
    off = rep.parse_pytest(DATA / "pytest-mixed.xml", log.format("asked, off"))
    assert off["cuda_sanitizer"] == "off" and off["checks"]["CUDA sanitizer on"] is False
    on = rep.parse_pytest(DATA / "pytest-mixed.xml", log.format("asked, on"))
    assert on["checks"]["CUDA sanitizer on"] is True
    assert "; CUDA sanitizer on" in rep.headline({"kind": "pytest", "figures": on})
    plain = rep.parse_pytest(DATA / "pytest-mixed.xml", log.format("not asked, off"))
    assert plain["cuda_sanitizer"] == "not asked" and "CUDA sanitizer on" not in plain["checks"]


def test_h2d_ratio_and_target():
    f = rep.parse_h2d(_json("h2d-cpu.json"), "")
    assert f == {"device": "cpu", "ratio": 1.309, "target": 0.8, "meets_target": True, "copier_gb_per_s": 1.15,
                 "plain_copy_gb_per_s": 0.88, "pinned_host": False, "mib_per_load": 11.2}


def test_spec_decode_speedup_and_tokens_per_verify():
    f = rep.parse_spec_decode(_json("spec-decode-cpu.json"), "")
    assert f["batches"]["1"]["speedup"] == 0.2 and f["batches"]["2"]["speedup"] == 0.478
    assert f["batches"]["1"]["tokens_per_verify"] == 1.0
    assert f["batches"]["2"]["acceptance_per_position"] == [0.0, 0.0, 0.0]
    assert f["checks"] == {"eagle = plain outputs": True}


def test_train_eagle_from_its_log_and_eval_json():
    f = rep.parse_train_eagle(DATA / "eval.json", (DATA / "train-eagle-cpu.log").read_text())
    assert f == {"head": "eagle-head", "reused": False, "train_s": 36, "answer_s": 13, "mean_accepted_len": 1.011,
                 "step_accept": [0.011, 0.0, 0.0], "num_drafts": 3, "checks": {"head written": True}}
    cached = rep.parse_train_eagle(None, "draft head: some/dir (cached)\n")
    assert (cached["head"], cached["reused"]) == ("some/dir", True)


def test_pytest_counts_failures_and_skip_reasons_from_junit():
    f = rep.parse_pytest(DATA / "pytest-mixed.xml", "1 failed, 2 passed, 2 skipped in 41.25s")
    assert (f["tests"], f["passed"], f["failed"], f["errors"], f["skipped"]) == (5, 2, 1, 0, 2)
    assert f["failures"] == [{"test": "tests.gpu.test_triton_cuda::test_decode_attention_matches_torch[fp32-1-gqa1]",
                              "kind": "failure", "message": "AssertionError: Tensor-likes are not close!"}]
    assert f["skip_reasons"] == {"flashinfer cannot be imported": 2}
    assert f["checks"] == {"no failures": False, "ran to the end": True}


def test_pytest_without_junit_reads_the_summary_line():
    f = rep.parse_pytest(None, "....\n!!! KeyboardInterrupt !!!\n3 passed, 1 skipped in 170.02s\n")
    assert (f["source"], f["passed"], f["skipped"]) == ("log", 3, 1)
    assert f["checks"] == {"summary line found": True, "no failures": True}


def test_serve_figures_and_checks():
    serve = _json("serve-cpu.json")
    f = rep.parse_serve(serve, "")
    assert (f["ready"], f["start_to_ready_s"], f["bench_rc"]) == ("ready", 62.74, 0)
    assert f["bench"]["completed"] == 4 and f["bench"]["failed"] == 0 and f["bench"]["median_ttft_ms"] == 693.318
    assert f["stop"] == {"how": "SIGTERM", "rc": 0, "stop_s": 6.18}
    assert all(f["checks"].values()) and "errors" not in f
    line = rep.headline({"kind": "serve", "figures": f})
    assert "ready in 62.74s; 4 ok, 0 failed, 8 out tok/s, TTFT p50 693 ms" in line
    assert "by phase" not in line  # a bench without the server's timelines
    ms = {"count": 4, "mean_ms": 1.0, "p50_ms": 700.0, "p90_ms": 1.0, "p99_ms": 1.0}
    split = {"requests": 4, "server_ttft": ms, "phases": {"queued": {**ms, "p50_ms": 600.0}},
             "worker_spans": {"transfer": {**ms, "p50_ms": 20.0}}}
    f = rep.parse_serve({**serve, "bench": {**serve["bench"], "ttft_phases": split}}, "")
    line = rep.headline({"kind": "serve", "figures": f})
    assert "(TTFT p50 by phase: server 700 ms, queued 600 ms, worker transfer 20 ms)" in line


def test_serve_greedy_tokens_that_part_at_no_near_tie_fail_the_step():
    serve = _json("serve-cpu.json")
    f = rep.parse_serve(serve, "")
    assert f["greedy"]["verdicts"] == {"The capital of France is": "equal", "def fibonacci(n):": "equal"}
    assert f["greedy"]["reference"] == {"model": "smollm2", "device": "cpu", "dtype": "float32", "wall_s": 53.79}
    near, differs = dict(serve["greedy"]["prompts"][0]), dict(serve["greedy"]["prompts"][1])
    near["verdict"] = "near-tie at step 3 (gap 0.066)"
    differs |= {"verdict": "differs at step 5 (gap 3.241)", "prompt_ids_equal": False}
    f = rep.parse_serve({**serve, "greedy": {**serve["greedy"], "prompts": [near, differs]}}, "")
    assert {k for k, ok in f["checks"].items() if not ok} == {"greedy = HF's (to a near-tie)",
                                                              "greedy prompt ids = HF's"}
    near_only = rep.parse_serve({**serve, "greedy": {**serve["greedy"], "prompts": [near]}}, "")
    assert all(near_only["checks"].values())
    assert "greedy = HF 0/1 (+1 near-tie)" in rep.headline({"kind": "serve", "figures": near_only})
    no_reference = rep.parse_serve({**serve, "greedy": {"reference": "exited 1", "served": []}}, "")
    assert no_reference["checks"]["greedy = HF's (to a near-tie)"] is False


def test_serve_failed_requests_and_a_hung_stop_fail_the_step():
    serve = _json("serve-cpu.json")
    hung = {**serve, "stop": {"how": "SIGTERM, then SIGKILL of its process group", "rc": -9, "stop_s": 20.0}}
    failed = {**hung, "bench": {**serve["bench"], "completed": 2, "failed": 2}}
    log = "2 requests failed; first distinct errors:\n  HTTP 429: too many\n  ServerDisconnected\n"
    f = rep.parse_serve(failed, log)
    assert f["errors"] == ["HTTP 429: too many", "ServerDisconnected"]
    assert {k for k, ok in f["checks"].items() if not ok} == {"no failed requests", "stopped cleanly"}
    never = rep.parse_serve({"ready": "exited 1", "start_to_ready_s": 2.5, "stop": {"how": "exited before stop",
                                                                                      "rc": 1}}, "")
    assert {k for k, ok in never["checks"].items() if not ok} == set(never["checks"])
    assert rep.headline({"kind": "serve", "figures": never}).startswith("not ready: exited 1 after 2.5s")


def test_report_statuses_exit_code_and_summary(tmp_path, capsys):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "h2d.json").write_text((DATA / "h2d-cpu.json").read_text())
    (tmp_path / "out" / "decode.json").write_text((DATA / "decode-fp32-cpu.json").read_text())
    logdir = make_logdir(tmp_path, [
        {"name": "h2d", "kind": "h2d", "artifact": "out/h2d.json"},
        {"name": "decode-fp32", "kind": "decode", "artifact": "out/decode.json"},
        {"name": "eagle-bench", "kind": "spec_decode", "rc": "124", "artifact": "out/missing.json"},
        {"name": "serve", "kind": "serve", "rc": "", "artifact": "out/serve.json"},
    ], logs={"eagle-bench": "x" * 5000 + "the end"})
    out = tmp_path / "report.json"
    assert rep.main(["report", "--logdir", str(logdir), "--out", str(out), "--budget-s", "480"]) == 1
    report = json.loads(out.read_text())
    status = {s["name"]: s["status"] for s in report["steps"]}
    assert status == {"h2d": "ok", "decode-fp32": "ok", "eagle-bench": "timeout", "serve": "skipped"}
    assert report["not_ok"] == ["eagle-bench", "serve"] and report["ok"] is False
    timed_out = report["steps"][2]
    assert timed_out["command"] == "tandem bench eagle-bench" and timed_out["wall_s"] == 1.5
    assert len(timed_out["log_tail"]) == rep.LOG_TAIL_CHARS and timed_out["log_tail"].endswith("the end")
    assert "log_tail" not in report["steps"][0]
    text = capsys.readouterr().out
    assert "copier / plain copy_ 1.31" in text and "NOT OK: eagle-bench, serve" in text


def test_a_step_with_output_it_cannot_parse_fails_not_the_report(tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "h2d.json").write_text('{"spec": {}}')
    logdir = make_logdir(tmp_path, [{"name": "h2d", "kind": "h2d", "artifact": "out/h2d.json"}])
    out = tmp_path / "report.json"
    assert rep.main(["report", "--logdir", str(logdir), "--out", str(out)]) == 1
    [step] = json.loads(out.read_text())["steps"]
    assert step["status"] == "failed" and step["failed_checks"] == ["output parsed"]
    assert step["figures"]["parse_error"].startswith("KeyError")
