"""`tandem bench serve --dataset multiturn`: chat-like conversations that resend their whole history.

Each of `--conversations` conversations has `--turns` turns; `--concurrency` of them are in flight at
once (a client takes the next conversation when its current one has ended). Turn t's prompt is

    | user 1 | answer 1 | user 2 | answer 2 | ... | user t |      (history_tokens = its length)

where `user i` are fresh random token ids (seeded, like `make_workload`) and `answer i` is the text
the server streamed for turn i, re-tokenized: the API streams text, not token ids, so the history a
client resends is what a chat client would resend. Between an answer and the conversation's next turn
the client waits a think time drawn from `--think-time-s`. Outputs have exact lengths (`ignore_eos`).

Reported per turn index: TTFT mean / p50 / p99, the history length, and the prompt tokens the server
says its prefix cache served (`usage.prompt_tokens_details.cached_tokens`); then the output
throughput of the whole run (think time included) and mean TTFT of turns >= 2 over turn 1. There is
no offline baseline for this dataset.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import random
import time
from dataclasses import dataclass

import numpy as np

from cluster.bench.offline import Throughput
from cluster.bench.serve import (QUEUE_ALL_SETS, ExistingServer, SpawnedServer, load_config, serve_flags,
                                 sse_frames, wait_ready)

log = logging.getLogger("tandem.bench")

WARMUP_PROMPT = list(range(10, 26))  # first-call costs; shares no prefix with the random conversations
BASELINE_NOTE = "offline baseline: skipped for --dataset multiturn (it has no conversation state)"


@dataclass(frozen=True)
class Conversation:
    user_turns: tuple[tuple[int, ...], ...]  # new user token ids of each turn
    output_lens: tuple[int, ...]  # exact answer length of each turn, in generated tokens
    think_times_s: tuple[float, ...]  # pause before each turn; 0 before the first


@dataclass(frozen=True)
class TurnResult:
    conversation: int
    turn: int  # 1-based
    history_tokens: int  # the prompt sent: earlier user turns and answers + this turn's user tokens
    prompt_tokens: int  # as the server counted them (usage)
    cached_tokens: int  # prompt tokens the server's prefix cache served (usage)
    answer_tokens: int  # the answer re-tokenized: what the next turn's history gains besides its user tokens
    output_tokens: int  # generated tokens (usage)
    ttft_s: float


def make_conversations(num_conversations: int, num_turns: int, turn_input_len: tuple[int, int],
                       turn_output_len: tuple[int, int], think_time_s: tuple[float, float], vocab_size: int,
                       seed: int) -> list[Conversation]:
    rng = random.Random(seed)

    def one() -> Conversation:
        users = tuple(tuple(rng.randrange(10, vocab_size) for _ in range(rng.randint(*turn_input_len)))
                      for _ in range(num_turns))
        outputs = tuple(rng.randint(*turn_output_len) for _ in range(num_turns))
        thinks = (0.0, *(rng.uniform(*think_time_s) for _ in range(num_turns - 1)))
        return Conversation(users, outputs, thinks)

    return [one() for _ in range(num_conversations)]


# ---- the load ----------------------------------------------------------------------------------
async def stream_turn(client, prompt: list[int], output_len: int, headers: dict) -> tuple[float, str, dict]:
    """(TTFT in seconds, the streamed text, usage) of one streaming /v1/completions request."""
    body = {"prompt": prompt, "max_tokens": output_len, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    texts, usage, first_s = [], None, None
    start_s = time.perf_counter()
    async with client.stream("POST", "/v1/completions", json=body, headers=headers) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"/v1/completions answered {resp.status_code} to a {len(prompt)}-token history: "
                               f"{(await resp.aread())[:500]!r}")
        async for frame in sse_frames(resp):
            usage = frame.get("usage") or usage
            text = "".join(choice.get("text") or "" for choice in frame.get("choices", ()))
            if text and first_s is None:
                first_s = time.perf_counter()
            texts.append(text)
    if usage is None or usage["completion_tokens"] != output_len:
        raise RuntimeError(f"asked for {output_len} tokens, usage says {usage}: was ignore_eos dropped?")
    return (first_s or time.perf_counter()) - start_s, "".join(texts), usage


async def run_conversation(client, index: int, conv: Conversation, tokenizer, headers: dict) -> list[TurnResult]:
    from kernels.model.tokenizer import encode_prompt

    history: list[int] = []
    results = []
    for turn, (user, output_len, think_s) in enumerate(zip(conv.user_turns, conv.output_lens, conv.think_times_s)):
        await asyncio.sleep(think_s)
        prompt = history + list(user)
        ttft_s, text, usage = await stream_turn(client, prompt, output_len, headers)
        answer = encode_prompt(tokenizer, text)
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        results.append(TurnResult(index, turn + 1, len(prompt), usage["prompt_tokens"], cached, len(answer),
                                  usage["completion_tokens"], ttft_s))
        history = prompt + answer
    return results


async def run_conversations(url: str, convs: list[Conversation], concurrency: int, tokenizer,
                            headers: dict) -> tuple[Throughput, list[TurnResult]]:
    """Closed loop over conversations: `concurrency` clients, each starting the next conversation when
    its last one ended (think time counts as in flight)."""
    import httpx

    results: list[TurnResult] = []
    pending = iter(range(len(convs)))  # shared by the clients; one loop thread, so no lock

    async def client_loop(client) -> None:
        for i in pending:
            results.extend(await run_conversation(client, i, convs[i], tokenizer, headers))

    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(None), limits=limits) as client:
        await stream_turn(client, WARMUP_PROMPT, 4, headers)
        start_s = time.perf_counter()
        await asyncio.gather(*(client_loop(client) for _ in range(concurrency)))
        elapsed_s = time.perf_counter() - start_s
    return Throughput("served", elapsed_s, sum(r.output_tokens for r in results)), results


# ---- the whole run -----------------------------------------------------------------------------
def check_args(args: argparse.Namespace) -> None:
    if args.conversations < 1 or args.turns < 1 or args.concurrency < 1:
        raise ValueError("--conversations, --turns and --concurrency must be >= 1")
    for flag, (low, high) in (("--turn-input-len", args.turn_input_len), ("--turn-output-len", args.turn_output_len)):
        if not 1 <= low <= high:
            raise ValueError(f"{flag} takes MIN MAX with 1 <= MIN <= MAX, got {low} {high}")
    if not 0 <= args.think_time_s[0] <= args.think_time_s[1]:
        raise ValueError("--think-time-s takes MIN MAX with 0 <= MIN <= MAX")


def bench_multiturn(args: argparse.Namespace) -> int:
    from kernels.model.loader import resolve_model_dir
    from kernels.model.tokenizer import load_tokenizer

    check_args(args)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request otherwise
    flags = serve_flags(args, tuple(QUEUE_ALL_SETS))
    tokenizer = load_tokenizer(resolve_model_dir(load_config(flags).model))
    convs = make_conversations(args.conversations, args.turns, tuple(args.turn_input_len),
                               tuple(args.turn_output_len), tuple(args.think_time_s), len(tokenizer), args.seed)
    log.info("workload: %d conversations x %d turns, concurrency %d; %s", args.conversations, args.turns,
             args.concurrency, BASELINE_NOTE)
    server = ExistingServer(args.url) if args.url else SpawnedServer(flags)
    try:
        key = os.environ.get("TANDEM_API_KEY")
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        wait_ready(server, headers, args.ready_timeout_s)
        served, results = asyncio.run(run_conversations(server.url, convs, args.concurrency, tokenizer, headers))
    finally:
        exit_code = server.stop()
    summary = summarize(args, served, results, exit_code)
    print_summary(summary, args.json)
    return 0 if exit_code == 0 else 1


def summarize(args: argparse.Namespace, served: Throughput, results: list[TurnResult], exit_code: int) -> dict:
    turns = [turn_row(t, [r for r in results if r.turn == t]) for t in range(1, args.turns + 1)]
    later = [r.ttft_s for r in results if r.turn >= 2]
    return {
        "workload": {"dataset": "multiturn", "conversations": args.conversations, "turns": args.turns,
                     "concurrency": args.concurrency, "turn_input_len": list(args.turn_input_len),
                     "turn_output_len": list(args.turn_output_len), "think_time_s": list(args.think_time_s),
                     "prompt_tokens": sum(r.prompt_tokens for r in results),
                     "cached_tokens": sum(r.cached_tokens for r in results)},
        "results": [{"system": served.system, "elapsed_s": served.elapsed_s, "output_tokens": served.output_tokens,
                     "output_tokens_per_s": served.output_tokens_per_s,
                     "requests_per_s": len(results) / served.elapsed_s}],
        "turns": turns,
        "ttft_mean_turns2plus_over_turn1": (float(np.mean(later)) / turns[0]["ttft_mean_s"]) if later else None,
        "baseline": BASELINE_NOTE,
        "server_exit_code": exit_code,
    }


def turn_row(turn: int, rows: list[TurnResult]) -> dict:
    """One turn index over all conversations: means and TTFT percentiles."""
    ttfts_s = [r.ttft_s for r in rows]

    def mean(field: str) -> float:
        return float(np.mean([getattr(r, field) for r in rows]))

    return {"turn": turn, "requests": len(rows), "ttft_mean_s": float(np.mean(ttfts_s)),
            "ttft_p50_s": float(np.percentile(ttfts_s, 50)), "ttft_p99_s": float(np.percentile(ttfts_s, 99)),
            "history_tokens_mean": mean("history_tokens"), "prompt_tokens_mean": mean("prompt_tokens"),
            "cached_tokens_mean": mean("cached_tokens"), "answer_tokens_mean": mean("answer_tokens")}


def print_summary(summary: dict, as_json: bool) -> None:
    served = summary["results"][0]
    print(f"{'system':<10}{'elapsed_s':>12}{'output_tokens':>15}{'tok/s':>10}{'req/s':>9}   (think time included)")
    print(f"{served['system']:<10}{served['elapsed_s']:>12.2f}{served['output_tokens']:>15}"
          f"{served['output_tokens_per_s']:>10.1f}{served['requests_per_s']:>9.2f}")
    print(summary["baseline"])
    print(f"{'turn':>4}{'requests':>10}{'history_tok':>13}{'cached_tok':>12}"
          f"{'TTFT mean ms':>14}{'p50 ms':>9}{'p99 ms':>9}")
    for row in summary["turns"]:
        print(f"{row['turn']:>4}{row['requests']:>10}{row['history_tokens_mean']:>13.1f}"
              f"{row['cached_tokens_mean']:>12.1f}{row['ttft_mean_s'] * 1e3:>14.1f}"
              f"{row['ttft_p50_s'] * 1e3:>9.1f}{row['ttft_p99_s'] * 1e3:>9.1f}")
    ratio = summary["ttft_mean_turns2plus_over_turn1"]
    print("mean TTFT turns>=2 / turn 1: " + ("n/a (one turn)" if ratio is None else f"{ratio:.2f}x"))
    if as_json:
        print(json.dumps(summary))
