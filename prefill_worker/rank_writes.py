"""A prefill worker's writes when its KV or its peer's landing spans tensor-parallel ranks.

Each prefill rank holds its KV heads' part of every page; each decode rank's landing holds its
heads' part (`common/landing.py`). So one "write pages [start, stop) of a request" is several
transfers, one per (prefill rank, decode rank) pair sharing heads (`kv_store/transfer/heads.py`),
each made by the prefill rank that holds the bytes, straight into the decode rank's memory:

    rank 0 (the worker's engine)   its own writes, one per landing shard: `ShardWrites.write`
    ranks 1.. (`RankSender`)       told by rank 0 over the control group ("ship"), they write theirs
                                   and report on them when rank 0 asks ("ship_poll", one gather)

`ShardWrites` gives the sender one handle for all of them, with a transport's calls (poll, error,
settled, retire): DONE when every part is, FAILED when any part is, settled when no part can still
move a byte. Each rank digests the part of the landing pages its heads make (`page_digest.py`) as it
writes them and reports those sums with its DONE; rank 0 adds them up (`add_other_sums`). Rank 0's
pins on the pages last until it is retired, and page ids are rank 0's on every rank, so no rank's
pages are reused while any rank still reads them. With one rank and a one-rank landing the handle is
the transport's own.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from common.landing import Landing
from kv_store.transfer.base import TransferError, TransferHandle, TransferStatus, Transport
from kv_store.transfer.heads import SourceKV, head_ops, sent_heads

if TYPE_CHECKING:
    from engine.tp import ControlGroup
    from engine.tp_launch import RankContext
    from kv_store.transfer.page_digest import PageDigest, PartialSums

log = logging.getLogger("tandem.prefill")
_KEYS = itertools.count(1)


@dataclass(frozen=True, eq=False)
class GroupWrite:
    """One write of a request's pages made of several transfers (this rank's `parts`, the other
    ranks' under `key`). Hashable by identity: it is the IN_FLIGHT owner of the pages it reads."""

    key: int
    parts: tuple[TransferHandle, ...]
    num_bytes: int
    others: bool
    refused: str = ""  # a part the transport refused: FAILED once the others settle


@dataclass
class _Report:
    """What the other ranks said of one write: per rank (status, error, settled, sums) once terminal;
    sums: its `PageDigest.shard_sums` of the pages written (start, sums), or None."""

    ranks: dict[int, tuple[str, str, bool, tuple | None]] = field(default_factory=dict)


class OtherRanks:
    """Rank 0's side of the other ranks' writes (`RankSender` on each); `held`: each rank's KV heads."""

    def __init__(self, control: ControlGroup, held: list[range]) -> None:
        self.control, self.held, self.size = control, held, len(held)
        self._reports: dict[int, _Report] = {}

    @property
    def num_kv_heads(self) -> int:
        return max(heads.stop for heads in self.held)

    def ship(self, key: int, landing: Landing, src_pages: list[int], start: int) -> None:
        self.control.send(("ship", key, landing, tuple(src_pages), start))
        self._reports[key] = _Report()

    def refresh(self) -> None:
        """Ask the other ranks how their writes stand (one broadcast, one gather), if any is open."""
        if not any(self._open(report) for report in self._reports.values()):
            return
        self.control.send(("ship_poll",))
        answers = self.control.gather(None)
        assert answers is not None, "rank 0's gather came back empty: OtherRanks on a rank other than 0?"
        for rank, said in enumerate(answers):
            for key, state in (said or {}).items():
                if key in self._reports:
                    self._reports[key].ranks[rank] = state

    def status(self, key: int) -> TransferStatus:
        states = self._reports[key].ranks.values()
        if any(status == TransferStatus.FAILED.value for status, *_ in states):
            return TransferStatus.FAILED
        return TransferStatus.DONE if len(states) == self.size - 1 else TransferStatus.PENDING

    def error(self, key: int) -> str:
        return "; ".join(f"rank {rank}: {error}" for rank, (_, error, *_) in self._reports[key].ranks.items() if error)

    def sums(self, key: int) -> list[tuple]:
        """The (start, sums) each other rank reported with its DONE (those that reported any)."""
        return [state[3] for state in self._reports[key].ranks.values() if state[3] is not None]

    def settled(self, key: int) -> bool:
        report = self._reports[key]
        return len(report.ranks) == self.size - 1 and all(state[2] for state in report.ranks.values())

    def retire(self, key: int) -> None:
        self._reports.pop(key, None)

    def _open(self, report: _Report) -> bool:
        return len(report.ranks) < self.size - 1 or not all(state[2] for state in report.ranks.values())


