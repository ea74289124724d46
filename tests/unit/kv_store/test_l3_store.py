"""L3 on a real redis-server (tests/redis_server.py): page keys, the value codec, and RedisPageStore's
contract that every fault is a counted miss and no unverified byte is ever returned."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from common.config import ConfigError
from kernels.kv_layout import KVCacheTensors, kv_layout
from kv_store.l3.codec import HEADER_BYTES, encode_value, pack_page, unpack_page
from kv_store.l3.config import L3Config
from kv_store.l3.keys import KeyNamespace, page_keys
from kv_store.l3.redis_store import RedisPageStore
from tests.redis_server import RedisServer

ROOT = Path(__file__).resolve().parents[3]
LAYOUT = kv_layout(num_layers=2, page_size=4, num_kv_heads=2, head_dim=8, dtype="float32")
NS = KeyNamespace("tiny-llama/seed0", LAYOUT)


def make_kv(num_pages=8, dtype=torch.float32, layout=LAYOUT, seed=0) -> KVCacheTensors:
    """A host KV cache with distinct random values in every page."""
    kv = KVCacheTensors.allocate(layout.num_layers, num_pages, layout.page_size, layout.num_kv_heads,
                                 layout.head_dim, dtype, "cpu")
    gen = torch.Generator().manual_seed(seed)
    for t in kv.k + kv.v:
        t.copy_(torch.randn(t.shape, generator=gen))
    return kv


def chain(num_pages: int, first_token=100) -> list[str]:
    return page_keys(NS, list(range(first_token, first_token + num_pages * LAYOUT.page_size)))


def make_store(server: RedisServer, url: str | None = None, **config) -> RedisPageStore:
    config.setdefault("error_backoff_s", 0.0)
    return RedisPageStore(L3Config(url=url or server.url, **config), NS)


def put_chain(store: RedisPageStore, kv: KVCacheTensors, pages: list[int]) -> list[str]:
    keys = chain(len(pages))
    assert store.put_pages(keys, [pack_page(kv, p) for p in pages]) == len(pages)
    return keys


def set_calls(server: RedisServer) -> int:
    return server.client().info("commandstats").get("cmdstat_set", {}).get("calls", 0)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = RedisServer(tmp_path_factory.mktemp("redis")).start()
    yield srv
    srv.stop()


@pytest.fixture
def store(server):
    server.client().flushall()
    st = make_store(server)
    yield st
    st.close()


# ---- pack / unpack ------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pack_unpack_round_trips_a_page_bytes_exactly(dtype):
    src, dst = make_kv(dtype=dtype, seed=1), make_kv(dtype=dtype, seed=2)
    before = [t.clone() for t in dst.k + dst.v]
    payload = pack_page(src, 3)
    assert len(payload) == src.layout.page_bytes
    unpack_page(dst, 5, payload)
    for s, d, b in zip(src.k + src.v, dst.k + dst.v, before):
        assert torch.equal(d[5], s[3])
        assert torch.equal(torch.cat([d[:5], d[6:]]), torch.cat([b[:5], b[6:]])), "another page changed"
    expected = torch.cat([t[3].reshape(-1).view(torch.uint8) for pair in zip(src.k, src.v) for t in pair])
    assert payload == expected.numpy().tobytes(), "payload is not layer-first, K then V"


def test_unpack_refuses_a_payload_of_another_layout():
    with pytest.raises(ValueError, match="another KV layout"):
        unpack_page(make_kv(), 1, b"\0" * (LAYOUT.page_bytes - 1))


# ---- keys ---------------------------------------------------------------------------------------
def test_keys_cover_whole_pages_and_chain_from_a_parent():
    tokens = list(range(3, 3 + 4 * 5 + 3))  # 5 whole pages and 3 tokens
    keys = page_keys(NS, tokens)
    assert len(keys) == 5 and len(set(keys)) == 5
    assert page_keys(NS, tokens[:8]) == keys[:2], "a prefix's keys are a prefix of the keys"
    assert page_keys(NS, tokens[8:], parent_key=keys[1]) == keys[2:], "a chain continues from its parent"
    assert page_keys(NS, tokens[:3]) == []


def test_keys_are_the_same_in_another_process():
    """No Python hash(): a process with another hash seed computes the same keys."""
    code = ("from kernels.kv_layout import kv_layout; from kv_store.l3.keys import KeyNamespace, page_keys; "
            "print(page_keys(KeyNamespace('tiny-llama/seed0', kv_layout(2, 4, 2, 8, 'float32')), "
            "list(range(100, 116)))[-1])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={"PYTHONHASHSEED": "12345"}, cwd=ROOT)
    assert out.stdout.strip() == chain(4)[-1]


def test_key_format_is_stable():
    """A changed encoding orphans every page already in a shared L3: change KEY_FORMAT with it."""
    assert chain(1)[0] == "6b69561890443a575b33759419d68d3dab092fcd498abbe8dd65838932eb4bb2"


def _variants():
    base = dict(num_layers=2, page_size=4, num_kv_heads=2, head_dim=8, dtype="float32")
    yield "model", KeyNamespace("tiny-llama/seed1", LAYOUT)
    for name, value in [("num_layers", 3), ("page_size", 8), ("num_kv_heads", 1), ("head_dim", 16),
                        ("dtype", "bfloat16")]:
        yield name, KeyNamespace(NS.model, kv_layout(**{**base, name: value}))


@pytest.mark.parametrize("what, other", list(_variants()), ids=[w for w, _ in _variants()])
def test_keys_differ_when_the_namespace_differs(what, other):
    tokens = list(range(100, 116))
    assert set(page_keys(other, tokens)).isdisjoint(page_keys(NS, tokens)), what
    assert other.fingerprint() != NS.fingerprint(), what


@settings(max_examples=200, deadline=None)
@given(a=st.lists(st.integers(0, 2**40), min_size=8, max_size=8),
       b=st.lists(st.integers(0, 2**40), min_size=8, max_size=8),
       parent=st.binary(min_size=32, max_size=32))
def test_keys_differ_when_tokens_or_parent_differ(a, b, parent):
    ka, kb = page_keys(NS, a), page_keys(NS, b)
    # page i's key names the whole prefix: equal iff every token up to the end of page i is equal
    for i in range(2):
        assert (ka[i] == kb[i]) == (a[:4 * (i + 1)] == b[:4 * (i + 1)])
    other_parent = page_keys(NS, a, parent_key=parent.hex())
    assert other_parent[0] != ka[0] or parent == bytes(32)


# ---- config -------------------------------------------------------------------------------------
@pytest.mark.parametrize("field, value", [
    ("backend", "memcached"), ("url", "http://127.0.0.1:6379"), ("url", "redis://"), ("url", "redis://h:99999"),
    ("url", "redis://h/x"), ("prefetch_min_pages", 0), ("prefetch_policy", "eager"), ("prefetch_timeout_s", 0),
    ("prefetch_timeout_per_page_s", -0.1), ("prefetch_timeout_per_page_s", 2),
    ("op_timeout_s", float("nan")), ("key_prefix", ""), ("key_prefix", "a b"), ("ttl_s", 0), ("ttl_s", 1.5),
    ("max_pipeline_pages", 0), ("error_backoff_s", -1),
])
def test_config_bounds_name_the_field(field, value):
    with pytest.raises(ConfigError, match=field):
        L3Config(**{field: value})


def test_config_never_shows_the_password():
    config = L3Config(url="redis://:s3cret@10.0.0.1:6380/2")
    assert "s3cret" not in repr(config) and "s3cret" not in config.redacted_url
    assert config.redacted_url == "redis://:***@10.0.0.1:6380/2"
    with pytest.raises(ConfigError) as err:
        L3Config(url="redis://:s3cret@h:99999/0")
    assert "s3cret" not in str(err.value)


# ---- the store on a real redis-server -----------------------------------------------------------
def test_pages_round_trip_through_redis_byte_exact(store):
    src, dst = make_kv(seed=3), make_kv(seed=4)
    keys = put_chain(store, src, [2, 5, 7])
    payloads = store.get_pages(keys)
    for page, payload in zip([1, 3, 6], payloads):
        unpack_page(dst, page, payload)
    for s, d in zip(src.k + src.v, dst.k + dst.v):
        assert torch.equal(d[[1, 3, 6]], s[[2, 5, 7]])
    stats = store.stats()
    assert (stats.hits, stats.misses, stats.errors, stats.corrupt) == (3, 0, 0, 0)
    assert stats.put_pages == 3 and stats.put_bytes == 3 * (HEADER_BYTES + LAYOUT.page_bytes)


def test_put_writes_only_the_absent_pages(store, server):
    kv = make_kv()
    keys = chain(6)
    payloads = [pack_page(kv, p) for p in range(1, 7)]
    assert store.put_pages(keys[:3], payloads[:3]) == 3
    sets = set_calls(server)
    assert store.put_pages(keys, payloads) == 3, "only pages 3..5 were absent"
    assert set_calls(server) == sets + 3
    assert store.put_pages(keys, payloads) == 0
    assert set_calls(server) == sets + 3, "a put of present pages sent a SET"
    stats = store.stats()
    assert (stats.put_pages, stats.put_present) == (6, 3 + 6)


def test_concurrent_writers_write_each_page_once(server, store):
    kv = make_kv()
    keys, payloads = chain(7), [pack_page(kv, p) for p in range(1, 8)]
    stores = [make_store(server) for _ in range(4)]
    written = []
    threads = [threading.Thread(target=lambda s=s: written.append(s.put_pages(keys, payloads))) for s in stores]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sum(written) == 7, f"pages written {written}: SET NX let two writers store one page"
    assert store.get_pages(keys) == payloads
    for s in stores:
        s.close()


def test_match_len_counts_leading_pages(store, server):
    kv = make_kv()
    keys = chain(5)
    assert store.match_len(keys) == 0
    put_chain(store, kv, [1, 2, 3, 4, 5])
    assert store.match_len(keys) == 5
    assert store.match_len(keys + chain(2, first_token=7)) == 5
    server.client().delete("tandem:kv:" + keys[2])  # an evicted page
    assert store.match_len(keys) == 2


def test_get_stops_at_the_first_miss(server):
    server.client().flushall()
    store = make_store(server, max_pipeline_pages=2)  # the gap sits in the second pipeline
    kv = make_kv()
    keys = put_chain(store, kv, [1, 2, 3, 4, 5])
    server.client().delete("tandem:kv:" + keys[3])
    out = store.get_pages(keys)
    assert out[:3] == [pack_page(kv, p) for p in (1, 2, 3)] and out[3:] == [None, None]
    stats = store.stats()
    assert (stats.hits, stats.misses) == (3, 2)
    assert store.match_len(keys) == 3
    store.close()


def _tamper(value: bytes, how: str, key: str) -> bytes:
    payload = value[HEADER_BYTES:]
    if how == "flipped_byte":
        return value[:-10] + bytes([value[-10] ^ 0x01]) + value[-9:]
    if how == "truncated":
        return value[:HEADER_BYTES + len(payload) // 2]
    if how == "short_header":
        return value[:HEADER_BYTES - 1]
    if how == "trailing_bytes":
        return value + b"\0"
    if how == "bad_magic":
        return b"XKV3" + value[4:]
    if how == "bad_version":
        return value[:4] + b"\x02\x00" + value[6:]
    if how == "wrong_layout":
        other = KeyNamespace(NS.model, kv_layout(2, 4, 2, 8, "bfloat16"))
        return encode_value(key, other.fingerprint(), payload)
    if how == "other_key":  # a verified value, stored under the wrong key
        return encode_value(chain(1, first_token=9)[0], NS.fingerprint(), payload)
    raise AssertionError(how)


@pytest.mark.parametrize("how", ["flipped_byte", "truncated", "short_header", "trailing_bytes", "bad_magic",
                                 "bad_version", "wrong_layout", "other_key"])
def test_a_corrupt_value_is_counted_deleted_and_never_returned(store, server, how):
    kv = make_kv()
    keys = put_chain(store, kv, [1, 2, 3, 4])
    raw = server.client()
    bad_key = "tandem:kv:" + keys[2]
    raw.set(bad_key, _tamper(raw.get(bad_key), how, keys[2]))
    out = store.get_pages(keys)
    assert out == [pack_page(kv, 1), pack_page(kv, 2), None, None]
    stats = store.stats()
    assert (stats.corrupt, stats.hits, stats.misses, stats.errors) == (1, 2, 2, 0)
    assert not raw.exists(bad_key), "the corrupt value was left in L3"
    assert store.put_pages(keys, [pack_page(kv, p) for p in (1, 2, 3, 4)]) == 1, "the page is rewritten"
    assert store.get_pages(keys) == [pack_page(kv, p) for p in (1, 2, 3, 4)]


def test_ttl_sets_an_expiry(server):
    server.client().flushall()
    store = make_store(server, ttl_s=100)
    keys = put_chain(store, make_kv(), [1, 2])
    assert all(0 < server.client().ttl("tandem:kv:" + k) <= 100 for k in keys)
    store.close()


def test_out_of_memory_is_a_counted_error(server, store):
    raw = server.client()
    raw.config_set("maxmemory-policy", "noeviction")
    raw.config_set("maxmemory", raw.info("memory")["used_memory"] + 2 * LAYOUT.page_bytes)
    try:
        kv = make_kv(num_pages=64)
        keys = chain(63)
        written = store.put_pages(keys, [pack_page(kv, p) for p in range(1, 64)])
    finally:
        raw.config_set("maxmemory", 0)
    assert written < 63 and store.stats().errors >= 1 and "OutOfMemory" in store.last_error


def test_a_killed_server_gives_misses_then_recovers(tmp_path):
    server = RedisServer(tmp_path).start()
    try:
        store = make_store(server)
        kv = make_kv()
        keys = put_chain(store, kv, [1, 2, 3])
        server.kill()
        assert store.get_pages(keys) == [None] * 3
        assert store.match_len(keys) == 0
        assert store.put_pages(keys, [pack_page(kv, p) for p in (1, 2, 3)]) == 0
        stats = store.stats()
        assert stats.errors == 3 and stats.misses == 3 and stats.hits == 0
        assert "ConnectionError" in store.last_error
        server.start()  # same port, empty (no persistence)
        assert store.get_pages(keys) == [None] * 3 and store.stats().errors == 3, "a miss, not an error"
        assert store.put_pages(keys, [pack_page(kv, p) for p in (1, 2, 3)]) == 3
        assert store.get_pages(keys) == [pack_page(kv, p) for p in (1, 2, 3)]
        assert store.last_error is None
        store.close()
    finally:
        server.stop()


def test_a_hung_server_times_out_into_a_miss(tmp_path):
    server = RedisServer(tmp_path).start()
    try:
        store = make_store(server, op_timeout_s=0.2)
        kv = make_kv()
        keys = put_chain(store, kv, [1, 2])
        server.pause()
        start = time.monotonic()
        assert store.get_pages(keys) == [None, None]
        assert time.monotonic() - start < 2.0
        assert store.stats().errors == 1 and "Timeout" in store.last_error
        server.resume()
        assert store.get_pages(keys) == [pack_page(kv, 1), pack_page(kv, 2)]
        store.close()
    finally:
        server.stop()


def test_after_an_error_the_store_backs_off(tmp_path):
    server = RedisServer(tmp_path).start()
    try:
        store = make_store(server, error_backoff_s=30.0)
        keys = chain(2)
        server.kill()
        assert store.match_len(keys) == 0
        server.start()
        start = time.monotonic()
        for _ in range(20):
            assert store.get_pages(keys) == [None, None]
        assert time.monotonic() - start < 0.5
        stats = store.stats()
        assert (stats.errors, stats.skipped, stats.misses) == (1, 20, 40)
        store.close()
    finally:
        server.stop()


def test_auth_through_the_url(tmp_path):
    server = RedisServer(tmp_path, password="right-pw").start()
    try:
        kv = make_kv()
        wrong = make_store(server, url=f"redis://:wrong-pw@127.0.0.1:{server.port}/0")
        none = make_store(server, url=f"redis://127.0.0.1:{server.port}/0")
        for store in (wrong, none):
            assert store.put_pages(chain(1), [pack_page(kv, 1)]) == 0
            assert store.get_pages(chain(1)) == [None]
            assert store.stats().errors == 2
            assert "wrong-pw" not in store.last_error
            store.close()
        assert "Authentication" in wrong.last_error and "Authentication" in none.last_error
        right = make_store(server)
        keys = put_chain(right, kv, [1, 2])
        assert right.get_pages(keys) == [pack_page(kv, 1), pack_page(kv, 2)]
        assert right.stats().errors == 0
        right.close()
    finally:
        server.stop()


def test_a_closed_store_refuses_calls(store):
    store.close()
    store.close()
    with pytest.raises(RuntimeError, match="after close"):
        store.get_pages(chain(1))


def test_tls_through_the_url(tmp_path):
    server = RedisServer(tmp_path, password="pw", tls=True).start()
    try:
        kv = make_kv()
        unverified = make_store(server, url=f"rediss://:pw@127.0.0.1:{server.port}/0")  # system CAs only
        plain = make_store(server, url=f"redis://:pw@127.0.0.1:{server.port}/0")
        for store in (unverified, plain):
            assert store.get_pages(chain(1)) == [None] and store.stats().errors == 1
            store.close()
        assert "CERTIFICATE_VERIFY_FAILED" in unverified.last_error
        verified = make_store(server)
        keys = put_chain(verified, kv, [1, 2])
        assert verified.get_pages(keys) == [pack_page(kv, 1), pack_page(kv, 2)]
        verified.close()
    finally:
        server.stop()
