"""`tandem bench llamacpp`: `tandem serve` against llama.cpp's OpenAI server on the same fp32 weights.

llama.cpp runs as llama-cpp-python's server (`python -m llama_cpp.server`), a bench-only tool that is
not a tandem dependency (README: how to install it). The two servers run one after the other, never
both loaded at once (`--repeats N`: N rounds, in the order llama.cpp-tandem, then tandem-llama.cpp, ...,
every figure taken over all rounds' samples together, since a shared host's speed can drift by 2x
within an hour), on the same thread count (`--threads`: llama.cpp's `n_threads` and
`n_threads_batch`, every tandem worker's `torch_threads`), and get the same requests over
`/v1/completions`, greedy:

    single stream   `--itl-runs` streams of `--prompt-len` -> `--output-len` tokens, one at a time:
                    inter-token latency = gaps between streamed text frames (p50 over all gaps)
    cold TTFT       `--ttft-runs` fresh `--ttft-prompt-len`-token prompts (no prefix cache can help),
                    one at a time: best and median time to the first text frame
    concurrency C   `--num-requests` streams, `--concurrency` closed-loop clients: output tok/s

Prompts are text made of seeded random words, each word one token of the model's vocabulary that
encodes back to itself, so a prompt of N words is exactly N tokens; the bench checks that tandem's
tokenizer and llama.cpp's (`/extras/tokenize`) both produce the same ids for every prompt.
tandem ignores EOS (exact lengths); llama.cpp's server cannot without a Python logits processor
on every token, so its streams may end early and count what arrived.

The weights: the bundled SmolLM2 GGUF is quantized (Q4_1, Q8_0 embeddings). tandem loads it
dequantized to float32; llama.cpp gets the same values as an f32 GGUF, each tensor dequantized with
gguf's reference dequantizer and the metadata copied, written once into
`cache_root/models/smollm2-135m-instruct-f32.gguf` (stamped with its source, rebuilt when stale).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import importlib.util
import json
import logging
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from cluster.bench.serve import (QUEUE_ALL_SETS, STOP_TIMEOUT_S, SpawnedServer, load_config, sse_frames,
                                 wait_ready)

log = logging.getLogger("tandem.bench")

F32_GGUF_NAME = "smollm2-135m-instruct-f32.gguf"
SOURCE_KEY = "tandem.f32_source"  # "<source file name>:<bytes>": which GGUF this file was made from
SERVER_MODULES = ("llama_cpp", "sse_starlette", "starlette_context", "pydantic_settings")
INSTALL_HINT = (
    "llama-cpp-python with its server extra is not installed in this environment; it is a bench-only tool, "
    "not a tandem dependency. Install it once (it builds llama.cpp from source, about 15 minutes on 2 cores):\n"
    "    CMAKE_ARGS=\"-DGGML_NATIVE=ON\" .venv/bin/pip install 'llama-cpp-python[server]'")
ITL_TARGET = 1.5  # tandem's single-stream ITL p50 <= this x llama.cpp's
TTFT_TARGET = 2.0  # tandem's cold TTFT <= this x llama.cpp's
SYSTEMS = ("llama.cpp", "tandem")


@dataclass(frozen=True)
class BenchSpec:
    threads: int  # llama.cpp n_threads / n_threads_batch, and every tandem worker's torch_threads
    prompt_len: int = 128  # tokens per prompt of the single-stream and concurrency runs
    output_len: int = 128  # tokens asked for per request of those runs
    itl_runs: int = 3
    ttft_prompt_len: int = 1032
    ttft_runs: int = 3
    concurrency: int = 16
    num_requests: int = 32  # of the concurrency run
    seed: int = 0

    def __post_init__(self):
        for name in ("threads", "prompt_len", "output_len", "itl_runs", "ttft_prompt_len", "ttft_runs",
                     "concurrency", "num_requests"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")

    @property
    def context_len(self) -> int:
        """Tokens one llama.cpp sequence must hold: the longest prompt plus what follows it."""
        return max(self.prompt_len + self.output_len, self.ttft_prompt_len + 2)


@dataclass(frozen=True)
class Prompts:
    """Every prompt of the run as text, with the token ids tandem's tokenizer gives it."""

    itl: tuple[str, ...]
    ttft: tuple[str, ...]
    concurrent: tuple[str, ...]
    token_ids: dict[str, tuple[int, ...]]

    def all(self) -> tuple[str, ...]:
        return (*self.itl, *self.ttft, *self.concurrent)


@dataclass(frozen=True)
class StreamResult:
    ttft_s: float  # to the first non-empty text frame
    frame_gaps_s: tuple[float, ...]  # between consecutive non-empty text frames
    output_tokens: int  # the usage block's count where the server sends one, else the text frames
    text: str


