"""Wire types between workers (bottom of the import graph: plain frozen dataclasses, no torch).

A `Landing` (`common/landing.py`) tells a prefill worker where its KV goes: the decode worker's
transport session(s), the landing pages reserved for the request, and the layout to address them by.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Protocol

from common.config import SamplingParams
from common.landing import KVLayout, Landing, LandingShard  # noqa: F401 - wire types, re-exported
from common.logprobs import TokenLogprobs


class WorkerRole(str, enum.Enum):
    """What a worker does, typed on the wire (`WorkerStats.role`, `WorkerReady.role`, `WorkerCrashed.role`)
    and everywhere after. A `str` enum whose `str()` is its value, so a log line, a metric label and a
    JSON body (`/workers`) print "prefill", not the member's name."""

    PREFILL = "prefill"
    DECODE = "decode"  # decodes transferred KV; prefills locally when no prefill worker is alive
    COLOCATED = "colocated"  # prefills and decodes every request itself; never part of a disaggregated pair

    def __str__(self) -> str:
        return self.value


# ---- prefill <-> decode messages ---------------------------------------------------------------


@dataclass(frozen=True)
class KVComplete:
    """Prefill -> decode: every landing page of the request is written and retired; here is the
    first sampled token."""

    request_id: str
    first_token: int
    cached_tokens: int = 0  # prompt tokens the prefill worker's prefix cache served
    timings: tuple[tuple[str, float], ...] = ()  # prefill-side monotonic timestamps (same host only)
    draft_feature: bytes = b""
    """With EAGLE: the draft head's feature at the prompt's last position (float32), from which the
    decode worker drafts the request's first decode step; empty without speculation."""
    first_logprobs: TokenLogprobs | None = None  # the first token's, when the request asked for logprobs
    cached_tiers: tuple[int, int, int] = (0, 0, 0)  # cached_tokens by tier: (device, host, L3)
    prompt_logprobs: tuple[TokenLogprobs | None, ...] = ()  # each prompt token's (None first), when asked
    page_sums: tuple[int, ...] = ()
    """The digest of each landing page as the prefill worker shipped it (over ranks: of each decode rank's
    part, shard-major; `kv_store/transfer/page_digest.py`), verified by the decode worker before the
    first token goes out; () where not computed (a rank that sent no digests of its part)."""


@dataclass(frozen=True)
class KVProgress:
    """Prefill -> decode: the first `pages_written` landing pages are written (a write retired).
    Restarts the decode side's transfer deadline: a slow transfer that moves is not a stall."""

    request_id: str
    pages_written: int


class FinishReason(enum.Enum):
    """Why a request ended (the OpenAI API's `finish_reason` is its value)."""

    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or the context limit
    ABORT = "abort"


class Failure(enum.Enum):
    """Why a request ended with an error, which decides what the dispatcher does with it."""

    TRANSFER = "transfer"  # its KV transfer failed: re-routed while no token reached the client
    CORRUPT = "corrupt"  # its landed KV failed its checksum: re-routed (computed again) with a budget of its own
    REJECTED = "rejected"  # it can never be served as asked (a closed session, say): the client's error
    BUSY = "busy"  # no room for it there now (a session's KV budget full): the client retries later (429)
    INTERNAL = "internal"  # a fault of its own while serving it: a retry would meet it again


@dataclass(frozen=True)
class TransferAborted:
    """Prefill -> decode: this request's transfer ended without completing, and no write to its
    landing is outstanding or will be issued (the landing may be freed). `reason` says why."""

    request_id: str
    reason: str
    failure: Failure = Failure.TRANSFER  # or INTERNAL: a fault of the request's own ended it


@dataclass(frozen=True)
class AbortTransfer:
    """Decode -> prefill: stop this request's transfer (deadline hit, client gone). Answered by
    `TransferAborted` once no write is outstanding."""

    request_id: str
    reason: str


# ---- driver <-> worker process messages ---------------------------------------------------------


@dataclass(frozen=True)
class PoolStats:
    total: int
    free: int
    private: int
    cached: int
    in_flight: int


