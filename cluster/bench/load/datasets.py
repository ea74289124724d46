"""What the load harness sends: a list of jobs, each one request or one multi-turn conversation.

    random         prompts of random token ids; input and output lengths drawn uniformly from
                   [len * (1 - r), len * (1 + r)] (r = --random-range-ratio, vLLM's rule)
    shared-prefix  --shared-prefix-groups random prefixes of --shared-prefix-len tokens; each prompt
                   is one prefix (round-robin) followed by a random suffix sized like `random`
    multi-turn     --num-prompts conversations of --multi-turn-turns turns; each turn resends the
                   history (earlier user turns and the answers as streamed, re-tokenized)
    jsonl          one JSON object per line: "prompt" (text or token ids) or "messages" (chat), with
                   "output_len" (or "max_tokens"); cycled when the file has fewer lines than asked
    mooncake-trace a trace in the published Mooncake format, replayed at its own times: one JSON object
                   per line, "timestamp" (ms), "input_length", "output_length", "hash_ids" (the prompt's
                   blocks of --trace-block-size tokens: equal ids, equal blocks, so a shared prefix is
                   shared); each block's tokens are drawn from its id, the prompt is its blocks cut to
                   input_length. --trace-token-scale scales lengths and the block size (a trace made
                   for a GPU cluster on a small machine), --trace-time-scale the gaps between arrivals
                   (2: half the rate); the first --num-prompts lines

Token-id prompts go to /v1/completions as ids; the chat endpoint gets them decoded by the tokenizer.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

DATASETS = ("random", "shared-prefix", "multi-turn", "jsonl", "mooncake-trace")
FIRST_TOKEN_ID = 10  # random ids start here: the lowest ids of most vocabularies are special tokens

Prompt = tuple[int, ...] | str | tuple[dict, ...]  # token ids | text | chat messages


class TextCodec(Protocol):
    """The tokenizer side the harness needs: ids -> text for chat prompts, text -> ids for histories."""

    def decode(self, token_ids: list[int]) -> str: ...

    def encode(self, text: str) -> list[int]: ...


@dataclass(frozen=True)
class SampleRequest:
    """One request: its prompt, its length in tokens (None: unknown until the server's usage says),
    and the output length asked for."""

    index: int  # position in the run; the merged results keep this order
    prompt: Prompt
    prompt_len: int | None
    output_len: int
    arrival_s: float | None = None  # a trace's arrival, from the run's start (None: the load shape's)


@dataclass(frozen=True)
class Conversation:
    """A multi-turn job: turn t sends | user 1 | answer 1 | ... | user t | and asks output_lens[t]."""

    index: int
    user_turns: tuple[tuple[int, ...], ...]
    output_lens: tuple[int, ...]
    think_time_s: float  # pause between an answer and the next turn

    @property
    def num_requests(self) -> int:
        return len(self.user_turns)


Job = SampleRequest | Conversation


@dataclass(frozen=True)
class DatasetSpec:
    """The dataset flags, validated."""

    name: str = "random"
    num_prompts: int = 100
    input_len: int = 256
    output_len: int = 64
    range_ratio: float = 0.0
    shared_prefix_len: int = 512
    shared_prefix_groups: int = 4
    turns: int = 4
    think_time_s: float = 0.0
    path: str | None = None
    vocab_size: int = 32000  # random ids are drawn from [FIRST_TOKEN_ID, vocab_size)
    trace_block_size: int = 512  # mooncake-trace: tokens per hash id (the published traces': 512)
    trace_token_scale: float = 1.0  # mooncake-trace: lengths and block size times this
    trace_time_scale: float = 1.0  # mooncake-trace: gaps between arrivals times this

    def __post_init__(self):
        if self.name not in DATASETS:
            raise ValueError(f"--dataset-name must be one of {', '.join(DATASETS)}, got {self.name!r}")
        if self.num_prompts < 1 or self.input_len < 1 or self.output_len < 1:
            raise ValueError("--num-prompts, --random-input-len and --random-output-len must be >= 1")
        if not 0.0 <= self.range_ratio < 1.0:
            raise ValueError(f"--random-range-ratio must be in [0, 1), got {self.range_ratio}")
        if self.shared_prefix_len < 0 or self.shared_prefix_groups < 1 or self.turns < 1 or self.think_time_s < 0:
            raise ValueError("--shared-prefix-len >= 0, --shared-prefix-groups >= 1, --multi-turn-turns >= 1 "
                             "and --multi-turn-think-time-s >= 0 are required")
        if (self.name in ("jsonl", "mooncake-trace")) != (self.path is not None):
            raise ValueError("--dataset-path goes with --dataset-name jsonl or mooncake-trace, and only with them")
        if self.trace_block_size < 1 or not self.trace_token_scale > 0 or not self.trace_time_scale >= 0:
            raise ValueError("--trace-block-size >= 1, --trace-token-scale > 0 and --trace-time-scale >= 0 "
                             "are required")
        if self.vocab_size <= FIRST_TOKEN_ID + 1:
            raise ValueError(f"vocab_size {self.vocab_size} leaves no room for random token ids")


def length_range(length: int, ratio: float) -> tuple[int, int]:
    """[low, high] of a length drawn with --random-range-ratio `ratio`; never below 1."""
    return max(1, math.floor(length * (1 - ratio))), max(1, math.ceil(length * (1 + ratio)))


def make_jobs(spec: DatasetSpec, seed: int) -> list[Job]:
    """The run's jobs in order; the same spec and seed give the same jobs."""
    rng = random.Random(seed)
    if spec.name == "random":
        return _random_samples(spec, rng, prefixes=None)
    if spec.name == "shared-prefix":
        prefixes = [_ids(rng, spec.shared_prefix_len, spec.vocab_size) for _ in range(spec.shared_prefix_groups)]
        return _random_samples(spec, rng, prefixes)
    if spec.name == "multi-turn":
        return _conversations(spec, rng)
    if spec.name == "mooncake-trace":
        return _trace_samples(spec, seed)
    assert spec.path is not None, "a jsonl dataset without its path: DatasetSpec checks --dataset-path"
    return _jsonl_samples(Path(spec.path), spec.num_prompts)


def num_requests(jobs: list[Job]) -> int:
    return sum(job.num_requests if isinstance(job, Conversation) else 1 for job in jobs)


def _ids(rng: random.Random, n: int, vocab_size: int) -> tuple[int, ...]:
    return tuple(rng.randrange(FIRST_TOKEN_ID, vocab_size) for _ in range(n))


def _random_samples(spec: DatasetSpec, rng: random.Random, prefixes: list[tuple[int, ...]] | None) -> list[Job]:
    in_low, in_high = length_range(spec.input_len, spec.range_ratio)
    out_low, out_high = length_range(spec.output_len, spec.range_ratio)
    samples: list[Job] = []
    for i in range(spec.num_prompts):
        prompt = _ids(rng, rng.randint(in_low, in_high), spec.vocab_size)
        if prefixes is not None:
            prompt = prefixes[i % len(prefixes)] + prompt
        samples.append(SampleRequest(i, prompt, len(prompt), rng.randint(out_low, out_high)))
    return samples


def _conversations(spec: DatasetSpec, rng: random.Random) -> list[Job]:
    in_low, in_high = length_range(spec.input_len, spec.range_ratio)
    out_low, out_high = length_range(spec.output_len, spec.range_ratio)
    return [Conversation(i, tuple(_ids(rng, rng.randint(in_low, in_high), spec.vocab_size) for _ in range(spec.turns)),
                         tuple(rng.randint(out_low, out_high) for _ in range(spec.turns)), spec.think_time_s)
            for i in range(spec.num_prompts)]


def _jsonl_samples(path: Path, num_prompts: int) -> list[Job]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if not rows:
        raise ValueError(f"{path}: no JSON lines")
    return [_jsonl_sample(i, rows[i % len(rows)], path) for i in range(num_prompts)]


def _jsonl_sample(index: int, row: dict, path: Path) -> SampleRequest:
    output_len = row.get("output_len", row.get("max_tokens"))
    if not isinstance(output_len, int) or output_len < 1:
        raise ValueError(f"{path}: every line needs a positive integer \"output_len\" (or \"max_tokens\")")
    if "messages" in row:
        return SampleRequest(index, tuple(row["messages"]), row.get("prompt_len"), output_len)
    prompt = row.get("prompt")
    if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        return SampleRequest(index, tuple(prompt), len(prompt), output_len)
    if not isinstance(prompt, str):
        raise ValueError(f"{path}: every line needs \"prompt\" (text or token ids) or \"messages\"")
    return SampleRequest(index, prompt, row.get("prompt_len"), output_len)


def _trace_samples(spec: DatasetSpec, seed: int) -> list[Job]:
    assert spec.path is not None, "a trace without its path: DatasetSpec checks --dataset-path"
    path = Path(spec.path)
    rows = [json.loads(line) for line in path.read_text().splitlines()[:spec.num_prompts] if line.strip()]
    if not rows:
        raise ValueError(f"{path}: no JSON lines")
    block = max(1, round(spec.trace_block_size * spec.trace_token_scale))
    blocks: dict[int, tuple[int, ...]] = {}
    t0 = rows[0].get("timestamp", 0)
    samples: list[Job] = []
    for i, row in enumerate(rows):
        try:
            input_len = max(1, round(int(row["input_length"]) * spec.trace_token_scale))
            output_len = max(1, round(int(row["output_length"]) * spec.trace_token_scale))
            hash_ids, at_ms = [int(h) for h in row.get("hash_ids", ())], float(row.get("timestamp", t0))
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"{path}: line {i + 1} needs \"input_length\", \"output_length\" (integers), "
                             f"\"timestamp\" (ms) and \"hash_ids\" (integers): {exc}") from None
        prompt: tuple[int, ...] = ()
        for h in hash_ids:
            if h not in blocks:
                blocks[h] = _ids(random.Random(f"{seed}:{h}"), block, spec.vocab_size)
            prompt += blocks[h]
        if len(prompt) < input_len:  # the trace's blocks fall short: the rest is this request's own
            prompt += _ids(random.Random(f"{seed}:tail:{i}"), input_len - len(prompt), spec.vocab_size)
        prompt = prompt[:input_len]
        samples.append(SampleRequest(i, prompt, len(prompt), output_len,
                                     max(0.0, (at_ms - t0) / 1e3) * spec.trace_time_scale))
    return samples


class TokenizerCodec:
    """A Hugging Face tokenizer as a `TextCodec` (no special tokens added: prompts are raw)."""

    def __init__(self, model_dir: str):
        from kernels.model.tokenizer import load_tokenizer

        self.model_dir = model_dir
        self.tokenizer = load_tokenizer(Path(model_dir))

    @property
    def vocab_size(self) -> int:
        return len(self.tokenizer)

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids)

    def encode(self, text: str) -> list[int]:
        from kernels.model.tokenizer import encode_prompt

        return encode_prompt(self.tokenizer, text)
