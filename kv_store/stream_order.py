"""Ordering KV reads after the forward that wrote the pages, chosen once per device (STYLE 17).

On a GPU the forward's kernels are queued on the compute stream and still running when the host moves
on; anything that reads the pages it wrote on another stream (the page copier's) or outside CUDA's
streams (a transport reading GPU memory over RDMA) must wait for them explicitly, not on whatever
host sync happens to come first (a sampled token's `.tolist()`; a step of prefill chunks samples
nothing). So:

    mark()                 on the caller's current stream, after the work just queued (an event)
    copy_after(mark)       a context: the copier's stream waits for `mark`, runs the copies, syncs
    layer_done()           an event after one layer's copy (layer-wise waiting), or None
    host_wait(mark)        the host blocks until `mark` has passed (before a transport reads memory)

On a CPU every op has finished when its call returns: `HostOrder` does nothing.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


class HostOrder:
    """A CPU device: nothing is asynchronous, nothing to order."""

    def mark(self) -> None:
        return None

    @contextlib.contextmanager
    def copy_after(self, mark: object) -> Iterator[None]:
        yield

    def layer_done(self) -> None:
        return None

    def host_wait(self, mark: object) -> None:
        pass


class CudaOrder:
    """A CUDA device: events on the caller's stream; the copies on a stream of their own."""

    def __init__(self, device: torch.device):
        self.device = device
        self.copy_stream = torch.cuda.Stream(device)

    def mark(self) -> torch.cuda.Event:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    @contextlib.contextmanager
    def copy_after(self, mark: torch.cuda.Event | None) -> Iterator[None]:
        if mark is not None:
            self.copy_stream.wait_event(mark)
        with torch.cuda.stream(self.copy_stream):
            yield
        self.copy_stream.synchronize()

    def layer_done(self) -> torch.cuda.Event:
        event = torch.cuda.Event()
        event.record(self.copy_stream)
        return event

    def host_wait(self, mark: torch.cuda.Event | None) -> None:
        if mark is not None:
            mark.synchronize()


def order_for(device: torch.device | str) -> HostOrder | CudaOrder:
    device = torch.device(device)
    return CudaOrder(device) if device.type == "cuda" else HostOrder()
