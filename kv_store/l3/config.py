"""The L3 store's configuration (the `kv_store.l3:` section of a cluster YAML; docs/design.md §5).

Plain scalar fields, so the cluster config loader can build it like every other section. The URL may
carry a password, so it never appears in `repr()`; log `redacted_url` instead.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from urllib.parse import urlsplit, urlunsplit

from common.config import ConfigError, require

BACKENDS = ("redis",)
URL_SCHEMES = ("redis", "rediss")
MAX_OP_TIMEOUT_S = 60.0
MAX_PREFETCH_TIMEOUT_S = 600.0
MAX_PIPELINE_PAGES = 4096
MAX_KEY_PREFIX_CHARS = 128
MAX_TTL_S = 365 * 24 * 3600


class PrefetchPolicy(enum.Enum):
    """How long a request waits for an L3 -> L2 prefetch before it prefills what did not arrive."""

    BEST_EFFORT = "best_effort"  # never wait: use the pages that landed by the time the request is scheduled
    WAIT_COMPLETE = "wait_complete"  # wait until the prefetch ends (done or failed; a fault ends it at once)
    TIMEOUT = "timeout"  # wait at most `prefetch_timeout_s`, then go on with what landed


@dataclass(frozen=True)
class L3Config:
    """A remote page store shared by every worker of one model (Redis), below L1 device and L2 host."""

    backend: str = "redis"
    """The store: "redis" (a real `redis-server`, 6.2 or newer)."""
    url: str = field(default="redis://127.0.0.1:6379/0", repr=False)
    """`redis://[[user]:password@]host[:port][/db]`, or `rediss://...` for TLS (certificate options as
    query parameters, e.g. `?ssl_cert_reqs=required&ssl_ca_certs=/path/ca.pem`). Never logged whole:
    see `redacted_url`."""
    prefetch_min_pages: int = 4
    """Prefetch L3 -> L2 only when the L3 match extends the local (L1/L2) match by at least this many
    pages (>= 1): a shorter gain costs a round trip for little saved prefill."""
    prefetch_policy: str = PrefetchPolicy.TIMEOUT.value
    """"best_effort", "wait_complete" or "timeout" (`PrefetchPolicy`). The default waits: a request
    that does not wait for its prefetch prefills what L3 is fetching for it, which on a CPU takes
    far longer than the wait (docs/results.md#kv-tiers)."""
    prefetch_timeout_s: float = 1.0
    """With the "timeout" policy, how long a request waits for its prefetch at least (> 0, <= 600)..."""
    prefetch_timeout_per_page_s: float = 0.01
    """... plus this per page it asked L3 for (>= 0, <= 1), so a long prefix is not given up for
    the time a short one takes. A prefetch that lands after its request went on still serves the
    requests after it. 10 ms per page fetches at >= ~75 MB/s (float32 SmolLM2 pages), far quicker
    than a CPU prefills a page; on a GPU, which prefills a page in well under a millisecond, set
    it (and prefetch_timeout_s) lower or use best_effort."""
    op_timeout_s: float = 0.5
    """Socket connect and read timeout of one Redis call (one pipeline), in (0, 60]. A call that runs
    out is an L3 error: counted, and the pages it was for are misses."""
    key_prefix: str = "tandem:kv:"
    """Prepended to every page key; separates deployments sharing one Redis (1..128 printable
    characters, no whitespace)."""
    ttl_s: int | None = None
    """Expiry of a written page in seconds (>= 1), or None: pages live until Redis evicts them
    (run Redis with a `maxmemory` and an `allkeys-lru` policy then)."""
    max_pipeline_pages: int = 16
    """Pages per Redis pipeline at most (1..4096): bounds one round trip's payload (16 SmolLM2 float32
    pages: 12 MB) and how long one call holds a connection. Deeper pipelines save round trips on a
    slow network but cost client memory; on loopback deeper than 16 was slower (docs/results.md#kv-tiers)."""
    error_backoff_s: float = 1.0
    """After a failed Redis call, skip L3 for this long (every lookup a miss, every put dropped)
    instead of paying a timeout per request while Redis is down (>= 0; 0: retry at once)."""

    def __post_init__(self) -> None:
        require(self.backend in BACKENDS, f"backend must be one of {BACKENDS}, got {self.backend!r}")
        self._check_url()
        require(_is_int(self.prefetch_min_pages) and self.prefetch_min_pages >= 1,
                f"prefetch_min_pages must be an integer >= 1, got {self.prefetch_min_pages!r}")
        policies = tuple(p.value for p in PrefetchPolicy)
        require(self.prefetch_policy in policies,
                f"prefetch_policy must be one of {policies}, got {self.prefetch_policy!r}")
        require(_is_real(self.prefetch_timeout_s) and 0 < self.prefetch_timeout_s <= MAX_PREFETCH_TIMEOUT_S,
                f"prefetch_timeout_s must be in (0, {MAX_PREFETCH_TIMEOUT_S}], got {self.prefetch_timeout_s!r}")
        require(_is_real(self.prefetch_timeout_per_page_s) and 0 <= self.prefetch_timeout_per_page_s <= 1,
                f"prefetch_timeout_per_page_s must be in [0, 1], got {self.prefetch_timeout_per_page_s!r}")
        require(_is_real(self.op_timeout_s) and 0 < self.op_timeout_s <= MAX_OP_TIMEOUT_S,
                f"op_timeout_s must be in (0, {MAX_OP_TIMEOUT_S}], got {self.op_timeout_s!r}")
        require(isinstance(self.key_prefix, str) and 1 <= len(self.key_prefix) <= MAX_KEY_PREFIX_CHARS
                and self.key_prefix.isprintable() and not any(c.isspace() for c in self.key_prefix),
                f"key_prefix must be 1..{MAX_KEY_PREFIX_CHARS} printable characters without whitespace, "
                f"got {self.key_prefix!r}")
        require(self.ttl_s is None or (_is_int(self.ttl_s) and 1 <= self.ttl_s <= MAX_TTL_S),
                f"ttl_s must be None or an integer in [1, {MAX_TTL_S}], got {self.ttl_s!r}")
        require(_is_int(self.max_pipeline_pages) and 1 <= self.max_pipeline_pages <= MAX_PIPELINE_PAGES,
                f"max_pipeline_pages must be an integer in [1, {MAX_PIPELINE_PAGES}], got {self.max_pipeline_pages!r}")
        require(_is_real(self.error_backoff_s) and 0 <= self.error_backoff_s <= MAX_OP_TIMEOUT_S,
                f"error_backoff_s must be in [0, {MAX_OP_TIMEOUT_S}], got {self.error_backoff_s!r}")

    @property
    def policy(self) -> PrefetchPolicy:
        return PrefetchPolicy(self.prefetch_policy)

    @property
    def redacted_url(self) -> str:
        """`url` with its password replaced by "***" (safe for logs and error messages)."""
        return redact_url(self.url)

    def _check_url(self) -> None:
        require(isinstance(self.url, str), f"url must be a string, got {type(self.url).__name__}")
        try:
            parts = urlsplit(self.url)
            parts.port  # noqa: B018 - raises ValueError on a port that is not a number in 0..65535
        except ValueError as err:
            raise ConfigError(f"url {redact_url(self.url)!r} does not parse: {err}") from None
        require(parts.scheme in URL_SCHEMES,
                f"url must start with redis:// or rediss:// (TLS), got {redact_url(self.url)!r}")
        require(bool(parts.hostname), f"url must name a host, got {redact_url(self.url)!r}")
        db = parts.path.lstrip("/")
        require(db == "" or db.isdigit(), f"url path must be a database number (/0), got {redact_url(self.url)!r}")


def redact_url(url: str) -> str:
    """`url` with any password replaced by "***"; an unparsable URL becomes "<unparsable url>"."""
    try:
        parts = urlsplit(url)
        if parts.password is None:
            return url
        user = parts.username or ""
        host = parts.hostname or ""
        port = f":{parts.port}" if parts.port is not None else ""
        return urlunsplit(parts._replace(netloc=f"{user}:***@{host}{port}"))
    except ValueError:
        return "<unparsable url>"


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_real(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
