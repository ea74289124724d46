"""L3: a remote KV page store shared by every worker of one model (docs/design.md §5).

`keys` names pages by a hash chain over their tokens, `codec` turns a host page into a verified value
and back, `redis_store.RedisPageStore` moves values to and from Redis (the one module that talks to it;
`redis_process` starts a local redis-server for tests and benchmarks). Any store fault is a counted miss, never an exception to the caller and never wrong KV.
"""

from kv_store.l3.codec import PageBytes, ValueFault, pack_page, unpack_page
from kv_store.l3.config import L3Config, PrefetchPolicy
from kv_store.l3.keys import ROOT_KEY, KeyNamespace, page_keys
from kv_store.l3.redis_store import L3Stats, RedisPageStore

__all__ = [
    "KeyNamespace",
    "L3Config",
    "L3Stats",
    "PageBytes",
    "PrefetchPolicy",
    "ROOT_KEY",
    "RedisPageStore",
    "ValueFault",
    "pack_page",
    "page_keys",
    "unpack_page",
]
