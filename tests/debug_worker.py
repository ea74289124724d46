"""Test hooks around a real worker: only tests build a `DebugWorker`, so the hooks' messages never
belong to the wire protocol.

    Stall(seconds)        the worker stops stepping for that long (a slow peer)
    DigestKV(ids, pages)  answered by KVDigest: a hash of the cached KV of the first pages of `ids`,
                          to compare the bytes a prefill worker computed with what a decode worker got

`build_debug_worker` is a `WorkerHost` / worker-process builder (picklable: a spawned worker process
imports this module to run it).
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass

import torch

from cluster.worker_host.build import WorkerSpec, build_worker


@dataclass(frozen=True)
class Stall:
    seconds: float


@dataclass(frozen=True)
class DigestKV:
    token_ids: tuple[int, ...]
    num_pages: int


@dataclass(frozen=True)
class KVDigest:
    role: str
    num_pages: int  # pages of the prefix found in the worker's prefix cache
    sha256: str  # over K then V of every layer, page by page; "" when fewer pages were found


class DebugWorker:
    """The worker contract of `inner`, plus the hooks above."""

    def __init__(self, inner):
        self.inner = inner
        self.role = inner.role

    def handle(self, msg) -> list:
        if isinstance(msg, Stall):
            time.sleep(msg.seconds)
            return []
        if isinstance(msg, DigestKV):
            return [kv_digest(self.inner, msg)]
        return self.inner.handle(msg)

    def __getattr__(self, name):  # the rest of the contract (step, busy, stats, ...) and the worker's parts
        return getattr(self.inner, name)


def kv_digest(worker, msg: DigestKV) -> KVDigest:
    engine = worker.engine
    found = engine.kvm.prefix_cache.match(list(msg.token_ids), len(msg.token_ids)).pages[:msg.num_pages]
    if len(found) < msg.num_pages:
        return KVDigest(worker.role.value, len(found), "")
    pages, digest = torch.tensor(found), hashlib.sha256()
    for tensors in (engine.kv_cache.k, engine.kv_cache.v):
        for t in tensors:
            digest.update(t.index_select(0, pages.to(t.device)).cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return KVDigest(worker.role.value, len(found), digest.hexdigest())


def build_debug_worker(spec: WorkerSpec, transport=None):
    worker, transport = build_worker(spec, transport)
    return DebugWorker(worker), transport
