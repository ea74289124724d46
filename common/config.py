"""Frozen, validated configuration shared by every package (the bottom of the import graph).

"Auto" values are resolved once into a new config object (`EngineConfig.resolve`); live objects
(models, pools, streams) are passed beside config, never inside it.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass

from common.grammar_spec import GrammarSpec

DTYPES = ("float32", "bfloat16", "float16")
WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")
ATTENTION_BACKENDS = ("auto", "flashinfer", "triton", "cpu", "torch")  # `auto` + kernels.attention.BACKEND_NAMES
SPECULATIVE_METHODS = ("none", "eagle")


class ConfigError(ValueError):
    """A configuration value is out of bounds; the message names the field and the bound."""


def require(ok: bool, message: str) -> None:
    """Every config's bound check: ConfigError(`message`) unless `ok`."""
    if not ok:
        raise ConfigError(message)


def require_min(config: object, prefix: str, bound: float, *names: str, strict: bool = False) -> None:
    """Each named field of `config` must be >= `bound` (> when `strict`); the message names `prefix` + the field."""
    for name in names:
        value = getattr(config, name)
        require(value > bound if strict else value >= bound,
                f"{prefix}{name} must be {'>' if strict else '>='} {bound}, got {value}")


def _is_real(x: object) -> bool:
    """A finite int or float (not a bool): NaN and infinities compare in ways no bound expects."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


GREEDY_TEMPERATURE_BELOW = 1e-5
"""Temperatures below this sample greedily (vLLM's `_SAMPLING_EPS`). Dividing logits by less can
overflow float32 (a temperature of 1e-45 turns every positive logit into inf and the softmax into
NaN), and sampling there differs from argmax only between logits closer than ~1e-3, which is
forward-pass noise: exp(-1e-3 / 1e-5) is below float32's smallest normal number."""
MAX_STOP_STRINGS = 64
"""Stop strings one request may give at most (every new token is checked against each)."""
MAX_STOP_CHARS = 4096
"""Characters of all one request's stop strings together at most (the longest sets the overlap
re-searched per token)."""
MAX_STOP_TOKEN_IDS = 1024
"""Stop token ids one request may give at most."""
SEED_MIN, SEED_MAX = -2**63, 2**63 - 1
"""Seeds are 64-bit signed integers (as OpenAI-style clients and vLLM accept)."""
MAX_CHOICES = 16
"""Most choices (`n`) one request asks for."""
MAX_LOGIT_BIAS = 1024
"""Most tokens one request's `logit_bias` names."""
LOGIT_BIAS_LIMIT = 100.0
"""A bias is in [-LOGIT_BIAS_LIMIT, LOGIT_BIAS_LIMIT] (the OpenAI API's range)."""
MAX_LOGPROBS = 20
"""Most alternatives per position a request's `logprobs` / `prompt_logprobs` ask for (vLLM's default)."""


GENERATION_CONFIG_MODES = ("auto", "none")
DEFAULT_KV_MEMORY_GIB = 2.0  # an engine made alone (tandem run, benches, tests), when neither size is given
USEFUL_POOL_BATCHES = 4
"""A pool sized from memory holds at most this many full running batches (`EngineConfig.useful_pages`)."""
DEFAULT_HOST_CACHE_RATIO = 2.0  # an engine made alone; on CUDA `tandem serve` caps it by the RAM budget
STAGING_CHUNKS = 4
"""A prefill worker that ships through host staging (its KV on a GPU, a transport that reads host
memory only: `prefill_worker/staging.py`) has room there for this many prefill chunks of pages."""


DEBUG_KV_ENV = "TANDEM_DEBUG_KV"


def debug_kv_from_env() -> bool:
    """TANDEM_DEBUG_KV is set (not empty, not 0): check KV integrity after every step."""
    return os.environ.get(DEBUG_KV_ENV, "0") not in ("", "0")


@dataclass(frozen=True)
class SamplingDefaults:
    """What a request's unset sampling fields become; a field the request sets always wins. The
    OpenAI API's own defaults, or the model's recommended ones (`gateway.generation_config`)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    """0: off."""
    source: str = "the OpenAI API's defaults"
    """Where these values come from, for the start-up log and /v1/models."""

    def __post_init__(self) -> None:
        require(math.isfinite(self.temperature) and self.temperature >= 0,
                f"default temperature must be a finite number >= 0, got {self.temperature}")
        require(math.isfinite(self.top_p) and 0 < self.top_p <= 1, f"default top_p must be in (0, 1], got {self.top_p}")
        require(_is_int(self.top_k) and self.top_k >= 0, f"default top_k must be an integer >= 0, got {self.top_k}")

    def describe(self) -> str:
        return (f"temperature={self.temperature:g} top_p={self.top_p:g} top_k={self.top_k or 'off'} "
                f"(from {self.source}; a request's own fields win)")


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples and when it stops."""

    max_tokens: int = 64
    """Completion tokens to generate at most (>= 1)."""
    temperature: float = 0.0
    """Finite, >= 0. Below `GREEDY_TEMPERATURE_BELOW` (0 included) greedy; otherwise logits are divided by it."""
    top_p: float = 1.0
    """Nucleus sampling mass in (0, 1]."""
    top_k: int = 0
    """Keep the k most likely tokens (>= 0); 0 disables, and so does any k >= the vocabulary."""
    seed: int | None = None
    """Makes sampled output reproducible (in [-2^63, 2^63)); without it each request draws its own seed."""
    stop: tuple[str, ...] = ()
    """Stop strings; the returned text ends before the first one found. At most `MAX_STOP_STRINGS`
    non-empty strings of `MAX_STOP_CHARS` characters together."""
    stop_token_ids: tuple[int, ...] = ()
    """Token ids that end generation (in addition to EOS unless `ignore_eos`); at most `MAX_STOP_TOKEN_IDS`."""
    ignore_eos: bool = False
    """Keep generating past EOS (benchmarks use it for exact output lengths)."""
    presence_penalty: float = 0.0
    """In [-2, 2]: subtracted from the logit of every token the output holds (the OpenAI API's)."""
    frequency_penalty: float = 0.0
    """In [-2, 2]: subtracted from a token's logit once per time the output holds it."""
    repetition_penalty: float = 1.0
    """> 0 (1: off): the logit of every token of the prompt or the output is divided by it where
    positive, multiplied where negative (HF transformers' and vLLM's)."""
    logit_bias: tuple[tuple[int, float], ...] = ()
    """(token id, bias) pairs (a dict is taken too), biases added to those tokens' logits; at most
    `MAX_LOGIT_BIAS` tokens, biases in [-100, 100]."""
    min_p: float = 0.0
    """In [0, 1]: after temperature, drop tokens whose probability is below min_p x the top token's."""
    min_tokens: int = 0
    """EOS and `stop_token_ids` cannot end the output before it holds this many tokens (<= max_tokens)."""
    logprobs: int | None = None
    """Each output token's log-probability and its `logprobs` most likely alternatives (0 to
    `MAX_LOGPROBS`); None: none. Values are the model's log-softmax before any rule or temperature."""
    prompt_logprobs: int | None = None
    """The same for every prompt token after the first (the prompt is then computed whole: its cached
    prefix is not reused); None: none."""
    grammar: GrammarSpec | None = None
    """Structured outputs: every token is sampled among those the grammar allows (`engine/structured.py`)."""
    share_prompt: bool = False
    """Not sampling: the prompt's KV enters the prefix tree as soon as it is computed, not when the
    request ends, so requests with the same prompt admitted meanwhile reuse it (the gateway sets it
    on choice 0 of a request with `n` > 1, whose siblings start after its first token)."""

    def __post_init__(self) -> None:
        require(_is_int(self.max_tokens) and self.max_tokens >= 1,
                 f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        require(_is_real(self.temperature) and self.temperature >= 0,
                 f"temperature must be a finite number >= 0, got {self.temperature!r}")
        require(_is_real(self.top_p) and 0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p!r}")
        require(_is_int(self.top_k) and self.top_k >= 0, f"top_k must be an integer >= 0, got {self.top_k!r}")
        require(self.seed is None or (_is_int(self.seed) and SEED_MIN <= self.seed <= SEED_MAX),
                 f"seed must be an integer in [-2^63, 2^63), got {self.seed!r}")
        require(isinstance(self.stop, (tuple, list)) and isinstance(self.stop_token_ids, (tuple, list)),
                 "stop and stop_token_ids must be sequences")
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        self._check_stop_rules()
        self._check_logit_rules()
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            require(value is None or (_is_int(value) and 0 <= value <= MAX_LOGPROBS),
                    f"{name} must be an integer in [0, {MAX_LOGPROBS}], got {value!r}")
        require(self.grammar is None or isinstance(self.grammar, GrammarSpec), "grammar must be a GrammarSpec")
        require(self.grammar is None or not self.min_tokens,
                "min_tokens cannot be combined with a grammar (which decides where the output ends)")

    def _check_stop_rules(self) -> None:
        require(all(isinstance(s, str) and s for s in self.stop), "stop strings must be non-empty strings")
        require(len(self.stop) <= MAX_STOP_STRINGS,
                 f"at most {MAX_STOP_STRINGS} stop strings are allowed, got {len(self.stop)}")
        total_chars = sum(map(len, self.stop))
        require(total_chars <= MAX_STOP_CHARS,
                 f"stop strings may have {MAX_STOP_CHARS} characters together at most, got {total_chars}")
        require(len(self.stop_token_ids) <= MAX_STOP_TOKEN_IDS,
                 f"at most {MAX_STOP_TOKEN_IDS} stop_token_ids are allowed, got {len(self.stop_token_ids)}")
        require(all(_is_int(t) and t >= 0 for t in self.stop_token_ids), "stop_token_ids must be non-negative integers")

    def _check_logit_rules(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            require(_is_real(value) and -2 <= value <= 2, f"{name} must be a number in [-2, 2], got {value!r}")
        require(_is_real(self.repetition_penalty) and self.repetition_penalty > 0,
                f"repetition_penalty must be a finite number > 0, got {self.repetition_penalty!r}")
        require(_is_real(self.min_p) and 0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p!r}")
        require(_is_int(self.min_tokens) and 0 <= self.min_tokens <= self.max_tokens,
                f"min_tokens must be an integer in [0, max_tokens], got {self.min_tokens!r}")
        bias = self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias
        require(isinstance(bias, (tuple, list, type({}.items()))), "logit_bias must map token ids to numbers")
        bias = tuple(bias)
        require(len(bias) <= MAX_LOGIT_BIAS, f"logit_bias may name {MAX_LOGIT_BIAS} tokens at most, got {len(bias)}")
        require(all(isinstance(pair, tuple) and len(pair) == 2 and _is_int(pair[0]) and pair[0] >= 0
                    and _is_real(pair[1]) and abs(pair[1]) <= LOGIT_BIAS_LIMIT for pair in bias),
                f"logit_bias maps token ids >= 0 to biases in [-{LOGIT_BIAS_LIMIT:g}, {LOGIT_BIAS_LIMIT:g}]")
        object.__setattr__(self, "logit_bias", tuple(sorted((t, float(v)) for t, v in bias)))

    @property
    def adjusts_logits(self) -> bool:
        """Whether the logits are changed before sampling (penalties, biases, min_tokens): by the
        request's own history, so each row is adjusted alone."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1
                    or self.logit_bias or self.min_tokens)

    @property
    def greedy(self) -> bool:
        """Whether this request takes the argmax (the sampler decides by the same threshold)."""
        return self.temperature < GREEDY_TEMPERATURE_BELOW


@dataclass(frozen=True)
class EngineConfig:
    """One worker's engine: KV pool shape, batching, prefix cache."""

    model: str = "smollm2"
    """`smollm2` (the bundled SmolLM2-135M-Instruct) or a local HF directory."""
    device: str = "cpu"
    dtype: str = "float32"
    attention_backend: str = "auto"
    """`auto`, `flashinfer`, `triton` or `torch`, resolved once when the engine is built (the model is
    made to run it, whatever it was built with): `auto` is flashinfer on CUDA for fp16/bf16 where it is
    installed with its prebuilt kernels, else triton on CUDA where importable, else torch (on CPU
    always torch); a named backend the device or dtype cannot run is a ConfigError there."""
    page_size: int = 16
    """Tokens per KV page; a power of two."""
    num_pages: int | None = None
    """KV pages in the device pool including scratch page 0; None: sized from `kv_memory_gib`."""
    kv_memory_gib: float | None = None
    """Memory for the KV pool when `num_pages` is None. None: `tandem serve` sizes the pool from its
    memory budget (`memory.budget_gib`, cluster/serve/memory.py); an engine made alone takes
    `DEFAULT_KV_MEMORY_GIB`."""
    chunk_size: int = 512
    """Prefill tokens per scheduler step (chunked prefill); decode tokens are not counted. A prompt
    that has waited `prefill_age_boost_s` adds one more chunk to every step's budget per such wait,
    up to 4 chunks (`engine/scheduler.py`: no prompt waits unboundedly behind decode steps)."""
    prefill_age_boost_s: float = 2.0
    max_running_requests: int = 64
    """Requests in the running batch at most."""
    max_model_len: int | None = None
    """Prompt + completion tokens at most; None: the model's max_position_embeddings."""
    cuda_graph: bool = True
    """Replay decode steps per batch-size bucket (CUDA graphs; on CPU the same gated static-buffer
    path run eagerly); False (`--no-cuda-graph`) runs every step eagerly."""
    graph_batch_sizes: tuple[int, ...] = ()
    """Batch-size buckets to capture; empty: 1, 2, 4, 8, 16, 24, 32, ... up to max_running_requests."""
    cpu_compile: bool | None = None
    """CPU, with `cuda_graph`: replayed single-request steps (bucket 1) run each decoder layer through
    one `torch.compile`d function (inductor; `kernels/cpu/compiled.py`), compiled at start-up (seconds,
    fewer from inductor's cache under ~/.cache/tandem/inductor; a served worker compiles beside
    serving and replays eagerly until then). Faster than eager at batch 1 with the same greedy tokens
    (docs/results.md#cpu-decode); bigger buckets stay eager (oneDNN's matmuls serve several rows
    well). None: on in `tandem serve`'s CPU workers
    that decode (decode, colocated), off in an engine made alone (tests, benches: `--cpu-compile`)
    and on prefill workers. `--no-cpu-compile` turns it off."""
    cpu_native_decode: bool = True
    """CPU, float32, with `cuda_graph`: replayed decode steps of up to 4 requests (buckets 1, 2, 4) run
    their decoder layers in C (`kernels/cpu/decode_layer.py`: each weight row read from memory once
    for all of them, four rows a pass; the norms, rotary, K/V write, attention and activation between
    them on the same threads), built on first use with the system C compiler. Faster than compiled
    at 1 request and than eager at 2 and 4 (docs/results.md#cpu-decode), with no compile at
    start-up. Takes precedence over `cpu_compile`, which serves where this is off or cannot
    (no C compiler, another dtype). `--no-cpu-native-decode` turns it off."""
    cpu_prepack: bool | None = None
    """CPU, float32 (and bfloat16 where the CPU has native bf16 dot products): keep every linear
    weight in oneDNN's packed layout too (`kernels/model/packed_linear.py`), about as much memory
    again as the weights; every eager matmul then runs on all of torch's threads without re-packing
    the weight. None: on where the engine decodes, off on a prefill worker (its matmuls have
    hundreds of rows, where the packed copy gains little, not worth a second copy of the weights).
    `--no-cpu-prepack` turns it off; a torch without oneDNN ignores it."""
    enable_prefix_cache: bool = True
    host_cache_ratio: float | None = None
    """L2: host-memory KV pages, as a multiple of the device pool's (`num_pages`); 0 turns the host
    tier off. Ignored without the prefix cache. None: `tandem serve` turns it off on CPU workers
    (there the device pool and the host tier are the same RAM: L2 would only hold copies a bigger
    L1 holds too) and uses `DEFAULT_HOST_CACHE_RATIO` on CUDA; an engine made alone takes
    `DEFAULT_HOST_CACHE_RATIO`."""
    host_cache_pages: int | None = None
    """L2 pages including a scratch page 0, overriding `host_cache_ratio`; 0 turns the host tier off."""
    write_policy: str = "write_through"
    """When a device page gets its host copy: `write_through` (on entering the prefix tree),
    `write_through_selective` (once matched `write_through_hits` times) or `write_back` (on L1 eviction)."""
    write_through_hits: int = 2
    """Matches after which `write_through_selective` backs a node up (>= 1)."""
    session_kv_fraction: float = 0.5
    """Streaming sessions may reserve at most this fraction of the device pool's tokens (their
    `capacity_tokens` summed), in [0, 1]; 0 refuses every session."""
    debug_kv: bool = False
    """Check KV integrity after every scheduler step (also set by TANDEM_DEBUG_KV=1)."""
    speculative: str = "none"
    """`none`, or `eagle`: an EAGLE draft head proposes `num_draft_tokens` tokens a step and the
    target verifies them in one forward (docs/design.md §6); the output is what `none` would give."""
    draft_model: str = ""
    """The draft head's directory (published EAGLE-1/2 or EAGLE-3 layout, or one `tandem train-eagle`
    wrote); "" with `eagle`: the head `tandem train-eagle` cached for `model`, resolved where the
    model is loaded."""
    num_draft_tokens: int = 3
    """Draft tokens proposed per request per step (the chain length k), in [1, 16]; with
    `speculative_topk` > 1 the depth of the draft tree."""
    speculative_topk: int = 1
    """Tree drafting: each level keeps the `speculative_topk` likeliest nodes (by the draft's
    cumulative probability) and the target verifies all `speculative_topk * num_draft_tokens` at once
    under a tree mask; 1 drafts a chain. Greedy and sampled requests alike; needs the torch or
    triton attention backend (FlashInfer's tree mask is not wired in), in [1, 8]."""
    speculative_tree_nodes: int = 0
    """Tree drafting: the verify takes this many of the tree's candidates (each expanded node's
    `speculative_topk` likeliest children), the likeliest by cumulative draft probability (EAGLE-2's
    re-ranking); 0: `speculative_topk * num_draft_tokens`. In [0, 64]."""
    tensor_parallel_size: int = 1
    """Ranks the model is split over, a process each (`kernels/model/tp.py`, `engine/tp.py`)."""
    speculative_max_batch: int = 8
    """Requests drafted for only while the running batch has at most this many: above it a verify
    costs more than the drafts save (measured, docs/results.md#speculative); the draft head's KV is kept
    current either way, so speculation resumes when the batch shrinks."""
    speculative_adaptive: bool = True
    """At or below `speculative_max_batch`, draft only where it pays: decode tokens/s with and without
    drafts are measured per batch size while serving, and the faster wins (`engine/spec/policy.py`).
    Off: always draft (what the bench times)."""

    def __post_init__(self) -> None:
        require(self.page_size >= 1 and self.page_size & (self.page_size - 1) == 0,
                 f"page_size must be a power of two >= 1, got {self.page_size}")
        require(self.num_pages is None or self.num_pages >= 2,
                 f"num_pages must be >= 2 (scratch page + one usable), got {self.num_pages}")
        require(self.kv_memory_gib is None or self.kv_memory_gib > 0,
                f"kv_memory_gib must be > 0, got {self.kv_memory_gib}")
        require(self.chunk_size >= 1, f"chunk_size must be >= 1, got {self.chunk_size}")
        require(_is_real(self.prefill_age_boost_s) and self.prefill_age_boost_s >= 0,
                f"prefill_age_boost_s must be a number >= 0 (0: off), got {self.prefill_age_boost_s!r}")
        require(self.max_running_requests >= 1, f"max_running_requests must be >= 1, got {self.max_running_requests}")
        require(self.dtype in DTYPES, f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        require(self.attention_backend in ATTENTION_BACKENDS,
                 f"attention_backend must be one of {ATTENTION_BACKENDS}, got {self.attention_backend!r}")
        require(self.host_cache_ratio is None or self.host_cache_ratio >= 0,
                f"host_cache_ratio must be >= 0, got {self.host_cache_ratio}")
        require(self.host_cache_pages is None or self.host_cache_pages == 0 or self.host_cache_pages >= 2,
                 f"host_cache_pages must be 0 (off) or >= 2 (scratch page + one usable), got {self.host_cache_pages}")
        require(self.write_policy in WRITE_POLICIES,
                 f"write_policy must be one of {WRITE_POLICIES}, got {self.write_policy!r}")
        require(0 <= self.session_kv_fraction <= 1,
                 f"session_kv_fraction must be in [0, 1], got {self.session_kv_fraction}")
        require(self.write_through_hits >= 1, f"write_through_hits must be >= 1, got {self.write_through_hits}")
        require(all(isinstance(s, int) and s >= 1 for s in self.graph_batch_sizes),
                 f"graph_batch_sizes must be positive integers, got {self.graph_batch_sizes}")
        require(self.speculative in SPECULATIVE_METHODS,
                f"speculative must be one of {SPECULATIVE_METHODS}, got {self.speculative!r}")
        require(_is_int(self.num_draft_tokens) and 1 <= self.num_draft_tokens <= 16,
                f"num_draft_tokens must be an integer in [1, 16], got {self.num_draft_tokens!r}")
        require(_is_int(self.speculative_topk) and 1 <= self.speculative_topk <= 8,
                f"speculative_topk must be an integer in [1, 8], got {self.speculative_topk!r}")
        require(_is_int(self.speculative_tree_nodes) and 0 <= self.speculative_tree_nodes <= 64,
                f"speculative_tree_nodes must be an integer in [0, 64], got {self.speculative_tree_nodes!r}")
        require(self.speculative_tree_nodes == 0 or self.speculative_topk > 1,
                f"speculative_tree_nodes {self.speculative_tree_nodes} takes a tree: set speculative_topk > 1")
        require(self.speculative_topk * self.num_draft_tokens <= 64,
                f"speculative_topk x num_draft_tokens must be at most 64 tree nodes, got "
                f"{self.speculative_topk} x {self.num_draft_tokens}")
        require(_is_int(self.tensor_parallel_size) and self.tensor_parallel_size >= 1,
                f"tensor_parallel_size must be an integer >= 1, got {self.tensor_parallel_size!r}")
        require(_is_int(self.speculative_max_batch) and self.speculative_max_batch >= 0,
                f"speculative_max_batch must be an integer >= 0, got {self.speculative_max_batch!r}")
        require(self.max_model_len is None or self.max_model_len >= 2,
                 f"max_model_len must be >= 2, got {self.max_model_len}")

    def useful_pages(self, max_model_len: int) -> int:
        """The most device pages a pool sized from memory gets: `USEFUL_POOL_BATCHES` running batches of
        full-length requests. A tiny model's pages are so small that a memory budget alone would give
        it millions, each one walked by every integrity check."""
        return 1 + -(-USEFUL_POOL_BATCHES * self.max_running_requests * max_model_len // self.page_size)

    def resolve(self, bytes_per_page: int, max_position_embeddings: int) -> EngineConfig:
        """Fill the auto fields from the loaded model; returns a new config."""
        max_model_len = self.max_model_len or max_position_embeddings
        require(max_model_len <= max_position_embeddings,
                 f"max_model_len {max_model_len} exceeds the model's {max_position_embeddings} positions")
        kv_bytes = (self.kv_memory_gib or DEFAULT_KV_MEMORY_GIB) * 2**30
        num_pages = self.num_pages or min(max(2, int(kv_bytes) // bytes_per_page), self.useful_pages(max_model_len))
        host_pages = self.host_cache_pages
        if host_pages is None:
            ratio = DEFAULT_HOST_CACHE_RATIO if self.host_cache_ratio is None else self.host_cache_ratio
            host_pages = int(num_pages * ratio)
        if not self.enable_prefix_cache or host_pages < 2:
            host_pages = 0
        return dataclasses.replace(self, num_pages=num_pages, max_model_len=max_model_len, host_cache_pages=host_pages,
                                   cpu_prepack=self.cpu_prepack is not False, cpu_compile=bool(self.cpu_compile))
