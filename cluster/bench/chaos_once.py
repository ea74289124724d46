"""`tandem bench chaos --once kill_decode|kill_prefill`: one fault under `--streams` seeded streams of
`--max-tokens` tokens, sent at once, the fault struck once every stream has its first token; each
stream's text against the same streams undisturbed (run first), and the latency the fault added to
each, p50 and p99."""

from __future__ import annotations

import asyncio
import os
import signal
import time

HUNG_S = 180.0  # a request with no end this long after it was sent is hung (here and in `chaos.py`)


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


async def _timed_streams(base_url: str, n: int, max_tokens: int, fault=None) -> list[tuple[str, float]]:
    """(text or "error: ...", seconds to its end) of `n` seeded streams sent at once; `fault()` (in a
    thread) once each has a token."""
    import openai

    client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0, timeout=HUNG_S)
    started = [asyncio.Event() for _ in range(n)]

    async def one(i: int) -> tuple[str, float]:
        t0, text = time.monotonic(), []
        try:
            stream = await client.completions.create(model="smollm2", prompt=f"List {i} fruits:", max_tokens=max_tokens,
                                                     temperature=0.8, seed=i, stream=True,
                                                     extra_body={"ignore_eos": True})
            async for chunk in stream:
                if chunk.choices:
                    text.append(chunk.choices[0].text)
                    started[i].set()
            return "".join(text), time.monotonic() - t0
        except openai.APIError as exc:
            started[i].set()
            return f"error: {exc.message}", time.monotonic() - t0

    tasks = [asyncio.create_task(one(i)) for i in range(n)]
    try:
        if fault is not None:
            await asyncio.gather(*(e.wait() for e in started))
            await asyncio.to_thread(fault)
        return await asyncio.wait_for(asyncio.gather(*tasks), HUNG_S)
    finally:
        await client.close()


def bench_once(server, args) -> int:
    """`--once`: one fault under `--streams` streams (module docstring of the option)."""
    import httpx

    def fault() -> None:
        role = args.once.split("_")[1]
        victim = next(w for w in httpx.get(f"{server.url}/debug/workers", timeout=30).json()["workers"]
                      if w["role"] == role and w["alive"])
        os.kill(victim["pid"], signal.SIGKILL)

    undisturbed = asyncio.run(_timed_streams(server.url, args.streams, args.max_tokens))
    faulted = asyncio.run(_timed_streams(server.url, args.streams, args.max_tokens, fault))
    same = sum(a[0] == b[0] and not a[0].startswith("error") for a, b in zip(undisturbed, faulted))
    added = [b[1] - a[1] for a, b in zip(undisturbed, faulted)]
    print(f"{args.once} under {args.streams} seeded streams of {args.max_tokens} tokens: {same}/{args.streams} "
          f"token-identical to their undisturbed run; latency added p50 {percentile(added, 50):.1f} s, "
          f"p99 {percentile(added, 99):.1f} s (undisturbed end-to-end p50 "
          f"{percentile([a[1] for a in undisturbed], 50):.1f} s)")
    for text, _ in faulted:
        if text.startswith("error"):
            print(f"  {text[:200]}")
    return 0 if same == args.streams else 1