@dataclass(frozen=True)
class TierStats:
    """Cumulative figures of a worker's KV hierarchy (L1 device, L2 host, L3 remote store)."""

    l3: bool = False  # the host tier reads and writes the cluster's L3 store (routing credits its prefixes)
    page_size: int = 0  # tokens per KV page (routing sizes its picture of the worker's tiers with it)
    hit_tokens_l1: int = 0  # prompt tokens found on device at first admission
    hit_tokens_l2: int = 0  # ... loaded back from the host tier
    hit_tokens_l3: int = 0  # ... fetched from the remote store
    l1_to_l2_bytes: int = 0
    l1_to_l2_seconds: float = 0.0
    l2_to_l1_bytes: int = 0
    l2_to_l1_seconds: float = 0.0
    evicted_pages_l1: int = 0
    evicted_pages_l2: int = 0
    copy_errors: int = 0
    l3_get_pages: int = 0  # pages read from L3, verified
    l3_get_seconds: float = 0.0
    l3_put_pages: int = 0  # pages written to L3 (those it had already are not sent)
    l3_put_seconds: float = 0.0
    l3_errors: int = 0  # failed calls (server down, timeout, AUTH, OOM): every page they were for a miss
    l3_corrupt: int = 0  # values that failed verification (deleted, never used)
    transfer_corrupt: int = 0  # landed prompts whose page checksum failed (the request re-routed, never served)
    transfer_verified_pages: int = 0  # landed prompt pages whose checksums were checked
    l2_corrupt: int = 0  # host-tier pages whose checksum failed at load-back (dropped, recomputed)
    prefetches: tuple[tuple[str, int], ...] = ()  # (outcome, count): completed, partial, short, no_room, failed
    sessions_open: int = 0
    session_pages: int = 0  # device pages sessions hold between turns
    session_offloads: int = 0  # idle sessions whose history was let go to the host tier for a request's pages


@dataclass(frozen=True)
class GraphStats:
    """Cumulative figures of a worker's graph runner: steps replayed, and run eagerly by reason."""

    replays: int = 0
    fallbacks: tuple[tuple[str, int], ...] = ()  # (reason, steps): not_decode, batch_too_large, ...
    compiling: bool = False  # a CPU decode step still compiles beside serving (it replays eagerly meanwhile)
    computed_tokens: int = 0  # tokens its forward passes computed (prompt chunks, decode and verify rows)


@dataclass(frozen=True)
class SpecStats:
    """Cumulative figures of a worker's speculative decoding (all zero when it is off)."""

    verifies: int = 0  # verify rows scored
    accepted_per_verify: tuple[tuple[int, int], ...] = ()  # (drafts accepted, verifies)
    drafted_at: tuple[tuple[int, int], ...] = ()  # (draft position from 1, drafts verified there)
    accepted_at: tuple[tuple[int, int], ...] = ()  # (draft position from 1, drafts accepted there)
    draft_errors: int = 0  # steps whose drafts a draft-head fault dropped


@dataclass(frozen=True)
class WorkerStats:
    """A worker's view of itself, sent with every heartbeat."""

    role: WorkerRole
    device: PoolStats
    landing: PoolStats | None  # decode workers only: the landing pool
    num_running: int
    num_waiting: int
    num_transfers: int  # requests with a transfer not yet ended
    integrity_error: str  # "" when check_integrity() passed
    host_cache: PoolStats | None = None  # the L2 tier's pool; None without one
    tiers: TierStats = TierStats()
    graphs: GraphStats = GraphStats()
    spec: SpecStats = SpecStats()
    step_threads: tuple[tuple[int, int], ...] = ()  # (torch threads, steps run on that many), with a core share


@dataclass(frozen=True)
class WorkerReady:
    role: WorkerRole
    session: str  # transport session id


@dataclass(frozen=True)
class WorkerCrashed:
    role: WorkerRole
    error: str


@dataclass(frozen=True)
class Heartbeat:
    stats: WorkerStats | None  # None: a liveness beat from the beat thread, sent even mid-step


@dataclass(frozen=True)
class Reserve:
    """Driver -> decode: reserve a landing; answered by `Reserved`."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    peer: str  # the prefill worker's id


@dataclass(frozen=True)
class Reserved:
    request_id: str
    landing: Landing | None  # None: the landing pool is full, retry later
    error: str  # non-empty: the request can never be served (the caller gets it)


@dataclass(frozen=True)
class Prefill:
    """Driver -> prefill: compute the prompt's KV into `landing`."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    landing: Landing


@dataclass(frozen=True)
class PrefillAnswer:
    """Driver -> prefill: a request this worker prefilled has finished on its decode worker; compute
    the KV of `token_ids` (its prompt, then the answer but its last token) into this worker's prefix
    cache, so the conversation's next turn, which resends both, finds its whole history here. Nothing
    is sent back."""

    request_id: str  # the worker's own id for the work, unique among its requests
    token_ids: tuple[int, ...]
    prompt_len: int  # the part this worker prefilled before


