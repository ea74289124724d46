"""The gateway's one error policy: every failure becomes `APIError`, every `APIError` one JSON shape.

    {"error": {"message": str, "type": str, "param": str | None, "code": str | None}}

    status  type                       code (examples)
    400     invalid_request_error      invalid_json, missing_parameter, invalid_value, unsupported_parameter,
                                       context_length_exceeded, prompt_too_long, rejected
    401     authentication_error       invalid_api_key
    403     permission_error           forbidden_host, forbidden_origin
    404     invalid_request_error      model_not_found, not_found, session_not_found
    405     invalid_request_error      method_not_allowed
    408     invalid_request_error      request_timeout                 (the connection is closed)
    409     invalid_request_error      session_busy                    (a turn of the session is running)
    413     invalid_request_error      request_too_large
    415     invalid_request_error      unsupported_media_type
    429     rate_limit_error           queue_full, too_many_pending_requests, too_many_sessions
    500     internal_error             internal_error
    503     service_unavailable_error  unavailable, draining          (always with Retry-After)

A server error (5xx) never shows the client what went wrong inside: its message is one short line
ending with an error id (`err-<hex>`), and the log gets the whole detail (traceback included) under
that id. Whatever a worker or a bug put into the text (tracebacks, the server's source paths) stays
in the log.

`failure_kind` names the row of `tandem:request_failure_total` an error counts under.
"""

from __future__ import annotations

import logging
import math
import re
import uuid

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from router.backend import BackendError, ErrorKind

log = logging.getLogger(__name__)

DEFAULT_RETRY_AFTER_S = 1.0

MAX_SERVER_MESSAGE_CHARS = 200  # a 5xx message is one line of at most this many characters (+ its id)
_ABSOLUTE_PATH = re.compile(r"(?:[A-Za-z]:)?(?:[\\/][\w.@+-]+){2,}")  # /a/b, C:\a\b: never shown to clients

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "invalid_request_error", 405: "invalid_request_error", 408: "invalid_request_error",
          409: "invalid_request_error",
          413: "invalid_request_error", 415: "invalid_request_error", 429: "rate_limit_error",
          500: "internal_error", 503: "service_unavailable_error"}

_BACKEND_STATUS = {ErrorKind.REJECTED: 400, ErrorKind.QUEUE_FULL: 429, ErrorKind.UNAVAILABLE: 503,
                   ErrorKind.INTERNAL: 500, ErrorKind.NOT_FOUND: 404}

_FAILURE_KINDS = {400: "invalid_request", 401: "unauthorized", 403: "forbidden", 404: "invalid_request",
                  405: "invalid_request", 408: "invalid_request", 409: "invalid_request", 413: "invalid_request",
                  415: "invalid_request", 429: "queue_full", 500: "internal", 503: "unavailable"}

CLIENT_DISCONNECT = "client_disconnect"
"""`tandem:request_failure_total{kind}` for a client that went away before its request ended."""


class APIError(Exception):
    """A request ends with HTTP `status` and the error body. `retry_after_s` only for 429/503.

    `message` is what the client reads. For a 5xx it is cut to its first line (absolute paths
    masked) and gets an error id; the full `detail` (default: `message`) and the traceback of `exc`
    are logged once, here, under that id. `detail` is the full text for whoever wraps this error.
    """

    def __init__(self, status: int, message: str, *, code: str | None = None, param: str | None = None,
                 retry_after_s: float | None = None, detail: str | None = None, exc: BaseException | None = None,
                 close_connection: bool = False):
        self.detail = detail if detail is not None else message
        self.error_id: str | None = None
        if status >= 500:
            self.error_id = f"err-{uuid.uuid4().hex[:16]}"
            message = f"{_one_short_line(message)} (error id {self.error_id})"
            log.log(logging.ERROR if status == 500 else logging.WARNING, "%s: HTTP %d %s: %s", self.error_id, status,
                    code, self.detail, exc_info=(type(exc), exc, exc.__traceback__) if exc is not None else None)
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param
        if status == 503 and retry_after_s is None:
            retry_after_s = DEFAULT_RETRY_AFTER_S  # a 503 without Retry-After makes clients guess
        self.retry_after_s = retry_after_s if status in (429, 503) else None  # retrying anything else is futile
        self.close_connection = close_connection  # the request was not read to its end: the connection is unusable

    @property
    def type(self) -> str:
        return _TYPES.get(self.status, "invalid_request_error" if self.status < 500 else "internal_error")

    @property
    def failure_kind(self) -> str:
        return _FAILURE_KINDS.get(self.status, "invalid_request" if self.status < 500 else "internal")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def headers(self) -> dict[str, str]:
        headers = {"Connection": "close"} if self.close_connection else {}
        if self.retry_after_s is not None:
            headers["Retry-After"] = str(max(1, math.ceil(self.retry_after_s)))  # whole seconds (RFC 9110)
        return headers

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers())


def _one_short_line(text: str) -> str:
    line = next((ln.strip() for ln in text.splitlines() if ln.strip()), "") or "server error"
    line = _ABSOLUTE_PATH.sub("<path>", line)
    return line if len(line) <= MAX_SERVER_MESSAGE_CHARS else line[:MAX_SERVER_MESSAGE_CHARS - 3] + "..."


def invalid(message: str, *, param: str | None = None, code: str = "invalid_value") -> APIError:
    return APIError(400, message, code=code, param=param)


def from_backend_error(err: BackendError) -> APIError:
    return from_error_kind(err.kind, err.message, err.retry_after_s)


def from_error_kind(kind: ErrorKind | None, message: str, retry_after_s: float | None = None) -> APIError:
    """The HTTP error for a request the backend failed (`None` kind: treated as internal). An internal
    failure's message is a worker's account of a bug (often a traceback): the client gets none of it."""
    kind = kind if kind is not None else ErrorKind.INTERNAL
    detail = message or kind.value
    shown = "internal server error" if kind is ErrorKind.INTERNAL else detail
    code, param = ("session_not_found", "session_id") if kind is ErrorKind.NOT_FOUND else (kind.value, None)
    return APIError(_BACKEND_STATUS[kind], shown, code=code, param=param, retry_after_s=retry_after_s,
                    detail=detail)


def internal(exc: BaseException) -> APIError:
    """A bug on our side while serving a request: logged with its traceback, shown as a bare 500."""
    return APIError(500, "internal server error", code="internal_error", detail=f"{type(exc).__name__}: {exc}",
                    exc=exc)


def install_handlers(app: FastAPI) -> None:
    """Make FastAPI's own errors (422 validation, 404 route, 405 method, uncaught) use the shape above."""

    async def on_api_error(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    async def on_validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        first = (exc.errors() or [{}])[0]
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        return invalid(first.get("msg", "invalid request"), param=".".join(loc) or None).response()

    async def on_http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        err = APIError(exc.status_code, str(exc.detail), code=code)
        return JSONResponse(err.body(), status_code=exc.status_code, headers={**(exc.headers or {}), **err.headers()})

    async def on_uncaught(_: Request, exc: Exception) -> JSONResponse:
        return internal(exc).response()  # logged, with its traceback, under the error id

    # starlette's stub types a handler as taking any Exception, not the class it is registered for
    app.add_exception_handler(APIError, on_api_error)  # type: ignore[arg-type]
    app.add_exception_handler(RequestValidationError, on_validation)  # type: ignore[arg-type]
    app.add_exception_handler(StarletteHTTPException, on_http)  # type: ignore[arg-type]
    app.add_exception_handler(Exception, on_uncaught)
