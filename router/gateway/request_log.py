"""The timelines of the requests that ended last (`router.timeline`), for `GET /debug/requests` and
`tandem bench serve`'s phase split; a request whose first token came later than
`gateway.slow_request_log_s` is also logged, one line saying where its time went."""

from __future__ import annotations

import logging
from collections import deque

from router.backend import GenerationChunk
from router.timeline import summary

log = logging.getLogger("tandem.gateway")

CAPACITY = 4096
"""Requests remembered (the oldest forgotten first)."""


class RequestLog:
    def __init__(self, slow_s: float = 0.0, capacity: int = CAPACITY) -> None:
        self.slow_s = slow_s  # 0: no log lines
        self._ended: deque[dict] = deque(maxlen=capacity)

    def record(self, request_id: str, prompt_len: int, chunk: GenerationChunk) -> None:
        """`chunk` ended request `request_id` (finished or failed)."""
        timeline = chunk.timeline or {}
        entry = {"id": request_id, "finish_reason": chunk.finish_reason, "error": chunk.error,
                 "prompt_tokens": prompt_len, "cached_tokens": chunk.cached_tokens,
                 "prefill_worker": chunk.prefill_worker, "decode_worker": chunk.decode_worker,
                 "first_token_s": timeline.get("first_token_s"), "phases": timeline.get("phases", []),
                 "worker_s": timeline.get("worker_s", {})}
        self._ended.append(entry)
        first = entry["first_token_s"]
        if self.slow_s and first is not None and first > self.slow_s:
            log.warning("slow request %s: first token after %.2f s (%d prompt tokens, %d cached): %s", request_id,
                        first, prompt_len, chunk.cached_tokens, summary(timeline))

    def entries(self, limit: int, order: str = "latest") -> list[dict]:
        """The last `limit` (order "latest", newest first) or the `limit` slowest to a first token."""
        ended = list(self._ended)
        if order == "slowest":
            ended.sort(key=lambda e: -1.0 if e["first_token_s"] is None else e["first_token_s"], reverse=True)
        else:
            ended.reverse()
        return ended[:limit]
