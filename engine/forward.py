"""One step's forward pass, with a fault blamed on the row that causes it.

The batch runs as one forward. When that raises, each row runs alone: a row writes only its own
request's uncommitted KV slots, so the rows one by one compute what the batch would have, and a row
that still raises alone fails its request (`fail`) while the others go on. Only when every row failed
is the model probed with one token; a probe that raises is no request's fault and ends the caller.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from common.faults import internal_error
from engine.graphs.runner import GraphRunner
from engine.output import StepOutput
from engine.request import Request
from engine.runner import ForwardOut
from engine.scheduler import ScheduledStep

Fail = Callable[[Request, str], list[StepOutput]]
"""Ends a request whose own row raised, with the error for its client; its outputs."""


def run_forward(runner: GraphRunner, scheduled: ScheduledStep, fail: Fail, check_integrity: Callable[[], None]
                ) -> tuple[ScheduledStep, ForwardOut, list[StepOutput]]:
    """(the step without the rows that failed, its forward's output, outputs of the requests failed).
    `check_integrity` runs after rows failed alone: what they held went back cleanly, or it raises."""
    try:
        out = runner.run(scheduled)
    except Exception:  # noqa: BLE001 - blame the row(s) that raise alone
        return _row_by_row(runner, scheduled, fail, check_integrity)
    return scheduled, out, []


def _row_by_row(runner: GraphRunner, scheduled: ScheduledStep, fail: Fail, check_integrity: Callable[[], None]
                ) -> tuple[ScheduledStep, ForwardOut, list[StepOutput]]:
    kept = ScheduledStep(relocation_version=scheduled.relocation_version,
                         loads_in_flight=scheduled.loads_in_flight)
    parts, outputs = [], []
    for req, row in zip(scheduled.requests, scheduled.rows):
        try:
            parts.append(runner.forward([row]))
        except Exception as exc:  # noqa: BLE001
            outputs += fail(req, internal_error(req.request_id, exc, "the forward pass"))
            continue
        kept.requests.append(req)
        kept.rows.append(row)
    if not kept.rows:
        runner.probe()  # raises (ending the worker's loop) when no forward pass can run at all
    check_integrity()  # the failed requests' KV went back cleanly, or the worker must stop
    empty = torch.empty(0)
    return kept, ForwardOut.cat(parts) if parts else ForwardOut(empty, empty, None), outputs
