"""The engine core shared by every worker: scheduler + runner + sampling + stop rules.

One KV pool: the scheduler picks the step, the runner runs it, sampling and stop checks end
requests, and every end goes through `Scheduler.finish` -> `KVManager.release`. Workers
specialise it through three hooks: `_after_commit` (a step's KV became valid: the prefill worker
ships pages from here), `_on_finished` (a request produced its last token) and `_fail_request`.

A fault is confined to the request that caused it: a forward pass that raises is retried row by
row, a batched sample that raises is retried row by row, and a request whose own row (or stop
check) still raises ends in ABORT with an "internal" error through the release path, while the
rest of the step goes on. Only a fault no request can be blamed for reaches the caller: a KV
integrity failure after failing requests, or a step whose every row failed while the model cannot
run even a probe token (the model or device is broken, not a request).
"""

from __future__ import annotations

import itertools
import time
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from cluster.config import EngineConfig, SamplingParams
from cluster.faults import FAILURE_INTERNAL, internal_error
from kernels.kv_layout import KVCacheTensors
from kernels.sampling import sample
from kv_store.device_pool import DevicePool, page_bytes
from kv_store.radix_cache import NullPrefixCache, RadixPrefixCache
from kv_store.req_kv import KVManager
from prefill_worker.request import FinishReason, Request, RequestStatus
from prefill_worker.runner import ModelRunner
from prefill_worker.scheduler import ScheduledStep, Scheduler
from prefill_worker.stop import StopRules

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def debug_kv_enabled(config: EngineConfig) -> bool:
    return config.debug_kv or os.environ.get("TANDEM_DEBUG_KV", "0") not in ("", "0")


