"""`tandem bench chaos`: a steady streaming load on a `tandem serve` started here (disaggregated, a
host tier, L3 on a Redis started here, KV damaged on purpose at `--inject`'s rates), while faults
hit it at random for `--duration-s`; then every completed request is replayed undisturbed and
compared, and the report says what became of each.

    load     `--streams` clients, each looping over: a seeded sampled completion (most), one with
             n = 2, or the next turn of its own streaming session
    faults   every ~`--fault-every-s` (exponential), one of the target's (`cluster/bench/chaos_targets.py`):
             SIGKILL the decode or the prefill worker, SIGTERM the decode worker (drained, then
             restarted), a rolling restart of it, SIGKILL Redis (restarted later); across network
             hosts also a link cut or made far and lossy; `--faults` picks kinds; each fault's
             recovery time is until a 1-token probe answers 200 again
    damage   `cluster.inject_faults`: landed prompt pages and host-tier pages damaged at random
             (`common/chaos.py`), each to be caught by its checksum and computed again
    verdict  sent; completed and token-identical to the undisturbed replay; completed but different
             (wrong: must be 0); failed with a clean error, by cause; hung past `HUNG_S` (must be 0);
             recovery p50/p99 per fault kind; every surviving worker's KV integrity at the end

A conversation is replayed in a new session, turn by turn with the same seeds, as far as its turns
completed (a failed turn leaves its history as it was, and its client starts a new conversation).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import logging
import random
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from cluster.bench.chaos_once import HUNG_S, bench_once, percentile
from cluster.bench.chaos_targets import ChaosTarget, LocalTarget

log = logging.getLogger("tandem.bench")

SESSION_TURNS, SESSION_TOKENS = 2, 176  # a conversation: 2 turns of <= 50 + 32 tokens (6 fit a small pool's budget)
WATCH_EVERY_S = 2.0
ERROR_PAUSE_S = 1.0
PROBE_TIMEOUT_S = 120.0
WORDS = ("harbour boats market nets captain bread river stone lamp field winter letter garden "
         "engine bridge signal cable page token cache").split()


@dataclass
class Sent:
    kind: str  # plain | n2 | session
    prompt: str  # a session turn's: its new text (the conversation is `conv`'s earlier turns and answers)
    seed: int
    max_tokens: int
    n: int = 1
    conv: int = -1  # a session turn: its conversation (turns in order in `sent`)
    texts: list[str] = field(default_factory=list)
    error: str = ""
    hung: bool = False
    started_s: float = 0.0
    ended_s: float = 0.0


@dataclass
class FaultRecord:
    kind: str
    at_s: float
    recovery_s: float | None  # None: not recovered within PROBE_TIMEOUT_S


def _prompt(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 40))) + "."


async def _complete(client, prompt: str, seed: int, max_tokens: int, n: int = 1, session_id: str = "") -> list[str]:
    extra = {"ignore_eos": True, **({"session_id": session_id} if session_id else {})}
    stream = await client.completions.create(model="smollm2", prompt=prompt, max_tokens=max_tokens,
                                             temperature=0.8, seed=seed, n=n, stream=True, extra_body=extra)
    texts = [""] * n
    async for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    return texts


async def _open_session(base_url: str, old: str = "") -> str:
    """A new session (closing `old`, a finished conversation's)."""
    import httpx

    async with httpx.AsyncClient(timeout=60) as http:
        if old:
            await http.delete(f"{base_url}/v1/sessions/{old}")
        # idle_timeout_s: turns come between other requests
        resp = await http.post(f"{base_url}/v1/sessions", json={"capacity_tokens": SESSION_TOKENS,
                                                                 "idle_timeout_s": 900})
        resp.raise_for_status()
        return resp.json()["id"]


async def _close_session(base_url: str, session_id: str) -> None:
    import httpx

    async with httpx.AsyncClient(timeout=60) as http:
        await http.delete(f"{base_url}/v1/sessions/{session_id}")


async def _client(i: int, base_url: str, stop_at: float, max_tokens: int, sent: list[Sent], seed: int) -> None:
    import httpx
    import openai

    rng = random.Random(seed * 1000 + i)
    client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0, timeout=HUNG_S)
    session_id, turns, conv = "", 0, i * 100000
    try:
        while time.monotonic() < stop_at:
            roll = rng.random()
            kind = "plain" if roll < 0.7 else "n2" if roll < 0.85 else "session"
            req = Sent(kind, _prompt(rng), rng.randrange(1 << 30), max_tokens, n=2 if kind == "n2" else 1,
                       started_s=time.monotonic())
            try:
                if kind == "session":
                    if not session_id or turns >= SESSION_TURNS:
                        session_id, turns, conv = await _open_session(base_url, session_id), 0, conv + 1
                    req.conv, turns = conv, turns + 1
                sent.append(req)
                req.texts = await asyncio.wait_for(
                    _complete(client, req.prompt, req.seed, max_tokens, req.n, session_id if kind == "session" else ""),
                    HUNG_S)
            except asyncio.TimeoutError:
                req.hung = True
            except (openai.APIError, httpx.HTTPError) as exc:
                req.error = getattr(exc, "message", None) or str(exc)
                if kind == "session":
                    session_id = ""  # a failed turn leaves the history as it was: start a new conversation
                await asyncio.sleep(ERROR_PAUSE_S)  # as a client told to retry after a while
            if not any(r is req for r in sent):
                sent.append(req)
            req.ended_s = time.monotonic()
    finally:
        if session_id:
            await _close_session(base_url, session_id)
        await client.close()


