"""The plain values routing is decided over (DESIGN §8): what the policy sees of a request
(`RequestView`) and of each worker (`WorkerView`), the knobs it weighs them with (`PolicyParams`),
and what it decides (`Route`). Frozen dataclasses, each checked where it is made.

Both `router.policy` (which decides) and `router.state` (which records what was decided) read these;
this module imports stdlib, `common.config` and `common.protocol` only, so neither needs the other's.
"""

from __future__ import annotations

from dataclasses import dataclass

from common.config import require
from common.protocol import WorkerRole

DEFAULT_MAX_TREE_TOKENS = 1 << 20  # the token budget of one approximate prefix tree (`RouterState`)


@dataclass(frozen=True)
class RequestView:
    """What routing needs to know about one request."""

    request_id: str
    prompt_token_ids: tuple[int, ...]  # at least one token: a prefill needs something to compute
    max_tokens: int  # completion tokens at most (>= 1)

    def __post_init__(self):
        object.__setattr__(self, "prompt_token_ids", tuple(self.prompt_token_ids))
        if not self.prompt_token_ids:
            raise ValueError(f"request {self.request_id!r} has an empty prompt: the gateway should reject it")
        if self.max_tokens < 1:
            raise ValueError(f"request {self.request_id!r} has max_tokens {self.max_tokens} < 1")


@dataclass(frozen=True)
class WorkerView:
    """One worker as last reported, plus what the caller routed to it since."""

    worker_id: str
    role: WorkerRole
    alive: bool
    num_running: int
    num_waiting: int
    kv_usage: float  # device KV pages in use / usable, in [0, 1]
    pending_prefill_tokens: int = 0  # prompt tokens routed here whose prefill has not completed (caller-tracked)
    shares_l3: bool = False  # its host tier reads the cluster's L3 store: any prefix prefilled anywhere is near
    device_tokens: int = 0  # tokens its device pool holds (0: unknown, its tree is not bounded by it)
    host_tokens: int = 0  # tokens its prefix-cache host tier (L2) holds
    landing_tokens: int = 0  # a decode worker's landing: the longest prompt it can receive (0: not reported)

    def __post_init__(self):
        if not isinstance(self.role, WorkerRole):
            raise ValueError(
                f"worker {self.worker_id!r} role {self.role!r} is not a WorkerRole: passed the wire string?")
        if min(self.num_running, self.num_waiting, self.pending_prefill_tokens) < 0:
            raise ValueError(f"worker {self.worker_id!r} reports a negative count: {self}")
        if not 0.0 <= self.kv_usage <= 1.0:
            raise ValueError(f"worker {self.worker_id!r} kv_usage {self.kv_usage} outside [0, 1]")


@dataclass(frozen=True)
class Route:
    """Where one request goes. `prefill_id is None` means local prefill: `decode_id` computes the prompt."""

    prefill_id: str | None
    decode_id: str
    matched_prefix_tokens: int  # prompt prefix found in the chosen prefill-capable worker's tree (0: unknown)
    reason: str  # human-readable: which rule picked these workers (for logs and debugging)

    @property
    def local_prefill(self) -> bool:
        return self.prefill_id is None


@dataclass(frozen=True)
class PolicyParams:
    """Knobs of the policies. Loads are counted in requests; prompt work in tokens."""

    cache_threshold: float = 0.5
    """cache_aware takes the best-matching worker only if matched / prompt_len >= this, in [0, 1]."""
    balance_abs_threshold: int = 8
    """Load is imbalanced when max_load - min_load > this (>= 0) AND max_load > rel * min_load;
    cache_aware then ignores the cache and picks the least loaded worker (as SGLang's router)."""
    balance_rel_threshold: float = 1.5
    """The relative half of the imbalance test (>= 1)."""
    max_tree_tokens: int = DEFAULT_MAX_TREE_TOKENS
    """Token budget of each worker's approximate prefix tree (>= 1); pass it to `RouterState`."""
    tokens_per_load_unit: int = 1024
    """Prompt tokens of pending prefill that weigh as much as one running request (>= 1): the exchange
    rate between token work and request counts in least_load and in kv_cost's local-prefill sum."""
    decode_waiting_weight: float = 2.0
    """kv_cost: a waiting request costs this many running ones on a decode worker (>= 0); it is queued
    behind the batch, usually because KV is short."""
    decode_kv_usage_weight: float = 8.0
    """kv_cost: cost, in running requests, of a decode worker's device KV being full (>= 0); scaled by
    kv_usage, since a full pool means retraction or preemption ahead."""
    host_load_cost: float = 0.1
    """What a prompt token costs a worker to load back from its own host tier instead of prefilling it
    (in [0, 1]): a prefix that the router's picture of that worker's device pool lost, but its host
    tier still holds, counts as cached at 1 - this. A memory copy, far cheaper than a forward, but
    the request waits for it."""
    l3_load_cost: float = 0.2
    """What a prompt token costs a worker that shares L3 to fetch from there instead of prefilling it
    (in [0, 1]; device hits cost 0, prefill 1), for a prefix the router routed to any worker: cache_aware
    and kv_cost count such a prefix as cached at 1 - this. On a CPU a prefix came back from Redis in
    about a tenth of its prefill time (docs/results.md#kv-tiers); a little dearer here for a store
    shared by many."""

    local_prefill_max_tokens: int | None = None
    """Conditional disaggregation: with prefill and decode workers alive, a prompt whose uncached part on
    the decode worker the policy's local pick chooses (its length less that worker's match: a
    conversation's next turn finds its history where it was decoded) is at most this many tokens is
    prefilled by that decode worker (a local-prefill route: no KV transfer, the decode worker's own
    chunked prefill) instead of by a prefill worker (>= 0; 0 or None here: every prompt goes to a
    prefill worker; `tandem serve` resolves None by the decode workers' device, cluster/serve/config.py).
    A short prefill costs the decode batch it joins less than the transfer and hand-off; a long one
    is worth a worker of its own."""

    def __post_init__(self):
        value = self.local_prefill_max_tokens
        require(value is None or (isinstance(value, int) and not isinstance(value, bool) and value >= 0),
                f"local_prefill_max_tokens must be an integer >= 0 or null, got {value!r}")
        require(0.0 <= self.cache_threshold <= 1.0, f"cache_threshold must be in [0, 1], got {self.cache_threshold}")
        require(isinstance(self.balance_abs_threshold, int) and self.balance_abs_threshold >= 0,
                 f"balance_abs_threshold must be an integer >= 0, got {self.balance_abs_threshold!r}")
        require(self.balance_rel_threshold >= 1.0,
                 f"balance_rel_threshold must be >= 1, got {self.balance_rel_threshold}")
        require(isinstance(self.max_tree_tokens, int) and self.max_tree_tokens >= 1,
                 f"max_tree_tokens must be an integer >= 1, got {self.max_tree_tokens!r}")
        require(isinstance(self.tokens_per_load_unit, int) and self.tokens_per_load_unit >= 1,
                 f"tokens_per_load_unit must be an integer >= 1, got {self.tokens_per_load_unit!r}")
        require(self.decode_waiting_weight >= 0,
                 f"decode_waiting_weight must be >= 0, got {self.decode_waiting_weight}")
        require(self.decode_kv_usage_weight >= 0,
                 f"decode_kv_usage_weight must be >= 0, got {self.decode_kv_usage_weight}")
        require(0.0 <= self.l3_load_cost <= 1.0, f"l3_load_cost must be in [0, 1], got {self.l3_load_cost}")
        require(0.0 <= self.host_load_cost <= 1.0, f"host_load_cost must be in [0, 1], got {self.host_load_cost}")
