"""`tandem run`: offline generation, with a progress bar on stderr: through the colocated engine, or
(`--mode disaggregated`) through the dispatcher over a prefill and a decode worker process."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.request import Request

log = logging.getLogger("tandem.run")


@dataclass(frozen=True)
class PromptInput:
    """One prompt as given: text, or chat messages."""

    prompt: str | list[dict]


def read_prompts(args: argparse.Namespace) -> list[PromptInput]:
    prompts = [PromptInput(p) for p in args.prompt]
    if args.prompts_file:
        prompts += read_prompts_file(Path(args.prompts_file))
    if not prompts:
        raise ValueError("no prompts: pass --prompt TEXT (repeatable) or --prompts-file FILE.jsonl")
    return prompts


def read_prompts_file(path: Path) -> list[PromptInput]:
    if not path.is_file():
        raise FileNotFoundError(f"prompts file {path} does not exist")
    out = []
    for lineno, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{lineno}: not JSON ({exc.msg})") from None
        if isinstance(item, dict):
            item = item.get("messages", item.get("prompt"))
        valid_chat = isinstance(item, list) and all(isinstance(m, dict) and "content" in m for m in item)
        if not (isinstance(item, str) or valid_chat):
            raise ValueError(f"{path}:{lineno}: expected a string, or an object with 'prompt' (string) "
                             "or 'messages' (list of {role, content})")
        out.append(PromptInput(item))
    return out


def tokenize_prompt(tokenizer, item: PromptInput, raw: bool) -> list[int]:
    from kernels.model.tokenizer import apply_chat_template, encode_prompt

    if isinstance(item.prompt, list):
        return apply_chat_template(tokenizer, item.prompt)
    return encode_prompt(tokenizer, item.prompt) if raw else apply_chat_template(tokenizer, item.prompt)


@dataclass(frozen=True)
class RunResult:
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str
    cached_tokens: int
    error: str = ""


def run_offline(args: argparse.Namespace) -> int:
    from cluster.cli.args import engine_config_from_args
    from common.config import SamplingParams

    prompts = read_prompts(args)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.seed, stop=tuple(args.stop))
    config = engine_config_from_args(args)
    sides = (args.prefill_tensor_parallel_size, args.decode_tensor_parallel_size)
    if args.mode != "disaggregated" and sides != (None, None):
        from common.config import ConfigError

        raise ConfigError("--prefill/--decode-tensor-parallel-size need --mode disaggregated "
                          "(else: --tensor-parallel-size)")
    run = _run_disaggregated if args.mode == "disaggregated" else _run_colocated
    results = run(args, config, prompts, params)
    failed = 0
    for item, res in zip(prompts, results):
        failed += bool(res.error)
        if args.json:
            print(json.dumps({
                "prompt": item.prompt, "prompt_token_ids": res.prompt_token_ids, "token_ids": res.token_ids,
                "text": res.text, "finish_reason": res.finish_reason, "prompt_tokens": len(res.prompt_token_ids),
                "completion_tokens": len(res.token_ids), "cached_tokens": res.cached_tokens,
                **({"error": res.error} if res.error else {}),
            }), flush=True)
        else:
            print(f"--- {item.prompt!r}\n{res.text if not res.error else 'ERROR: ' + res.error}\n", flush=True)
    return 1 if failed else 0


def _progress(total: int):
    from tqdm import tqdm

    return tqdm(total=total, desc="generating", unit="req", file=sys.stderr, disable=None)


def _run_colocated(args, config, prompts, params) -> list[RunResult]:
    from engine import load_engine

    t0 = time.perf_counter()
    # A run writes a small part of the pool: mapping all of it in first took seconds of its start and
    # made all of it resident; its pages fault in as they are written.
    engine = load_engine(config, populate=False)
    log.info("loaded %s in %.2fs (%d KV pages of %d tokens)", config.model, time.perf_counter() - t0,
             engine.config.num_pages, engine.config.page_size)
    try:
        token_ids = [tokenize_prompt(engine.tokenizer, p, args.raw) for p in prompts]
        t1 = time.perf_counter()
        with _progress(len(prompts)) as bar:
            reqs = engine.generate(token_ids, params, on_finish=lambda _: bar.update(1))
        _log_throughput([len(r.output_token_ids) for r in reqs], time.perf_counter() - t1)
        return [RunResult(r.prompt_token_ids, r.output_token_ids, engine.output_text(r), _finish_reason(r),
                          r.cached_tokens) for r in reqs]
    finally:
        engine.close()  # the host tier's copier thread must not outlive the interpreter's torch


def _run_disaggregated(args, config, prompts, params) -> list[RunResult]:
    """A prefill and a decode worker process behind the dispatcher `tandem serve` runs: a failed
    transfer is re-routed (to local prefill when the prefill worker is gone), a landing that never
    comes times out, as in a cluster."""
    import asyncio

    from cluster.worker_host.process import ProcessViews, pair_specs, serve_prompts
    from kernels.model.loader import resolve_model_dir
    from kernels.model.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(resolve_model_dir(config.model))
    token_ids = [tokenize_prompt(tokenizer, p, args.raw) for p in prompts]
    t0 = time.perf_counter()
    prefill_engine, decode_engine = (dataclasses.replace(config, tensor_parallel_size=n or config.tensor_parallel_size)
                                     for n in (args.prefill_tensor_parallel_size, args.decode_tensor_parallel_size))
    with ProcessViews(pair_specs(prefill_engine, decode_engine, args.host_pages)) as views:
        log.info("prefill and decode workers ready in %.2fs", time.perf_counter() - t0)
        t1 = time.perf_counter()
        with _progress(len(prompts)) as bar:
            reqs = asyncio.run(serve_prompts(views, token_ids, params, id_prefix="run",
                                             on_finish=lambda _: bar.update(1)))
        _log_throughput([len(r.token_ids) for r in reqs], time.perf_counter() - t1)
    return [RunResult(r.prompt_token_ids, r.token_ids, _text(tokenizer, r.token_ids, params.stop), r.finish_reason,
                      r.cached_tokens, r.error) for r in reqs]


def _finish_reason(req: Request) -> str:
    assert req.finish_reason is not None, f"{req.request_id} came back from EngineCore.generate unfinished"
    return req.finish_reason.value


def _text(tokenizer, token_ids: list[int], stop: tuple[str, ...]) -> str:
    """Output text, cut before the first stop string (the engine's stop rule, `engine.stop`)."""
    from engine.stop import cut_at_stop, decode

    return cut_at_stop(decode(tokenizer, token_ids), stop)


def _log_throughput(output_lens: list[int], elapsed_s: float) -> None:
    num_out = sum(output_lens)
    log.info("%d requests, %d output tokens in %.2fs (%.1f tok/s)", len(output_lens), num_out, elapsed_s,
             num_out / max(elapsed_s, 1e-9))
