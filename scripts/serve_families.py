"""Serve a tiny random model of each architecture through `tandem serve` (defaults: disaggregated, a
prefill and a decode worker as Ray actors, KV over Mooncake TCP, `TANDEM_DEBUG_KV=1`) with every worker
over `--tp` tensor-parallel ranks, and compare the official `openai` client's greedy tokens (twice: the
second from the prefix cache) with transformers'. CI serves one family at TP=2 (the others run through
`tandem run -tp 2`); this serves them all, a server each (about a minute a family on two cores).

    .venv/bin/python scripts/serve_families.py [--tp 2] [--family gemma2 ...]

Prints one line a family and exits non-zero if any differs.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def serve_one(name: str, tp: int, workdir: Path) -> tuple[bool, str]:
    """(tokens equal on both asks, what happened) for family `name`."""
    import openai

    from tests.integration.serve_harness import start_server
    from tests.integration.test_serve_families import NEW_TOKENS, PROMPT, write_checkpoint

    model_dir = workdir / name
    model_dir.mkdir()
    expected = write_checkpoint(name, model_dir)
    server = start_server(workdir, ["--model", str(model_dir), "-tp", str(tp)], env={"TANDEM_DEBUG_KV": "1"},
                          warm=False, ready_timeout_s=600)
    try:
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none", max_retries=0, timeout=300)
        ask = dict(model=client.models.list().data[0].id, prompt=PROMPT, max_tokens=NEW_TOKENS, temperature=0,
                   extra_body={"ignore_eos": True, "return_token_ids": True})
        first, again = client.completions.create(**ask), client.completions.create(**ask)
        got = [first.choices[0].token_ids, again.choices[0].token_ids]
        cached = again.usage.prompt_tokens_details.cached_tokens
        ok = got == [expected, expected] and cached > 0
        return ok, f"cached {cached} of {again.usage.prompt_tokens}" + ("" if ok else f": {got} vs {expected}")
    finally:
        code = server.terminate()
        if code != 0:
            print(server.log_tail(), file=sys.stderr)


def main() -> int:
    from tests.unit.engine.test_model_families import FAMILIES

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tp", type=int, default=2, help="every worker's tensor-parallel ranks")
    parser.add_argument("--family", action="append", choices=sorted(FAMILIES), help="default: every family")
    args = parser.parse_args()
    failed = []
    with tempfile.TemporaryDirectory(prefix="serve-families-") as tmp:
        for name in args.family or sorted(FAMILIES):
            start = time.monotonic()
            try:
                ok, what = serve_one(name, args.tp, Path(tmp))
            except Exception as exc:  # noqa: BLE001 - one family's failure is reported, the others still run
                ok, what = False, f"{type(exc).__name__}: {exc}"
            print(f"{name:15} tp={args.tp} {'ok  ' if ok else 'FAIL'} {time.monotonic() - start:5.0f} s  {what}",
                  flush=True)
            if not ok:
                failed.append(name)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
