"""`tandem bench llamacpp`: `tandem serve` against llama.cpp's OpenAI server on the same fp32 weights.

The peer is llama.cpp's C++ `llama-server` (`--peer llama-server`, the default: parallel slots with
continuous batching, what a CPU user would run), or llama-cpp-python's Python server only when asked
(`--peer llama-cpp-python`); llamacpp_peers.py finds and starts them. Neither is a tandem dependency.
The two servers run one after the other, never both loaded at once (`--repeats N`: N rounds, in the
order llama.cpp-tandem, then tandem-llama.cpp, ..., every figure taken over all rounds' samples
together, since a shared host's speed can drift a lot within an hour), on the same thread count
(`--threads`: llama.cpp's `-t`/`-tb`; tandem's workers share as many, `tandem_serve_flags`), and get the same
requests over `/v1/completions`, greedy, through the load harness's transport (a pooled connection
the server closed is retried on a fresh one: load/transport.py):

    single stream   `--itl-runs` streams of `--prompt-len` -> `--output-len` tokens, one at a time:
                    inter-token latency = gaps between streamed text frames (p50 over all gaps)
    cold TTFT       `--ttft-runs` fresh `--ttft-prompt-len`-token prompts (no prefix cache can help),
                    one at a time: best and median time to the first text frame
    concurrency C   `--num-requests` streams, `--concurrency` closed-loop clients: output tok/s
    memory          after those runs, RSS and PSS summed over every process of each server (tandem:
                    its gateway, workers and Ray; proc_memory.py)
    greedy text     after every round, HF transformers' greedy text of the first single-stream prompt in
                    the bench's dtype (`hf_greedy_text`): how far each server's first text agrees with it

Prompts are text made of seeded random words, each word one token of the model's vocabulary that
encodes back to itself, so a prompt of N words is exactly N tokens; the bench checks that tandem's
tokenizer and llama.cpp's (its tokenize endpoint) both produce the same ids for every prompt. Both
servers get `ignore_eos` and stream exact lengths; llama-cpp-python's server cannot ignore EOS
without a Python logits processor on every token, so its streams may end early and count what arrived.

The weights: the bundled SmolLM2 GGUF is quantized (Q4_1, Q8_0 embeddings). tandem loads it
dequantized to float32 (`--dtype bfloat16`: cast to bf16); llama.cpp gets the same values as an f32
(bf16: matrices bf16, norms f32) GGUF, each tensor dequantized with
gguf's reference dequantizer and the metadata copied, written once into
`cache_root/models/smollm2-135m-instruct-{f32,bf16}.gguf` (stamped with its source, rebuilt when stale).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from cluster.bench.llamacpp_gguf import ensure_gguf
from cluster.bench.llamacpp_peers import PeerUnavailable, make_peer, wait_peer_ready
from cluster.bench.llamacpp_report import SYSTEMS, format_table, round_lines, summarize, system_figures
from cluster.bench.llamacpp_runs import BenchSpec, StreamResult, SystemRun, merge_runs
from cluster.bench.load.transport import make_transport
from cluster.bench.proc_memory import memory_of, process_tree, tandem_serve_processes
from cluster.bench.serve import QUEUE_ALL_SETS, SpawnedServer, load_config, wait_ready, wait_warm

log = logging.getLogger("tandem.bench")


@dataclass(frozen=True)
class Prompts:
    """Every prompt of the run as text, with the token ids tandem's tokenizer gives it."""

    itl: tuple[str, ...]
    ttft: tuple[str, ...]
    concurrent: tuple[str, ...]
    token_ids: dict[str, tuple[int, ...]]

    def all(self) -> tuple[str, ...]:
        return (*self.itl, *self.ttft, *self.concurrent)


