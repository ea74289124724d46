"""Page copies between the device tier and the host tier, off the scheduler's thread (DESIGN §5).

One background thread per copier runs the jobs in submission order; `submit` returns at once and
a job's completion is an event the scheduler polls (`CopyJob.done`) or, rarely, waits on. On CUDA
the thread issues the copies on its own stream (so they overlap the decode stream) and records one
CUDA event per layer as it lands (`CopyJob.layer_events`, for layer-wise waiting), then
synchronizes that stream before the job counts as done. Host-side gathers and scatters are numpy
byte copies: single-threaded and outside the GIL, and never torch's parallel CPU ops, which must stay
on the worker's one compute thread (`docs/design.md`, "One compute thread per worker"): torch ops on
this thread once cost every later decode step ~1.8x on 2 cores.

The copier touches only the pages named in a job; the caller guarantees nobody else reads or
writes those pages until the job is done (they are IN_FLIGHT, or locked in the prefix tree).
"""

from __future__ import annotations

import enum
import queue
import threading
import time
import weakref
from dataclasses import dataclass, field

import numpy as np
import torch

from kernels.kv_layout import KVCacheTensors


class Direction(enum.Enum):
    TO_HOST = "to_host"  # device -> host (a backup or an eviction's write-back)
    TO_DEVICE = "to_device"  # host -> device (a load-back)


@dataclass(eq=False)
class CopyJob:
    """`src_pages[i]` -> `dst_pages[i]` in every layer, K and V."""

    direction: Direction
    src_pages: tuple[int, ...]
    dst_pages: tuple[int, ...]
    num_bytes: int
    layer_events: list = field(default_factory=list)  # torch.cuda.Event per layer, CUDA only
    error: BaseException | None = None
    seconds: float = 0.0
    _done: threading.Event = field(default_factory=threading.Event, repr=False)

    def done(self) -> bool:
        """Whether the copy has finished (successfully or not: see `error`). Never blocks."""
        return self._done.is_set()

    def wait(self, timeout_s: float) -> bool:
        return self._done.wait(timeout_s)


_STOP = object()


class PageCopier:
    """Copies pages between `device` and `host` tensors of one layout. `close` stops its thread."""

    def __init__(self, device: KVCacheTensors, host: KVCacheTensors, name: str = "kv-copier"):
        assert device.layout == host.layout, f"device/host layouts differ: {device.layout} vs {host.layout}"
        self.device, self.host = device, host
        self.bytes_per_page = device.layout.page_bytes
        dev = device.k[0].device
        self._stream = torch.cuda.Stream(dev) if dev.type == "cuda" else None
        self._jobs: queue.Queue = queue.Queue()
        # The thread holds only a weak reference: an engine dropped without close() frees its KV
        # tensors, and the finalizer stops the thread.
        self._thread = threading.Thread(target=_serve, args=(self._jobs, weakref.ref(self)), name=name, daemon=True)
        self._thread.start()
        weakref.finalize(self, self._jobs.put, _STOP)

    def submit(self, direction: Direction, src_pages: list[int], dst_pages: list[int]) -> CopyJob:
        assert len(src_pages) == len(dst_pages), "a copy needs one destination page per source page"
        job = CopyJob(direction, tuple(src_pages), tuple(dst_pages), len(src_pages) * self.bytes_per_page)
        if not self._thread.is_alive():
            raise RuntimeError("the KV copier is closed")
        self._jobs.put(job)
        return job

    def close(self, timeout_s: float = 5.0) -> None:
        """Finish the queued jobs, then stop the thread."""
        if self._thread.is_alive():
            self._jobs.put(_STOP)
            self._thread.join(timeout_s)

    def _run_job(self, job: CopyJob) -> None:
        start = time.perf_counter()
        try:
            self._copy(job)
        except BaseException as exc:  # noqa: BLE001 - reported on the job; the caller undoes it
            job.error = exc
        job.seconds = time.perf_counter() - start

    def _copy(self, job: CopyJob) -> None:
        to_host = job.direction is Direction.TO_HOST
        src_kv, dst_kv = (self.device, self.host) if to_host else (self.host, self.device)
        src_idx = _page_index(job.src_pages, src_kv.k[0].device)
        dst_idx = _page_index(job.dst_pages, dst_kv.k[0].device)
        if self._stream is None:
            self._copy_layers(src_kv, dst_kv, src_idx, dst_idx, job)
            return
        with torch.cuda.stream(self._stream):
            self._copy_layers(src_kv, dst_kv, src_idx, dst_idx, job)
        self._stream.synchronize()

    def _copy_layers(self, src_kv, dst_kv, src_idx, dst_idx, job: CopyJob) -> None:
        dst_dev = dst_kv.k[0].device
        # device -> host must land before the host-side index_copy_ reads it: a blocking copy there
        overlap = self._stream is not None and dst_dev.type == "cuda"
        for layer in range(len(src_kv.k)):
            for src, dst in ((src_kv.k[layer], dst_kv.k[layer]), (src_kv.v[layer], dst_kv.v[layer])):
                rows = _gather(src, src_idx, pinned=overlap and src.is_pinned())  # [n, page_size, kvh, hd]
                _scatter(dst, dst_idx, rows.to(dst_dev, non_blocking=overlap))
            if self._stream is not None:
                event = torch.cuda.Event()
                event.record(self._stream)
                job.layer_events.append(event)


def _page_index(pages: tuple[int, ...], device: torch.device):
    """Page ids as the index `_gather` / `_scatter` take on `device`: numpy on the host, torch elsewhere."""
    if device.type == "cpu":
        return np.asarray(pages, dtype=np.int64)
    return torch.tensor(pages, dtype=torch.int64, device=device)


def _byte_rows(t: torch.Tensor) -> np.ndarray:
    """A contiguous host tensor `[num_pages, ...]` as `[num_pages, bytes per page]` uint8 (shares memory)."""
    return t.view(t.shape[0], -1).view(torch.uint8).numpy()


def _gather(t: torch.Tensor, index, pinned: bool = False) -> torch.Tensor:
    """Pages `index` of `t` (a new tensor). `pinned` (a host `t` bound for the device): the pages land
    in pinned memory, so the copy to the device that follows is asynchronous and at pinned bandwidth
    (from pageable memory it would be staged and block this thread); torch's caching host allocator
    reuses the buffer only once that copy has completed."""
    if t.device.type != "cpu":
        return t.index_select(0, index)
    out = torch.empty((len(index), *t.shape[1:]), dtype=t.dtype, pin_memory=pinned)
    np.take(_byte_rows(t), index, axis=0, out=_byte_rows(out))
    return out


def _scatter(t: torch.Tensor, index, rows: torch.Tensor) -> None:
    """`t[index[i]] = rows[i]`, in place."""
    if t.device.type != "cpu":
        t.index_copy_(0, index, rows)
        return
    _byte_rows(t)[index] = _byte_rows(rows.contiguous())


def _serve(jobs: queue.Queue, copier_ref: weakref.ref) -> None:
    """The copier's thread: run jobs in order until told to stop (or the copier is gone)."""
    while True:
        job = jobs.get()
        if job is _STOP:
            return
        copier = copier_ref()
        if copier is None:
            job.error = RuntimeError("the KV copier was dropped")
        else:
            copier._run_job(job)
        del copier
        job._done.set()
