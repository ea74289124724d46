"""The loop that hosts one worker, whatever carries its messages (a pipe or in-memory queues).

The loop: drain the driver's messages, step the worker while it has work, send its outputs and
outbox messages, and a heartbeat (with pool stats and an integrity check) every
`heartbeat_interval_s`.

A fault while handling a message about one request fails that request (its client gets an
"internal" error, what it held is released) and the loop goes on; the engine confines a fault in
a step to its request the same way. Any other exception ends the loop (the host reports it as
`WorkerCrashed`).
"""

from __future__ import annotations

import time

from cluster import protocol as p
from cluster.faults import FAILURE_INTERNAL, internal_error
from cluster.worker_host.build import WorkerSpec


def _pool_stats(pool) -> p.PoolStats:
    u = pool.usage()
    return p.PoolStats(u.total, u.free, u.private, u.cached, u.in_flight)


def _stats(role: str, worker) -> p.WorkerStats:
    try:
        worker.check_integrity()
        error = ""
    except AssertionError as exc:
        error = str(exc) or "integrity check failed"
    host = getattr(worker, "host", None)
    transfers = len(getattr(worker, "shipments", {})) + len(getattr(worker, "inbound", {}))
    return p.WorkerStats(role, _pool_stats(worker.device_pool.pages), _pool_stats(host.pool) if host else None,
                         len(worker.scheduler.running), len(worker.scheduler.waiting), transfers, error)


def _handle(worker, msg, conn) -> bool:
    """Apply one driver message. Returns False on Shutdown."""
    if isinstance(msg, p.Shutdown):
        return False
    if isinstance(msg, p.Stall):
        time.sleep(msg.seconds)
    elif isinstance(msg, p.Reserve):
        try:
            landing = worker.reserve(msg.request_id, list(msg.prompt_token_ids), msg.params, msg.peer)
            conn.send(p.Reserved(msg.request_id, landing, ""))
        except ValueError as exc:
            conn.send(p.Reserved(msg.request_id, None, str(exc)))
    elif isinstance(msg, p.Prefill):
        try:
            worker.submit(msg.request_id, list(msg.prompt_token_ids), msg.params, msg.landing)
        except ValueError as exc:
            worker.outbox.append(p.TransferAborted(msg.request_id, f"rejected: {exc}"))
    elif isinstance(msg, p.Generate):
        try:
            worker.add_request(list(msg.prompt_token_ids), msg.params, msg.request_id)
        except ValueError as exc:
            conn.send(p.TokenOutput(msg.request_id, (), "abort", str(exc), failure="rejected"))
    elif isinstance(msg, p.Abort):
        worker.abort(msg.request_id)
    elif isinstance(msg, p.PeerDead):
        worker.peer_dead(msg.peer)
    elif isinstance(msg, p.DigestKV):
        conn.send(_kv_digest(worker, msg))
    else:
        worker.on_message(msg)  # KVComplete / TransferAborted / AbortTransfer
    return True


def _handle_confined(worker, msg, conn) -> bool:
    """`_handle`, with a fault confined to the request the message is about. Returns False on Shutdown."""
    try:
        return _handle(worker, msg, conn)
    except Exception as exc:  # noqa: BLE001 - one request's fault; anything else is re-raised below
        request_id = getattr(msg, "request_id", None)
        if request_id is None:
            raise  # not about one request: the worker's own fault
        _fail_message(worker, msg, conn, request_id, internal_error(request_id, exc, type(msg).__name__))
        return True


def _fail_message(worker, msg, conn, request_id: str, error: str) -> None:
    """Release what the request holds, check the pools are consistent again (else the loop ends),
    and tell its client. A prefill worker's client hears it through the decode worker (`TransferAborted`)."""
    worker.fail_request(request_id, error)
    worker.check_integrity()
    if worker.speaks_for_client:
        conn.send(p.TokenOutput(request_id, (), "abort", error, failure=FAILURE_INTERNAL))
    if isinstance(msg, p.Reserve):  # the dispatcher also waits for the answer to a reservation
        conn.send(p.Reserved(request_id, None, error))


def _kv_digest(worker, msg: p.DigestKV) -> p.KVDigest:
    import hashlib

    import torch

    found = worker.kvm.prefix_cache.match(list(msg.token_ids), len(msg.token_ids)).pages[:msg.num_pages]
    if len(found) < msg.num_pages:
        return p.KVDigest(worker.role_name, len(found), "")
    pages, digest = torch.tensor(found), hashlib.sha256()
    for tensors in (worker.kv_cache.k, worker.kv_cache.v):
        for t in tensors:
            digest.update(t.index_select(0, pages.to(t.device)).cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return p.KVDigest(worker.role_name, len(found), digest.hexdigest())


def _send_progress(worker, conn, outputs) -> None:
    """Tokens go to the client only from the decode worker: the prefill worker's one sampled
    token reaches the decode worker inside `KVComplete`."""
    for out in outputs if worker.speaks_for_client else ():
        reason = out.finish_reason.value if out.finish_reason is not None else None
        failure = out.failure or ("transfer" if out.error else "")
        conn.send(p.TokenOutput(out.request_id, tuple(out.new_token_ids), reason, out.error, out.cached_tokens,
                                out.timings, time.time(), failure))
    for item in worker.outbox:
        conn.send(item[1] if isinstance(item, tuple) else item)  # decode's outbox holds (peer, msg)
    worker.outbox.clear()


def run_loop(spec: WorkerSpec, worker, conn) -> None:
    """Serve `worker` over `conn` until Shutdown; an exception that is no one request's fault ends it."""
    last_beat = 0.0
    while True:
        if worker.scheduler.has_work():
            timeout = 0.0  # compute to do: only drain what is already there
        elif worker.has_unfinished():
            timeout = 0.002  # only transfers/loads in flight: don't spin a core the transport needs
        else:
            timeout = min(0.05, spec.heartbeat_interval_s)
        while conn.poll(timeout):
            if not _handle_confined(worker, conn.recv(), conn):
                return
            timeout = 0.0
        if worker.has_unfinished():
            _send_progress(worker, conn, worker.step())
        else:
            _send_progress(worker, conn, [])
        now = time.monotonic()
        if now - last_beat >= spec.heartbeat_interval_s:
            conn.send(p.Heartbeat(_stats(spec.role, worker)))
            last_beat = now