class ShardWrites:
    """This rank's writes of its heads into a landing's shards, and (rank 0 over ranks) the other
    ranks', as one handle with a transport's calls."""

    def __init__(self, transport: Transport, others: OtherRanks | None = None) -> None:
        self.transport, self.others = transport, others

    def write(self, source: SourceKV, landing: Landing, src_pages: list[int],
              start: int) -> TransferHandle | GroupWrite:
        """Write `source`'s `src_pages` (the request's pages [start, start + len)) into `landing`; the
        other ranks write theirs. Raises `TransferError` when nothing was written; a refusal after
        some part went out is a FAILED handle."""
        parts, refused = [], ""
        for session, ops in head_ops(source, src_pages, landing, start).items():
            try:
                parts.append(self.transport.write(session, ops))
            except TransferError as exc:
                if not parts:
                    raise
                refused = str(exc)
                break
        if self.others is None and len(parts) == 1:
            return parts[0]
        key = next(_KEYS)
        if self.others is not None and not refused:
            self.others.ship(key, landing, src_pages, start)
        return GroupWrite(key, tuple(parts), sum(p.num_bytes for p in parts), self.others is not None and not refused,
                          refused)

    def refresh(self) -> None:
        if self.others is not None:
            self.others.refresh()

    def poll(self, handle: TransferHandle | GroupWrite) -> TransferStatus:
        if isinstance(handle, TransferHandle):
            return self.transport.poll(handle)
        states = [self.transport.poll(part) for part in handle.parts]
        if handle.others:
            states.append(self._ranks().status(handle.key))
        if handle.refused or TransferStatus.FAILED in states:
            return TransferStatus.FAILED
        return TransferStatus.PENDING if TransferStatus.PENDING in states else TransferStatus.DONE

    def error(self, handle: TransferHandle | GroupWrite) -> object:
        if isinstance(handle, TransferHandle):
            return self.transport.error(handle)
        errors = [str(e) for e in (self.transport.error(part) for part in handle.parts) if e is not None]
        if handle.others and self._ranks().error(handle.key):
            errors.append(self._ranks().error(handle.key))
        return "; ".join(([handle.refused] if handle.refused else []) + errors) or None

    def add_other_sums(self, handle: TransferHandle | GroupWrite, sums: PartialSums) -> None:
        """Add the other ranks' digest parts of a DONE `handle` to `sums`."""
        if isinstance(handle, GroupWrite) and handle.others:
            for start, part in self._ranks().sums(handle.key):
                sums.add(start, part)

    def settled(self, handle: TransferHandle | GroupWrite) -> bool:
        if isinstance(handle, TransferHandle):
            return self.transport.settled(handle)
        return (all(self.transport.settled(part) for part in handle.parts)
                and (not handle.others or self._ranks().settled(handle.key)))

    def retire(self, handle: TransferHandle | GroupWrite) -> None:
        if isinstance(handle, TransferHandle):
            self.transport.retire(handle)
            return
        for part in handle.parts:
            self.transport.retire(part)
        if handle.others:
            self._ranks().retire(handle.key)

    def _ranks(self) -> OtherRanks:
        """The other ranks, for a write they take part in (`GroupWrite.others`)."""
        assert self.others is not None, "a group write shipped to other ranks by a single-rank prefill worker"
        return self.others


@dataclass(frozen=True)
class RankSender:
    """What a prefill worker's rank other than 0 runs beside its engine shard (made in its process
    by `engine.tp_launch.follower_main`): a transport of its own over its KV, and the calls "ship"
    (write these pages into that landing) and "ship_poll" (report the writes that ended)."""

    hostname: str
    protocol: str

    def start(self, ctx: RankContext) -> dict[str, Callable[..., None]]:
        """Returns this rank's calls by name."""
        from kv_store.transfer.mooncake import MooncakeTransport
        from kv_store.transfer.page_digest import PageDigest

        transport = MooncakeTransport(self.hostname, self.protocol)
        ctx.closing.callback(transport.close)  # after the regions (an exit stack unwinds backwards)
        if not transport.reads_device_memory and ctx.kv.k[0].device.type != "cpu":
            raise TransferError("a prefill worker over tensor-parallel ranks ships from its device pools in place: "
                                "it needs a transport that reads device memory (install the `gpu` extra's Mooncake)")
        for t in (*ctx.kv.k, *ctx.kv.v):
            ctx.closing.enter_context(transport.register_tensor(t))
        shipper = _RankShipper(ShardWrites(transport), ctx, PageDigest(ctx.kv))
        return {"ship": shipper.ship, "ship_poll": shipper.poll}


class _RankShipper:
    """A rank's writes that rank 0 asked for, by rank 0's key, until reported settled."""

    def __init__(self, writes: ShardWrites, ctx: RankContext, digest: PageDigest) -> None:
        from kv_store.stream_order import order_for

        held = [shard.kv_heads for shard in ctx.shards]
        self.writes, self.control, self.digest = writes, ctx.control, digest
        self.source = SourceKV.of(ctx.kv, held[ctx.rank], sent_heads(held, ctx.rank))
        self.order = order_for(ctx.kv.k[0].device)
        self.open: dict[int, TransferHandle | GroupWrite | TransferError] = {}  # key -> handle, or its refusal
        self.sums: dict[int, tuple] = {}  # key -> (start, the digest parts of what it writes)

    def ship(self, key: int, landing: Landing, src_pages: tuple, start: int) -> None:
        self.order.host_wait(self.order.mark())  # the forward that wrote these pages is done
        try:
            self.open[key] = self.writes.write(self.source, landing, list(src_pages), start)
        except TransferError as exc:
            self.open[key] = exc
            return
        shards = [shard.heads for shard in landing.all_shards()]
        self.sums[key] = (start, self.digest.shard_sums(list(src_pages), self.source.held, self.source.sent, shards))

    def poll(self) -> None:
        """Gather to rank 0 {key: (status, error, settled, sums)} of the writes that ended; forget the
        settled."""
        said: dict[int, tuple[str, str, bool, tuple | None]] = {}
        for key, handle in list(self.open.items()):
            if isinstance(handle, TransferError):
                said[key] = (TransferStatus.FAILED.value, str(handle), True, None)
            elif (status := self.writes.poll(handle)) is not TransferStatus.PENDING:
                sums = self.sums.get(key) if status is TransferStatus.DONE else None
                said[key] = (status.value, str(self.writes.error(handle) or ""), self.writes.settled(handle), sums)
                if said[key][2]:
                    self.writes.retire(handle)
            if key in said and said[key][2]:
                del self.open[key]
                self.sums.pop(key, None)
        self.control.gather(said)
