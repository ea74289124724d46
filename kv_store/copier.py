"""Page copies between the device tier and the host tier (DESIGN §5).

On CUDA one background thread per copier runs the jobs in submission order; `submit` returns at
once and a job's completion is an event the scheduler polls (`CopyJob.done`) or, rarely, waits on.
The thread issues the copies on its own stream (so they overlap the decode stream), after an event
recorded on the submitter's stream at `submit` (so a backup never reads pages before the forward that
wrote them is done: `kv_store/stream_order.py`), and records one CUDA event per layer as it lands
(`CopyJob.layer_events`, for layer-wise waiting), then synchronizes that stream before the job counts as done.

On a CPU device the copies run inline: `submit` does the job on the caller's thread (the
scheduler's, between forwards) and returns it done. A second thread there does not overlap
anything: it takes a core from the forward's OpenMP team, whose every parallel region then waits
for the descheduled thread (with such a thread, retract with offload ran slower than recomputing:
docs/results.md#cpu-threads). Inline, a copy costs its memcpy time and no more.

How a layer's pages move (`_KernelMove` or `_StagedMove`, chosen per copier):
- kernel (CUDA, host tier pinned): one `kernels.cuda.page_copy` launch per layer, K and V together; the
  GPU reads or writes the pinned host pages in place (mapped memory), with the page indices on the
  device, so the host does no per-page work at all; each layer's launch is planned once. Staged, a
  load-back is held by the single-threaded host gather; through the kernel it runs close to a plain
  contiguous pinned `copy_` (`tandem bench h2d`: docs/results.md#kv-tiers). A kernel copy that
  raises (say, Triton refuses the host pointer) is logged once, redone staged, and the copier stays
  staged.
- staged (everywhere else): per layer and K/V, gather the pages into one contiguous tensor, move
  it, scatter it. Host-side gathers and scatters are numpy byte copies: single-threaded and outside
  the GIL, and never torch's parallel CPU ops, which must stay on the worker's one compute thread
  (`docs/design.md`, "One compute thread per worker"): torch ops on this thread once slowed every
  later decode step.

The copier touches only the pages named in a job; the caller guarantees nobody else reads or
writes those pages until the job is done (they are IN_FLIGHT, or locked in the prefix tree).
"""

from __future__ import annotations

import enum
import logging
import queue
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

from kernels.attention import import_error
from kernels.kv_layout import KVCacheTensors
from kv_store.stream_order import CudaOrder, HostOrder, order_for

log = logging.getLogger(__name__)

PageIndex = np.ndarray | torch.Tensor  # page ids as `_gather` / `_scatter` take them: numpy on the host, else torch


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
    after: torch.cuda.Event | None = None  # the submitter's mark: the copies wait for the work queued before it (CUDA)
    error: BaseException | None = None
    seconds: float = 0.0
    _done: threading.Event = field(default_factory=threading.Event, repr=False)

    def done(self) -> bool:
        """Whether the copy has finished (successfully or not: see `error`). Never blocks."""
        return self._done.is_set()

    def wait(self, timeout_s: float) -> bool:
        return self._done.wait(timeout_s)


_STOP = object()


class Copier(Protocol):
    """What a host tier copies through: a `PageCopier`, or one that sends each copy on to the other ranks
    of a tensor-parallel engine first (`engine.tp_tiers.LeadCopier`)."""

    def submit(self, direction: Direction, src_pages: list[int], dst_pages: list[int]) -> CopyJob: ...

    def close(self, timeout_s: float = 5.0) -> None: ...