async def _probe(base_url: str) -> bool:
    import httpx

    try:
        async with httpx.AsyncClient(timeout=30) as http:
            resp = await http.post(f"{base_url}/v1/completions", json={
                "model": "smollm2", "prompt": "Hi", "max_tokens": 1, "temperature": 0})
            return resp.status_code == 200
    except httpx.HTTPError:
        return False


async def _faults(target: ChaosTarget, kinds: tuple[str, ...], start: float, stop_at: float, every_s: float,
                  rng: random.Random, records: list[FaultRecord]) -> None:
    base_url = target.url
    while True:
        await asyncio.sleep(rng.expovariate(1.0 / every_s))
        if time.monotonic() >= stop_at:
            return
        kind = rng.choice(kinds)
        at = time.monotonic()
        if not await asyncio.to_thread(target.inflict, kind):
            continue
        log.info("chaos: %s at %.0f s", kind, at - start)
        while not await _probe(base_url) and time.monotonic() - at < PROBE_TIMEOUT_S:
            await asyncio.sleep(0.5)
        recovered = time.monotonic() - at
        records.append(FaultRecord(kind, at - start, recovered if recovered < PROBE_TIMEOUT_S else None))


async def _replay(base_url: str, done: list[Sent], concurrency: int) -> list[list[str] | str]:
    """Each completed request again, undisturbed (a conversation's turns in a new session, in order):
    its texts, or why it could not be replayed."""
    import openai

    client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=2, timeout=HUNG_S)
    gate = asyncio.Semaphore(concurrency)
    out: dict[int, list[str] | str] = {}
    convs: dict[int, list[int]] = collections.defaultdict(list)
    for k, req in enumerate(done):
        if req.kind == "session":
            convs[req.conv].append(k)

    async def one(k: int) -> None:
        async with gate:
            req = done[k]
            try:
                out[k] = await _complete(client, req.prompt, req.seed, req.max_tokens, req.n)
            except openai.APIError as exc:
                out[k] = f"replay failed: {exc.message}"

    async def conversation(ks: list[int]) -> None:
        async with gate:
            try:
                session_id = await _open_session(base_url)
            except Exception as exc:  # noqa: BLE001 - reported as unverified
                out.update({k: f"replay failed: {exc}" for k in ks})
                return
            for k in ks:
                req = done[k]
                try:
                    out[k] = await _complete(client, req.prompt, req.seed, req.max_tokens, 1, session_id)
                except openai.APIError as exc:
                    out.update({j: f"replay failed: {exc.message}" for j in ks if j not in out})
                    break
            await _close_session(base_url, session_id)

    try:
        await asyncio.gather(*(one(k) for k, req in enumerate(done) if req.kind != "session"),
                             *(conversation(ks) for ks in convs.values()))
        return [out[k] for k in range(len(done))]
    finally:
        await client.close()


