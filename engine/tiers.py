"""The engine's KV tiers below the device pool: the L2 host cache and, under it, the L3 store, built
from the resolved config (docs/design.md §5)."""

from __future__ import annotations

import hashlib
import itertools

import torch

from common.config import EngineConfig, require
from kv_store.device_pool import DevicePool
from kv_store.host_cache import HostCache, NullHostCache, WritePolicy
from kv_store.l3.config import L3Config
from kv_store.l3.keys import KeyNamespace
from kv_store.l3.tier import L3Tier
from kv_store.radix_cache import NullPrefixCache, RadixPrefixCache
from kv_store.tier_copies import host_tensors


def host_cache(config: EngineConfig, tree: RadixPrefixCache | NullPrefixCache, device_pool: DevicePool,
               l3: L3Config | None, l3_model_id: str) -> HostCache | NullHostCache:
    """The L2 tier under `tree` when the resolved config asks for host pages, with L3 below it when
    `l3` is given (L3 pages move through L2, so L3 needs it); `l3_model_id` names the KV's producer
    in L3 keys (`model_id`)."""
    if not config.host_cache_pages:
        require(l3 is None, "kv_store.l3 needs the host tier: set host_cache_ratio > 0 and keep the prefix cache on")
        return NullHostCache()
    assert isinstance(tree, RadixPrefixCache), "host cache pages but no prefix tree: the prefix cache is off?"
    host_kv = host_tensors(device_pool.kv, config.host_cache_pages)
    tier = None
    if l3 is not None:
        from kv_store.l3.redis_store import RedisPageStore

        namespace = KeyNamespace(l3_model_id, device_pool.layout)
        tier = L3Tier(RedisPageStore(l3, namespace), namespace, host_kv, l3)
    return HostCache(tree, device_pool, host_kv, WritePolicy(config.write_policy), config.write_through_hits, l3=tier)


def model_id(name: str, model: torch.nn.Module, draft_head: torch.nn.Module | None = None) -> str:
    """`name` plus a digest of the weights' first bytes (and the draft head's, whose KV is the pages'
    last layer): L3 keys of two models, or of one model with two heads, never meet, even under one name."""
    h = hashlib.blake2b(digest_size=8)
    for module in (model, draft_head) if draft_head is not None else (model,):
        for _, tensor in itertools.islice(module.state_dict().items(), 4):
            h.update(str(tuple(tensor.shape)).encode())
            h.update(tensor.detach().flatten()[:4096].float().cpu().numpy().tobytes())
    return f"{name}@{h.hexdigest()}"
