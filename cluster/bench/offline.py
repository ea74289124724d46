"""`tandem bench offline`: tandem's engine vs HF transformers `generate` on the same requests.

Both systems get the same random-token prompts and exact output lengths (EOS ignored) and batch at
most `--max-batch-size` requests. HF `generate` cannot give each row its own length, so it runs
batches in arrival order to the longest output of the batch; only the requested tokens count as
useful output for either system.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch

log = logging.getLogger("tandem.bench")


@dataclass(frozen=True)
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def num_output_tokens(self) -> int:
        return sum(self.output_lens)


@dataclass(frozen=True)
class Throughput:
    system: str
    elapsed_s: float
    output_tokens: int

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.elapsed_s


def make_workload(num_requests: int, input_len: tuple[int, int], output_len: tuple[int, int], vocab_size: int,
                  seed: int) -> Workload:
    rng = random.Random(seed)
    prompts = [[rng.randrange(10, vocab_size) for _ in range(rng.randint(*input_len))] for _ in range(num_requests)]
    return Workload(prompts, [rng.randint(*output_len) for _ in range(num_requests)])


def run_tandem(engine, work: Workload) -> Throughput:
    from common.config import SamplingParams

    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in work.output_lens]
    t0 = time.perf_counter()
    reqs = engine.generate(work.prompts, params)
    elapsed = time.perf_counter() - t0
    got = [len(r.output_token_ids) for r in reqs]
    assert got == work.output_lens, "tandem produced the wrong number of tokens"
    return Throughput("tandem", elapsed, sum(got))


@torch.inference_mode()
def run_hf(model, work: Workload, max_batch_size: int, pad_token_id: int) -> Throughput:
    t0 = time.perf_counter()
    for start in range(0, len(work.prompts), max_batch_size):
        prompts = work.prompts[start:start + max_batch_size]
        max_new = max(work.output_lens[start:start + max_batch_size])
        width = max(map(len, prompts))
        ids = torch.tensor([[pad_token_id] * (width - len(p)) + p for p in prompts])  # left padding
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        out = model.generate(ids, attention_mask=mask, max_new_tokens=max_new, min_new_tokens=max_new,
                             do_sample=False, pad_token_id=pad_token_id, eos_token_id=None)
        assert out.shape[1] == width + max_new, "HF generate stopped early"
    return Throughput("hf_transformers", time.perf_counter() - t0, work.num_output_tokens)


def load_hf_model(model_dir, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()


def bench_offline(args: argparse.Namespace) -> int:
    from cluster.cli.args import engine_config_from_args
    from common.config import SamplingParams
    from engine import load_engine
    from kernels.kv_layout import TORCH_DTYPES
    from kernels.model.loader import resolve_model_dir

    config = engine_config_from_args(args, max_running_requests=args.max_batch_size)
    engine = load_engine(config)
    work = make_workload(args.num_requests, tuple(args.input_len), tuple(args.output_len),
                         engine.arch.vocab_size, args.seed)
    log.info("workload: %d requests, %d prompt tokens, %d output tokens, max batch %d", len(work.prompts),
             sum(map(len, work.prompts)), work.num_output_tokens, args.max_batch_size)
    engine.generate([work.prompts[0][:16]], SamplingParams(max_tokens=2))  # warm up
    kv_dtype = TORCH_DTYPES[engine.config.dtype]  # its KV cache's (`engine/build.py:_pools`)
    hf = None if args.skip_baseline else load_hf_model(resolve_model_dir(config.model), kv_dtype)
    runs: dict[str, list[Throughput]] = {"tandem": [], "hf_transformers": []}
    for _ in range(args.repeats):  # alternate, so drift in machine speed hits both systems alike
        runs["tandem"].append(run_tandem(engine, work))
        if hf is not None:
            runs["hf_transformers"].append(run_hf(hf, work, args.max_batch_size, pad_token_id=0))
    results = [min(r, key=lambda t: t.elapsed_s) for r in runs.values() if r]  # best run of each
    print_results(results, args.json)
    return 0


def print_results(results: list[Throughput], as_json: bool) -> None:
    print(f"{'system':<18}{'elapsed_s':>12}{'output_tokens':>15}{'tok/s':>10}")
    for r in results:
        print(f"{r.system:<18}{r.elapsed_s:>12.2f}{r.output_tokens:>15}{r.output_tokens_per_s:>10.1f}")
    summary: dict[str, Any] = {
        "results": [{**asdict(r), "output_tokens_per_s": r.output_tokens_per_s} for r in results]}
    if len(results) == 2:
        ratio = results[0].output_tokens_per_s / results[1].output_tokens_per_s
        summary["ratio_tandem_over_hf"] = ratio
        print(f"ratio tandem / hf_transformers: {ratio:.2f}x")
    if as_json:
        print(json.dumps(summary))