@dataclass(frozen=True)
class SystemRun:
    system: str
    itl: tuple[StreamResult, ...]
    ttft: tuple[StreamResult, ...]
    concurrent_elapsed_s: float
    concurrent_output_tokens: int


def merge_runs(runs: list[SystemRun]) -> SystemRun:
    """One system's rounds as one run: every stream of every round, the concurrency runs' tokens and
    seconds summed (so its tok/s is total tokens / total time, not a mean of rates)."""
    return SystemRun(runs[0].system, tuple(r for run in runs for r in run.itl), tuple(r for run in runs for r in run.ttft),
                     sum(run.concurrent_elapsed_s for run in runs), sum(run.concurrent_output_tokens for run in runs))


def round_order(round_index: int) -> tuple[str, str]:
    """Which server runs first in a round: llama.cpp, tandem, then tandem, llama.cpp, and so on (ABBA),
    so a machine that drifts slower or faster over the run hits both alike."""
    return SYSTEMS if round_index % 2 == 0 else SYSTEMS[::-1]


# ---- the f32 GGUF --------------------------------------------------------------------------------
def write_f32_gguf(source: Path, out_path: Path, source_tag: str) -> None:
    """`source` with every tensor dequantized to float32 (gguf's reference dequantizer, the values
    tandem loads) and all its metadata, `general.file_type` = ALL_F32 and `SOURCE_KEY` = `source_tag`."""
    import gguf

    reader = gguf.GGUFReader(source)
    writer = gguf.GGUFWriter(out_path, reader.fields["general.architecture"].contents())
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key in ("general.architecture", "general.file_type"):
            continue  # the header's own fields, the one the writer adds, the one that changes
        is_array = field.types[0] == gguf.GGUFValueType.ARRAY
        writer.add_key_value(key, field.contents(), field.types[0], field.types[-1] if is_array else None)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_string(SOURCE_KEY, source_tag)
    for tensor in reader.tensors:  # numpy shape = ggml's ne reversed, so the writer restores ne
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        writer.add_tensor(tensor.name, np.ascontiguousarray(values, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def f32_gguf_source(path: Path) -> str | None:
    """The `SOURCE_KEY` stamp of an f32 GGUF; None when the file is absent, unreadable or unstamped."""
    import gguf

    try:
        field = gguf.GGUFReader(path).fields.get(SOURCE_KEY)
    except (OSError, ValueError):
        return None
    return None if field is None else field.contents()


def ensure_f32_gguf(cache_root: Path | None = None) -> Path:
    """The f32 GGUF of the bundled SmolLM2, converted once (a tmp file renamed into place)."""
    from kernels.model.convert import default_cache_root, smollm2_gguf_path

    source = smollm2_gguf_path()
    tag = f"{source.name}:{source.stat().st_size}"
    final = (cache_root or default_cache_root()) / "models" / F32_GGUF_NAME
    if f32_gguf_source(final) == tag:
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    log.info("writing the f32 GGUF for llama.cpp (once): %s -> %s", source.name, final)
    fd, tmp = tempfile.mkstemp(prefix=f".{F32_GGUF_NAME}.tmp-", dir=final.parent)
    os.close(fd)
    try:
        write_f32_gguf(source, Path(tmp), tag)
        os.chmod(tmp, 0o644)
        os.replace(tmp, final)  # atomic: a concurrent reader sees the old file or the whole new one
    finally:
        Path(tmp).unlink(missing_ok=True)
    return final


# ---- prompts -------------------------------------------------------------------------------------
def word_pool(tokenizer) -> list[str]:
    """Vocabulary entries " word" (ASCII letters) that encode back to their own single id, sorted."""
    candidates = []
    for token_id in range(len(tokenizer)):
        text = tokenizer.decode([token_id])
        if len(text) >= 3 and text[0] == " " and text[1:].isascii() and text[1:].isalpha():
            candidates.append((token_id, text))
    encoded = tokenizer([text for _, text in candidates], add_special_tokens=False)["input_ids"]
    return sorted(text for (token_id, text), ids in zip(candidates, encoded) if ids == [token_id])


def make_prompts(spec: BenchSpec, tokenizer) -> Prompts:
    """Seeded random-word prompts; asserts each encodes to exactly its intended token count."""
    pool = np.array(word_pool(tokenizer))
    rng = np.random.default_rng(spec.seed)

    def draw(num_prompts: int, num_words: int) -> tuple[str, ...]:
        return tuple("".join(pool[rng.integers(len(pool), size=num_words)]) for _ in range(num_prompts))

    itl, ttft = draw(spec.itl_runs, spec.prompt_len), draw(spec.ttft_runs, spec.ttft_prompt_len)
    concurrent = draw(spec.num_requests, spec.prompt_len)
    token_ids = {}
    for text in (*itl, *ttft, *concurrent):
        token_ids[text] = tuple(tokenizer(text, add_special_tokens=False)["input_ids"])
        assert len(token_ids[text]) == text.count(" "), "a prompt word split into several tokens: pool filter broken?"
    return Prompts(itl, ttft, concurrent, token_ids)


# ---- the servers ---------------------------------------------------------------------------------
def missing_server_modules() -> list[str]:
    """Modules `python -m llama_cpp.server` needs that this interpreter cannot import."""
    return [name for name in SERVER_MODULES if importlib.util.find_spec(name) is None]


class LlamaCppServer(SpawnedServer):
    """llama-cpp-python's OpenAI server as a child process on a free port, its output in a temp log."""

    def __init__(self, gguf_path: Path, spec: BenchSpec, extra_args: list[str]):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        log_fd, self.log_path = tempfile.mkstemp(prefix="llamacpp-server-", suffix=".log")
        # logits_all False: the server's default (True) computes the LM head over every prompt token
        # interrupt_requests False: its default cuts a running stream short when another request arrives
        cmd = [sys.executable, "-m", "llama_cpp.server", "--model", str(gguf_path), "--host", "127.0.0.1",
               "--port", str(port), "--n_threads", str(spec.threads), "--n_threads_batch", str(spec.threads),
               "--n_ctx", str(max(2048, spec.context_len)), "--logits_all", "false",
               "--interrupt_requests", "false", "--verbose", "false", *extra_args]
        self.proc = subprocess.Popen(cmd, stdout=log_fd, stderr=subprocess.STDOUT, start_new_session=True,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1"})
        os.close(log_fd)
        log.info("started llama.cpp server (pid %d) on port %d; its log: %s", self.proc.pid, port, self.log_path)

    def stop(self) -> int:
        """SIGTERM (SIGKILL to the group on timeout). uvicorn re-raises SIGTERM after a clean shutdown,
        so death by SIGTERM counts as a clean exit (0), as does 0; the log is kept otherwise."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(30)
        if self.proc.returncode in (0, -signal.SIGTERM):
            os.unlink(self.log_path)
            return 0
        print(f"llama.cpp server exited with code {self.proc.returncode}; its log ends:\n{self.log_tail()}",
              file=sys.stderr)
        return self.proc.returncode


def wait_llamacpp_ready(server: LlamaCppServer, timeout_s: float) -> None:
    """Until `/v1/models` answers (the server loads the model before it listens)."""
    wait_ready(server, {}, timeout_s, path="/v1/models", name="llama.cpp server")


def tandem_serve_flags(args: argparse.Namespace, threads: int) -> list[str]:
    """The default `tandem serve` that queues what it is sent, every worker on `threads` torch threads."""
    sets = [*QUEUE_ALL_SETS, *(f"{group}.torch_threads={threads}" for group in ("prefill", "decode", "colocated")),
            *args.set]
    return [*(["--config", args.config] if args.config else []), *(f for s in sets for f in ("--set", s))]


# ---- measuring -----------------------------------------------------------------------------------
async def stream_completion(client, prompt: str, max_tokens: int, extra_body: dict) -> StreamResult:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True, **extra_body}
    frame_times_s, texts, usage_tokens = [], [], None
    start_s = time.perf_counter()
    async with client.stream("POST", "/v1/completions", json=body) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"/v1/completions answered {resp.status_code}: {(await resp.aread())[:500]!r}")
        async for frame in sse_frames(resp):
            if frame.get("usage"):
                usage_tokens = frame["usage"]["completion_tokens"]
            text = "".join(choice.get("text") or "" for choice in frame.get("choices", ()))
            if text:
                frame_times_s.append(time.perf_counter())
                texts.append(text)
    end_s = time.perf_counter()
    first_s = frame_times_s[0] if frame_times_s else end_s
    return StreamResult(first_s - start_s, tuple(np.diff(frame_times_s).tolist()),
                        len(frame_times_s) if usage_tokens is None else usage_tokens, "".join(texts))


async def measure(url: str, headers: dict, prompts: Prompts, spec: BenchSpec, extra_body: dict) -> SystemRun:
    """Warm-up, single streams, cold TTFTs, then the closed-loop concurrency run, against one server."""
    import httpx

    limits = httpx.Limits(max_connections=spec.concurrency, max_keepalive_connections=spec.concurrency)
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=httpx.Timeout(None), limits=limits) as client:
        await stream_completion(client, " hello world", 4, extra_body)  # first-call costs
        itl = [await stream_completion(client, p, spec.output_len, extra_body) for p in prompts.itl]
        ttft = [await stream_completion(client, p, 2, extra_body) for p in prompts.ttft]
        pending = iter(prompts.concurrent)  # shared by the clients; one loop thread, so no lock
        results: list[StreamResult] = []

        async def client_loop() -> None:
            for prompt in pending:
                results.append(await stream_completion(client, prompt, spec.output_len, extra_body))

        start_s = time.perf_counter()
        await asyncio.gather(*(client_loop() for _ in range(spec.concurrency)))
        elapsed_s = time.perf_counter() - start_s
    return SystemRun("", tuple(itl), tuple(ttft), elapsed_s, sum(r.output_tokens for r in results))


def check_llamacpp_tokens(url: str, prompts: Prompts) -> None:
    """llama.cpp must see the very token ids tandem's tokenizer gives each prompt."""
    import httpx

    for text in prompts.all():
        got = httpx.post(f"{url}/extras/tokenize", json={"input": text}, timeout=60).json()["tokens"]
        if tuple(got) != prompts.token_ids[text]:
            raise RuntimeError(f"llama.cpp tokenizes a prompt differently ({len(got)} ids vs "
                               f"{len(prompts.token_ids[text])}): not the same tokenizer?")


def run_llamacpp(gguf_path: Path, prompts: Prompts, spec: BenchSpec, args: argparse.Namespace) -> SystemRun:
    server = LlamaCppServer(gguf_path, spec, args.llamacpp_arg)
    try:
        wait_llamacpp_ready(server, args.ready_timeout_s)
        check_llamacpp_tokens(server.url, prompts)
        run = asyncio.run(measure(server.url, {}, prompts, spec, {"repeat_penalty": 1.0}))
    finally:
        server.stop()
    return dataclasses.replace(run, system="llama.cpp")


def run_tandem(prompts: Prompts, spec: BenchSpec, args: argparse.Namespace) -> SystemRun:
    key = os.environ.get("TANDEM_API_KEY")
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    server = SpawnedServer(tandem_serve_flags(args, spec.threads))
    try:
        wait_ready(server, headers, args.ready_timeout_s)
        run = asyncio.run(measure(server.url, headers, prompts, spec, {"ignore_eos": True,
                                                                       "stream_options": {"include_usage": True}}))
    finally:
        exit_code = server.stop()
    if exit_code != 0:
        raise RuntimeError(f"tandem serve exited with code {exit_code}")
    return dataclasses.replace(run, system="tandem")


# ---- the summary ---------------------------------------------------------------------------------
def system_figures(run: SystemRun) -> dict:
    gaps_s = [g for r in run.itl for g in r.frame_gaps_s]
    ttfts_s = [r.ttft_s for r in run.ttft]
    return {"itl_p50_s": float(np.percentile(gaps_s, 50)) if gaps_s else None,
            "itl_mean_s": statistics.fmean(gaps_s) if gaps_s else None,
            "itl_num_gaps": len(gaps_s), "itl_output_tokens": [r.output_tokens for r in run.itl],
            "ttft_best_s": min(ttfts_s), "ttft_median_s": statistics.median(ttfts_s), "ttft_all_s": ttfts_s,
            "concurrent_output_tokens": run.concurrent_output_tokens,
            "concurrent_elapsed_s": run.concurrent_elapsed_s,
            "concurrent_output_tokens_per_s": run.concurrent_output_tokens / run.concurrent_elapsed_s}


def ratio(tandem: float | None, llamacpp: float | None) -> float | None:
    return None if tandem is None or not llamacpp else tandem / llamacpp


def common_prefix_len(a: str, b: str) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def summarize(runs: dict[str, SystemRun], spec: BenchSpec) -> dict:
    """Figures per system, tandem / llama.cpp ratios with the targets, and the greedy texts' agreement."""
    figures = {name: system_figures(run) for name, run in runs.items()}
    ours, theirs = figures["tandem"], figures["llama.cpp"]
    ratios = {
        "itl_p50": {"ratio": ratio(ours["itl_p50_s"], theirs["itl_p50_s"]), "target_max": ITL_TARGET},
        "ttft_best": {"ratio": ratio(ours["ttft_best_s"], theirs["ttft_best_s"]), "target_max": TTFT_TARGET},
        "ttft_median": {"ratio": ratio(ours["ttft_median_s"], theirs["ttft_median_s"]), "target_max": TTFT_TARGET},
        "concurrent_output_tokens_per_s": {"ratio": ratio(ours["concurrent_output_tokens_per_s"],
                                                          theirs["concurrent_output_tokens_per_s"]),
                                           "target_max": None},
    }
    for entry in ratios.values():
        limit = entry["target_max"]
        entry["met"] = None if limit is None or entry["ratio"] is None else entry["ratio"] <= limit
    text_ours, text_theirs = runs["tandem"].itl[0].text, runs["llama.cpp"].itl[0].text
    return {"spec": dataclasses.asdict(spec), "systems": figures, "ratios_tandem_over_llamacpp": ratios,
            "greedy_first_stream": {"common_prefix_chars": common_prefix_len(text_ours, text_theirs),
                                    "tandem_chars": len(text_ours), "llamacpp_chars": len(text_theirs)}}


def _fmt(value: float | None, scale: float = 1.0, digits: int = 1) -> str:
    return "n/a" if value is None else f"{value * scale:.{digits}f}"


def format_table(summary: dict) -> str:
    spec, sys_, rat = summary["spec"], summary["systems"], summary["ratios_tandem_over_llamacpp"]
    rows = [("single stream ITL p50 (ms)", "itl_p50_s", 1e3, "itl_p50"),
            (f"cold TTFT {spec['ttft_prompt_len']} tok, best (ms)", "ttft_best_s", 1e3, "ttft_best"),
            (f"cold TTFT {spec['ttft_prompt_len']} tok, median (ms)", "ttft_median_s", 1e3, "ttft_median"),
            (f"concurrency {spec['concurrency']} output tok/s", "concurrent_output_tokens_per_s", 1.0,
             "concurrent_output_tokens_per_s")]
    lines = [f"{'threads ' + str(spec['threads']):<36}{'llama.cpp':>11}{'tandem':>10}{'ratio':>9}{'target':>10}"]
    for label, key, scale, ratio_key in rows:
        entry = rat[ratio_key]
        target = "" if entry["target_max"] is None else f"<={entry['target_max']}x " + ("ok" if entry["met"] else "MISS")
        lines.append(f"{label:<36}{_fmt(sys_['llama.cpp'][key], scale):>11}{_fmt(sys_['tandem'][key], scale):>10}"
                     f"{_fmt(entry['ratio'], digits=2) + 'x':>9}  {target}")
    greedy = summary["greedy_first_stream"]
    lines.append(f"greedy text of the first stream: first {greedy['common_prefix_chars']} chars identical "
                 f"(tandem {greedy['tandem_chars']}, llama.cpp {greedy['llamacpp_chars']} chars)")
    tokens = {name: sys_[name]["itl_output_tokens"] for name in SYSTEMS}
    lines.append(f"single-stream output tokens per run (asked {spec['output_len']}): {tokens}")
    return "\n".join(lines)


def bench_llamacpp(args: argparse.Namespace) -> int:
    missing = missing_server_modules()
    if missing:
        print(f"tandem bench llamacpp: cannot import {', '.join(missing)}.\n{INSTALL_HINT}", file=sys.stderr)
        return 2
    from kernels.model.loader import resolve_model_dir
    from kernels.model.tokenizer import load_tokenizer

    logging.getLogger("httpx").setLevel(logging.WARNING)
    if args.repeats < 1:
        raise ValueError(f"--repeats must be >= 1, got {args.repeats}")
    spec = BenchSpec(args.threads, args.prompt_len, args.output_len, args.itl_runs, args.ttft_prompt_len,
                     args.ttft_runs, args.concurrency, args.num_requests, args.seed)
    model = load_config(tandem_serve_flags(args, spec.threads)).model
    if model != "smollm2" and args.gguf is None:
        raise ValueError(f"tandem serves {model!r}: pass --gguf with the same weights in f32 for llama.cpp")
    gguf_path = Path(args.gguf) if args.gguf else ensure_f32_gguf()
    prompts = make_prompts(spec, load_tokenizer(resolve_model_dir(model)))
    log.info("llama.cpp (%s) and tandem serve, one after the other, %d round(s); %d threads each", gguf_path.name,
             args.repeats, spec.threads)
    rounds: dict[str, list[SystemRun]] = {name: [] for name in SYSTEMS}
    for i in range(args.repeats):
        for name in round_order(i):
            run = run_llamacpp(gguf_path, prompts, spec, args) if name == "llama.cpp" else run_tandem(prompts, spec, args)
            rounds[name].append(run)
    summary = summarize({name: merge_runs(runs) for name, runs in rounds.items()}, spec)
    summary["rounds"] = args.repeats
    print(format_table(summary))
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2))
    return 0
