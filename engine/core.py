"""The engine every worker runs: scheduler + runner + sampling + stop rules, over one KV pool.

The scheduler picks the step, the runner runs it, sampling and stop checks end requests, and every
end goes through `Scheduler.finish` -> `KVManager.release` (`endings.py`: every way a request ends).
A token enters a request's output in one place, `tokens.apply_stop_rules`: a sampled one from `_emit`,
a first token that arrived with its KV from `accept_first_token`. Workers differ only in the
`KVConnector` the engine holds (`connector.py`): it is told when a step's KV is valid and when a request
finished, and hands over requests whose KV arrived and held requests that may be released. A worker
asks the engine what it needs (`has_compute`, `cached_prefix_len`, ...), never its parts.

A fault is confined to the request that caused it: a forward pass (`forward.py`) or a batched sample that raises
is retried row by row, and a request whose own row (or stop check) still raises ends in ABORT with
an "internal" error through the release path while the step goes on. Only a fault no request can be
blamed for reaches the caller: a KV integrity failure, or a step whose every row failed while the
model cannot run even a probe token (the model or device is broken, not a request).
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Sequence

import torch

from common.config import EngineConfig, SamplingParams, debug_kv_from_env
from common.faults import internal_error
from common.grammar_spec import GrammarError
from common.logprobs import TokenLogprobs
from common.protocol import Failure, GraphStats, SpecStats, TierStats, WorkerRole, WorkerStats
from engine.batch import run_batch
from engine.connector import ConnectorPorts, KVConnector, NullConnector
from engine.endings import Endings
from engine.forward import run_forward
from engine.logprobs import record_output, record_prompt
from engine.output import StepOutput, step_output
from engine.parts import EngineParts
from engine.request import FinishReason, Request, RequestStatus, check_tokens
from engine.runner import ForwardOut, ForwardRow
from engine.scheduler import ScheduledStep
from engine.sessions import SessionError
from engine.spec.speculator import Committed
from engine.stats import IntegrityBeat, graph_stats, pool_stats, spec_stats, tier_stats
from engine.stop import StopRules
from engine.structured import StructuredOutputs
from engine.tokens import apply_stop_rules, row_tokens
from kernels.kv_layout import populate_in_background
from kv_store.page_pool import PagePool, PoolUsage

log = logging.getLogger("tandem.engine")

IDLE_COPY_WAIT_S = 0.005
"""A step that scheduled nothing while tier copies are in flight waits this long for one to land."""


def debug_kv_enabled(config: EngineConfig) -> bool:
    return config.debug_kv or debug_kv_from_env()


class EngineCore:
    """Continuous-batching engine over one paged KV pool. Not thread-safe: one caller drives `step`.
    Made by `build_engine` (`engine/build.py`), which builds its parts (`engine/parts.py`)."""

    def __init__(self, parts: EngineParts, connector: Callable[[ConnectorPorts], KVConnector] | None = None):
        """`connector`: makes the worker's connector from the ports the engine lends it (None: colocated)."""
        self.config, self.model, self.arch = parts.config, parts.model, parts.arch
        self.device = torch.device(self.config.device)
        self.tokenizer, self.eos_token_ids = parts.tokenizer, parts.eos_token_ids
        self.kv_cache, self.device_pool, self.kvm = parts.kv_cache, parts.device_pool, parts.kvm
        self.host_cache, self.sessions, self.scheduler = parts.host_cache, parts.sessions, parts.scheduler
        self.runner, self.speculator = parts.runner, parts.speculator
        self.requests: dict[str, Request] = {}
        self._ids = itertools.count()
        self.debug_kv = debug_kv_enabled(self.config)
        self.num_retractions = 0
        self.integrity = IntegrityBeat()  # the heartbeat's check (`stats`)
        ports = ConnectorPorts(self.kv_cache, self.device_pool, self.config.page_size, self.scheduler,
                               self.new_request, self.accept_first_token, self.speculator.export_feature,
                               self.kvm.check_integrity)
        self.connector = connector(ports) if connector is not None else NullConnector()
        self.endings = Endings(self.requests, self.scheduler, self.connector, self.sessions)
        self.structured = StructuredOutputs(self.tokenizer, self.arch.vocab_size, tuple(sorted(self.eos_token_ids)))
        self._close_hooks: list[Callable[[], None]] = []

    # ---- requests ----------------------------------------------------------------------------------
    def add_request(self, prompt_token_ids: list[int], params: SamplingParams,
                    request_id: str | None = None, session_id: str = "", resumed: Sequence[int] = ()) -> Request:
        """Queue a request (a turn of `session_id` when given: its prompt is the session's history plus
        the new tokens; `resumed`: `Generate.resume_output`). Raises ValueError (queueing nothing) when
        it can never fit, and SessionError (a ValueError) when the session cannot take it."""
        if session_id and params.prompt_logprobs is not None:
            raise ValueError("prompt_logprobs are not available on a session turn (its history's KV is reused)")
        req = self.new_request(prompt_token_ids, params, request_id, resumed)
        if session_id:
            self.sessions.start_turn(session_id, req.request_id, req.num_tokens + params.max_tokens)
            req.session_id = session_id
        self.requests[req.request_id] = req
        compiling = self.structured.prepare(params.grammar) if params.grammar is not None else None
        if compiling is not None and (not compiling.done() or compiling.exception() is not None):
            self.structured.hold(req)  # queued once its grammar compiled, refused if it did not (`take_ready`)
        else:
            self.scheduler.add(req)
        return req

    def new_request(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str | None,
                    resumed: Sequence[int] = ()) -> Request:
        """A new Request, not queued (a receiver holds it until its KV lands), or ValueError when it
        can never be served here. `resumed`: its output so far (`Request.resume`)."""
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer; this engine has none")
        limit = self.scheduler.max_request_tokens()
        check_tokens(prompt_token_ids, resumed, self.arch.vocab_size, limit, params.max_tokens)
        if params.grammar is not None:
            self.structured.prepare(params.grammar)  # compiles beside the steps from now
        req = Request(request_id, list(prompt_token_ids), params,
                      stop_rules=StopRules(params, self.eos_token_ids, self.tokenizer, limit))
        if resumed:
            req.resume(resumed)
        return req

    def abort(self, request_id: str) -> bool:
        """End a request now, releasing its KV. Returns False when it is unknown or already done."""
        req = self.requests.get(request_id)
        if req is None or req.status is RequestStatus.FINISHED:
            return False
        if self.structured.release(req):  # waiting for its grammar's compile: holds nothing yet
            self.endings.end_held(req)
            return True
        if req in self.scheduler.running or req.status in (RequestStatus.WAITING, RequestStatus.LOADING):
            self.endings.finish(req, FinishReason.ABORT)
        else:  # held by the connector (KV still in flight): it releases the request when it can
            return False
        self._after_step()
        return True

    def end_stopped(self) -> None:
        """Requests the connector stopped serving end or leave the batch (`Endings.end_stopped`). Every
        step does this; a worker also calls it when a message made its connector stop one."""
        self.endings.end_stopped()

    def busy(self) -> bool:
        """Whether a step would do anything: requests to schedule, the connector's or the host tier's own
        work, or a session to reap."""
        return (self.scheduler.has_work() or self.connector.busy() or self.host_cache.busy()
                or self.sessions.reap_due() or bool(self.structured.held))

    @staticmethod
    def accept_first_token(req: Request, token: int, logprobs: TokenLogprobs | None,
                           prompt_logprobs: Sequence[TokenLogprobs | None]) -> FinishReason | None:
        """`req`'s first token, sampled by the prefill worker that computed its prompt (with its logprobs
        and its prompt's, when asked): appended under its stop rules as a token sampled here is
        (`tokens.apply_stop_rules`; not marked `first_token`: this engine did not compute it). Returns
        the reason it ended (None: it goes on). Lent to the connector (`ConnectorPorts.first_token`)."""
        _, reason = apply_stop_rules(req, [token], computed_here=False)
        if logprobs is not None:
            req.output_logprobs.append(logprobs)
        req.prompt_logprobs = list(prompt_logprobs)
        return reason

    # ---- sessions ----------------------------------------------------------------------------------
    def open_session(self, session_id: str, capacity_tokens: int, idle_timeout_s: float) -> None:
        """Raises SessionError (nothing opened) when the session budget or the arguments forbid it."""
        limit = self.scheduler.max_request_tokens()
        if capacity_tokens > limit:
            raise SessionError(f"capacity_tokens {capacity_tokens} exceeds the {limit} tokens one request may "
                               "hold here")
        self.sessions.open(session_id, capacity_tokens, idle_timeout_s)

    def close_session(self, session_id: str) -> bool:
        return self.sessions.close(session_id)

    # ---- what its worker asks ------------------------------------------------------------------------
    def has_compute(self) -> bool:
        """Whether a step would run a forward pass (requests to schedule), not only poll."""
        return self.scheduler.has_work()

    def housekeeping_due(self) -> bool:
        """Whether the engine's own work beside its requests needs a step soon: a tier copy in flight,
        or an idle session past its timeout."""
        return self.host_cache.busy() or self.sessions.reap_due()

    def cached_prefix_len(self, token_ids: Sequence[int]) -> int:
        """The whole-page prefix of `token_ids` cached here, in any tier. Read-only: nothing is touched."""
        return self.kvm.prefix_cache.cached_len(token_ids)

    def start_compile(self, thread_counts: tuple[int, ...], then: Callable[[], object] = lambda: None) -> None:
        """Compile the decode step for each torch thread count on a thread beside the steps, then run
        `then` there (`GraphRunner.start_compile`)."""
        self.runner.start_compile(thread_counts=thread_counts, then=then)

    def compiling(self) -> bool:
        """Whether the compile `start_compile` began still runs."""
        return self.runner.compiling()

    def map_kv_in(self) -> None:
        """Map the KV pool's memory in (the OS zeroes it lazily), a chunk at a time while no step computes."""
        populate_in_background(self.kv_cache.k + self.kv_cache.v, busy=self.has_compute)

    # ---- what a benchmark asks beside `stats` (`cluster/bench`) ------------------------------------
    def graphs_enabled(self) -> bool:
        """Whether decode steps may replay (`GraphRunner`); False: every step runs eagerly."""
        return self.runner.enabled

    def occupancy(self) -> tuple[int, int, int, PoolUsage]:
        """(waiting, loading, running) requests, and the device pool's pages. Read-only."""
        s = self.scheduler
        return len(s.waiting), len(s.loading), len(s.running), self.device_pool.pages.usage()

    def flush_l3(self, timeout_s: float) -> bool:
        """Wait up to `timeout_s` for the L3 writes queued so far; False: some are still unsent."""
        return self.host_cache.l3.flush(timeout_s)

    def evict_device_cache(self) -> None:
        """Evict every cached device page no request holds (those backed up to a host tier load back from it)."""
        self.kvm.prefix_cache.evict(self.kvm.pool.num_usable)

    # ---- the loop ----------------------------------------------------------------------------------
    def step(self) -> list[StepOutput]:
        """The connector's housekeeping, then schedule, run one forward, sample, apply stop rules,
        and release what the connector no longer holds. Returns per-request progress."""
        self.host_cache.poll()
        self.sessions.reap()
        outputs = self.connector.before_step()
        outputs += [out for req, error in self.structured.take_ready(self.scheduler.add)
                    for out in self.endings.end_held(req, error)]
        self.end_stopped()
        arrived = self.connector.take_arrived()
        for req, kv in arrived:
            self.requests[req.request_id] = req
            self.scheduler.admit_loaded(req, kv)
        if arrived:  # their first decode step verifies drafts too (from the prefill worker's head feature)
            self._speculate(lambda: self.speculator.draft_arrived([r for r, _ in arrived], self.scheduler.running,
                                                                  self.scheduler.reserve_draft_slots,
                                                                  self.scheduler.max_request_tokens()))
        ran = False
        if self.scheduler.has_work():
            ran, computed = self._compute()
            outputs += computed
        if not ran and self.host_cache.busy():
            # Nothing ran while a tier copy is in flight (a load, or the write that frees pages): wait
            # for one outside the GIL rather than spin, or the copier's thread barely gets the GIL (a
            # one-page copy then takes seconds: docs/results.md#cpu-threads).
            self.host_cache.wait_any(IDLE_COPY_WAIT_S)
        self.end_stopped()
        self.endings.release_held()
        self._after_step()
        return outputs

    def _compute(self) -> tuple[bool, list[StepOutput]]:
        """Schedule and run one forward; returns whether any row ran, and the outputs."""
        self.speculator.begin_step()
        scheduled = self.scheduler.schedule()
        scheduled.loads_in_flight = self.device_pool.loads_in_flight()
        self.num_retractions += len(scheduled.retracted)
        outputs: list[StepOutput] = []
        if scheduled.rows:
            scheduled, out, outputs = run_forward(self.runner, scheduled, self.endings.failed, self.check_integrity)
            if scheduled.rows:
                outputs += self._emit(scheduled, out)
        return bool(scheduled.rows), outputs

    def generate(self, prompts: Sequence[list[int]], params: SamplingParams | Sequence[SamplingParams],
                 on_finish: Callable[[Request], None] | None = None) -> list[Request]:
        """Run `prompts` to completion; returns their finished requests in input order (`engine.batch`)."""
        return run_batch(self, prompts, params, on_finish)

    def output_text(self, req: Request) -> str:
        return self.tokenizer.decode(req.output_token_ids, skip_special_tokens=True)[:req.text_len]

    def check_integrity(self) -> None:
        self.kvm.check_integrity()
        self.connector.check_integrity()

    def max_request_tokens(self) -> int:
        return self.scheduler.max_request_tokens()

    def stats(self, role: WorkerRole, landing_pool: PagePool | None = None, transfers: int = 0) -> WorkerStats:
        """The heartbeat's view of this engine, with the integrity check's verdict (`IntegrityBeat`)."""
        l2 = self.host_cache.pool
        return WorkerStats(role, pool_stats(self.device_pool.pages), pool_stats(landing_pool) if landing_pool else None,
                           len(self.scheduler.running), len(self.scheduler.waiting) + len(self.scheduler.loading),
                           transfers, self.integrity.verdict(self.scheduler.has_work(), self.check_integrity),
                           pool_stats(l2) if l2 is not None else None, self.tier_stats(), self.graph_stats(),
                           self.spec_stats())

    def spec_stats(self) -> SpecStats:
        return spec_stats(self.speculator.counters)

    def graph_stats(self) -> GraphStats:
        return graph_stats(self.runner.counters, self.runner.compiling())

    def tier_stats(self) -> TierStats:
        return tier_stats(self.host_cache, self.scheduler.hit_tokens_l1, self.sessions, self.config.page_size,
                          self.connector.checksum_failures, self.connector.verified_pages)

    def on_close(self, hook: Callable[[], None]) -> None:
        """Run `hook` when the engine closes, after its parts (a tensor-parallel rank 0 stops its ranks)."""
        self._close_hooks.append(hook)

    def close(self) -> None:
        """Close the parts, then run the `on_close` hooks in the order given, even if a part's close raised."""
        try:
            self.connector.close()
            self.host_cache.close()
            self.structured.close()
        finally:
            for hook in self._close_hooks:
                hook()

    # ---- helpers -----------------------------------------------------------------------------------

    def _emit(self, scheduled: ScheduledStep, out: ForwardOut) -> list[StepOutput]:
        """Each row's tokens (sampled, or its verified drafts), stop rules applied token by token; then
        the KV they leave valid is committed (rejected drafts' pages freed), the draft head catches up
        over it, finished requests end, and the speculator drafts for the next step."""
        kept = ScheduledStep(relocation_version=scheduled.relocation_version,
                             loads_in_flight=scheduled.loads_in_flight)
        committed, emitted, outputs, feature_row = [], [], [], 0
        self.structured.ensure_states([r for r, row in zip(scheduled.requests, scheduled.rows) if row.num_logits])
        for req, row, (tokens, rows) in zip(scheduled.requests, scheduled.rows,
                                            row_tokens(scheduled, out.logits, self.speculator)):
            first, feature_row = feature_row, feature_row + len(row.token_ids)
            try:
                if isinstance(tokens, Exception):
                    raise tokens
                if req.wants_prompt_logprobs:
                    record_prompt(req, row, out.hidden[first:feature_row], self.model.compute_logits)
                applied, reason = apply_stop_rules(req, tokens)
                record_output(req, out.logits, rows, applied)
                if self.structured.accept(req, applied) and reason is None:
                    reason = FinishReason.STOP  # its grammar ended (a stop token that ignore_eos kept going)
            except Exception as exc:  # noqa: BLE001 - this request's fault: end it, keep the others going
                grammar = isinstance(exc, GrammarError)  # allows no token: the request's own doing
                outputs += self.endings.failed(req, str(exc) if grammar else internal_error(
                    req.request_id, exc, "sampling and stop rules"), Failure.REJECTED if grammar else Failure.INTERNAL)
                continue
            start = req.held_kv().kv_committed_len
            committed.append(Committed(req, start, self._commit(req, row, len(applied)), first))
            kept.requests.append(req)
            kept.rows.append(row)
            if row.num_logits:
                emitted.append((req, applied, reason))
        self._speculate(lambda: self.speculator.catch_up(committed, out.hidden, out.aux, len(self.scheduler.running)))
        self.connector.after_commit(kept)
        for req, applied, reason in emitted:
            if reason is not None:
                self.endings.finished(req, reason)
            outputs.append(step_output(req, applied, reason))
        self._speculate(lambda: self.speculator.draft(self.scheduler.running, self.scheduler.reserve_draft_slots,
                                                      self.scheduler.max_request_tokens()))
        return outputs

    def _commit(self, req: Request, row: ForwardRow, num_emitted: int) -> int:
        """Commit the KV `row` left valid and return its end: all of it, or for a verify row the last
        token and the drafts accepted before a stop (`num_emitted` tokens emitted); the pages past
        that end go back to the pool."""
        end = row.seq_len - row.num_logits + num_emitted if row.num_draft_tokens else row.seq_len
        self.scheduler.commit(req, end)
        return end

    def _speculate(self, action: Callable[[], None]) -> None:
        """A draft head's fault costs speed, never output: drafts are dropped (verification would
        have rejected bad ones anyway) and the fault is counted and logged."""
        try:
            action()
        except Exception:
            counters = self.speculator.counters
            assert counters is not None, "the null speculator's draft raised: it has no draft head to fail"
            counters.draft_errors += 1
            log.exception("the draft head failed; this step's drafts are dropped")
            for req in self.scheduler.running:
                req.spec.clear()

    def _after_step(self) -> None:
        if self.debug_kv or not self.scheduler.has_work():
            self.kvm.check_integrity()
        if self.debug_kv or not self.busy():
            self.connector.check_integrity()
