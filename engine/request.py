"""A generation request inside one worker: its tokens, lifecycle state and KV handle.

Lifecycle (each move is a method that raises on an illegal transition):

    LOADING <--start_loading-- WAITING --admit--> RUNNING --finish--> FINISHED
       +--------loaded------------>  ^                  |
                                     +----retract-------+    abort: WAITING | LOADING | RUNNING -> FINISHED

LOADING: its cached prefix is being copied from the host tier to the device (`load_ticket`).
"""

from __future__ import annotations

import enum
import itertools
import random
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from common.config import SamplingParams
from common.logprobs import TokenLogprobs
from common.protocol import FinishReason  # the engine's name for it too
from kv_store.kv_manager import ReqKV

if TYPE_CHECKING:
    from engine.grammar import GrammarState
    from engine.stop import StopRules
    from kv_store.host_cache import LoadTicket


def check_tokens(prompt_token_ids: Sequence[int], resumed: Sequence[int], vocab: int, limit: int,
                 max_tokens: int) -> None:
    """ValueError unless a request of `prompt_token_ids` (its output so far `resumed`) can run on an
    engine of `vocab` tokens holding `limit` tokens a request."""
    if any(not 0 <= t < vocab for t in prompt_token_ids):
        raise ValueError(f"prompt token ids must be in [0, {vocab})")
    if len(prompt_token_ids) >= limit:
        raise ValueError(f"prompt of {len(prompt_token_ids)} tokens leaves no room to generate: this engine "
                         f"holds at most {limit} tokens per request (context length / KV pool)")
    if any(not 0 <= t < vocab for t in resumed):
        raise ValueError(f"resumed output token ids must be in [0, {vocab})")
    if resumed and (len(resumed) >= max_tokens or len(prompt_token_ids) + len(resumed) >= limit):
        raise ValueError(f"a resumed output of {len(resumed)} tokens leaves no room to generate (max_tokens "
                         f"{max_tokens}, {limit} tokens a request here)")


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    LOADING = "loading"
    RUNNING = "running"
    FINISHED = "finished"


class IllegalTransition(RuntimeError):
    pass


_arrival = itertools.count()


@dataclass
class TierState:
    """A request's dealings with the host tier (L2) and L3; written by the scheduler alone."""

    host_hit_tokens: int = 0
    """Prompt tokens loaded back from the host tier before its first admission (of `cached_tokens`)."""
    l3_hit_tokens: int = 0
    """Of those, tokens an L3 prefetch had brought to the host tier."""
    l3_checked: bool = False
    """Whether the host tier has looked its prompt up in L3 (once per request)."""
    load_ticket: LoadTicket | None = None
    """Set while its prefix is loading, and until admission takes the loaded pages."""

    def ticket(self) -> LoadTicket:
        """`load_ticket`, for a request whose prefix is loading (LOADING)."""
        assert self.load_ticket is not None, "a loading request holds no load ticket: dropped before its load ended?"
        return self.load_ticket


@dataclass
class DraftState:
    """A request's speculative drafts; written by the speculator (cleared on retract and finish)."""

    token_ids: list[int] = field(default_factory=list)
    """Tokens a draft head proposed after the last one, verified by the next step; their KV slots
    are allocated (`kv.kv_allocated_len` covers them). Empty while not speculating."""
    parents: list[int] | None = None
    """Tree drafts: the verify row of each draft's parent (row 0 is the last token, row i + 1 draft i;
    `kernels.speculative`); None for a chain."""
    feature: bytes = b""
    """Arrived from a prefill worker: the head's feature to draft its first decode step from
    (`KVComplete.draft_feature`); used up when the decode engine admits it."""

    def clear(self) -> None:
        """Drop the drafts (the feature stays until the speculator uses it)."""
        self.token_ids, self.parents = [], None


ENGINE_MARKS = ("received", "admitted", "tier_load_start", "tier_load_done", "first_token")
"""The timestamps a `Request` takes itself (`Request.timings`)."""


def prefill_marks(timings: Mapping[str, float] | Iterable[tuple[str, float]]) -> dict[str, float]:
    """A prefill worker's timings as the decode side keeps them: its engine's own marks renamed
    `prefill_<mark>`, so they never mix with the decode engine's (`router.timeline` reads both)."""
    return {(f"prefill_{k}" if k in ENGINE_MARKS else k): v for k, v in dict(timings).items()}


