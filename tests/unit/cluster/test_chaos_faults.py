"""`--faults` of `tandem bench chaos` and `scripts/netns_chaos.py`: the kinds a run may inflict, checked
before anything starts (a wrong name is a clear error naming the valid ones, exit 2)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from cluster.bench.chaos import fault_kinds
from cluster.bench.chaos_targets import LocalTarget
from scripts.netns_chaos import NetnsTarget
from tests.integration.serve_harness import REPO


def test_the_named_kinds_or_every_kind_of_the_target():
    assert fault_kinds(LocalTarget, "") == LocalTarget.kinds
    assert fault_kinds(NetnsTarget, "lossy_decode_link,cut_decode_link") == ("lossy_decode_link", "cut_decode_link")
    with pytest.raises(ValueError, match="no fault kind lossy_decode_link here; kinds: kill_decode"):
        fault_kinds(LocalTarget, "lossy_decode_link")


def test_a_wrong_kind_stops_the_bench_before_it_starts_a_server():
    done = subprocess.run([sys.executable, "-m", "cluster.cli", "bench", "chaos", "--faults", "kill_everything"],
                          capture_output=True, text=True, timeout=120, cwd=REPO)
    assert done.returncode == 2
    assert "--faults: no fault kind kill_everything here; kinds: kill_decode" in done.stderr
