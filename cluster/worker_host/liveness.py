"""`death_cause`: the one rule that declares a worker dead, for worker processes (`process.py`) and
the Ray controller's actors (`cluster/serve/controller.py`) alike. Pure: a host passes what it observed."""

from __future__ import annotations

import math


def death_cause(*, crashed: str = "", exit_code: int | None = None, beat_age_s: float = 0.0,
                beat_timeout_s: float = math.inf, step_age_s: float = 0.0, step_timeout_s: float = math.inf) -> str:
    """Why a worker incarnation counts as dead; "" while it lives. Its loop crashed, its process
    exited, no heartbeat for longer than `beat_timeout_s` (the beat thread answers even mid-step,
    so silence means the process is stuck or gone), or no step finished for longer than
    `step_timeout_s` (a hung step). A host passes what it can observe; the rest stays at its
    never-dead default."""
    if crashed:
        return f"its loop crashed:\n{crashed}"
    if exit_code is not None:
        return f"its process exited (code {exit_code})"
    if beat_age_s > beat_timeout_s:
        return f"no heartbeat for {beat_age_s:.1f}s"
    if step_age_s > step_timeout_s:
        return f"its loop has not finished a step for {step_age_s:.0f}s (hung)"
    return ""
