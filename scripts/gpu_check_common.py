"""What the Python parts of `scripts/gpu-check.sh` share (standard library only): the repository's
root, the JSON file each step writes, SIGTERM as KeyboardInterrupt."""

from __future__ import annotations

import json
import signal
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def write_json(path: str | Path, data: dict) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(data, indent=1) + "\n")


def _interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def interrupt_on_signals(*signums: int) -> None:
    """`signums` (default SIGTERM, what `timeout` sends) raise KeyboardInterrupt from now on, so a step
    cut short still writes what it has and stops what it started."""
    for signum in signums or (signal.SIGTERM,):
        signal.signal(signum, _interrupt)


def last_json_line(text: str) -> dict | None:
    """The last line of `text` that is one JSON object (`bench serve --json` prints its result so)."""
    for line in reversed(text.strip().splitlines()):
        if line.startswith("{") and line.endswith("}"):
            try:
                return json.loads(line)
            except ValueError:
                return None
    return None
