"""`tandem bench llamacpp` (cluster/bench/llamacpp.py, llamacpp_peers.py, proc_memory.py) without llama.cpp:
the f32 GGUF conversion checked against gguf's own reader and the float values it was quantized from,
its cache, the prompts (exact token counts with SmolLM2's tokenizer), the tandem flags as `tandem
serve` parses them, the summary's ratios against the targets, how llama-server is found and the
command line it gets (a stand-in script records it), the messages when a peer is missing, and the
memory summed over a server's processes. No pool is involved."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
from types import SimpleNamespace

import numpy as np
import pytest

import cluster.bench.llamacpp as bench
import cluster.bench.llamacpp_gguf as llama_gguf
from cluster.bench.llamacpp import make_prompts, tandem_serve_flags
from cluster.bench.llamacpp_gguf import ensure_gguf, gguf_source, write_gguf
from cluster.bench.llamacpp_peers import LLAMA_SERVER_ENV, PEERS, LlamaServerPeer, find_llama_server, wait_peer_ready
from cluster.bench.llamacpp_report import format_table, round_lines, summarize, system_figures
from cluster.bench.llamacpp_runs import BenchSpec, StreamResult, SystemRun
from cluster.bench.proc_memory import ProcessMemory, memory_of, process_tree, tandem_serve_processes
from cluster.bench.serve import load_config
from cluster.cli.main import build_parser, main

gguf = pytest.importorskip("gguf")

ROWS, COLS = 8, 64  # quantized rows must be whole blocks: 32 values per Q8_0 / Q4_1 block


def _original_tensors() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {"token_embd.weight": rng.standard_normal((ROWS, COLS)).astype(np.float32),
            "blk.0.ffn_up.weight": rng.standard_normal((ROWS, COLS)).astype(np.float32),
            "blk.0.attn_norm.weight": rng.standard_normal(COLS).astype(np.float32)}


def _write_source(path, tensors: dict[str, np.ndarray]) -> None:
    """A tiny quantized GGUF as the bundled one is made: Q8_0 embeddings, Q4_1 matrices, F32 norms."""
    qtypes = {"token_embd.weight": gguf.GGMLQuantizationType.Q8_0,
              "blk.0.ffn_up.weight": gguf.GGMLQuantizationType.Q4_1}
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_block_count(1)
    writer.add_bool("tokenizer.ggml.add_bos_token", False)
    writer.add_token_list(["<a>", "<b>", " word"])
    writer.add_token_types([3, 3, 1])
    writer.add_float32("llama.rope.freq_base", 100000.0)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_1)
    for name, values in tensors.items():
        qtype = qtypes.get(name)
        if qtype is None:
            writer.add_tensor(name, values)
        else:
            writer.add_tensor(name, gguf.quants.quantize(values, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _fields(reader) -> dict:
    return {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}


def test_f32_gguf_has_the_dequantized_values_and_the_metadata(tmp_path):
    original = _original_tensors()
    _write_source(tmp_path / "src.gguf", original)
    write_gguf(tmp_path / "src.gguf", tmp_path / "f32.gguf", "src.gguf:123")

    source, out = gguf.GGUFReader(tmp_path / "src.gguf"), gguf.GGUFReader(tmp_path / "f32.gguf")
    assert [t.name for t in out.tensors] == [t.name for t in source.tensors]
    assert all(t.tensor_type == gguf.GGMLQuantizationType.F32 for t in out.tensors)
    for src_tensor, out_tensor in zip(source.tensors, out.tensors):
        assert list(out_tensor.shape) == list(src_tensor.shape), src_tensor.name  # ggml ne kept
        values = np.array(out_tensor.data)
        # exactly what the quantized file holds, and near what it was quantized from (4-bit: coarse)
        np.testing.assert_array_equal(values, gguf.quants.dequantize(src_tensor.data, src_tensor.tensor_type))
        np.testing.assert_allclose(values, original[src_tensor.name], atol=0.35, rtol=0)
    np.testing.assert_array_equal(np.array(out.tensors[2].data), original["blk.0.attn_norm.weight"])

    expected = {**_fields(source), "general.file_type": int(gguf.LlamaFileType.ALL_F32),
                llama_gguf.SOURCE_KEY: "src.gguf:123"}
    assert _fields(out) == expected
    assert gguf_source(tmp_path / "f32.gguf") == "src.gguf:123"
    assert gguf_source(tmp_path / "absent.gguf") is None
    assert gguf_source(tmp_path / "src.gguf") is None  # a GGUF this bench did not write


def test_bf16_gguf_rounds_the_matrices_as_torch_does_and_keeps_the_norms_f32(tmp_path):
    import torch

    _write_source(tmp_path / "src.gguf", _original_tensors())
    write_gguf(tmp_path / "src.gguf", tmp_path / "bf16.gguf", "src.gguf:123", "bfloat16")
    source, out = gguf.GGUFReader(tmp_path / "src.gguf"), gguf.GGUFReader(tmp_path / "bf16.gguf")
    assert _fields(out)["general.file_type"] == int(gguf.LlamaFileType.MOSTLY_BF16)
    for src_tensor, out_tensor in zip(source.tensors, out.tensors):
        assert list(out_tensor.shape) == list(src_tensor.shape), src_tensor.name
        f32 = gguf.quants.dequantize(src_tensor.data, src_tensor.tensor_type).astype(np.float32)
        got = gguf.quants.dequantize(out_tensor.data, out_tensor.tensor_type)
        if f32.ndim >= 2:  # tandem's bf16 engine casts the same float32 values with torch
            assert out_tensor.tensor_type == gguf.GGMLQuantizationType.BF16, src_tensor.name
            np.testing.assert_array_equal(got, torch.from_numpy(f32).to(torch.bfloat16).float().numpy())
        else:
            assert out_tensor.tensor_type == gguf.GGMLQuantizationType.F32, src_tensor.name
            np.testing.assert_array_equal(got, f32)
    with pytest.raises(ValueError, match="float16"):
        write_gguf(tmp_path / "src.gguf", tmp_path / "f16.gguf", "src.gguf:123", "float16")


def test_f32_gguf_is_written_once_and_again_when_its_source_changes(tmp_path, monkeypatch):
    source = tmp_path / "pkg" / "SmolLM2.gguf"
    source.parent.mkdir()
    _write_source(source, _original_tensors())
    monkeypatch.setattr("kernels.model.convert.smollm2_gguf_path", lambda: source)
    path = ensure_gguf(tmp_path / "cache")
    assert path == tmp_path / "cache" / "models" / llama_gguf.F32_GGUF_NAME
    assert gguf_source(path) == f"SmolLM2.gguf:{source.stat().st_size}"

    def refuse(*_):
        raise AssertionError("converted again although the cached file is current")

    monkeypatch.setattr(llama_gguf, "write_gguf", refuse)
    assert ensure_gguf(tmp_path / "cache") == path
    monkeypatch.undo()
    monkeypatch.setattr("kernels.model.convert.smollm2_gguf_path", lambda: source)
    with open(source, "ab") as handle:  # a different source: the stamp no longer matches
        handle.write(b"\0" * 32)
    assert ensure_gguf(tmp_path / "cache") == path
    assert gguf_source(path) == f"SmolLM2.gguf:{source.stat().st_size}"
    assert sorted(p.name for p in path.parent.iterdir()) == [llama_gguf.F32_GGUF_NAME]  # no tmp file left


def test_prompts_are_exact_token_counts_of_words_and_seeded():
    from kernels.model.loader import resolve_model_dir
    from kernels.model.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(resolve_model_dir("smollm2"))
    spec = BenchSpec(threads=1, prompt_len=20, output_len=4, itl_runs=2, ttft_prompt_len=50, ttft_runs=2,
                     concurrency=2, num_requests=3, seed=7)
    prompts = make_prompts(spec, tokenizer)
    assert (len(prompts.itl), len(prompts.ttft), len(prompts.concurrent)) == (2, 2, 3)
    assert len(set(prompts.all())) == 7  # fresh prompts: no prefix cache helps a cold TTFT
    for text in prompts.all():
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert tuple(ids) == prompts.token_ids[text]
        assert len(ids) == (50 if text in prompts.ttft else 20)
        assert [tokenizer.decode([i]) for i in ids] == [" " + w for w in text.split(" ")[1:]]
    assert make_prompts(spec, tokenizer) == prompts


def test_tandem_workers_share_the_threads_and_the_users_sets_win():
    args = build_parser().parse_args(["bench", "llamacpp", "--threads", "4"])
    config = load_config(tandem_serve_flags(args, args.threads))
    assert (config.prefill.torch_threads, config.decode.torch_threads) == (2, 2)  # 4 cores, 2 workers
    assert config.cluster.lend_idle_cores  # a busy worker borrows the idle one's
    assert config.decode.engine.dtype == "float32"
    args = build_parser().parse_args(["bench", "llamacpp", "--dtype", "bfloat16"])
    config = load_config(tandem_serve_flags(args, args.threads))
    assert config.prefill.engine.dtype == config.decode.engine.dtype == "bfloat16"
    assert config.router.max_queued_requests == 100000  # queues the concurrency run instead of refusing it
    args = build_parser().parse_args(["bench", "llamacpp", "--threads", "2", "--set", "prefill.count=0",
                                      "--set", "decode.count=0", "--set", "colocated.count=1",
                                      "--set", "decode.torch_threads=5"])
    config = load_config(tandem_serve_flags(args, args.threads))
    assert (config.colocated.torch_threads, config.decode.torch_threads) == (2, 5)  # one worker: all of them
    args = build_parser().parse_args(["bench", "llamacpp", "--threads", "1"])
    config = load_config(tandem_serve_flags(args, args.threads))
    assert (config.prefill.torch_threads, config.decode.torch_threads) == (1, 1)  # never fewer than one


def _stream(gaps_ms: list[float], ttft_s: float = 0.1, text: str = "") -> StreamResult:
    return StreamResult(ttft_s, tuple(g / 1e3 for g in gaps_ms), len(gaps_ms) + 1, text)


def test_summary_ratios_against_the_targets():
    spec = BenchSpec(threads=2, itl_runs=2, ttft_runs=3, concurrency=16)
    llamacpp = SystemRun("llama.cpp", (_stream([10, 10, 12], text=" the cat sat"), _stream([10, 30])),
                         tuple(_stream([], ttft_s=t) for t in (1.0, 1.2, 1.1)), 10.0, 1000,
                         ProcessMemory(1, 1000 * 2**20, 900 * 2**20), "llama-server",
                         concurrent=(_stream([100] * 99 + [300], ttft_s=3.0), _stream([100], ttft_s=4.0)),
                         ready_s=(1.2,))
    tandem = SystemRun("tandem", (_stream([10.5, 11, 10.6], text=" the cat ran"), _stream([10.8, 40])),
                       tuple(_stream([], ttft_s=t) for t in (1.2, 1.1, 1.5)), 10.0, 1250,
                       ProcessMemory(9, 3000 * 2**20, None),
                       concurrent=(_stream([50] * 100, ttft_s=2.0), _stream([60], ttft_s=3.0)), ready_s=(11.0, 16.0))
    summary = summarize({"llama.cpp": llamacpp, "tandem": tandem}, spec)

    theirs, ours = summary["systems"]["llama.cpp"], summary["systems"]["tandem"]
    assert theirs["itl_p50_s"] == pytest.approx(0.010) and ours["itl_p50_s"] == pytest.approx(0.0108)
    assert theirs["itl_num_gaps"] == 5 and theirs["itl_output_tokens"] == [4, 3]
    assert (theirs["ttft_best_s"], theirs["ttft_median_s"]) == (1.0, 1.1)
    assert (ours["ttft_best_s"], ours["ttft_median_s"]) == (1.1, 1.2)
    assert ours["concurrent_output_tokens_per_s"] == 125.0 and theirs["concurrent_output_tokens_per_s"] == 100.0
    assert theirs["concurrent_itl_p99_s"] == pytest.approx(0.102, abs=0.002)  # 1 gap of 101 is slow
    assert ours["concurrent_itl_p50_s"] == pytest.approx(0.050) and ours["concurrent_ttft_p50_s"] == 2.5
    assert ours["ready_s"] == 16.0 and ours["ready_all_s"] == [11.0, 16.0]  # the slowest round
    ratios = summary["ratios_tandem_over_llamacpp"]
    assert ratios["itl_p50"]["ratio"] == pytest.approx(1.08) and ratios["itl_p50"]["met"] is True  # <= 1.1x
    assert ratios["ttft_best"]["ratio"] == pytest.approx(1.1) and ratios["ttft_best"]["met"] is True  # <= 1.3x
    assert ratios["ttft_median"]["ratio"] == pytest.approx(1.2 / 1.1) and ratios["ttft_median"]["met"] is True
    tok = ratios["concurrent_output_tokens_per_s"]
    assert tok["ratio"] == 1.25 and tok["target_min"] == 1.2 and tok["met"] is True  # >= 1.2x
    assert ratios["concurrent_itl_p99"]["target_max"] == 0.5 and ratios["concurrent_itl_p99"]["met"] is True
    assert ratios["ready"]["tandem_met"] is False  # 16 s > 15 s
    assert ratios["rss"]["ratio"] == 3.0 and ratios["rss"]["met"] is None
    assert summary["greedy_first_stream"] == {"common_prefix_chars": 9, "tandem_chars": 12, "llamacpp_chars": 12}
    assert summary["peer"] == "llama-server" and ours["memory"]["num_processes"] == 9
    table = format_table(summary)
    assert "single stream ITL p50 (ms)" in table and "1.08x" in table and ">=1.2x ok" in table
    assert "concurrency 16 ITL p99 (ms)" in table and "tandem <=15s MISS" in table
    assert "server RSS, all processes (MiB)" in table and "3.00x" in table
    assert "tandem memory after the runs: RSS 3000 MiB, PSS n/a MiB, summed over 9 processes" in table
    assert "llama.cpp memory after the runs: RSS 1000 MiB, PSS 900 MiB, summed over 1 processes" in table
    lines = round_lines({"llama.cpp": [system_figures(llamacpp)], "tandem": [system_figures(tandem)]})
    assert any(line.startswith("  concurrency output tok/s") and line.endswith("100.0 | 125.0") for line in lines)
    slow = dataclasses.replace(tandem, concurrent=(_stream([500] * 100),), concurrent_output_tokens=900)
    ratios = summarize({"llama.cpp": llamacpp, "tandem": slow}, spec)["ratios_tandem_over_llamacpp"]
    assert ratios["concurrent_output_tokens_per_s"]["met"] is False and ratios["concurrent_itl_p99"]["met"] is False


def test_summary_holds_both_texts_against_hf_greedy_text():
    spec = BenchSpec(threads=2, itl_runs=1, ttft_runs=1, dtype="bfloat16")
    llamacpp = SystemRun("llama.cpp", (_stream([10, 10], text=" the cat sat down"),), (_stream([], ttft_s=1.0),),
                         10.0, 100, None, "llama-server", ready_s=(1.0,))
    tandem = SystemRun("tandem", (_stream([10, 10], text=" the cat ran off"),), (_stream([], ttft_s=1.0),), 10.0,
                       100, None, ready_s=(1.0,))
    summary = summarize({"llama.cpp": llamacpp, "tandem": tandem}, spec, hf_text=" the cat ran away")
    assert summary["greedy_first_stream"] == {"common_prefix_chars": 9, "tandem_chars": 16, "llamacpp_chars": 17,
                                              "hf_chars": 17, "tandem_hf_common_prefix_chars": 13,
                                              "llamacpp_hf_common_prefix_chars": 9}
    assert ("against HF transformers' greedy text (bfloat16, 17 chars): tandem's first 13 chars identical, "
            "llama.cpp's first 9") in format_table(summary)


def test_missing_llama_cpp_python_says_how_to_install_it(monkeypatch, capsys):
    import importlib.util

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "llama_cpp" else real_find_spec(name, *a))
    assert main(["bench", "llamacpp", "--peer", "llama-cpp-python"]) == 2
    err = capsys.readouterr().err
    assert "cannot import llama_cpp" in err and "pip install 'llama-cpp-python[server]'" in err


def _executable(path, text: str = "#!/bin/sh\nexit 0\n"):
    path.write_text(text)
    path.chmod(0o755)
    return path


def test_llama_server_is_found_by_the_flag_then_the_environment_then_path(tmp_path, monkeypatch):
    on_path, in_env, flagged = (_executable(tmp_path / d / "llama-server") for d in ("bin", "env", "flag")
                                if (tmp_path / d).mkdir() is None)
    monkeypatch.setenv("PATH", str(on_path.parent))
    monkeypatch.delenv(LLAMA_SERVER_ENV, raising=False)
    assert find_llama_server(None) == on_path
    monkeypatch.setenv(LLAMA_SERVER_ENV, str(in_env))
    assert find_llama_server(None) == in_env
    assert find_llama_server(str(flagged)) == flagged
    with pytest.raises(FileNotFoundError, match="--llama-server .*: not an executable file"):
        find_llama_server(str(tmp_path / "absent"))
    monkeypatch.setenv(LLAMA_SERVER_ENV, str(tmp_path / "bin"))  # a directory
    with pytest.raises(FileNotFoundError, match=f"\\${LLAMA_SERVER_ENV} .*: not an executable file"):
        find_llama_server(None)


def test_missing_llama_server_names_the_three_ways_to_give_it(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv(LLAMA_SERVER_ENV, raising=False)
    assert main(["bench", "llamacpp"]) == 2
    err = capsys.readouterr().err
    assert "--llama-server PATH" in err and f"${LLAMA_SERVER_ENV}" in err and "llama-server on PATH" in err
    assert "--peer llama-cpp-python" in err


def test_every_peer_can_be_named_and_llama_server_is_the_default():
    parser = build_parser()
    assert parser.parse_args(["bench", "llamacpp"]).peer == "llama-server"
    assert [parser.parse_args(["bench", "llamacpp", "--peer", name]).peer for name in PEERS] == list(PEERS)
    with pytest.raises(SystemExit):
        parser.parse_args(["bench", "llamacpp", "--peer", "vllm"])


def test_llama_server_gets_the_fair_cpu_command_line(tmp_path):
    """A stand-in binary writes its argv and exits: what the bench would run, flag by flag."""
    argv_file = tmp_path / "argv.json"
    fake = _executable(tmp_path / "llama-server",
                       f"#!{sys.executable}\nimport json, sys\n"
                       f"json.dump(sys.argv[1:], open({str(argv_file)!r}, 'w'))\n")
    args = build_parser().parse_args(["bench", "llamacpp", "--llama-server", str(fake), "--llamacpp-arg=-fa"])
    peer = PEERS[args.peer].from_args(args)
    assert isinstance(peer, LlamaServerPeer) and peer.extra_body["ignore_eos"] is True
    server = peer.start(tmp_path / "model.gguf", threads=2, num_slots=16, tokens_per_sequence=1034)
    assert server.proc.wait(60) == 0 and server.stop() == 0
    argv = json.loads(argv_file.read_text())
    port = server.url.rsplit(":", 1)[1]
    assert argv == ["-m", str(tmp_path / "model.gguf"), "--host", "127.0.0.1", "--port", port, "-t", "2", "-tb", "2",
                    "-np", "16", "-c", "16544", "--kv-unified", "-ctk", "f32", "-ctv", "f32", "--no-webui", "-fa"]


def test_repeated_rounds_alternate_which_server_goes_first_and_pool_every_sample(monkeypatch, tmp_path):
    order = []

    def fake_run(name: str, gap_ms: float, tokens: int):
        def run(*args):
            order.append(name)
            streams = (_stream([gap_ms + len(order)], text=" same text"),)
            return SystemRun(name, streams, (_stream([], ttft_s=len(order)),), 2.0, tokens)
        return run

    monkeypatch.setattr(bench, "make_peer", lambda args: SimpleNamespace(name="llama-server"))
    monkeypatch.setattr(bench, "ensure_gguf", lambda dtype: tmp_path / "model.gguf")
    monkeypatch.setattr("kernels.model.loader.resolve_model_dir", lambda model: tmp_path)
    monkeypatch.setattr("kernels.model.tokenizer.load_tokenizer", lambda path: None)
    monkeypatch.setattr(bench, "make_prompts", lambda spec, tokenizer: SimpleNamespace(itl=("a b",),
                                                                                     token_ids={"a b": (7, 8)}))
    monkeypatch.setattr(bench, "run_peer", lambda peer, *args: fake_run("llama.cpp", 10, 100)(*args))
    monkeypatch.setattr(bench, "run_tandem", fake_run("tandem", 20, 300))
    hf_asked = []
    monkeypatch.setattr(bench, "hf_greedy_text", lambda *a: hf_asked.append(a) or " same thing")
    out = tmp_path / "summary.json"
    assert main(["bench", "llamacpp", "--repeats", "3", "--json", str(out)]) == 0
    assert hf_asked == [(tmp_path, (7, 8), 128, "float32")]  # the first stream's prompt, once

    assert order == ["llama.cpp", "tandem", "tandem", "llama.cpp", "llama.cpp", "tandem"]
    summary = json.loads(out.read_text())
    theirs, ours = summary["systems"]["llama.cpp"], summary["systems"]["tandem"]
    # gaps of every round pooled: llama.cpp ran as calls 1, 4, 5 -> 11, 14, 15 ms; tandem 2, 3, 6 -> 22, 23, 26
    assert theirs["itl_num_gaps"] == ours["itl_num_gaps"] == 3
    assert theirs["itl_p50_s"] == pytest.approx(0.014) and ours["itl_p50_s"] == pytest.approx(0.023)
    assert theirs["ttft_all_s"] == [1, 4, 5] and ours["ttft_best_s"] == 2
    assert theirs["concurrent_output_tokens_per_s"] == pytest.approx(300 / 6.0)  # total tokens / total seconds
    assert ours["concurrent_output_tokens_per_s"] == pytest.approx(900 / 6.0)
    assert summary["rounds"] == 3
    assert [f["itl_p50_s"] for f in summary["per_round"]["tandem"]] == pytest.approx([0.022, 0.023, 0.026])
    assert summary["greedy_first_stream"]["tandem_hf_common_prefix_chars"] == 7  # " same t"


def test_repeats_below_one_are_refused(monkeypatch, capsys):
    monkeypatch.setattr(bench, "make_peer", lambda args: SimpleNamespace(name="llama-server"))
    assert main(["bench", "llamacpp", "--repeats", "0"]) == 2
    assert "--repeats must be >= 1, got 0" in capsys.readouterr().err


def test_memory_is_summed_over_a_process_tree_and_the_ray_session_the_log_names():
    # a parent in its own session with a child; a second session stands for tandem's Ray instance
    code = ("import subprocess, sys, time; "
            "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); time.sleep(60)")
    parent = subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
    ray_like = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        while len(process_tree(parent.pid)) < 2:
            assert time.monotonic() < deadline, "the child did not start"
            time.sleep(0.05)
        tree = process_tree(parent.pid)
        assert parent.pid in tree and len(tree) == 2 and os.getpid() not in tree
        memory = memory_of(tree)
        assert memory.num_processes == 2 and memory.rss_bytes > 2 * 2**20
        assert memory.pss_bytes is None or 0 < memory.pss_bytes <= memory.rss_bytes
        log = (f"INFO started a local Ray instance at 127.0.0.1:1 (2 CPUs; loopback only, token auth; "
               f"OS session {ray_like.pid})")
        assert tandem_serve_processes(parent.pid, log) == tree | {ray_like.pid}
        assert tandem_serve_processes(parent.pid, "no Ray here") == tree
    finally:
        for proc in (parent, ray_like):
            os.killpg(proc.pid, 9)
            proc.wait(30)
    assert memory_of({parent.pid}) == ProcessMemory(0, 0, 0), "an exited process counts as nothing"


def test_a_peer_killed_by_an_illegal_instruction_is_told_to_rebuild(tmp_path):
    """A prebuilt llama-server made for a CPU with more instructions dies of SIGILL at start: the
    bench's error says that, not just 'exited with -4'."""
    fake = _executable(tmp_path / "llama-server", "#!/bin/sh\nkill -ILL $$\n")
    args = build_parser().parse_args(["bench", "llamacpp", "--llama-server", str(fake)])
    peer = PEERS[args.peer].from_args(args)
    server = peer.start(tmp_path / "model.gguf", threads=2, num_slots=16, tokens_per_sequence=1034)
    with pytest.raises(RuntimeError, match="exited with -4 \\(SIGILL: an instruction this CPU lacks.*rebuild"):
        wait_peer_ready(peer, server, timeout_s=60)
    server.stop()
