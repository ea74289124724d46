"""`tandem run`: offline generation through the colocated engine, with a progress bar on stderr."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from dataclasses import dataclass
from pathlib import Path

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
    from kernels.model.loader import apply_chat_template, encode_prompt

    if isinstance(item.prompt, list):
        return apply_chat_template(tokenizer, item.prompt)
    return encode_prompt(tokenizer, item.prompt) if raw else apply_chat_template(tokenizer, item.prompt)


def run_offline(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from cluster.cli import engine_config_from_args
    from cluster.config import SamplingParams
    from decode_worker.engine import ColocatedEngine

    prompts = read_prompts(args)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.seed, stop=tuple(args.stop))
    config = engine_config_from_args(args)
    t0 = time.perf_counter()
    engine = ColocatedEngine.from_config(config)
    log.info("loaded %s in %.2fs (%d KV pages of %d tokens)", config.model, time.perf_counter() - t0,
             engine.config.num_pages, engine.config.page_size)
    token_ids = [tokenize_prompt(engine.tokenizer, p, args.raw) for p in prompts]
    t1 = time.perf_counter()
    with tqdm(total=len(prompts), desc="generating", unit="req", file=sys.stderr, disable=None) as bar:
        reqs = engine.generate(token_ids, params, on_finish=lambda _: bar.update(1))
    elapsed = time.perf_counter() - t1
    num_out = sum(len(r.output_token_ids) for r in reqs)
    log.info("%d requests, %d output tokens in %.2fs (%.1f tok/s)", len(reqs), num_out, elapsed, num_out / elapsed)
    for item, req in zip(prompts, reqs):
        text = engine.output_text(req)
        if args.json:
            print(json.dumps({
                "prompt": item.prompt, "prompt_token_ids": req.prompt_token_ids, "token_ids": req.output_token_ids,
                "text": text, "finish_reason": req.finish_reason.value, "prompt_tokens": len(req.prompt_token_ids),
                "completion_tokens": len(req.output_token_ids), "cached_tokens": req.cached_tokens,
            }), flush=True)
        else:
            print(f"--- {item.prompt!r}\n{text}\n", flush=True)
    return 0