def round_order(round_index: int) -> tuple[str, str]:
    """Which server runs first in a round: llama.cpp, tandem, then tandem, llama.cpp, and so on (ABBA),
    so a machine that drifts slower or faster over the run hits both alike."""
    return SYSTEMS if round_index % 2 == 0 else SYSTEMS[::-1]


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
def tandem_serve_flags(args: argparse.Namespace, threads: int) -> list[str]:
    """The default `tandem serve` that queues what it is sent, its workers on `threads` cores in all,
    like llama.cpp: each of its W workers gets `threads // W` torch threads (at least 1), and a busy
    worker borrows the idle ones' (`cluster.lend_idle_cores`). Giving every worker all `threads`
    would oversubscribe the cores whenever two compute at once."""
    given = [*(["--config", args.config] if args.config else []), *(f for s in args.set for f in ("--set", s))]
    config = load_config(given)
    groups = [g for g in ("prefill", "decode", "colocated") if getattr(config, g).count]
    share = max(1, threads // sum(getattr(config, g).count for g in groups))
    dtype = getattr(args, "dtype", "float32")
    sets = [*QUEUE_ALL_SETS, *(f"{g}.torch_threads={share}" for g in groups),
            *([f"engine.dtype={dtype}"] if dtype != "float32" else []), *args.set]
    return [*(["--config", args.config] if args.config else []), *(f for s in sets for f in ("--set", s))]


# ---- measuring -----------------------------------------------------------------------------------
async def stream_completion(transport, headers: dict, prompt: str, max_tokens: int, extra_body: dict) -> StreamResult:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True, **extra_body}
    frame_times_s, texts, usage_tokens = [], [], None
    start_s = time.perf_counter()
    async with contextlib.aclosing(transport.sse_data("/v1/completions", body, headers)) as payloads:
        async for data in payloads:
            if data == "[DONE]":
                continue  # read on to the end: the connection goes back to the pool
            frame = json.loads(data)
            if "error" in frame:
                raise RuntimeError(f"/v1/completions sent an error frame: {frame['error']}")
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
    async with make_transport(url, spec.concurrency) as transport:
        async def stream(prompt: str, max_tokens: int) -> StreamResult:
            return await stream_completion(transport, headers, prompt, max_tokens, extra_body)

        await stream(" hello world", 4)  # first-call costs
        itl = [await stream(p, spec.output_len) for p in prompts.itl]
        ttft = [await stream(p, 2) for p in prompts.ttft]
        pending = iter(prompts.concurrent)  # shared by the clients; one loop thread, so no lock
        results: list[StreamResult] = []

        async def client_loop() -> None:
            for prompt in pending:
                results.append(await stream(prompt, spec.output_len))

        start_s = time.perf_counter()
        await asyncio.gather(*(client_loop() for _ in range(spec.concurrency)))
        elapsed_s = time.perf_counter() - start_s
    return SystemRun("", tuple(itl), tuple(ttft), elapsed_s, sum(r.output_tokens for r in results),
                     concurrent=tuple(results))


def check_peer_tokens(peer, url: str, prompts: Prompts) -> None:
    """llama.cpp must see the very token ids tandem's tokenizer gives each prompt."""
    for text in prompts.all():
        got = peer.token_ids(url, text)
        if tuple(got) != prompts.token_ids[text]:
            raise RuntimeError(f"{peer.name} tokenizes a prompt differently ({len(got)} ids vs "
                               f"{len(prompts.token_ids[text])}): not the same tokenizer?")


def run_peer(peer, gguf_path: Path, prompts: Prompts, spec: BenchSpec, args: argparse.Namespace) -> SystemRun:
    start_s = time.perf_counter()
    server = peer.start(gguf_path, spec.threads, spec.concurrency, spec.context_len)
    try:
        wait_peer_ready(peer, server, args.ready_timeout_s)
        ready_s = time.perf_counter() - start_s
        check_peer_tokens(peer, server.url, prompts)
        run = asyncio.run(measure(server.url, {}, prompts, spec, peer.extra_body))
        memory = memory_of(process_tree(server.proc.pid))
    finally:
        server.stop()
    return dataclasses.replace(run, system="llama.cpp", memory=memory, peer=peer.name, ready_s=(ready_s,))


