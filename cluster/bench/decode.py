"""`tandem bench decode`: per-step decode latency, eager vs graph, per attention backend, and HF's.

For each attention backend (`kernels.attention.BACKEND_NAMES`; one that cannot run on the device is
skipped with a printed note) x batch size B x mode (eager: `cuda_graph` off; graph: the graph runner,
a CUDA graph replay on CUDA, the static-buffer path on CPU), one engine over the backend's model
(one load per backend, shared by its engines) gets B requests of `--prompt-len` seeded random
tokens. Prefill is not timed: once every request has its first token, `--warmup-steps` decode steps
run untimed, then `--steps` pure decode steps (B rows of one token each) are timed one by one
(`torch.cuda.synchronize()` around each on CUDA). Each engine captures only bucket B
(`graph_batch_sizes=(B,)`, `max_running_requests=B`), has no host tier (nothing but decode runs
while timed), and the runner's counters say what the timed steps were: in graph mode all replays,
in eager mode all `disabled` fallbacks. The requests are then aborted (the release path) and the
pool checked (`check_integrity`).

    timeline of one run:  | prefill steps | warm-up decode steps | timed decode steps | abort all |

The reference is HF transformers `generate` over the same weights, the same B prompts, greedy,
1 + warm-up + steps new tokens; a logits processor stamps the time of every new token, so a step
is the time between two stamps (its forward, the argmax and generate's own bookkeeping).

Greedy outputs are compared: eager vs graph (every request's tokens) and request 0's against HF's.
Modes alternate per batch size (eager, then graph), so drift in machine load hits both alike.

Each tandem run's bytes read per step and its fraction of the device's HBM-bandwidth limit are added
(`cluster/bench/roofline.py`). `--random-weights SHAPE` times a named Llama shape (Llama-3-8B's) with
random weights drawn on the device instead of `--model`: no checkpoint to carry, no HF reference.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import random
import statistics
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch

from cluster.bench import collect_engines
from common.config import EngineConfig, SamplingParams
from engine.request import RequestStatus
from kernels.kv_layout import TORCH_DTYPES

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from engine import EngineCore
    from engine.request import Request
    from kernels.model.arch import LlamaArch
    from kernels.model.llama import LlamaForCausalLM

log = logging.getLogger("tandem.bench")

DEFAULT_BATCH_SIZES = (1, 8, 32)
GPU_BATCH_SIZES = (64,)
"""Added to the defaults on CUDA."""
CPU_BACKENDS = ("torch", "cpu")
"""Backends with a CPU path; the others are GPU kernels (Triton runs on a CPU only under its
interpreter, a test tool far too slow to time), skipped on a CPU device."""
MODES = ("eager", "graph")


@dataclass(frozen=True)
class DecodeSpec:
    batch_sizes: tuple[int, ...]
    prompt_len: int  # tokens per prompt
    steps: int  # timed decode steps per run
    warmup_steps: int = 2  # untimed decode steps before them
    seed: int = 0


@dataclass(frozen=True)
class DecodeRow:
    """One timed run: a tandem engine (backend x mode x batch) or HF generate (batch)."""

    system: str  # "tandem" | "hf_transformers"
    backend: str  # tandem: the attention backend; HF: "hf:" + its attention implementation
    mode: str  # "eager" | "graph" | "generate"
    batch: int
    step_s: tuple[float, ...]  # each timed decode step
    tokens: tuple[tuple[int, ...], ...]  # every request's output tokens (HF: what generate made)
    replays: int = 0  # timed steps the graph runner replayed
    fallbacks: dict[str, int] = field(default_factory=dict)  # timed steps run eagerly, by reason
    fallbacks_run: dict[str, int] = field(default_factory=dict)  # the whole run's, prefill steps included

    @property
    def step_ms_p50(self) -> float:
        return 1e3 * statistics.median(self.step_s)

    @property
    def step_ms_mean(self) -> float:
        return 1e3 * statistics.fmean(self.step_s)

    @property
    def tokens_per_s(self) -> float:
        """Output tokens per second while decoding: B tokens a step."""
        return self.batch * len(self.step_s) / sum(self.step_s)


class Models(Protocol):
    """Where the bench gets its models: ours per attention backend, HF's over the same weights. One that
    has an `arch` attribute (the LlamaArch, None until known) gets the HBM-bandwidth figures too."""

    def ours(self, backend: str) -> tuple[LlamaForCausalLM, LlamaArch]:
        """(our model with `backend` attention, its LlamaArch)."""

    def hf(self) -> PreTrainedModel:
        """The HF transformers model of the same weights, dtype and device, in eval mode."""


class SharedModels:
    """`config.model` loaded once per backend (the backend is chosen at load); only the latest kept."""

    def __init__(self, config: EngineConfig):
        self.config = config
        self._loaded: dict[str, tuple[LlamaForCausalLM, LlamaArch]] = {}
        self.arch: LlamaArch | None = None  # once a model is loaded

    def ours(self, backend: str) -> tuple[LlamaForCausalLM, LlamaArch]:
        from kernels.model.loader import load_model

        if backend not in self._loaded:
            self._loaded.clear()
            m = load_model(self.config.model, device=self.config.device, dtype=TORCH_DTYPES[self.config.dtype],
                           backend=backend)
            self._loaded[backend] = (m.model, m.arch)
            self.arch = m.arch
        return self._loaded[backend]

    def hf(self) -> PreTrainedModel:
        from transformers import AutoModelForCausalLM

        from kernels.model.loader import resolve_model_dir

        model = AutoModelForCausalLM.from_pretrained(resolve_model_dir(self.config.model),
                                                     dtype=TORCH_DTYPES[self.config.dtype])
        # typeshed's functools.wraps does not bind: transformers' wrapped PreTrainedModel.to reads as unbound
        return model.to(self.config.device).eval()  # type: ignore[arg-type]


def default_batch_sizes(device: str) -> tuple[int, ...]:
    return DEFAULT_BATCH_SIZES + (GPU_BATCH_SIZES if torch.device(device).type == "cuda" else ())


def skip_reason(backend: str, device: str, dtype: torch.dtype | None = None) -> str:
    """Why `backend` cannot be timed on `device` ("" when it can)."""
    from kernels.attention import unavailable_reason

    if torch.device(device).type != "cuda" and backend not in CPU_BACKENDS:
        return f"{backend} is a GPU backend, not timed on {device}"
    return unavailable_reason(backend, device, dtype) or ""


def make_prompts(spec: DecodeSpec, vocab_size: int) -> list[list[int]]:
    """max(batch_sizes) prompts; a batch of B takes the first B (request 0 is the same in every run)."""
    rng = random.Random(spec.seed)
    return [[rng.randrange(10, vocab_size) for _ in range(spec.prompt_len)] for _ in range(max(spec.batch_sizes))]


# ---- tandem -----------------------------------------------------------------------------------------
def run_config(base: EngineConfig, spec: DecodeSpec, backend: str, mode: str, batch: int) -> EngineConfig:
    """The engine of one run: bucket B only, no host tier, pages for B requests (unless --num-pages)."""
    one = math.ceil((spec.prompt_len + max_new_tokens(base, spec, batch)) / base.page_size)
    return dataclasses.replace(base, attention_backend=backend, cuda_graph=mode == "graph",
                               max_running_requests=batch, graph_batch_sizes=(batch,),
                               num_pages=base.num_pages or batch * one + 2, host_cache_pages=0)


def max_new_tokens(base: EngineConfig, spec: DecodeSpec, batch: int) -> int:
    """Enough that no request ends before the timed steps do: the first token, a decode step per
    prefill step (a request decodes while later ones prefill), the warm-up and timed steps, 1 spare."""
    prefill_steps = math.ceil(batch * spec.prompt_len / base.chunk_size) + 1
    return 1 + prefill_steps + spec.warmup_steps + spec.steps + 1


def run_tandem(engine: EngineCore, prompts: list[list[int]], spec: DecodeSpec, backend: str) -> DecodeRow:
    """Prefill `prompts`, warm up, time `spec.steps` decode steps; then abort them all and check the pool."""
    run_fallbacks = _fallbacks(engine)
    params = SamplingParams(max_tokens=max_new_tokens(engine.config, spec, len(prompts)), ignore_eos=True)
    reqs = [engine.add_request(p, params) for p in prompts]
    try:
        _prefill(engine, reqs, max_new_tokens(engine.config, spec, len(reqs)))
        for _ in range(spec.warmup_steps):
            _decode_step(engine, reqs)
        replays, fallbacks = engine.graph_stats().replays, _fallbacks(engine)
        step_s = tuple(_decode_step(engine, reqs) for _ in range(spec.steps))
        tokens = tuple(tuple(r.output_token_ids) for r in reqs)
    finally:
        for r in reqs:
            engine.abort(r.request_id)
    engine.check_integrity()
    mode, now = ("graph" if engine.graphs_enabled() else "eager"), _fallbacks(engine)
    return DecodeRow("tandem", backend, mode, len(prompts), step_s, tokens, engine.graph_stats().replays - replays,
                     _reasons(now - fallbacks), _reasons(now - run_fallbacks))


def _prefill(engine: EngineCore, reqs: list[Request], max_steps: int) -> None:
    """Step until every request has its first token; raises when that takes more than `max_steps`
    (requests the engine never admits: --num-pages too small?)."""
    for _ in range(max_steps):
        if all(r.output_token_ids for r in reqs):
            return
        engine.step()
    if not all(r.output_token_ids for r in reqs):
        raise RuntimeError(f"{sum(not r.output_token_ids for r in reqs)} of {len(reqs)} requests still without a "
                           f"first token after {max_steps} steps: --num-pages too small?")


def _decode_step(engine: EngineCore, reqs: list[Request]) -> float:
    """One engine step, timed; raises unless it gave every request exactly one token."""
    before = [len(r.output_token_ids) for r in reqs]
    sync_device(engine.device)
    start_s = time.perf_counter()
    engine.step()
    sync_device(engine.device)
    elapsed_s = time.perf_counter() - start_s
    got = [len(r.output_token_ids) - n for r, n in zip(reqs, before)]
    if got != [1] * len(reqs) or any(r.status is not RequestStatus.RUNNING for r in reqs):
        raise RuntimeError(f"a decode step gave {got} tokens to {len(reqs)} requests (statuses "
                           f"{sorted({r.status.name for r in reqs})}): finished or retracted early?")
    return elapsed_s


def _fallbacks(engine: EngineCore) -> Counter[str]:
    """Steps the engine ran eagerly so far, by reason (`Fallback`'s value)."""
    return Counter(dict(engine.graph_stats().fallbacks))


def _reasons(fallbacks: Counter[str]) -> dict[str, int]:
    """{reason name: steps} of the reasons that counted any."""
    return dict(sorted((reason, n) for reason, n in fallbacks.items() if n))


def sync_device(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ---- HF transformers ----------------------------------------------------------------------------------
class _TokenClock:
    """A logits processor that changes nothing and stamps the time: generate calls it once per new token."""

    def __init__(self, device: torch.device):
        self.device = device
        self.stamps_s: list[float] = []  # perf_counter() at each new token

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        sync_device(self.device)
        self.stamps_s.append(time.perf_counter())
        return scores


@torch.inference_mode()
def run_hf(model: PreTrainedModel, prompts: list[list[int]], spec: DecodeSpec) -> DecodeRow:
    """HF generate, greedy, on the same prompts (one length: no padding); the gaps between tokens."""
    from transformers import GenerationMixin, LogitsProcessorList

    assert isinstance(model, GenerationMixin), f"{type(model).__name__} cannot generate: not a causal LM?"
    device = next(model.parameters()).device
    ids = torch.tensor(prompts, device=device)  # [B, prompt_len]
    clock = _TokenClock(device)
    new = 1 + spec.warmup_steps + spec.steps
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                         do_sample=False, pad_token_id=0, eos_token_id=None,
                         logits_processor=LogitsProcessorList([clock]))
    assert out.shape[1] == spec.prompt_len + new, "HF generate stopped early"
    gaps = [b - a for a, b in zip(clock.stamps_s, clock.stamps_s[1:])]
    attn = getattr(model.config, "_attn_implementation", None) or "default"
    return DecodeRow("hf_transformers", f"hf:{attn}", "generate", len(prompts), tuple(gaps[spec.warmup_steps:]),
                     tuple(tuple(row) for row in out[:, spec.prompt_len:].tolist()))


# ---- the whole comparison -----------------------------------------------------------------------------
def compare(models: Models, base: EngineConfig, spec: DecodeSpec, backends: tuple[str, ...],
            with_hf: bool = True) -> tuple[list[DecodeRow], dict[str, str]]:
    """(every row: per backend, per batch, eager then graph; then HF per batch, {skipped backend: why})."""
    from engine import build_engine

    modes = MODES if base.cuda_graph else ("eager",)
    rows: list[DecodeRow] = []
    skipped = {b: why for b in backends if (why := skip_reason(b, base.device, TORCH_DTYPES[base.dtype]))}
    for backend in (b for b in backends if b not in skipped):
        model, arch = models.ours(backend)
        prompts = make_prompts(spec, arch.vocab_size)
        for batch in spec.batch_sizes:
            for mode in modes:
                collect_engines()
                engine = build_engine(run_config(base, spec, backend, mode, batch), model, arch)
                try:
                    rows.append(run_tandem(engine, prompts[:batch], spec, backend))
                finally:
                    engine.close()
                log.info("%s %s batch %d: %.2f ms a step (p50)", backend, mode, batch, rows[-1].step_ms_p50)
    if with_hf:
        hf = models.hf()
        prompts = make_prompts(spec, hf.config.vocab_size)
        for batch in spec.batch_sizes:
            rows.append(run_hf(hf, prompts[:batch], spec))
            log.info("HF generate batch %d: %.2f ms a step (p50)", batch, rows[-1].step_ms_p50)
    return rows, skipped


def summarize(rows: list[DecodeRow], skipped: dict[str, str], base: EngineConfig, spec: DecodeSpec) -> dict:
    """The JSON of the run: config, workload, every row (with its p50 speedup over its eager row), checks."""
    tandem = {(r.backend, r.mode, r.batch): r for r in rows if r.system == "tandem"}
    first_backend = next((r.backend for r in rows if r.system == "tandem"), None)

    def eager_of(r: DecodeRow) -> DecodeRow | None:  # an HF row's: the first backend's (none without tandem rows)
        backend = r.backend if r.system == "tandem" else first_backend
        return None if backend is None else tandem.get((backend, "eager", r.batch))

    def row(r: DecodeRow) -> dict:
        eager = eager_of(r)
        d = {k: v for k, v in dataclasses.asdict(r).items() if k not in ("step_s", "tokens")}
        speedup = eager.step_ms_p50 / r.step_ms_p50 if eager else None
        return {**d, "steps": len(r.step_s), "step_ms_p50": r.step_ms_p50, "step_ms_mean": r.step_ms_mean,
                "tokens_per_s": r.tokens_per_s, "speedup_vs_eager": speedup,
                "step_ms": [1e3 * s for s in r.step_s], "first_request_tokens": list(r.tokens[0])}

    identical = {f"{b}/{batch}": tandem[(b, "eager", batch)].tokens == g.tokens
                 for (b, mode, batch), g in tandem.items() if mode == "graph" and (b, "eager", batch) in tandem}
    hf_same = {}
    for r in rows:
        if r.system == "hf_transformers" and (eager := eager_of(r)) is not None:
            ours = eager.tokens[0]
            hf_same[str(r.batch)] = ours[:len(r.tokens[0])] == r.tokens[0]
    return {"config": {"model": base.model, "device": base.device, "dtype": base.dtype, "page_size": base.page_size,
                       "chunk_size": base.chunk_size},
            "workload": dataclasses.asdict(spec), "skipped_backends": skipped, "rows": [row(r) for r in rows],
            "outputs_identical_eager_graph": identical, "first_request_identical_to_hf": hf_same}


def print_summary(s: dict) -> None:
    w = s["workload"]
    print(f"\ndecode: {w['prompt_len']}-token prompts, {w['steps']} timed decode steps after {w['warmup_steps']} "
          f"untimed ({s['config']['device']}, {s['config']['dtype']}); vs_eager = p50 step of the same backend's "
          "eager run / this row's (HF: the first backend's); tok/s = batch / mean step")
    for backend, why in s["skipped_backends"].items():
        print(f"note: backend {backend} skipped: {why}")
    print(f"{'backend':<10}{'mode':<10}{'batch':>6}{'step_ms_p50':>13}{'step_ms_mean':>14}{'tok/s':>10}"
          f"{'vs_eager':>10}{'replayed':>10}  fallbacks")
    for r in s["rows"]:
        ratio = f"{r['speedup_vs_eager']:.2f}x" if r["speedup_vs_eager"] else "-"
        replayed = f"{r['replays']}/{r['steps']}" if r["system"] == "tandem" else "-"
        falls = ", ".join(f"{k} {v}" for k, v in r["fallbacks"].items()) or "-"
        print(f"{r['backend']:<10}{r['mode']:<10}{r['batch']:>6}{r['step_ms_p50']:>13.2f}{r['step_ms_mean']:>14.2f}"
              f"{r['tokens_per_s']:>10.1f}{ratio:>10}{replayed:>10}  {falls}")
    for key, same in s["outputs_identical_eager_graph"].items():
        print(f"greedy outputs eager vs graph ({key}, every request): {'identical' if same else 'DIFFERENT'}")
    for batch, same in s["first_request_identical_to_hf"].items():
        print(f"request 0 vs HF generate (batch {batch}): {'identical' if same else 'DIFFERENT'}")


def bench_decode(args: argparse.Namespace, models: Models | None = None) -> int:
    """The command: every backend x batch x mode, HF generate; prints the table, writes `--json`."""
    from cluster.cli.args import engine_config_from_args
    from kernels.attention import BACKEND_NAMES

    base = engine_config_from_args(args)
    spec = DecodeSpec(tuple(args.batch_sizes or default_batch_sizes(base.device)), args.prompt_len, args.steps,
                      args.warmup_steps, args.seed)
    if min(spec.batch_sizes) < 1 or spec.prompt_len < 1 or spec.steps < 1 or spec.warmup_steps < 0:
        raise ValueError("--batch-sizes, --prompt-len and --steps must be >= 1, --warmup-steps >= 0")
    backends = tuple(args.backends or BACKEND_NAMES)
    unknown = set(backends) - set(BACKEND_NAMES)
    if unknown:
        raise ValueError(f"unknown attention backends {sorted(unknown)}; available: {', '.join(BACKEND_NAMES)}")
    if args.random_weights:
        from cluster.bench.roofline import RandomModels

        base = dataclasses.replace(base, model=f"random:{args.random_weights}")
        models = models or RandomModels(base, args.random_weights, args.seed)
    models = models or SharedModels(base)
    rows, skipped = compare(models, base, spec, backends, with_hf=not (args.skip_hf or args.random_weights))
    summary = summarize(rows, skipped, base, spec)
    print_summary(summary)
    arch = getattr(models, "arch", None)  # the shape, where the Models says (a test's stand-in need not)
    if arch is not None:
        from cluster.bench.roofline import decode_bandwidth, print_bandwidth

        summary["bandwidth"] = decode_bandwidth(rows, arch, base, spec.prompt_len)
        print_bandwidth(summary["bandwidth"])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1)
    return 0