def add_chaos_args(p) -> None:
    p.add_argument("--duration-s", type=float, default=600.0, help="how long the load and the faults run")
    p.add_argument("--streams", type=int, default=6, help="concurrent clients")
    p.add_argument("--max-tokens", type=int, default=32, help="output tokens of every request")
    p.add_argument("--fault-every-s", type=float, default=30.0, help="mean seconds between faults (exponential)")
    p.add_argument("--inject", default="landing=0.02,l2=0.02",
                   help="cluster.inject_faults of the server: KV damaged on purpose (\"\" for none)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="passed to `tandem serve`")
    p.add_argument("--ready-timeout-s", type=float, default=300.0)
    p.add_argument("--faults", default="", metavar="KIND[,KIND...]",
                   help="only these fault kinds (default: every kind the cluster has; the report lists them)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="FILE", help="write the report as JSON to FILE")
    p.add_argument("--once", choices=("kill_decode", "kill_prefill"),
                   help="instead: `--streams` seeded streams of `--max-tokens` undisturbed, then again with this "
                        "one fault once every stream has a token; each stream's text compared, and the latency "
                        "the fault added to each (p50/p99)")


def bench_chaos(args) -> int:
    from cluster.bench.serve import SpawnedServer, wait_ready
    from kv_store.l3.redis_process import RedisServer

    try:
        fault_kinds(LocalTarget, args.faults)
    except ValueError as exc:
        print(f"tandem bench chaos: {exc}", file=sys.stderr)
        return 2
    workdir = Path(tempfile.mkdtemp(prefix="tandem-chaos-"))
    redis = RedisServer(workdir / "redis").start()
    # every prompt crosses to the decode worker (the transfer checks run), whose small pool keeps its host
    # tier busy (the L2 checks run); L3 on a Redis of our own (killed and restarted below)
    flags = ["--set", "kv_store.l3.backend=redis", "--set", f"kv_store.l3.url={redis.url}",
             "--set", "router.local_prefill_max_tokens=0", "--set", "decode.engine.num_pages=128",
             "--set", "decode.engine.host_cache_ratio=4",
             *(["--set", f"cluster.inject_faults={args.inject}"] * bool(args.inject)),
             "--set", "cluster.max_restarts=10000",  # the faults here are the point: no crash-loop guard
             *(f for s in args.set for f in ("--set", s))]
    server = SpawnedServer(flags)
    try:
        wait_ready(server, {}, args.ready_timeout_s)
        if args.once:
            return bench_once(server, args)
        report = asyncio.run(run_chaos(LocalTarget(server, redis), args))
    finally:
        code = server.stop()
        redis.stop()
    report["server_exit_code"] = code
    _print(report)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    ok = report["hung"] == 0 and report["wrong"] == 0 and report["integrity_errors"] == [] and code == 0
    return 0 if ok else 1


def fault_kinds(target: ChaosTarget | type[ChaosTarget], wanted: str) -> tuple[str, ...]:
    """The kinds `--faults` names (all of the target's when empty); ValueError naming the valid ones."""
    kinds = tuple(k for k in wanted.split(",") if k) or tuple(target.kinds)
    unknown = [k for k in kinds if k not in target.kinds]
    if unknown:
        raise ValueError(f"--faults: no fault kind {', '.join(unknown)} here; kinds: {', '.join(target.kinds)}")
    return kinds


async def run_chaos(target: ChaosTarget, args) -> dict:
    """The load, the faults, the replay on `target`; the report (`_print` shows it)."""
    import httpx

    base_url = target.url
    rng = random.Random(args.seed)
    sent: list[Sent] = []
    records: list[FaultRecord] = []
    start = time.monotonic()
    stop_at = start + args.duration_s
    clients = [asyncio.create_task(_client(i, base_url, stop_at, args.max_tokens, sent, args.seed))
               for i in range(args.streams)]
    faults = asyncio.create_task(_faults(target, fault_kinds(target, args.faults), start, stop_at,
                                         args.fault_every_s, rng, records))
    watch, watching = CounterWatch(), asyncio.Event()
    watcher = asyncio.create_task(_watch(base_url, watch, watching))
    await asyncio.gather(*clients)
    await faults
    log.info("chaos: load over after %.0f s; replaying %d requests undisturbed", time.monotonic() - start, len(sent))
    done = [req for req in sent if not req.error and not req.hung]
    replayed = await _replay(base_url, done, args.streams)
    wrong = sum(1 for req, again in zip(done, replayed) if isinstance(again, list) and again != req.texts)
    unverified = sum(1 for again in replayed if isinstance(again, str))
    watch.read(httpx.get(f"{base_url}/metrics", timeout=30).text)
    watching.set()
    await watcher
    workers = httpx.get(f"{base_url}/debug/workers", timeout=30).json()["workers"]
    causes = collections.Counter(req.error.splitlines()[0][:120] for req in sent if req.error)
    recovery: dict[str, dict] = {}
    for kind in sorted({r.kind for r in records}):
        times = [r.recovery_s for r in records if r.kind == kind and r.recovery_s is not None]
        recovery[kind] = {"count": sum(r.kind == kind for r in records), "recovered": len(times),
                          "p50_s": percentile(times, 50), "p99_s": percentile(times, 99)}
    return {
        "duration_s": args.duration_s, "streams": args.streams, "inject": args.inject,
        "sent": len(sent), "by_kind": dict(collections.Counter(req.kind for req in sent)),
        "completed": len(done), "identical": len(done) - wrong - unverified, "wrong": wrong, "unverified": unverified,
        "unverified_causes": dict(collections.Counter(a.splitlines()[0][:120] for a in replayed if isinstance(a, str))),
        "failed": sum(1 for req in sent if req.error), "failure_causes": dict(causes.most_common()),
        "hung": sum(1 for req in sent if req.hung), "faults": [r.__dict__ for r in records], "recovery": recovery,
        "counters": watch.totals(),
        "integrity_errors": [f"{w['worker_id']}: {w['stats']['integrity_error']}" for w in workers
                             if w["alive"] and w["stats"] and w["stats"].get("integrity_error")],
        "workers_alive": sorted(w["worker_id"] for w in workers if w["alive"]),
    }


class CounterWatch:
    """Counters summed across worker restarts: a restarted worker's counters start again from 0, so
    each fall of a series adds what it had reached."""

    PREFIXES = ("tandem:kv_checksum_failures_total", "tandem:request_migrations_total")

    def __init__(self) -> None:
        self.last: dict[str, float] = {}
        self.carried: dict[str, float] = collections.defaultdict(float)

    def read(self, text: str) -> None:
        for line in text.splitlines():
            if line.startswith(self.PREFIXES):
                series, _, text = line.rpartition(" ")
                value = float(text)
                if value < self.last.get(series, 0.0):
                    self.carried[series] += self.last[series]
                self.last[series] = value

    def totals(self) -> dict[str, float]:
        return {series: value + self.carried[series] for series, value in sorted(self.last.items()) if
                value + self.carried[series]}


async def _watch(base_url: str, watch: CounterWatch, stop: asyncio.Event) -> None:
    import httpx

    async with httpx.AsyncClient(timeout=30) as http:
        while not stop.is_set():
            with contextlib.suppress(httpx.HTTPError):
                watch.read((await http.get(f"{base_url}/metrics")).text)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), WATCH_EVERY_S)


def _print(r: dict) -> None:
    print(f"chaos run: {r['duration_s']:.0f} s, {r['streams']} streams, damage {r['inject'] or 'none'}")
    print(f"  sent {r['sent']} {r['by_kind']}; completed {r['completed']}: {r['identical']} token-identical to the "
          f"undisturbed replay, {r['wrong']} different, {r['unverified']} not replayed")
    for cause, count in r["unverified_causes"].items():
        print(f"    not replayed: {count} x {cause}")
    print(f"  failed with a clean error: {r['failed']}; hung: {r['hung']}")
    for cause, count in r["failure_causes"].items():
        print(f"    {count} x {cause}")
    for kind, rec in r["recovery"].items():
        p50 = "-" if rec["p50_s"] is None else f"{rec['p50_s']:.1f} s"
        p99 = "-" if rec["p99_s"] is None else f"{rec['p99_s']:.1f} s"
        print(f"  {kind}: {rec['count']} faults, recovered {rec['recovered']}, recovery p50 {p50}, p99 {p99}")
    for series, value in r["counters"].items():
        print(f"  {series} {value:g}")
    print(f"  workers alive at the end: {', '.join(r['workers_alive'])}; KV integrity errors: "
          f"{r['integrity_errors'] or 'none'}")
