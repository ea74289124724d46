"""`tandem bench h2d` (cluster/bench/h2d.py) on the CPU: the copier's loads are checked byte for byte
(a copier that drops its scatter fails the bench), the byte count is K and V of every layer, and the
command prints the comparison and writes the JSON. Timing is measured, never asserted."""

from __future__ import annotations

import json

import pytest

from cluster.bench import h2d
from cluster.cli.main import build_parser, main

SMALL = ["--pages", "8", "--page-size", "4", "--num-layers", "3", "--num-kv-heads", "2", "--head-dim", "8",
         "--repeats", "2"]


def test_bench_prints_both_copies_and_writes_the_json(tmp_path, capsys):
    out = tmp_path / "h2d.json"
    assert main(["bench", "h2d", *SMALL, "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "tandem copier (scattered pages)" in printed and "plain copy_ (contiguous)" in printed
    result = json.loads(out.read_text())
    assert result["bytes"] == 2 * 3 * 8 * 4 * 2 * 8 * 4  # K and V x layers x pages x page x heads x dim x fp32
    assert len(result["copier_s"]) == len(result["plain_copy_s"]) == 2
    assert result["ratio"] == pytest.approx(result["copier_gb_per_s"] / result["plain_copy_gb_per_s"])


def test_a_load_that_moved_the_wrong_bytes_fails_the_bench(monkeypatch):
    monkeypatch.setattr("kv_store.copier._scatter", lambda t, index, rows: None)  # lands nothing
    args = build_parser().parse_args(["bench", "h2d", *SMALL])
    with pytest.raises(RuntimeError, match="differ from the host pages"):
        h2d.bench_h2d(args)


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError, match="num_pages must be >= 1"):
        h2d.H2DSpec(num_pages=0)