@dataclass(eq=False)
class Request:
    """Prompt + output tokens of one request. `kv` is held only while RUNNING."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    output_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None  # set exactly when FINISHED
    kv: ReqKV | None = None  # set exactly when RUNNING
    cached_tokens: int = 0
    """Prompt tokens served from the prefix cache (any tier) at first admission (`tier.host_hit_tokens`
    of them loaded back from the host tier)."""
    session_id: str = ""
    """The streaming session this request is a turn of ("" for none)."""
    tier: TierState = field(default_factory=lambda: TierState())
    """Its dealings with the host tier and L3 (the scheduler's)."""
    num_retractions: int = 0
    error: str = ""
    """Why the request ended in ABORT when the client did not ask for it (transfer failure, ...)."""
    timings: dict[str, float] = field(default_factory=dict)
    """Monotonic timestamps of lifecycle events: this engine's ("received", first "admitted", first
    "tier_load_start" / "tier_load_done", "first_token" computed here) and its connector's
    ("prefill_submitted", "compute_done", "transfer_done", "reserved", "load_done", ...)."""
    arrival: int = field(default_factory=lambda: next(_arrival))
    sample_seed: int = 0
    stop_rules: StopRules | None = None
    """Its stop rules with their incremental state; set by the engine that admits it."""
    spec: DraftState = field(default_factory=lambda: DraftState())
    """Its drafts for the next step (the speculator's)."""
    prompt_shared: bool = False
    """Its prompt's whole pages entered the prefix tree while it runs (`Scheduler.share_prompt`)."""
    output_logprobs: list[TokenLogprobs] = field(default_factory=list)
    """With `params.logprobs`: one per output token, in order (`engine.logprobs`)."""
    prompt_logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    """With `params.prompt_logprobs`: one per prompt token (None first), filled as its chunks run."""
    prompt_logprobs_sent: bool = False
    """Its prompt logprobs went out with its first output."""
    grammar: GrammarState | None = None
    """With `params.grammar`: its matcher, past every output token (`engine/structured.py`)."""

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise ValueError(f"request {self.request_id}: empty prompt")
        seed = self.params.seed
        self.sample_seed = seed if seed is not None else random.getrandbits(62)
        self.timings.setdefault("received", time.monotonic())

    @property
    def text_len(self) -> int | None:
        """Where a stop string cut the output text (chars); None: not cut."""
        return self.stop_rules.text_len if self.stop_rules is not None else None

    @property
    def cached_tiers(self) -> tuple[int, int, int]:
        """`cached_tokens` by the tier that held them at admission: (device, host, L3)."""
        host, l3 = self.tier.host_hit_tokens, self.tier.l3_hit_tokens
        return self.cached_tokens - host, host - l3, l3

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Its prompt's logprobs are asked for and not all known yet: the prompt is computed whole
        (no cached prefix reused) until its first token."""
        return self.params.prompt_logprobs is not None and not self.output_token_ids

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def held_kv(self) -> ReqKV:
        """`kv`, for a request that must hold it (RUNNING)."""
        assert self.kv is not None, f"request {self.request_id} ({self.status.value}) holds no KV: used after release?"
        return self.kv

    @property
    def num_uncomputed(self) -> int:
        """Tokens whose KV is not written yet: 1 while decoding, more while prefilling."""
        return self.num_tokens - self.held_kv().kv_committed_len

    def admit(self, kv: ReqKV) -> None:
        self._move(RequestStatus.WAITING, RequestStatus.RUNNING)
        self.kv = kv
        self.timings.setdefault("admitted", time.monotonic())

    def start_loading(self, ticket: LoadTicket) -> None:
        self._move(RequestStatus.WAITING, RequestStatus.LOADING)
        self.tier.load_ticket = ticket
        self.timings.setdefault("tier_load_start", time.monotonic())

    def loaded(self) -> None:
        self._move(RequestStatus.LOADING, RequestStatus.WAITING)
        self.timings.setdefault("tier_load_done", time.monotonic())

    def resume(self, output_token_ids: Sequence[int]) -> None:
        """A request another worker was serving when it died: `output_token_ids` already reached the
        client. It runs as a retracted one does (its prompt and that output prefilled, through the
        prefix cache and the tiers), so every rule sees its whole output: the sampler's position
        (`row_generator(seed, len(output))`: with its seed, token-identical to an undisturbed run),
        penalties, `min_tokens` and `max_tokens`, stop strings (fed here), the grammar (its matcher is
        made by replaying the output). The prompt's logprobs went out with its first tokens."""
        assert self.status is RequestStatus.WAITING and not self.output_token_ids, self.request_id
        self.output_token_ids = list(output_token_ids)
        self.prompt_logprobs_sent = True
        if self.stop_rules is not None:
            self.stop_rules.resume(self.output_token_ids)

    def retract(self) -> None:
        self._move(RequestStatus.RUNNING, RequestStatus.WAITING)
        self.kv = None
        self.spec.clear()
        self.num_retractions += 1

    def finish(self, reason: FinishReason) -> None:
        if self.status is RequestStatus.FINISHED:
            raise IllegalTransition(f"request {self.request_id} finished twice ({self.finish_reason} then {reason})")
        self.status, self.finish_reason, self.kv = RequestStatus.FINISHED, reason, None
        self.spec.clear()

    def _move(self, src: RequestStatus, dst: RequestStatus) -> None:
        if self.status is not src:
            raise IllegalTransition(f"request {self.request_id}: {self.status.value} -> {dst.value} is illegal")
        self.status = dst
