"""What a `router.dispatcher.Dispatcher` is built from: its knobs (`DispatcherConfig`, frozen, resolved
once by whoever builds it: `tandem serve` from the router, gateway, cluster and transport sections) and
its collaborators (`DispatcherParts`, each owning its own state), wired by `DispatcherParts.build` alone.
`Dispatcher.build` makes a dispatcher of both."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from common.config import require, require_min
from router.admission import AdmissionParams
from router.answers import Answers
from router.migration import MigrationParams, Migrations
from router.picker import RoutePicker
from router.policy import Policy
from router.policy_types import PolicyParams
from router.relay_endpoint import RelayEndpoint
from router.sessions import SessionTable
from router.state import RouterState
from router.transfer_phase import TransferPhase


@dataclass(frozen=True)
class DispatcherConfig:
    """The dispatcher's knobs. Its automatic values (admission's window, the per-worker limit) are
    resolved before it is built (`RouterConfig.admission`); live objects (the worker views, the
    tokenizer, the clock) are passed beside it."""

    model_name: str
    """The name requests are answered under (unless `gateway.served_model_name` says otherwise)."""
    max_model_len: int
    """Prompt + completion tokens a request may have at most (>= 0; 0: unknown, an offline run that
    checks no request's length)."""
    policy: Policy = Policy.CACHE_AWARE
    """Which worker serves a request (docs/design.md §8)."""
    policy_params: PolicyParams = PolicyParams()
    """The policy's knobs (a `RouterConfig` is one); `max_tree_tokens` also bounds the router's trees."""
    admission: AdmissionParams = AdmissionParams()
    """Which new requests are taken, and each prefill worker's window (`router.admission`)."""
    migration: MigrationParams = MigrationParams()
    """How streams whose worker died or drains resume on another (`router.migration`)."""
    max_pending: int = 256
    """Requests in flight at most (>= 1; `gateway.max_pending_requests`); more get 429 at once."""
    max_transfer_retries: int = 1
    """Re-routes of a request whose transfer failed before any token reached the client (>= 0)."""
    refresh_interval_s: float = 0.5
    """Seconds between two pulls of the worker views (> 0; `cluster.heartbeat_interval_s`)."""
    collect_timeout_s: float = 5.0
    """Seconds one long-poll for a worker's messages waits for one (> 0)."""
    reserve_retry_s: float = 0.05
    """Seconds a reservation whose decode worker had no room to land it backs off (> 0)."""
    landing_timeout_s: float = 30.0
    """Seconds after its first reservation a request that finds no landing fails (> 0;
    `transport.bootstrapping_s`)."""
    session_open_timeout_s: float = 10.0
    """Seconds a worker has to open a streaming session (> 0)."""
    prefill_answers: bool = True
    """A finished request's answer is prefilled by its prefill worker too (`RouterConfig.prefill_answers`)."""
    relay_host: str | None = None
    """Where the token relay (`common/relay.py`) listens; None: every message comes by long-poll."""

    def __post_init__(self):
        require(isinstance(self.policy, Policy), f"policy must be a Policy, got {self.policy!r}")
        require_min(self, "", 0, "max_model_len", "max_transfer_retries")
        require_min(self, "", 1, "max_pending")
        require_min(self, "", 0, "refresh_interval_s", "collect_timeout_s", "reserve_retry_s",
                    "landing_timeout_s", "session_open_timeout_s", strict=True)


@dataclass(frozen=True)
class DispatcherParts:
    """The dispatcher's collaborators. Each owns its state; the dispatcher calls them and applies what
    they answer, and none of them calls back into it."""

    clock: Callable[[], float]  # seconds, monotonic: every deadline and rate the router keeps
    state: RouterState  # the router's guess at each worker's prefix cache
    picker: RoutePicker  # admission at arrival and the policy's choice of workers
    transfers: TransferPhase  # reservations, hand-offs and relays of the transfers in flight
    answers: Answers  # what a finished request leaves for its conversation's next turn
    sessions: SessionTable  # which worker holds each streaming session
    migrations: Migrations  # the streams waiting for a worker to resume on
    token_relay: RelayEndpoint  # the dispatcher's end of the token relay

    @classmethod
    def build(cls, config: DispatcherConfig, clock: Callable[[], float]) -> DispatcherParts:
        """Every collaborator, made from `config`; the picker and the answers share the one `state`."""
        state = RouterState(config.policy_params.max_tree_tokens)
        return cls(clock, state, RoutePicker(config.policy, config.policy_params, state, clock),
                   TransferPhase(clock, config.reserve_retry_s), Answers(state, config.prefill_answers),
                   SessionTable(), Migrations(config.migration), RelayEndpoint(config.relay_host))
