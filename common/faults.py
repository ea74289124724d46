"""How a fault while serving one request is reported: its client gets a short message with an error
id and failure `Failure.INTERNAL`; the log gets the traceback under the same id (never the client, whose
message must not carry source paths)."""

from __future__ import annotations

import logging
import uuid

log = logging.getLogger("tandem.worker")


def internal_error(request_id: str, exc: BaseException, where: str) -> str:
    """Log `exc` (with its traceback) as request `request_id`'s fault in `where` under a fresh error
    id; return the message its client gets."""
    error_id = uuid.uuid4().hex[:12]
    log.error("request %s failed in %s (error id %s)", request_id, where, error_id, exc_info=exc)
    return f"internal error in the worker ({type(exc).__name__} in {where}); error id {error_id}"