@dataclass(frozen=True)
class Generate:
    """Driver -> decode: serve the request alone (local prefill: no prefill worker alive, or a turn of a
    streaming session, whose history is pinned on this worker)."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    session_id: str = ""  # a turn of this session (its prompt: the session's history + the new tokens)
    resume_output: tuple[int, ...] = ()
    """The output a worker that died had already streamed: the request resumes after it (migrated)."""


@dataclass(frozen=True)
class OpenSession:
    """Driver -> decode/colocated: open a streaming session here; answered by `SessionOpened`."""

    session_id: str
    capacity_tokens: int  # the session's history + one turn's prompt and max_tokens, at most
    idle_timeout_s: float  # idle this long between turns: closed, its KV left to the cache tiers


@dataclass(frozen=True)
class SessionOpened:
    session_id: str
    error: str  # non-empty: not opened (the session KV budget is full, or bad arguments)


@dataclass(frozen=True)
class CloseSession:
    """Driver -> decode/colocated: close a session (a turn still running ends as a plain request)."""

    session_id: str


@dataclass(frozen=True)
class Abort:
    request_id: str


@dataclass(frozen=True)
class PeerDead:
    peer: str  # prefill worker id, or decode transport session


@dataclass(frozen=True)
class TokenOutput:
    request_id: str
    new_token_ids: tuple[int, ...]
    finish_reason: FinishReason | None  # None while the request runs
    error: str
    cached_tokens: int = 0
    timings: tuple[tuple[str, float], ...] = ()  # on the finishing output: where the request spent time
    emitted_unix_s: float = 0.0  # wall clock when the worker sent it (token relay latency)
    failure: Failure | None = None  # with `error`: why (None exactly when `error` is empty)
    logprobs: tuple[TokenLogprobs, ...] = ()  # one per new token, when the request asked for them
    prompt_logprobs: tuple[TokenLogprobs | None, ...] = ()  # on its first output, when asked (None first)
    cached_tiers: tuple[int, int, int] | tuple[()] = ()  # on the finishing output: cached tokens (device, host, L3)


@dataclass(frozen=True)
class Shutdown:
    pass


@dataclass(frozen=True)
class RelayTo:
    """Dispatcher -> worker host: send every later message to the gateway (but heartbeats and a crash
    report) over a TCP connection to `host:port`, opened with `hello` (`common/relay.py`)."""

    host: str
    port: int
    hello: bytes


ToWorker = (Generate | OpenSession | CloseSession | Abort | Reserve | Prefill | PrefillAnswer | AbortTransfer
            | KVProgress | KVComplete | TransferAborted | PeerDead)
"""What a worker's `handle` takes: the dispatcher's messages and, relayed by it, a peer's."""
AboutRequest = (Generate | Abort | Reserve | Prefill | PrefillAnswer | AbortTransfer | KVProgress | KVComplete
                | TransferAborted)
"""The messages about one request (they carry its `request_id`): a fault handling one fails that request."""
FromWorker = TokenOutput | Reserved | SessionOpened | KVProgress | KVComplete | TransferAborted | AbortTransfer
"""What a worker's `handle`, `fail` and `step` return: to the dispatcher, or relayed by it to a peer."""


class Worker(Protocol):
    """What a worker host (`cluster/worker_host/loop.py`) knows of the worker it runs, whatever its role.

    `handle` answers a driver message at once (Reserved, a rejection) and may queue work; `step`
    does one unit of that work and returns what it produced (TokenOutput, KVProgress, KVComplete,
    TransferAborted, AbortTransfer). Neither blocks on a peer.
    """

    role: WorkerRole

    def start(self) -> None:
        """The loop begins serving (the worker reported ready): start what runs beside it (a CPU
        decode step's compile, on a thread of its own)."""

    def handle(self, msg: ToWorker) -> list[FromWorker]:
        """Apply one driver message; its immediate replies. ValueError-type rejections are replies, not raises.
        A message kind the role does not take raises TypeError."""

    def fail(self, msg: AboutRequest, error: str) -> list[FromWorker]:
        """`handle(msg)` raised: end the request `msg` is about (release what it holds); its replies."""

    def step(self) -> list[FromWorker]:
        """One scheduler step (and the transfers' housekeeping); the messages it produced."""

    def busy(self) -> bool:
        """Whether `step` has anything to do (requests, transfers or loads in flight, messages to hand over)."""

    def has_compute(self) -> bool:
        """Whether `step` would run a forward pass (else it only polls transfers and loads)."""

    def holds_a_core(self) -> bool:
        """Whether work beside the steps (the decode step's background compile) keeps a core busy: a
        worker on a core share then neither lends its threads nor borrows the idle workers'."""

    def wait_s(self) -> float:
        """Busy without compute: how long the loop may wait for a message before the next `step`
        (short while transfers or loads need polling; longer while only messages can move things)."""

    def stats(self) -> WorkerStats:
        """The heartbeat's view; runs the integrity check (a failure is reported in `error`)."""

    def max_request_tokens(self) -> int:
        """Tokens one request may hold here (context, device pool, landing)."""

    def check_integrity(self) -> None:
        """Raise AssertionError when the worker's KV pools are inconsistent."""

    def close(self) -> None:
        """Release the transport registrations (after the loop stopped)."""
