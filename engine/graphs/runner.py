"""The decode step replayed per batch-size bucket, gated by what the KV tier is doing (DESIGN §5).

A step is *replayed* only when all of these hold; otherwise it runs eagerly (`ModelRunner.forward`)
and the reason is counted (`GraphCounters`, `/metrics` `tandem:graph_fallbacks_total{reason}`):

    not_decode        every row wants logits for each of its new tokens: a decode row (one token), or
                      on CUDA a speculative verify row (`ForwardRow.num_draft_tokens`), which replays
                      as one decode row per token (see "Verify rows" below); or every row a full
                      tree verify row (`draft_parents`), which replays from the tree graphs
                      (`tree.py`; CUDA with Triton attention)
    batch_too_large   the batch fits a bucket (`batch_buckets`)
    context_too_long  every row's page table fits the captured width (`max_model_len` pages)
    load_in_flight    no host->device load still in flight writes a page the batch reads
    relocated         the device pool's `relocation_version` is the one the batch's page tables were
                      derived at; when it moved, the rows are derived again from their requests
                      (`ScheduledStep.refresh_rows`) and the step runs eagerly
    disabled          `engine.cuda_graph` is off (`--no-cuda-graph`)

A replay copies the batch into `StaticBuffers` (one set, sized for the largest bucket): rows
`[0, n)` are the batch, rows `[n, bucket)` are padding — token 0 at position 0, sequence length 1,
page table all page 0, slot 0 — so padding writes only scratch page 0 and reads nothing else.

Verify rows: a verify row of n tokens at KV length S is the n decode rows (token i, length
S - n + 1 + i) over the same page table. Each layer writes every row's K/V before any row attends,
so row i sees exactly positions < S - n + 1 + i, as in the causal extend the eager step runs; logits
and features come out in the same order. A bucket is then n rows per request (the engine sizes its
buckets for `speculative_max_batch` x (k + 1)); the prefix's KV is read n times, which at decode
batch sizes costs far less than the eager step's kernel launches. Without captured graphs verify
rows keep the eager extend (`expand_verify`; tests switch it on).

How a bucket replays is the engine's `StepPlan`, chosen once at build (`strategy.py`).

With `cuda_graph` each bucket is captured once at start-up into a `torch.cuda.CUDAGraph` (all captures share
one memory pool; capture time and memory are logged), with the attention planned for the captured
width (`seq_lens_cpu` = capacity, the real lengths in the device `seq_lens`), so a replay reads only
the static buffers. On a CPU the same buffers, padding and gates run, and "replay" is the model
run over the buffers of the bucket: with `c_layers` through decoder layers in C (`NativeDecode`:
nothing to compile; float32 buckets of up to 4 rows, bigger ones eagerly through oneDNN; bfloat16
every bucket where the CPU has no bf16 dot products); with `compiled` bucket 1 through its decoder
layers compiled (`CompiledLayers`, six layers a call; compiled at start-up, or by a served worker on a
thread beside serving; the KV length is a dynamic dimension, so nothing compiles again while
serving). Compiled, batch 1 steps faster than eager with the same greedy tokens; at batch 4
compiled steps were *slower* than eager (with a dynamic batch dimension, and even compiled for
batch 4 alone), so bigger buckets replay eagerly (docs/results.md#cpu-decode).
"""

from __future__ import annotations

import enum
import logging
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from common.config import EngineConfig
from engine.graphs.capture import StaticBuffers, batch_buckets, bucket_for, capture_graph
from engine.graphs.strategy import StepPlan, StepStrategy
from engine.graphs.tree import TreeVerifyGraphs
from engine.runner import ForwardOut, ForwardRow, ModelRunner, StepModel
from kernels.attention.metadata import AttnMetadata

if TYPE_CHECKING:
    from engine.graphs.capture import GraphPool
    from engine.scheduler import ScheduledStep
    from kv_store.device_pool import DevicePool

log = logging.getLogger("tandem.engine")

COMPILED_CPU_BUCKET = 1
"""The one bucket `engine.cpu_compile` compiles (see the module docstring for why only this one)."""
COMPILE_SWITCH_INTERVAL_S = 0.0001
"""The interpreter's thread switch interval while a background compile runs (Python's default: 5 ms).
The compile is pure Python for seconds (tracing); each time the serving loop lets the GIL go (a torch
op, a socket read) the compile takes it, and the loop waited up to the whole interval to get it back.
A short interval serves a request sent at ready far sooner, and the compile itself ends sooner too
(docs/results.md#cpu-threads)."""
COMPILED_MIN_PAGES = 2
"""KV pages a compiled CPU replay's attention spans at least (a dynamic size of 1 would be specialised)."""


