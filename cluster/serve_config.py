"""Frozen, validated configuration of a `tandem serve` cluster (YAML + CLI overrides).

Every field is documented and bounded; a bad value raises `ConfigError` naming the field.
"""

from __future__ import annotations

from dataclasses import dataclass

from cluster.config import ConfigError, _require

__all__ = ["ConfigError", "GatewayConfig"]


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
    max_pending_requests: int = 256
    """Requests in flight at most; more get 429."""
    ready_timeout_s: float = 30.0
    """/health/ready: deadline for its one-token generation."""

    def __post_init__(self):
        _require(isinstance(self.port, int) and 0 <= self.port <= 65535, f"gateway.port must be in [0, 65535], got {self.port!r}")
        _require(self.api_key is None or (isinstance(self.api_key, str) and self.api_key != ""),
                 "gateway.api_key must be a non-empty string or null")
        _require(self.max_body_bytes >= 1024, f"gateway.max_body_bytes must be >= 1024, got {self.max_body_bytes}")
        _require(self.max_prompt_tokens is None or self.max_prompt_tokens >= 1,
                 f"gateway.max_prompt_tokens must be >= 1 or null, got {self.max_prompt_tokens}")
        _require(self.default_max_tokens >= 1, f"gateway.default_max_tokens must be >= 1, got {self.default_max_tokens}")
        _require(self.max_pending_requests >= 1,
                 f"gateway.max_pending_requests must be >= 1, got {self.max_pending_requests}")
        _require(self.ready_timeout_s > 0, f"gateway.ready_timeout_s must be > 0, got {self.ready_timeout_s}")