def run_tandem(prompts: Prompts, spec: BenchSpec, args: argparse.Namespace) -> SystemRun:
    key = os.environ.get("TANDEM_API_KEY")
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    start_s = time.perf_counter()
    server = SpawnedServer(tandem_serve_flags(args, spec.threads))
    try:
        wait_ready(server, headers, args.ready_timeout_s)
        ready_s = time.perf_counter() - start_s
        wait_warm(server, headers, args.ready_timeout_s)  # its steady state is timed, as llama-server's is
        run = asyncio.run(measure(server.url, headers, prompts, spec, {"ignore_eos": True,
                                                                       "stream_options": {"include_usage": True}}))
        memory = memory_of(tandem_serve_processes(server.proc.pid, Path(server.log_path).read_text(errors="replace")))
    finally:
        exit_code = server.stop()
    if exit_code != 0:
        raise RuntimeError(f"tandem serve exited with code {exit_code}")
    return dataclasses.replace(run, system="tandem", memory=memory, ready_s=(ready_s,))


def hf_greedy_text(model_dir: Path, prompt_ids: tuple[int, ...], max_new_tokens: int, dtype: str) -> str:
    """HF transformers' greedy continuation of `prompt_ids` in `dtype`, end of sequence ignored as both
    servers were told to (the independent reference for both texts), decoded."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("HF transformers' greedy text of the first stream's prompt (%s), the reference for both", dtype)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=getattr(torch, dtype))
    model.generation_config.eos_token_id = None  # an end token is a token like any other here
    ids = torch.tensor([prompt_ids])
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             do_sample=False, pad_token_id=0)
    text = AutoTokenizer.from_pretrained(str(model_dir)).decode(out[0, len(prompt_ids):], skip_special_tokens=False)
    assert isinstance(text, str), "one sequence decodes to one string (transformers types a batch's list too)"
    return text


def bench_llamacpp(args: argparse.Namespace) -> int:
    try:
        peer = make_peer(args)
    except PeerUnavailable as exc:
        print(f"tandem bench llamacpp: {exc}", file=sys.stderr)
        return 2
    from kernels.model.loader import resolve_model_dir
    from kernels.model.tokenizer import load_tokenizer

    logging.getLogger("httpx").setLevel(logging.WARNING)
    if args.repeats < 1:
        raise ValueError(f"--repeats must be >= 1, got {args.repeats}")
    spec = BenchSpec(args.threads, args.prompt_len, args.output_len, args.itl_runs, args.ttft_prompt_len,
                     args.ttft_runs, args.concurrency, args.num_requests, args.seed, args.dtype)
    model = load_config(tandem_serve_flags(args, spec.threads)).model
    if model != "smollm2" and args.gguf is None:
        raise ValueError(f"tandem serves {model!r}: pass --gguf with the same weights for llama.cpp")
    gguf_path = Path(args.gguf) if args.gguf else ensure_gguf(dtype=args.dtype)
    prompts = make_prompts(spec, load_tokenizer(resolve_model_dir(model)))
    log.info("llama.cpp's %s (%s) and tandem serve, one after the other, %d round(s); %d threads each", peer.name,
             gguf_path.name, args.repeats, spec.threads)
    rounds: dict[str, list[SystemRun]] = {name: [] for name in SYSTEMS}
    for i in range(args.repeats):
        for name in round_order(i):
            run = (run_peer(peer, gguf_path, prompts, spec, args) if name == "llama.cpp"
                   else run_tandem(prompts, spec, args))
            rounds[name].append(run)
    first = prompts.token_ids[prompts.itl[0]]
    hf_text = hf_greedy_text(resolve_model_dir(model), first, spec.output_len, spec.dtype)
    summary = summarize({name: merge_runs(runs) for name, runs in rounds.items()}, spec, hf_text)
    summary["rounds"] = args.repeats
    summary["per_round"] = {name: [system_figures(run) for run in runs] for name, runs in rounds.items()}
    print(format_table(summary))
    print("\n".join(round_lines(summary["per_round"])))
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2))
    return 0
