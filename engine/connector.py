"""The engine's one seam with prefill/decode disaggregation (docs/design.md §2).

Every worker runs the same `EngineCore`; what differs is the connector it holds:

    NullConnector   colocated: KV never leaves the engine
    KVSender        prefill (prefill_worker/sender.py): ships each step's KV to a decode worker's landing
    KVReceiver      decode (decode_worker/receiver.py): landings in the host tier, loads to device

The seam exchanges data, as vLLM's `KVConnectorBase_V1` does: the engine alone owns its request
table and its batch, and a connector never holds the engine. A worker hands the engine a factory;
the engine makes its connector with `ConnectorPorts` (its KV tensors, device pool, the scheduler's
KV methods for requests, and four callables); then it calls the connector at fixed points of
`EngineCore.step`:

    before_step()      housekeeping before scheduling; outputs of requests it ended outside the batch
    take_stopped()     requests it stopped serving (an aborted transfer): the engine ends those that
                       hold no KV and takes running ones out of the batch; the connector hands those
                       back through take_finished() once their KV may be released
    take_arrived()     requests whose KV is on the device now: they join the batch
    after_commit(s)    the KV of step `s` is valid (before sampling)
    request_finished   a request produced its last token; True: the connector holds its KV from now on
    request_failed     a fault of the request's own ended it; True: the connector holds its KV and
                       tells its client
    take_finished()    held requests whose KV may be released now, with their reason
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from common.protocol import Failure

if TYPE_CHECKING:
    from common.config import SamplingParams
    from common.logprobs import TokenLogprobs
    from engine.output import StepOutput
    from engine.request import FinishReason, Request
    from engine.scheduler import ScheduledStep
    from kernels.kv_layout import KVCacheTensors
    from kv_store.device_pool import DevicePool
    from kv_store.kv_manager import ReleaseReason, ReqKV


class ConnectorKV(Protocol):
    """The request-KV owner's methods a connector may call (the engine lends its `Scheduler`)."""

    def open_for_load(self, request_id: str, num_tokens: int) -> ReqKV | None:
        """Device pages for `num_tokens` of KV that arrives whole (None: no room yet)."""

    def commit_loaded(self, kv: ReqKV, num_tokens: int) -> None:
        """The loaded KV is valid up to `num_tokens`."""

    def release_kv(self, kv: ReqKV, reason: ReleaseReason, token_ids: list[int] | None) -> None:
        """Release KV no request in the batch holds (None: its content is not cached)."""

    def pin_for_transfer(self, kv: ReqKV, first_page: int, end_page: int, handle: object) -> object: ...

    def unpin_transfer(self, handle: object) -> list[int]: ...

    def lent_pages(self, kv: ReqKV) -> list[int]: ...


@dataclass(frozen=True)
class ConnectorPorts:
    """All a connector gets of its engine: data and narrow calls, never the engine itself."""

    kv_cache: KVCacheTensors
    device_pool: DevicePool
    page_size: int
    kv: ConnectorKV
    new_request: Callable[[list[int], SamplingParams, str], Request]
    """A Request for a prompt whose KV will arrive (ValueError: it can never be served here)."""
    first_token: Callable[[Request, int, TokenLogprobs | None, Sequence[TokenLogprobs | None]], FinishReason | None]
    """Appends an arrived request's first token (with its logprobs and its prompt's) under its stop rules, as
    a token sampled here is; the reason it ended, or None (`EngineCore.accept_first_token`)."""
    export_feature: Callable[[str], bytes]
    """The draft head's feature at a request's last position (b"" without EAGLE)."""
    check_integrity: Callable[[], None]
    """The device KV's integrity check (raises AssertionError)."""


class KVConnector(Protocol):
    """Made by `EngineCore` from a worker's factory (`Callable[[ConnectorPorts], KVConnector]`): its
    constructor registers memory and builds its pools."""

    checksum_failures: int
    """Arrived KV that failed its checksum (each such request failed as a transfer, never served)."""
    verified_pages: int
    """Arrived KV pages whose checksums were checked."""

    def before_step(self) -> list[StepOutput]: ...

    def take_stopped(self) -> list[Request]: ...

    def take_arrived(self) -> list[tuple[Request, ReqKV]]: ...

    def after_commit(self, step: ScheduledStep) -> None: ...

    def request_finished(self, req: Request, reason: FinishReason) -> bool: ...

    def request_failed(self, req: Request, error: str, failure: Failure = Failure.INTERNAL) -> bool: ...

    def take_finished(self) -> list[tuple[Request, FinishReason]]: ...

    def busy(self) -> bool:
        """Whether the connector still has work of its own (transfers, loads, outputs to hand over)."""

    def check_integrity(self) -> None:
        """Raise AssertionError when the memory the connector owns (a host tier) is inconsistent."""

    def close(self) -> None: ...


class NullConnector:
    """Colocated: every request is prefilled and decoded here; nothing arrives or leaves. Its no-ops
    are also the defaults the other connectors inherit for the hooks they do not need."""

    checksum_failures = verified_pages = 0

    def before_step(self) -> list[StepOutput]:
        return []

    def take_stopped(self) -> list[Request]:
        return []

    def take_arrived(self) -> list[tuple[Request, ReqKV]]:
        return []

    def after_commit(self, step: ScheduledStep) -> None:
        pass

    def request_finished(self, req: Request, reason: FinishReason) -> bool:
        return False

    def request_failed(self, req: Request, error: str, failure: Failure = Failure.INTERNAL) -> bool:
        return False

    def take_finished(self) -> list[tuple[Request, FinishReason]]:
        return []

    def busy(self) -> bool:
        return False

    def check_integrity(self) -> None:
        pass

    def close(self) -> None:
        pass