class Fallback(str, enum.Enum):
    NOT_DECODE = "not_decode"
    BATCH_TOO_LARGE = "batch_too_large"
    CONTEXT_TOO_LONG = "context_too_long"
    LOAD_IN_FLIGHT = "load_in_flight"
    RELOCATED = "relocated"
    DISABLED = "disabled"


def graph_max_batch(config: EngineConfig) -> int:
    """Rows of the largest bucket: `max_running_requests`, or with speculation the verify rows of
    `speculative_max_batch` requests (k + 1 each) when that is more."""
    if config.speculative == "none":
        return config.max_running_requests
    return max(config.max_running_requests,
               min(config.max_running_requests, config.speculative_max_batch) * (config.num_draft_tokens + 1))


@dataclass
class GraphCounters:
    replays: int = 0
    fallbacks: Counter = field(default_factory=Counter)  # Fallback -> steps run eagerly for it
    computed_tokens: int = 0  # tokens of the rows `run` and `forward` computed


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph
    out: ForwardOut  # logits [bucket, vocab], hidden [bucket, h] (aux): written by each replay


class GraphRunner:
    """Runs each step: replayed when the gates allow (see the module docstring), else eagerly."""

    def __init__(self, eager: ModelRunner, pool: DevicePool, max_batch: int, max_model_len: int,
                 plan: StepPlan = StepPlan(StepStrategy.BUFFERS), sizes: Iterable[int] = (),
                 loads_in_flight: Callable[[], frozenset] = frozenset, tree_rows: int = 0, tree_batch: int = 1,
                 compile_in_background: bool = False):
        """`plan`: how steps replay (`strategy.py`, chosen once by `build_engine`). `tree_rows`: tokens
        of a full tree verify row (`tree.tree_verify_rows`; 0: no trees), replayed for up to
        `tree_batch` requests. `compile_in_background` (strategy compiled): the compile waits for
        `start_compile` (a served worker's loop, once it reported ready) and runs on a thread beside
        serving (bucket 1 replays eagerly until it is done); else it runs before the constructor returns."""
        self.eager = eager
        self.pool = pool
        self.plan = plan
        self.enabled = plan.replays
        self.page_size = eager.page_size
        self.buckets = batch_buckets(max_batch, sizes)
        self.loads_in_flight = loads_in_flight
        """The host -> device copies in flight now (`CopyJob`s: `.dst_pages` are the device pages they write)."""
        self.counters = GraphCounters()
        self.gated = True
        """Test-only switch: False replays without the load and relocation gates (the hazard they stop)."""
        self.expand_verify = plan.captures
        """Verify rows replay as decode rows (module docstring); off where nothing is captured."""
        self.bufs = StaticBuffers.allocate(self.buckets[-1], -(-max_model_len // self.page_size), eager.device)
        self._graphs: dict[int, _Captured] = {}
        self._cpu_replays: dict[int, StepModel] = {}  # CPU: bucket -> its replay (a C layer, a compiled forward)
        self._compiling: threading.Thread | None = None  # a background compile, once started
        self._compile_later: Callable[[Iterable[int]], None] | None = None  # a background compile, until started
        self.trees: TreeVerifyGraphs | None = None  # when the engine drafts trees
        if self.enabled and tree_rows:
            capture = plan.captures and eager.model.backend.name == "triton"
            self.trees = TreeVerifyGraphs(eager, tree_batch, tree_rows, self.bufs.max_pages, capture)
        if plan.strategy is StepStrategy.CUDA_GRAPH:
            self._capture_all()
        elif plan.strategy is StepStrategy.C_LAYERS:
            native = plan.native
            assert native is not None, "a c_layers plan without its NativeDecode: not made by choose_step_strategy?"
            self._cpu_replays.update((b, native) for b in self.buckets
                                     if native.max_rows is None or b <= native.max_rows)
        elif plan.strategy is StepStrategy.COMPILED and COMPILED_CPU_BUCKET in self.buckets:
            self._compile(COMPILED_CPU_BUCKET, compile_in_background)

    # ---- the step ----------------------------------------------------------------------------------
    def run(self, step: ScheduledStep) -> ForwardOut:
        """`step`'s forward (its rows refreshed when the pool relocated)."""
        self.counters.computed_tokens += sum(len(r.token_ids) for r in step.rows)
        reason, bucket, tree = self._gate(step)
        if reason is None:
            self.counters.replays += 1
            return self.tree_replay(step.rows, bucket) if tree else self._replay(_decode_rows(step.rows), bucket)
        self.counters.fallbacks[reason] += 1
        if reason is Fallback.RELOCATED:
            step.refresh_rows(self.pool.relocation_version)
        return self.eager.forward(step.rows)

    def forward(self, rows: list[ForwardRow]) -> ForwardOut:
        """An eager step, ungated (a failed batch retried row by row)."""
        self.counters.computed_tokens += sum(len(r.token_ids) for r in rows)
        return self.eager.forward(rows)

    def replay(self, rows: list[ForwardRow], bucket: int) -> ForwardOut:
        """Decode rows through bucket `bucket`'s replay, ungated: a tensor-parallel rank runs what its
        rank 0 decided (`engine/tp.py`)."""
        return self._replay(rows, bucket)

    def tree_replay(self, rows: list[ForwardRow], bucket: int) -> ForwardOut:
        """Tree verify rows through the tree graphs' bucket `bucket`, ungated (as `replay`)."""
        assert self.trees is not None, "a tree replay on an engine without tree graphs: it drafts no trees"
        return self.trees.replay(rows, bucket)

    def probe(self) -> None:
        self.eager.probe()

    def _gate(self, step: ScheduledStep) -> tuple[Fallback | None, int, bool]:
        """(why the step runs eagerly or None, the bucket it replays, whether from the tree graphs)."""
        rows = step.rows
        if not self.enabled:
            return Fallback.DISABLED, 0, False
        tree_bucket = self.trees.takes(rows) if self.trees is not None else None
        tree = tree_bucket is not None
        if not tree and not all(r.num_logits == len(r.token_ids) and r.draft_parents is None
                                and (len(r.token_ids) == 1 or self.expand_verify) for r in rows):
            return Fallback.NOT_DECODE, 0, False
        bucket = tree_bucket if tree else bucket_for(self.buckets, sum(len(r.token_ids) for r in rows))
        if bucket is None:
            return Fallback.BATCH_TOO_LARGE, 0, False
        if any(len(r.pages) > self.bufs.max_pages for r in rows):
            return Fallback.CONTEXT_TOO_LONG, 0, False
        if self.gated:
            if step.relocation_version != self.pool.relocation_version:
                return Fallback.RELOCATED, 0, False
            loads = self.loads_in_flight()
            if loads and _touches(loads, rows):
                return Fallback.LOAD_IN_FLIGHT, 0, False
        return None, bucket, tree

    def _replay(self, rows: list[ForwardRow], bucket: int) -> ForwardOut:
        self.bufs.fill(rows, bucket, self.page_size)
        seq_lens = tuple(r.seq_len for r in rows) + (1,) * (bucket - len(rows))
        compiled = self._cpu_replays.get(bucket)
        if compiled is not None:
            # The attention's work spans at least the warm-up's two pages (the device seq_lens mask
            # each row): one page would specialise the compiled step and compile again mid-serving.
            seq_lens = tuple(max(n, COMPILED_MIN_PAGES * self.page_size) for n in seq_lens)
        meta = self.bufs.meta(bucket, self.page_size, seq_lens)
        captured = self._graphs.get(bucket)
        if captured is not None:
            self.eager.model.backend.prepare_graph_decode(meta)
            captured.graph.replay()
            return _rows_of(captured.out, len(rows), clone=True)
        return _rows_of(self._body(bucket, meta, compiled), len(rows))

    def _body(self, bucket: int, meta: AttnMetadata, model: StepModel | None = None,
              bufs: StaticBuffers | None = None) -> ForwardOut:
        bufs = bufs or self.bufs
        with torch.inference_mode():
            return self.eager.run_model(bufs.input_ids[:bucket], bufs.positions[:bucket], meta, model)

    # ---- CPU compile -------------------------------------------------------------------------------
    def _compile(self, bucket: int, background: bool) -> None:
        """`torch.compile` the forward for `bucket` and run it over padding rows (which read and write
        only scratch page 0), so no request waits for a compile: before serving, or on a thread beside
        it (`background`, from `start_compile`; its own buffers, the step's stay the loop's). The warm-up
        spans two KV pages, the least a compiled replay plans for (with one, the page count would be
        specialised to 1, and any other would compile again)."""
        # the step's shapes to the last: a view of a differently sized buffer would compile again
        warm = StaticBuffers.allocate(self.buckets[-1], self.bufs.max_pages, self.eager.device)
        warm.fill([], bucket, self.page_size)
        warm_lens = (COMPILED_MIN_PAGES * self.page_size,) * bucket
        # eager once, here: the model's lazy tables exist before any thread runs
        self._body(bucket, warm.meta(bucket, self.page_size, warm_lens), bufs=warm)

        def run(thread_counts: Iterable[int] = ()) -> None:
            """Compile for each torch thread count (a compiled step is specialised to its count), then
            put it in place: the loop never meets a count that is still compiling."""
            log.info("compiling the CPU decode step for batch size %d (seconds; cached for restarts)%s ...", bucket,
                     "; it replays eagerly until then" if background else "")
            start_s = time.perf_counter()
            try:
                from kernels.cpu.compiled import CompiledLayers  # imports the compiler (seconds): not before ready

                compiled = CompiledLayers(self.eager.model)
                with compiled.compiling():
                    for n in thread_counts or (torch.get_num_threads(),):
                        torch.set_num_threads(n)  # this thread's count: the loop's stays its own
                        self._body(bucket, warm.meta(bucket, self.page_size, warm_lens), compiled, bufs=warm)
            except Exception:
                if not background:
                    raise
                log.exception("compiling the CPU decode step failed: batch size %d stays eager", bucket)
                return
            self._cpu_replays[bucket] = compiled
            log.info("compiled the CPU decode step for batch size %d in %.1f s", bucket, time.perf_counter() - start_s)

        if background:
            self._compile_later = run
        else:
            run()

    def start_compile(self, thread_counts: Iterable[int] = (), then: Callable[[], object] = lambda: None) -> None:
        """Start the background compile (once; nothing when there is none), for the calling thread's
        torch thread count and each of `thread_counts` (the counts its steps may run on: a worker that
        borrows its node's idle cores steps on more than its own), so no step compiles again. `then`
        runs once the compile is over, on its thread (at once where there is none to run)."""
        if self._compile_later is None:
            then()
            return
        mine = torch.get_num_threads()  # the loop's; a new thread may start with another
        counts = [n for n in dict.fromkeys(thread_counts) if n != mine] + [mine]
        compile_then = self._compile_later

        def run() -> None:
            switch_s = sys.getswitchinterval()
            sys.setswitchinterval(min(switch_s, COMPILE_SWITCH_INTERVAL_S))
            try:
                compile_then(counts)
            finally:
                sys.setswitchinterval(switch_s)
            then()

        self._compiling = threading.Thread(target=run, name="tandem-compile", daemon=True)
        self._compile_later = None
        self._compiling.start()

    def compiling(self) -> bool:
        """Whether a background compile is still to start or running."""
        return self._compile_later is not None or (self._compiling is not None and self._compiling.is_alive())

    def wait_compiled(self, timeout_s: float | None = None) -> bool:
        """Wait for a started background compile; True when none is left running."""
        if self._compiling is not None:
            self._compiling.join(timeout_s)
        return self._compiling is None or not self._compiling.is_alive()

    # ---- CUDA capture ------------------------------------------------------------------------------
    def _capture_all(self) -> None:
        """One graph per bucket, largest first, in one memory pool."""
        device = self.eager.device
        start_s, free_before = time.perf_counter(), torch.cuda.mem_get_info(device)[0]
        pool = None
        for bucket in reversed(self.buckets):
            self._graphs[bucket] = self._capture(bucket, pool)
            pool = self._graphs[bucket].graph.pool()
        torch.cuda.synchronize(device)
        used = free_before - torch.cuda.mem_get_info(device)[0]
        log.info("captured decode graphs for batch sizes %s in %.1f s, %.0f MiB", list(self.buckets),
                 time.perf_counter() - start_s, used / 2**20)

    def _capture(self, bucket: int, pool: GraphPool | None) -> _Captured:
        self.bufs.fill([], bucket, self.page_size)  # all padding: scratch page 0
        capacity = (self.bufs.max_pages * self.page_size,) * bucket
        graph, out = capture_graph(lambda meta: self._body(bucket, meta),
                                   lambda: self.bufs.meta(bucket, self.page_size, capacity),
                                   self.eager.model.backend, self.eager.device, pool)
        return _Captured(graph, out)


def _rows_of(out: ForwardOut, n: int, clone: bool = False) -> ForwardOut:
    """The first `n` rows of a replay's output (one token a row; the rest is padding)."""
    def take(t: torch.Tensor) -> torch.Tensor:
        return t[:n].clone() if clone else t[:n]
    return ForwardOut(take(out.logits), take(out.hidden), None if out.aux is None else take(out.aux))


def _decode_rows(rows: list[ForwardRow]) -> list[ForwardRow]:
    """`rows` as one-token decode rows: a verify row of n tokens becomes n rows (module docstring)."""
    if all(len(r.token_ids) == 1 for r in rows):
        return rows
    return [ForwardRow([t], r.seq_len - len(r.token_ids) + 1 + i, r.pages, True)
            for r in rows for i, t in enumerate(r.token_ids)]


def _touches(loads: frozenset, rows: list[ForwardRow]) -> bool:
    pages = {p for r in rows for p in r.pages}
    return any(not pages.isdisjoint(load.dst_pages) for load in loads)