class PageCopier:
    """Copies pages between `device` and `host` tensors of one layout. `close` stops its thread.

    `use_kernel`: None moves pages with the copy kernel wherever it can run (a CUDA device, every
    host tensor pinned, `kernels.cuda.page_copy` importable) and staged elsewhere; True asks for the kernel
    anyway (tests run it interpreted on CPU tensors); False never uses it. A kernel copy that raises
    is redone staged, and the copier stays staged from then on (`uses_kernel` turns False).
    `inline`: None runs jobs on the caller's thread for a CPU device and on the copier's own thread
    for a CUDA one (see the module docstring); True or False asks for one or the other.
    """

    def __init__(self, device: KVCacheTensors, host: KVCacheTensors, name: str = "kv-copier",
                 use_kernel: bool | None = None, inline: bool | None = None,
                 order: HostOrder | CudaOrder | None = None):
        assert device.layout == host.layout, f"device/host layouts differ: {device.layout} vs {host.layout}"
        self.device, self.host = device, host
        self.bytes_per_page = device.layout.page_bytes
        dev = device.k[0].device
        self._order = order if order is not None else order_for(dev)
        """Each job's copies wait for the work queued before its `submit` (`kv_store/stream_order.py`)."""
        self._move = _first_move(device, host, use_kernel)
        self.inline = dev.type == "cpu" if inline is None else inline
        self._closed = False
        self._jobs: queue.Queue = queue.Queue()
        self._thread = None
        if not self.inline:
            # The thread holds only a weak reference: an engine dropped without close() frees its KV
            # tensors, and the finalizer stops the thread.
            self._thread = threading.Thread(target=_serve, args=(self._jobs, weakref.ref(self)), name=name,
                                            daemon=True)
            self._thread.start()
            weakref.finalize(self, self._jobs.put, _STOP)

    @property
    def uses_kernel(self) -> bool:
        """Whether the next job moves its pages with the copy kernel (False once a kernel copy failed)."""
        return isinstance(self._move, _KernelMove)

    def submit(self, direction: Direction, src_pages: list[int], dst_pages: list[int]) -> CopyJob:
        assert len(src_pages) == len(dst_pages), "a copy needs one destination page per source page"
        job = CopyJob(direction, tuple(src_pages), tuple(dst_pages), len(src_pages) * self.bytes_per_page,
                      after=self._order.mark())
        if self._closed or (self._thread is not None and not self._thread.is_alive()):
            raise RuntimeError("the KV copier is closed")
        if self.inline:
            self._run_job(job)
            job._done.set()
            return job
        self._jobs.put(job)
        return job

    def close(self, timeout_s: float = 5.0) -> None:
        """Finish the queued jobs, then stop the thread."""
        self._closed = True
        if self._thread is not None and self._thread.is_alive():
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
        """Runs `job` with `_move`; a failed kernel copy is redone staged (a job never fails for the
        fast path's sake): it rewrites the same bytes to the same pages, which nobody else touches."""
        try:
            self._copy_with(self._move, job)
        except Exception as exc:
            if not self.uses_kernel:
                raise
            log.warning("the KV page copy kernel failed (%s: %s); this copier moves pages staged from now on",
                        type(exc).__name__, exc)
            self._move = _StagedMove(self.device, self.host)
            job.layer_events.clear()
            self._copy_with(self._move, job)

    def _copy_with(self, move: _KernelMove | _StagedMove, job: CopyJob) -> None:
        with self._order.copy_after(job.after):  # after the forward that wrote the pages, on CUDA
            self._copy_layers(move, job)

    def _copy_layers(self, move: _KernelMove | _StagedMove, job: CopyJob) -> None:
        to_host = job.direction is Direction.TO_HOST
        src_idx, dst_idx = move.page_index(job, to_host)
        for layer in range(self.device.num_layers):
            move.copy_layer(layer, to_host, src_idx, dst_idx)
            event = self._order.layer_done()
            if event is not None:
                job.layer_events.append(event)


def _first_move(device: KVCacheTensors, host: KVCacheTensors, use_kernel: bool | None) -> _KernelMove | _StagedMove:
    if use_kernel is None:
        use_kernel = _kernel_can_run(device, host)
    if use_kernel:
        try:
            return _KernelMove(device, host)
        except Exception as exc:  # noqa: BLE001 - a broken triton install fails with more than ImportError
            log.warning("the KV page copy kernel cannot be set up (%s: %s); this copier moves pages staged",
                        type(exc).__name__, exc)
    return _StagedMove(device, host)


def _kernel_can_run(device: KVCacheTensors, host: KVCacheTensors) -> bool:
    """A CUDA device, every host page tensor pinned (mapped into the device's address space), and
    the kernel's module importable (triton installed and working)."""
    if device.k[0].device.type != "cuda" or not all(t.is_pinned() for t in host.k + host.v):
        return False
    why = import_error("kernels.cuda.page_copy")
    if why is not None:
        log.info("KV pages move staged, without the copy kernel: %s", why)
    return why is None


