"""Where a tandem server's first tokens went: each request's timeline (`router.timeline`, from the
server's `GET /debug/requests`) joined with the run's responses by id, and each phase's seconds
summarised over them (mean, p50, p90, p99 in ms); the workers' own spans likewise. Other servers
have no such route: then nothing is reported."""

from __future__ import annotations

from typing import Any

import numpy as np

from cluster.bench.load.client import RequestOutput
from router.timeline import phase_seconds

QUANTILES = (50, 90, 99)


def fetch_timelines(url: str, headers: dict, limit: int) -> dict[str, dict] | None:
    """The server's last `limit` request timelines by request id; None when it has none (not tandem)."""
    import httpx

    try:
        resp = httpx.get(f"{url}/debug/requests", params={"limit": min(max(limit, 1), 4096)}, headers=headers,
                         timeout=30)
        entries = resp.json()["requests"] if resp.status_code == 200 else None
    except (httpx.HTTPError, ValueError, KeyError, TypeError):
        return None
    return None if entries is None else {e["id"]: e for e in entries}


def ttft_phases(outputs: list[RequestOutput], timelines: dict[str, dict] | None) -> dict | None:
    """Per phase before the first token (and per worker span): ms statistics over the run's
    successful requests the server remembered; None without timelines."""
    if timelines is None:
        return None
    pairs = [(o, timelines[o.response_id]) for o in outputs if o.success and o.response_id in timelines]
    joined = [e for _, e in pairs]
    if not joined:
        return None
    phases = [phase_seconds(e) for e in joined]
    names = sorted({name for p in phases for name in p}, key=lambda n: _ORDER.get(n, 99))
    out: dict[str, Any] = {"requests": len(joined), "server_ttft": _stats([e["first_token_s"] for e in joined
                                                            if e["first_token_s"] is not None]),
           "phases": {name: _stats([p.get(name, 0.0) for p in phases]) for name in names},
           "worker_spans": {}}
    for span in sorted({s for e in joined for s in e["worker_s"]}):
        out["worker_spans"][span] = _stats([e["worker_s"][span] for e in joined if span in e["worker_s"]])
    if any(o.turn for o, _ in pairs):  # conversations: where each turn's first token went (means, ms)
        out["by_turn"] = {}
        for turn in sorted({o.turn for o, _ in pairs}):
            rows = [e for o, e in pairs if o.turn == turn]
            means = {name: float(np.mean([phase_seconds(e).get(name, 0.0) for e in rows])) * 1e3 for name in names}
            spans = {s for e in rows for s in e["worker_s"]}
            means.update({f"worker: {s}": float(np.mean([e["worker_s"][s] for e in rows if s in e["worker_s"]])) * 1e3
                          for s in sorted(spans)})
            out["by_turn"][turn] = {"requests": len(rows), "mean_ms": means}
    return out


_ORDER = {"queued": 0, "reserving": 1, "backoff": 2, "prefilling": 3, "local": 4, "migrating": 5}


def _stats(seconds: list[float]) -> dict:
    ms = np.asarray(seconds, dtype=float) * 1e3
    if ms.size == 0:
        return {"count": 0}
    return {"count": int(ms.size), "mean_ms": float(ms.mean()),
            **{f"p{q}_ms": float(np.percentile(ms, q)) for q in QUANTILES}}


def format_phases(split: dict) -> str:
    lines = [f"{' TTFT split (server timelines) ':=^60}",
             f"{'requests joined:':<28}{split['requests']}"]
    rows = [("server TTFT", split["server_ttft"]), *split["phases"].items(),
            *((f"worker: {k}", v) for k, v in split["worker_spans"].items())]
    lines.append(f"{'':<28}{'mean':>8}{'p50':>8}{'p90':>8}{'p99':>8}  (ms)")
    for name, st in rows:
        if st.get("count"):
            lines.append(f"{name:<28}" + "".join(f"{st[k]:>8.1f}" for k in ("mean_ms", "p50_ms", "p90_ms", "p99_ms")))
    for turn, row in split.get("by_turn", {}).items():
        parts = ", ".join(f"{k} {v:.0f}" for k, v in row["mean_ms"].items())
        lines.append(f"turn {turn} ({row['requests']} requests), mean ms: {parts}")
    return "\n".join(lines)