@dataclass(frozen=True)
class StepOutput:
    """What one step produced for one request (streaming granularity)."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: FinishReason | None  # None while the request is still running
    error: str = ""  # why an ABORT that the client did not ask for happened (e.g. a transfer failed)
    failure: str = ""  # with `error`: FAILURE_INTERNAL, or "" (a transfer failure)
    cached_tokens: int = 0  # set on the finishing output
    timings: tuple[tuple[str, float], ...] = ()  # set on the finishing output


class EngineCore:
    """Continuous-batching engine over one paged KV pool. Not thread-safe: one caller drives `step`."""

    speaks_for_client = True
    """Whether `step`'s outputs are the client's tokens (a prefill worker's are not)."""

    def __init__(self, config: EngineConfig, model: torch.nn.Module, arch, tokenizer=None,
                 eos_token_ids: Sequence[int] = ()):
        dtype = TORCH_DTYPES[config.dtype]
        bytes_per_page = page_bytes(arch.num_layers, config.page_size, arch.num_kv_heads, arch.head_dim, dtype)
        self.config = config.resolve(bytes_per_page, arch.max_position_embeddings)
        self.device = torch.device(config.device)
        self.model, self.arch, self.tokenizer = model, arch, tokenizer
        self.eos_token_ids = frozenset(eos_token_ids)
        self.kv_cache = KVCacheTensors.allocate(arch.num_layers, self.config.num_pages, config.page_size,
                                                arch.num_kv_heads, arch.head_dim, dtype, self.device)
        self.device_pool = DevicePool(self.kv_cache)
        pool = self.device_pool.pages
        cache = RadixPrefixCache(pool) if config.enable_prefix_cache else NullPrefixCache(pool)
        self.kvm = KVManager(pool, cache)
        self.scheduler = Scheduler(self.config, self.kvm)
        self.runner = ModelRunner(model, self.kv_cache, config.page_size, self.device)
        self.requests: dict[str, Request] = {}
        self._ids = itertools.count()
        self.debug_kv = debug_kv_enabled(self.config)
        self.num_retractions = 0

    # ---- requests ----------------------------------------------------------------------------------
    def add_request(self, prompt_token_ids: list[int], params: SamplingParams,
                    request_id: str | None = None) -> Request:
        """Queue a request. Raises ValueError (queueing nothing) when it can never fit."""
        req = self._validated_request(prompt_token_ids, params, request_id)
        self.requests[req.request_id] = req
        self.scheduler.add(req)
        return req

    def _validated_request(self, prompt_token_ids: list[int], params: SamplingParams,
                           request_id: str | None) -> Request:
        """A new Request, or ValueError when it can never be served here."""
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer; this engine has none")
        vocab = self.arch.vocab_size
        if any(not 0 <= t < vocab for t in prompt_token_ids):
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        limit = self.scheduler.max_request_tokens()
        if len(prompt_token_ids) >= limit:
            raise ValueError(f"prompt of {len(prompt_token_ids)} tokens leaves no room to generate: this engine "
                             f"holds at most {limit} tokens per request (context length / KV pool)")
        rules = StopRules(params, self.eos_token_ids, self.tokenizer, limit)
        return Request(request_id, list(prompt_token_ids), params, stop_rules=rules)

    def abort(self, request_id: str) -> bool:
        """End a request now, releasing its KV. Returns False when it is unknown or already done."""
        req = self.requests.get(request_id)
        if req is None or req.status is RequestStatus.FINISHED:
            return False
        self.scheduler.finish(req, FinishReason.ABORT)
        del self.requests[request_id]
        self._after_step()
        return True

    def fail_request(self, request_id: str, error: str) -> None:
        """End `request_id` after a fault while handling a message about it: release what it holds,
        as `abort` does. The caller tells its client (`error`)."""
        self.abort(request_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    # ---- the loop ----------------------------------------------------------------------------------
    def step(self) -> list[StepOutput]:
        """Schedule, run one forward, sample, apply stop rules. Returns per-request progress."""
        scheduled = self.scheduler.schedule()
        scheduled.relocation_version = self.device_pool.relocation_version
        scheduled.loads_in_flight = self._loads_in_flight()
        self.num_retractions += len(scheduled.retracted)
        outputs = []
        if scheduled.rows:
            scheduled, logits, outputs = self._forward(scheduled)
            if scheduled.rows:
                self.scheduler.commit(scheduled)
                self._after_commit(scheduled)
                outputs += self._sample_and_stop(scheduled, logits)
        self._after_step()
        return outputs

    def generate(self, prompts: Sequence[list[int]], params: SamplingParams | Sequence[SamplingParams],
                 on_finish: Callable[[Request], None] | None = None) -> list[Request]:
        """Run `prompts` to completion; returns their finished requests in input order."""
        params_list = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        assert len(params_list) == len(prompts), "one SamplingParams per prompt"
        reqs = [self.add_request(p, sp) for p, sp in zip(prompts, params_list)]
        by_id = {r.request_id: r for r in reqs}
        while any(r.status is not RequestStatus.FINISHED for r in reqs):
            for out in self.step():
                if out.finish_reason is not None and on_finish is not None and out.request_id in by_id:
                    on_finish(by_id[out.request_id])
        return reqs

    def output_text(self, req: Request) -> str:
        text = self.tokenizer.decode(req.output_token_ids, skip_special_tokens=True)
        return text if req.text_len is None else text[:req.text_len]

    def check_integrity(self) -> None:
        self.kvm.check_integrity()

    # ---- helpers -----------------------------------------------------------------------------------
    def _forward(self, scheduled: ScheduledStep) -> tuple[ScheduledStep, torch.Tensor, list[StepOutput]]:
        """(the step without the rows that failed, its logits, outputs of the requests failed)."""
        try:
            logits = self.runner.forward(scheduled.rows)
        except Exception:  # noqa: BLE001 - blame the row(s) that raise alone
            return self._forward_row_by_row(scheduled)
        return scheduled, logits, []

    def _forward_row_by_row(self, scheduled: ScheduledStep) -> tuple[ScheduledStep, torch.Tensor, list[StepOutput]]:
        """Each row alone: a row writes only its own request's uncommitted KV slots, so running the rows
        one by one computes what the batch would have. Rows that raise alone fail their request."""
        kept = ScheduledStep(relocation_version=scheduled.relocation_version,
                             loads_in_flight=scheduled.loads_in_flight)
        logits, outputs = [], []
        for req, row in zip(scheduled.requests, scheduled.rows):
            try:
                row_logits = self.runner.forward([row])  # [1 or 0, vocab]
            except Exception as exc:  # noqa: BLE001
                outputs += self._fail_request(req, internal_error(req.request_id, exc, "the forward pass"))
                continue
            kept.requests.append(req)
            kept.rows.append(row)
            logits.append(row_logits)
        if not kept.rows:
            self.runner.probe()  # raises (ending the worker's loop) when no forward pass can run at all
        self.check_integrity()  # the failed requests' KV went back cleanly, or the worker must stop
        return kept, torch.cat(logits) if logits else torch.empty(0), outputs

    def _sample_and_stop(self, scheduled: ScheduledStep, logits: torch.Tensor) -> list[StepOutput]:
        reqs = [req for req, row in zip(scheduled.requests, scheduled.rows) if row.wants_logits]
        outputs = []
        for req, token in zip(reqs, self._sample_rows(reqs, logits)):
            try:
                if isinstance(token, Exception):
                    raise token
                outputs.append(self._advance(req, token))
            except Exception as exc:  # noqa: BLE001 - this request's fault: end it, keep the others going
                outputs += self._fail_request(req, internal_error(req.request_id, exc, "sampling and stop rules"))
        return outputs

    def _sample_rows(self, reqs: list[Request], logits: torch.Tensor) -> list[int | Exception]:
        """One token per request, or the exception its row raised. The batch is sampled at once; only
        when that raises is each row sampled alone (the sampler's draws do not depend on the batch)."""
        try:
            return self._sample(reqs, logits)
        except Exception:  # noqa: BLE001 - some request's values broke the batch: find which
            return [self._sample_alone(req, logits[i:i + 1]) for i, req in enumerate(reqs)]

    def _sample_alone(self, req: Request, logits: torch.Tensor) -> int | Exception:
        try:
            return self._sample([req], logits)[0]
        except Exception as exc:  # noqa: BLE001 - returned: the caller fails this request alone
            return exc

    @staticmethod
    def _sample(reqs: list[Request], logits: torch.Tensor) -> list[int]:
        return sample(logits, [r.params.temperature for r in reqs], [r.params.top_k for r in reqs],
                      [r.params.top_p for r in reqs], [r.sample_seed for r in reqs],
                      [len(r.output_token_ids) for r in reqs]).tolist()

    def _advance(self, req: Request, token: int) -> StepOutput:
        req.output_token_ids.append(token)
        reason = self._stop_reason(req, token)
        if reason is not None:
            self._on_finished(req, reason)
        return self._output(req, [token], reason)

    def _stop_reason(self, req: Request, token: int) -> FinishReason | None:
        """The stop rules after `token` (just appended to `req.output_token_ids`); see `prefill_worker.stop`."""
        assert req.output_token_ids[-1] == token, f"request {req.request_id}: check the token just appended"
        return req.stop_rules.check(req.output_token_ids, req.num_tokens)

    def _loads_in_flight(self) -> frozenset:
        """Hook: host->device loads not yet completed (none without a host tier)."""
        return frozenset()

    @staticmethod
    def _output(req: Request, tokens: list[int], reason: FinishReason | None, error: str = "",
                failure: str = "") -> StepOutput:
        if reason is None:
            return StepOutput(req.request_id, tokens, None)
        req.timings.setdefault("finished", time.monotonic())
        return StepOutput(req.request_id, tokens, reason, error, failure, req.cached_tokens,
                          tuple(req.timings.items()))

    def _after_commit(self, scheduled: ScheduledStep) -> None:
        """Hook: the KV of `scheduled` is valid now (before sampling)."""

    def _on_finished(self, req: Request, reason: FinishReason) -> None:
        """Hook: `req` produced its last token. Default: end it through the release path."""
        self.scheduler.finish(req, reason)
        del self.requests[req.request_id]

    def _fail_request(self, req: Request, error: str) -> list[StepOutput]:
        """Hook: a fault of `req`'s own ended it (`error` for its client). Default: ABORT through the
        release path; its client gets an "internal" error."""
        if req.status is not RequestStatus.FINISHED:
            self.scheduler.finish(req, FinishReason.ABORT)
        self.requests.pop(req.request_id, None)
        req.error = error
        return [self._output(req, [], FinishReason.ABORT, error, FAILURE_INTERNAL)]

    def _after_step(self) -> None:
        if self.debug_kv or not self.scheduler.has_work():
            self.kvm.check_integrity()
