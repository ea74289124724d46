"""What a server's processes hold in memory, read from /proc (Linux), for benches that compare servers.

    RSS   resident pages of each process, summed over the processes (what `ps` shows; a page shared by
          several processes, a library or shared memory, counts once per process)
    PSS   each shared page split among its sharers, summed: what the processes cost together

Which processes make a server: the one started and everything below it; for `tandem serve` also the
local Ray instance it starts, whose processes live in their own OS session (cluster/serve/local_ray.py)
named in tandem's log.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

RAY_SESSION_LOG = re.compile(r"OS session (\d+)")  # local_ray.py's start-up line


@dataclass(frozen=True)
class ProcessMemory:
    num_processes: int
    rss_bytes: int
    pss_bytes: int | None  # None: some process had no readable /proc/<pid>/smaps_rollup


def _stat_fields(pid: int) -> list[str] | None:
    """/proc/<pid>/stat after "pid (comm) ": state, ppid, pgrp, session, ...; None once it exited."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat[stat.rindex(")") + 2:].split()


def _live_pids() -> list[int]:
    return [int(entry) for entry in os.listdir("/proc") if entry.isdigit()]


def process_tree(root_pid: int) -> set[int]:
    """`root_pid` and every live process below it."""
    children: dict[int, list[int]] = {}
    for pid in _live_pids():
        fields = _stat_fields(pid)
        if fields is not None and fields[0] != "Z":
            children.setdefault(int(fields[1]), []).append(pid)
    tree, todo = set(), [root_pid]
    while todo:
        pid = todo.pop()
        if pid not in tree:
            tree.add(pid)
            todo += children.get(pid, ())
    return tree if _stat_fields(root_pid) is not None else tree - {root_pid}


def session_processes(session_id: int) -> set[int]:
    """Live processes of OS session `session_id`."""
    return {pid for pid in _live_pids() if (f := _stat_fields(pid)) is not None and f[0] != "Z"
            and int(f[3]) == session_id}


def tandem_serve_processes(root_pid: int, log_text: str) -> set[int]:
    """A `tandem serve` started as `root_pid`: its tree and the Ray session its log names (if any)."""
    found = RAY_SESSION_LOG.findall(log_text)
    return process_tree(root_pid) | (session_processes(int(found[-1])) if found else set())


def memory_of(pids: set[int]) -> ProcessMemory:
    """RSS and PSS summed over `pids` (processes that exited meanwhile count as nothing)."""
    rss = pss = counted = 0
    pss_known = True
    for pid in pids:
        rollup = _smaps_rollup_kib(pid)
        if rollup is not None:
            rss, pss = rss + rollup["Rss"] * 1024, pss + rollup["Pss"] * 1024
        else:
            try:  # statm: size, resident, ... in pages
                rss += int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
            except OSError:
                continue  # exited
            pss_known = False
        counted += 1
    return ProcessMemory(counted, rss, pss if pss_known else None)


def _smaps_rollup_kib(pid: int) -> dict[str, int] | None:
    try:
        text = Path(f"/proc/{pid}/smaps_rollup").read_text()
    except OSError:
        return None
    values = {}
    for line in text.splitlines():
        name, _, rest = line.partition(":")
        if name in ("Rss", "Pss"):
            values[name] = int(rest.split()[0])
    return values if len(values) == 2 else None
