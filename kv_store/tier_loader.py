"""Host -> device loads (DESIGN §5): landing pages into device pages, tracked by handle.

While a load is in flight both its host pages and its device pages are IN_FLIGHT under the load's
handle (DESIGN §4 rule 2); `poll_completed` retires them when the copy has finished. On CUDA the
copy runs on a dedicated load stream and completion is a recorded event; on CPU it is a plain
synchronous copy, complete when `start` returns. Every started load bumps the device pool's
relocation version.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch

from kv_store.device_pool import DevicePool
from kv_store.host_tier import HostTier


@dataclass(frozen=True, eq=False)
class LoadHandle:
    id: int
    request_id: str
    host_pages: tuple[int, ...]
    device_pages: tuple[int, ...]
    event: object = None  # torch.cuda.Event on CUDA
    staging: list = field(default_factory=list, repr=False)  # pinned buffers kept alive until the event

    def __hash__(self) -> int:
        return hash(("load", self.id))

    @property
    def pages(self) -> tuple[int, ...]:
        """The device pages this load writes."""
        return self.device_pages


class HostToDeviceLoader:
    """Not thread-safe: driven by the decode worker's loop."""

    def __init__(self, host: HostTier, device: DevicePool):
        assert host.layout == device.layout, f"host/device layouts differ: {host.layout} vs {device.layout}"
        self.host, self.device = host, device
        dev = device.kv.k[0].device
        self.stream = torch.cuda.Stream(dev) if dev.type == "cuda" else None
        self.in_flight: dict[int, LoadHandle] = {}
        self._ids = itertools.count(1)

    def start(self, request_id: str, host_pages: list[int], device_pages: list[int]) -> LoadHandle:
        """Copy `host_pages[i]` -> `device_pages[i]` in every layer (K and V). Both page lists must
        be PRIVATE to `request_id`; they are IN_FLIGHT until the handle completes."""
        assert len(host_pages) == len(device_pages), "load needs one device page per host page"
        handle = LoadHandle(next(self._ids), request_id, tuple(host_pages), tuple(device_pages))
        self.host.pool.hand_off(host_pages, request_id, handle)
        self.device.pages.hand_off(device_pages, request_id, handle)
        self.device.bump_relocation_version()
        if self.stream is None:
            self._copy(handle)
        else:
            with torch.cuda.stream(self.stream):
                self._copy(handle)
                event = torch.cuda.Event()
                event.record(self.stream)
            object.__setattr__(handle, "event", event)
        self.in_flight[handle.id] = handle
        return handle

    def poll_completed(self) -> list[LoadHandle]:
        """Retire and return every load whose copy has finished (never blocks)."""
        done = [h for h in self.in_flight.values() if h.event is None or h.event.query()]
        for h in done:
            del self.in_flight[h.id]
            self.host.pool.retire(h)
            self.device.pages.retire(h)
        return done

    def handles(self) -> frozenset:
        return frozenset(self.in_flight.values())

    def _copy(self, handle: LoadHandle) -> None:
        dev = self.device.kv.k[0].device
        src_idx = torch.tensor(handle.host_pages, dtype=torch.int64)
        dst_idx = torch.tensor(handle.device_pages, dtype=torch.int64, device=dev)
        for src_layer, dst_layer in ((self.host.kv.k, self.device.kv.k), (self.host.kv.v, self.device.kv.v)):
            for src, dst in zip(src_layer, dst_layer):
                rows = src.index_select(0, src_idx)  # [n, page_size, kvh, hd] on the host
                if dev.type == "cuda":
                    rows = rows.pin_memory()
                    handle.staging.append(rows)
                dst.index_copy_(0, dst_idx, rows.to(dev, non_blocking=True))
