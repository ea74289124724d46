"""Offline use of an engine: a batch of prompts run to completion (`tandem run`, benches, tests)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from common.config import SamplingParams
from engine.request import Request, RequestStatus


def run_batch(engine: Any, prompts: Sequence[list[int]], params: SamplingParams | Sequence[SamplingParams],
              on_finish: Callable[[Request], None] | None = None) -> list[Request]:
    """Add every prompt to `engine` (an `EngineCore`; one `params` for all, or one each), step until all
    finished; their requests in input order. `on_finish` hears each as its last output comes."""
    params_list = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
    assert len(params_list) == len(prompts), "one SamplingParams per prompt"
    reqs = [engine.add_request(p, sp) for p, sp in zip(prompts, params_list)]
    by_id = {r.request_id: r for r in reqs}
    while any(r.status is not RequestStatus.FINISHED for r in reqs):
        for out in engine.step():
            if out.finish_reason is not None and on_finish is not None and out.request_id in by_id:
                on_finish(by_id[out.request_id])
    return reqs
