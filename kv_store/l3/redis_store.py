"""The L3 page store on Redis: the only module in tandem that imports `redis` (imported lazily).

Owns one Redis client (a connection pool) and the store's counters. A page is one Redis string:
key = `L3Config.key_prefix` + the page's chain key (`keys.page_keys`), value = `codec.encode_value`.

Error policy, one for every call: a Redis fault (server down, connection reset, timeout, AUTH or TLS
failure, out of memory, an evicted or expired key) and a value that fails verification are counted
and turn into misses. Nothing here raises to the caller for them, and no unverified byte is ever
returned. After a failed call the store skips Redis for `L3Config.error_backoff_s`, so a dead server
costs one timeout, not one per request. Wrong arguments (a payload of the wrong size, a store used
after `close()`) are caller bugs and do raise.

Thread-safe: the redis client's pool is, and the counters sit under a lock, so a prefetch thread and
the scheduler loop may share one store.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from common.config import ConfigError
from kv_store.l3.codec import ValueFault, decode_value, encode_value
from kv_store.l3.config import L3Config
from kv_store.l3.keys import KeyNamespace

log = logging.getLogger(__name__)


@dataclass
class L3Stats:
    """Counters since the store was built (`RedisPageStore.stats()` returns a copy)."""

    hits: int = 0
    """Pages `get_pages` returned (verified)."""
    misses: int = 0
    """Pages `get_pages` was asked for and did not return: absent, past the first gap, corrupt, or
    lost to a fault."""
    errors: int = 0
    """Redis calls (one pipeline each) that failed: refused, reset, timed out, AUTH, OOM, ..."""
    corrupt: int = 0
    """Values that failed verification (`codec.ValueFault`); each was deleted."""
    skipped: int = 0
    """Calls not sent because the store was backing off after an error."""
    put_pages: int = 0
    """Pages `put_pages` wrote."""
    put_bytes: int = 0
    """Bytes `put_pages` wrote (header + payload)."""
    put_present: int = 0
    """Pages `put_pages` found in L3 already (not sent)."""
    get_calls: int = 0
    put_calls: int = 0
    match_calls: int = 0
    get_seconds: float = 0.0
    """Wall time summed over `get_pages` calls (divide by `get_calls` or `hits` for a mean)."""
    put_seconds: float = 0.0
    """Wall time summed over `put_pages` calls."""
    match_seconds: float = 0.0
    """Wall time summed over `match_len` calls."""


def _import_redis() -> types.ModuleType:
    try:
        import redis
        import redis.backoff  # noqa: F401 - loads the submodule read below as redis.backoff
        import redis.retry  # noqa: F401 - loads the submodule read below as redis.retry
    except ImportError as err:
        raise ImportError("the L3 store needs the redis client: pip install 'redis>=5' (a core dependency of "
                          "tandem-serve; reinstall with bash scripts/setup.sh), or run without kv_store.l3") from err
    return redis


class RedisPageStore:
    """Pages of one `KeyNamespace` (model + KV layout) in one Redis database.

    Every method takes page keys in chain order (page 0 first); only a contiguous run from the first
    key is useful to a prefix, so reads stop at the first gap.
    """

    def __init__(self, config: L3Config, namespace: KeyNamespace):
        redis = _import_redis()
        self.config = config
        self.namespace = namespace
        self._fingerprint = namespace.fingerprint()
        self._page_bytes = namespace.layout.page_bytes
        self._faults = (redis.RedisError, OSError)
        # one immediate retry on a dropped connection (a restarted server leaves stale pooled sockets);
        # none on a timeout: that already cost op_timeout_s
        retry = redis.retry.Retry(redis.backoff.NoBackoff(), 1, supported_errors=(redis.ConnectionError,))
        try:
            self._client = redis.Redis.from_url(
                config.url, socket_timeout=config.op_timeout_s, socket_connect_timeout=config.op_timeout_s,
                retry=retry, health_check_interval=0, client_name="tandem-l3",
                socket_read_size=_read_size(self._page_bytes))
        except ValueError as err:  # a bad query parameter in the URL
            raise ConfigError(f"url {config.redacted_url!r}: {err}") from None
        self._lock = threading.Lock()
        self._stats = L3Stats()
        self._down_until = 0.0  # time.monotonic() before which calls are skipped
        self._closed = False
        self.last_error: str | None = None
        """The most recent fault, as text (no password in it), or None."""

    # ---- the interface ---------------------------------------------------------------------------
    def match_len(self, keys: Sequence[str]) -> int:
        """How many leading pages of `keys` exist in L3 (pipelined EXISTS). Values are not read, so a
        page counted here can still turn out absent (evicted) or corrupt in `get_pages`. A fault ends
        the count: pipelines answered before it still count (0 when the first one fails)."""
        start = time.perf_counter()
        found = 0
        for chunk in self._chunks(keys):
            exists = self._run(lambda pipe, ks=chunk: [pipe.exists(self._redis_key(k)) for k in ks])
            if exists is None:
                break
            run = _leading_true(exists)
            found += run
            if run < len(chunk):
                break
        self._add(match_calls=1, match_seconds=time.perf_counter() - start)
        return found

    def get_pages(self, keys: Sequence[str]) -> list[bytes | None]:
        """Payloads of the leading pages of `keys`, verified: `out[i]` is page i's payload for i below
        the first miss, None from it on (a page that is absent, corrupt, or lost to a fault). Every
        value read is checked against its header; a bad one is deleted and never returned."""
        start = time.perf_counter()
        out: list[bytes | None] = [None] * len(keys)
        hits, bad = 0, []
        for chunk in self._chunks(keys):
            values = self._run(lambda pipe, ks=chunk: [pipe.get(self._redis_key(k)) for k in ks])
            if values is None:
                break
            payloads, fault = self._verified_run(chunk, values)
            out[hits:hits + len(payloads)] = payloads
            hits += len(payloads)
            if fault is not None:
                bad.append(fault)
            if len(payloads) < len(chunk):
                break
        if bad:
            self._drop_corrupt(bad)
        self._add(get_calls=1, hits=hits, misses=len(keys) - hits, get_seconds=time.perf_counter() - start)
        return out

    def put_pages(self, keys: Sequence[str], payloads: Sequence[bytes]) -> int:
        """Store the pages of `keys` that L3 lacks; returns how many this call wrote.

        Pipelined EXISTS first, so present pages cost no payload on the wire; then pipelined
        `SET NX` (with `ttl_s` when set), so a concurrent writer of the same page never clobbers and
        a page is written once. A fault stops the call; pages written before it stay.
        """
        if len(keys) != len(payloads):
            raise ValueError(f"{len(keys)} keys but {len(payloads)} payloads")
        for i, payload in enumerate(payloads):
            if len(payload) != self._page_bytes:
                raise ValueError(f"payload {i} has {len(payload)} bytes, a page of this layout has "
                                 f"{self._page_bytes}: packed from another KV layout?")
        start = time.perf_counter()
        written = 0
        for offset in range(0, len(keys), self.config.max_pipeline_pages):
            end = offset + self.config.max_pipeline_pages
            n = self._put_chunk(keys[offset:end], payloads[offset:end])
            if n is None:
                break
            written += n
        self._add(put_calls=1, put_seconds=time.perf_counter() - start)
        return written

    def stats(self) -> L3Stats:
        """A copy of the counters."""
        with self._lock:
            return dataclasses.replace(self._stats)

    def close(self) -> None:
        """Close every connection. Idempotent; the store must not be used afterwards."""
        if not self._closed:
            self._closed = True
            try:
                self._client.close()
            except self._faults as err:  # closing a socket to a dead server: nothing left to do
                log.debug("L3: closing the redis client: %s", err)

    # ---- internals -------------------------------------------------------------------------------
    def _put_chunk(self, keys: Sequence[str], payloads: Sequence[bytes]) -> int | None:
        """Write the absent pages of one pipeline's worth; pages written, or None on a fault."""
        exists = self._run(lambda pipe: [pipe.exists(self._redis_key(k)) for k in keys])
        if exists is None:
            return None
        missing = [i for i, present in enumerate(exists) if not present]
        self._add(put_present=len(keys) - len(missing))
        if not missing:
            return 0
        values = {i: encode_value(keys[i], self._fingerprint, payloads[i]) for i in missing}
        ttl = self.config.ttl_s
        done = self._run(lambda pipe: [pipe.set(self._redis_key(keys[i]), values[i], nx=True, ex=ttl)
                                       for i in missing])
        if done is None:
            return None
        stored = [i for i, ok in zip(missing, done) if ok]  # None: a concurrent writer got there first
        self._add(put_pages=len(stored), put_bytes=sum(len(values[i]) for i in stored),
                  put_present=len(missing) - len(stored))
        return len(stored)

    def _verified_run(self, keys: Sequence[str], values: list) -> tuple[list[bytes], tuple | None]:
        """The verified payloads of the leading present values, and (key, fault) of the value that
        ended the run when it failed verification (None when it ended at an absent key or the end)."""
        payloads: list[bytes] = []
        for key, value in zip(keys, values):
            if value is None:
                return payloads, None
            decoded = decode_value(key, self._fingerprint, self._page_bytes, value)
            if decoded.payload is None:  # exactly one of payload and fault is set
                return payloads, (key, decoded.fault)
            payloads.append(decoded.payload)
        return payloads, None

    def _drop_corrupt(self, bad: list[tuple[str, ValueFault]]) -> None:
        for key, fault in bad:
            log.warning("L3: page %s failed verification (%s); deleted, counted as a miss", key, fault.value)
        self._add(corrupt=len(bad))
        self._run(lambda pipe: [pipe.delete(self._redis_key(k)) for k, _ in bad])

    def _run(self, queue: Callable) -> list | None:
        """Send the commands `queue(pipeline)` adds as one pipeline; their replies, or None when the
        store is backing off or the call failed (then counted and logged)."""
        if self._closed:
            raise RuntimeError("RedisPageStore used after close()")
        if time.monotonic() < self._down_until:
            self._add(skipped=1)
            return None
        try:
            with self._client.pipeline(transaction=False) as pipe:
                queue(pipe)
                replies = pipe.execute()
        except self._faults as err:
            self._fault(err)
            return None
        if self.last_error is not None:
            log.info("L3: %s answers again", self.config.redacted_url)
            self.last_error = None
        return replies

    def _fault(self, err: BaseException) -> None:
        text = f"{type(err).__name__}: {err}"
        if self.last_error is None:
            log.warning("L3: %s failed (%s); L3 lookups are misses, retrying in %.1f s",
                        self.config.redacted_url, text, self.config.error_backoff_s)
        self.last_error = text
        self._down_until = time.monotonic() + self.config.error_backoff_s
        self._add(errors=1)

    def _chunks(self, keys: Sequence[str]) -> list[Sequence[str]]:
        n = self.config.max_pipeline_pages
        return [keys[i:i + n] for i in range(0, len(keys), n)]

    def _redis_key(self, key: str) -> str:
        return self.config.key_prefix + key

    def _add(self, **counts: float) -> None:
        with self._lock:
            for name, value in counts.items():
                setattr(self._stats, name, getattr(self._stats, name) + value)


def _read_size(page_bytes: int) -> int:
    """Bytes per socket read: a whole value in one read when it fits 4 MiB. redis-py's pure-Python
    reader reads 64 KiB at a time by default, which makes a page GET several times slower than one read."""
    return min(max(64 * 1024, page_bytes + 4096), 4 * 1024 * 1024)


def _leading_true(replies: list) -> int:
    """How many replies from the start are truthy (EXISTS answers 1 or 0)."""
    n = 0
    for reply in replies:
        if not reply:
            break
        n += 1
    return n
