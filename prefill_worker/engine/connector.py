"""The engine's one seam with prefill/decode disaggregation (docs/design.md §2).

Every worker runs the same `EngineCore`; what differs is the connector it holds:

    NullConnector   colocated: KV never leaves the engine
    KVSender        prefill (prefill_worker/sender.py): ships each step's KV to a decode worker's landing
    KVReceiver      decode (decode_worker/receiver.py): landings in the host tier, loads to device

The engine calls the connector at fixed points of `EngineCore.step` (its scheduler side follows
vLLM's `KVConnectorBase_V1`: `request_finished` / finished sending / finished receiving):

    before_step()      housekeeping before scheduling; outputs of requests it ended outside the batch
    take_arrived()     requests whose KV is on the device now: they join the batch
    after_commit(s)    the KV of step `s` is valid (before sampling)
    request_finished   a request produced its last token; True: the connector holds its KV from now on
    request_failed     a fault of the request's own ended it; True: the connector tells its client
    take_finished()    held requests whose KV may be released now, with their reason
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from kv_store.req_kv import ReqKV
    from prefill_worker.engine.core import EngineCore, StepOutput
    from prefill_worker.engine.request import FinishReason, Request
    from prefill_worker.engine.scheduler import ScheduledStep


class KVConnector(Protocol):
    def attach(self, engine: EngineCore) -> None:
        """Called once by the engine's constructor, its pools built: register memory, build tiers."""

    def before_step(self) -> list[StepOutput]: ...

    def take_arrived(self) -> list[tuple[Request, ReqKV]]: ...

    def after_commit(self, step: ScheduledStep) -> None: ...

    def request_finished(self, req: Request, reason: FinishReason) -> bool: ...

    def request_failed(self, req: Request, error: str) -> bool: ...

    def take_finished(self) -> list[tuple[Request, FinishReason]]: ...

    def can_retract(self, req: Request) -> bool:
        """Whether the scheduler may retract `req` (release its KV to make room)."""

    def loads_in_flight(self) -> frozenset:
        """Host->device loads not yet completed, each with `.pages` (the device pages it writes): the
        graph runner replays no step that reads one of them (docs/design.md §5)."""

    def busy(self) -> bool:
        """Whether the connector still has work of its own (transfers, loads, outputs to hand over)."""

    def check_integrity(self) -> None:
        """Raise AssertionError when the memory the connector owns (a host tier) is inconsistent."""

    def close(self) -> None: ...


class NullConnector:
    """Colocated: every request is prefilled and decoded here; nothing arrives or leaves. Its no-ops
    are also the defaults the other connectors inherit for the hooks they do not need."""

    def attach(self, engine: EngineCore) -> None:
        pass

    def before_step(self) -> list[StepOutput]:
        return []

    def take_arrived(self) -> list[tuple[Request, ReqKV]]:
        return []

    def after_commit(self, step: ScheduledStep) -> None:
        pass

    def request_finished(self, req: Request, reason: FinishReason) -> bool:
        return False

    def request_failed(self, req: Request, error: str) -> bool:
        return False

    def take_finished(self) -> list[tuple[Request, FinishReason]]:
        return []

    def can_retract(self, req: Request) -> bool:
        return True

    def loads_in_flight(self) -> frozenset:
        return frozenset()

    def busy(self) -> bool:
        return False

    def check_integrity(self) -> None:
        pass

    def close(self) -> None:
        pass
