"""`RestartBudget`: how often the controller may restart a worker slot (pure: a clock, no Ray)."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable


class RestartBudget:
    """At most `max_restarts` restarts in any `window_s` seconds. Restarts older than the window no
    longer count, so the budget refills: a worker that crashes now and then is always restarted, and
    one that crash-loops is restarted `max_restarts` times per window rather than never again."""

    def __init__(self, max_restarts: int, window_s: float, clock: Callable[[], float] = time.monotonic):
        assert max_restarts >= 0 and window_s > 0, f"bad restart budget {max_restarts} per {window_s}s"
        self.max_restarts, self.window_s, self._clock = max_restarts, window_s, clock
        self._times: deque[float] = deque()  # monotonic times of the restarts still in the window

    def try_spend(self) -> bool:
        """Take one restart if the window has one left; False (nothing taken) otherwise."""
        if self.wait_s() > 0 or self.max_restarts == 0:
            return False
        self._times.append(self._clock())
        return True

    def wait_s(self) -> float:
        """Seconds until a restart may be taken (0: now). With max_restarts 0: forever (inf)."""
        if self.max_restarts == 0:
            return float("inf")
        now = self._clock()
        while self._times and self._times[0] <= now - self.window_s:
            self._times.popleft()
        if len(self._times) < self.max_restarts:
            return 0.0
        return self._times[0] + self.window_s - now
