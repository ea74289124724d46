"""The router's configuration (the `router:` section of a cluster YAML): the policy's knobs
(`PolicyParams`, declared once there), re-routing, and admission."""

from __future__ import annotations

from dataclasses import dataclass

from common.config import require, require_min
from router.admission import DEFAULT_TTFT_BUDGET_S, AdmissionParams
from router.migration import MigrationParams
from router.policy import Policy
from router.policy_types import PolicyParams

POLICIES = tuple(p.value for p in Policy)


@dataclass(frozen=True)
class RouterConfig(PolicyParams):
    """Which worker serves a request (docs/design.md §8), and which requests are taken at all. The
    policy knobs are `PolicyParams`' fields; this adds the policy's name, re-routing and admission."""

    policy: str = "cache_aware"
    """One of round_robin | least_load | cache_aware | kv_cost."""
    max_transfer_retries: int = 1
    """Re-routes of a request whose KV transfer failed before any token reached the client (>= 0)."""
    max_migrations: int = 2
    """Times a request's stream moves to another worker when the one serving it dies mid-stream
    (>= 0; 0: such streams end with an error). It resumes after the tokens already streamed, token-
    identical with its seed (`router/migration.py`)."""
    migration_timeout_s: float = 30.0
    """How long such a stream waits for a worker to resume on (the dead one's restart, where it had no
    peer), seconds (> 0); past it the client gets the error."""
    max_queue_delay_s: float = DEFAULT_TTFT_BUDGET_S
    """Admission: the TTFT budget, seconds (> 0). A request is admitted and queues (in the router,
    holding no KV) while its predicted first token is within it; past it, it gets 429 + Retry-After
    at once. 30 s by default: an absolute bound a chat user tolerates, so ordinary load queues
    rather than being refused. The decode workers' adaptive limits are cut only while first tokens
    come later than it."""
    max_queued_requests: int = 256
    """Admission: requests waiting in the router per prefill worker at most (>= 0): a memory bound,
    sized for hundreds of waiting requests; the only bound until the worker's first prefills are
    measured."""
    prefill_window_tokens: int | None = None
    """Prompt tokens handed to one prefill worker and not yet delivered (>= 1); the rest wait in the
    router, holding no landing, so queue time never counts against a transfer deadline.
    None: twice prefill.engine.chunk_size."""
    prefill_answers: bool = True
    """When a request prefilled by a prefill worker finishes, that worker prefills the answer too (its
    whole pages, at most one chunk) into its prefix cache, so a conversation's next turn, which resends
    prompt and answer, finds its whole history cached there. The answer was decoded on another worker:
    without this, every turn re-prefills the previous answer before its new message. Costs the prefill
    worker the answer's tokens once, off the next turn's path unless the user replies at once."""
    max_requests_per_worker: int | None = None
    """Admission: requests one decode (or colocated) worker holds at once, from arrival (>= 1), at
    most; more get 429. None: the group's engine.max_running_requests, so none waits for a decode
    slot. The worker's adaptive limit (see max_queue_delay_s) starts here and never exceeds it."""

    def __post_init__(self):
        super().__post_init__()
        require(self.policy in POLICIES, f"policy must be one of {POLICIES}, got {self.policy!r}")
        require_min(self, "", 0, "max_transfer_retries", "max_queued_requests", "max_migrations")
        self.migration()  # its checks
        require(isinstance(self.max_queue_delay_s, (int, float)) and self.max_queue_delay_s > 0,
                f"max_queue_delay_s must be > 0, got {self.max_queue_delay_s}")
        for name in ("prefill_window_tokens", "max_requests_per_worker"):
            value = getattr(self, name)
            require(value is None or value >= 1, f"{name} must be >= 1 or null, got {value}")

    def migration(self) -> MigrationParams:
        return MigrationParams(self.max_migrations, self.migration_timeout_s)

    def admission(self, prefill_chunk_size: int, decode_max_running: int) -> AdmissionParams:
        """The admission knobs with the automatic ones resolved from the worker groups' engines."""
        return AdmissionParams(max_queue_delay_s=self.max_queue_delay_s, max_queued_requests=self.max_queued_requests,
                               prefill_window_tokens=self.prefill_window_tokens or 2 * prefill_chunk_size,
                               max_requests_per_worker=self.max_requests_per_worker or decode_max_running)