class _KernelMove:
    """One launch of `kernels.cuda.page_copy` per layer, K and V together, on the current stream: the GPU
    reads (or writes) the pinned host pages in place, so nothing is gathered on the host. Each
    layer's launch is planned once per direction, here: per job the host only launches."""

    def __init__(self, device: KVCacheTensors, host: KVCacheTensors):
        from kernels.cuda import page_copy as kv_copy  # triton only where the kernel runs

        self._device = device.k[0].device
        self._plans = {  # to_host -> one PageCopy per layer
            to_host: [kv_copy.plan_copy(src.k[layer], src.v[layer], dst.k[layer], dst.v[layer])
                      for layer in range(device.num_layers)]
            for to_host, (src, dst) in ((True, (device, host)), (False, (host, device)))
        }

    def page_index(self, job: CopyJob, to_host: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """Source and destination page ids, int64 `[n]` each, on the kernel's device (one copy up)."""
        index = torch.tensor(job.src_pages + job.dst_pages, dtype=torch.int64, device=self._device)
        return index[:len(job.src_pages)], index[len(job.src_pages):]

    def copy_layer(self, layer: int, to_host: bool, src_idx: PageIndex, dst_idx: PageIndex) -> None:
        assert isinstance(src_idx, torch.Tensor) and isinstance(dst_idx, torch.Tensor), (
            "kernel copy given numpy page ids: indices from a _StagedMove?")
        self._plans[to_host][layer].launch(src_idx, dst_idx)


class _StagedMove:
    """Per layer and K/V: gather the pages into one contiguous tensor on the source's side, move it,
    scatter it on the destination's side (numpy byte copies on the host, torch on a device)."""

    def __init__(self, device: KVCacheTensors, host: KVCacheTensors):
        self.device, self.host = device, host

    def page_index(self, job: CopyJob, to_host: bool) -> tuple[PageIndex, PageIndex]:
        src_kv, dst_kv = (self.device, self.host) if to_host else (self.host, self.device)
        return _page_index(job.src_pages, src_kv.k[0].device), _page_index(job.dst_pages, dst_kv.k[0].device)

    def copy_layer(self, layer: int, to_host: bool, src_idx: PageIndex, dst_idx: PageIndex) -> None:
        src_kv, dst_kv = (self.device, self.host) if to_host else (self.host, self.device)
        dst_dev = dst_kv.k[0].device
        # device -> host must land before the host-side scatter reads it: a blocking copy there
        overlap = dst_dev.type == "cuda"
        for src, dst in ((src_kv.k[layer], dst_kv.k[layer]), (src_kv.v[layer], dst_kv.v[layer])):
            rows = _gather(src, src_idx, pinned=overlap and src.is_pinned())  # [n, page_size, kvh, hd]
            _scatter(dst, dst_idx, rows.to(dst_dev, non_blocking=overlap))


def _page_index(pages: tuple[int, ...], device: torch.device) -> PageIndex:
    """Page ids as the index `_gather` / `_scatter` take on `device`: numpy on the host, torch elsewhere."""
    if device.type == "cpu":
        return np.asarray(pages, dtype=np.int64)
    return torch.tensor(pages, dtype=torch.int64, device=device)


def _byte_rows(t: torch.Tensor) -> np.ndarray:
    """A contiguous host tensor `[num_pages, ...]` as `[num_pages, bytes per page]` uint8 (shares memory)."""
    return t.view(t.shape[0], -1).view(torch.uint8).numpy()


def _gather(t: torch.Tensor, index: PageIndex, pinned: bool = False) -> torch.Tensor:
    """Pages `index` of `t` (a new tensor). `pinned` (a host `t` bound for the device): the pages land
    in pinned memory, so the copy to the device that follows is asynchronous and at pinned bandwidth
    (from pageable memory it would be staged and block this thread); torch's caching host allocator
    reuses the buffer only once that copy has completed."""
    if t.device.type != "cpu":
        assert isinstance(index, torch.Tensor), f"numpy page ids for a {t.device} tensor: indexed on the wrong side?"
        return t.index_select(0, index)
    out = torch.empty((len(index), *t.shape[1:]), dtype=t.dtype, pin_memory=pinned)
    np.take(_byte_rows(t), index, axis=0, out=_byte_rows(out))
    return out


def _scatter(t: torch.Tensor, index: PageIndex, rows: torch.Tensor) -> None:
    """`t[index[i]] = rows[i]`, in place."""
    if t.device.type != "cpu":
        assert isinstance(index, torch.Tensor), f"numpy page ids for a {t.device} tensor: indexed on the wrong side?"
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
