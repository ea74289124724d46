"""L3: a remote KV page store shared by every worker of one model (docs/design.md §5).

`keys` names pages by a hash chain over their tokens, `codec` turns a host page into a verified value
and back, `redis_store.RedisPageStore` moves values to and from Redis (the one module that talks to it;
`redis_process` starts a local redis-server for tests and benchmarks). Any store fault is a counted miss, never an
exception to the caller and never wrong KV.

The package imports none of them: `kv_store.l3.config` is read by the gateway and the controller,
which must not pay for torch (the codec's).
"""
