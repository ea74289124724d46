"""The gateway's configuration (the `gateway:` section of a cluster YAML)."""

from __future__ import annotations

from dataclasses import dataclass

from common.config import GENERATION_CONFIG_MODES, require
from router.gateway.tool_parsers import PARSERS

API_KEY_ENV = "TANDEM_API_KEY"
"""Environment variable read for `gateway.api_key` when neither the file nor an override sets that key."""


@dataclass(frozen=True)
class GatewayConfig:
    """The OpenAI-compatible HTTP front end."""

    host: str = "127.0.0.1"
    """Interface to bind; loopback unless told otherwise."""
    port: int = 8000
    """TCP port; 0 picks a free one (tests)."""
    api_key: str | None = None
    """When set, /v1/* requires `Authorization: Bearer <api_key>` (401 otherwise)."""
    served_model_name: str | None = None
    """The model id clients must name; None: the model spec (e.g. "smollm2")."""
    max_body_bytes: int = 1 << 20
    """Request bodies larger than this get 413."""
    max_prompt_tokens: int | None = None
    """Prompts longer than this get 400; None: only the model's context limits them."""
    default_max_tokens: int = 256
    """Completion tokens when the request names no max_tokens (capped by the context left)."""
    generation_config: str = "auto"
    """What fills a request's unset temperature, top_p and top_k: `auto`, the model's recommended
    sampling (a local HF dir's generation_config.json; for the bundled SmolLM2 its model card's
    temperature 0.2, top_p 0.9); `none`, the OpenAI API's defaults (temperature 1). A field the
    request sets always wins. The start-up log and /v1/models say what applies."""
    tool_call_parser: str = "auto"
    """How a chat's tool calls are read from the output (vLLM's --tool-call-parser): `hermes`,
    `llama3_json`, `mistral`, or `auto` (by the chat template's markers; hermes for templates without
    tools, which the gateway then describes in that form itself: `router.gateway.tools`)."""
    max_pending_requests: int = 256
    """Requests in flight at most (counted once their body is read and valid); more get 429."""
    ready_timeout_s: float = 30.0
    """/health/ready: deadline for its one-token generation."""
    ready_interval_s: float = 5.0
    """/health/ready generates at most once per this many seconds; callers in between get the cached
    answer (it is open to anyone, so it must stay cheap)."""
    body_timeout_s: float = 30.0
    """A request's whole body must arrive within this many seconds of its headers; 408 otherwise."""
    header_timeout_s: float = 10.0
    """A connection must send a whole request head (line + headers) within this many seconds of
    opening or of its previous response; it is closed otherwise (slow-header clients)."""
    keep_alive_timeout_s: float = 5.0
    """An idle keep-alive connection is closed after this many seconds."""
    max_connections: int = 1024
    """Open connections at most (idle ones included); a request on one more gets a JSON 503 (the API's
    error shape, Retry-After) and its connection closes."""
    slow_request_log_s: float = 5.0
    """A request whose first token comes later than this many seconds after arrival is logged with its
    timeline (where the time went: `router.timeline`); 0: never. Every ended request's timeline is at
    `GET /debug/requests` either way."""
    allowed_hosts: tuple[str, ...] | None = None
    """Host names a request's Host (and Origin, when sent) may name, else 403 (DNS rebinding, cross-site
    browser requests); "*" allows any. None: derived from `host`, loopback names for a loopback bind,
    any host for a wildcard bind (0.0.0.0, ::), else `host` itself."""

    def __post_init__(self):
        require(isinstance(self.port, int) and 0 <= self.port <= 65535,
                f"gateway.port must be in [0, 65535], got {self.port!r}")
        require(self.api_key is None or (isinstance(self.api_key, str) and self.api_key != ""),
                 "gateway.api_key must be a non-empty string or null")
        require(self.max_body_bytes >= 1024, f"gateway.max_body_bytes must be >= 1024, got {self.max_body_bytes}")
        require(self.max_prompt_tokens is None or self.max_prompt_tokens >= 1,
                 f"gateway.max_prompt_tokens must be >= 1 or null, got {self.max_prompt_tokens}")
        require(self.default_max_tokens >= 1, f"gateway.default_max_tokens must be >= 1, got {self.default_max_tokens}")
        require(self.generation_config in GENERATION_CONFIG_MODES,
                f"gateway.generation_config must be one of {GENERATION_CONFIG_MODES}, got {self.generation_config!r}")
        require(self.tool_call_parser in ("auto", *PARSERS),
                f"gateway.tool_call_parser must be auto or one of {PARSERS}, got {self.tool_call_parser!r}")
        require(self.max_pending_requests >= 1,
                 f"gateway.max_pending_requests must be >= 1, got {self.max_pending_requests}")
        require(self.ready_timeout_s > 0, f"gateway.ready_timeout_s must be > 0, got {self.ready_timeout_s}")
        require(isinstance(self.slow_request_log_s, (int, float)) and self.slow_request_log_s >= 0,
                f"gateway.slow_request_log_s must be >= 0, got {self.slow_request_log_s!r}")
        for name in ("ready_interval_s", "body_timeout_s", "header_timeout_s", "keep_alive_timeout_s"):
            require(0 < getattr(self, name) <= 3600, f"gateway.{name} must be in (0, 3600], got {getattr(self, name)}")
        if self.allowed_hosts is not None:
            require(isinstance(self.allowed_hosts, (tuple, list)) and self.allowed_hosts
                     and all(isinstance(h, str) and h.strip() for h in self.allowed_hosts),
                     f"gateway.allowed_hosts must be a non-empty list of host names (or [\"*\"]) or null, "
                     f"got {self.allowed_hosts!r}")
            object.__setattr__(self, "allowed_hosts", tuple(self.allowed_hosts))
        require(self.max_connections >= self.max_pending_requests,
                 f"gateway.max_connections must be >= gateway.max_pending_requests ({self.max_pending_requests}): "
                 f"every request in flight holds a connection; got {self.max_connections}")
