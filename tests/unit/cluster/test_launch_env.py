"""What `tandem serve`'s own environment passes to its workers, which are Ray actors that do not
inherit it (`cluster.serve.launch.with_debug_kv`)."""

from __future__ import annotations

import pytest

from cluster.serve import launch
from cluster.serve.config_load import load_serve_config


@pytest.mark.parametrize("value, on", [(None, False), ("0", False), ("", False), ("1", True)])
def test_debug_kv_in_the_environment_reaches_every_groups_engine(monkeypatch, value, on):
    if value is None:
        monkeypatch.delenv("TANDEM_DEBUG_KV", raising=False)
    else:
        monkeypatch.setenv("TANDEM_DEBUG_KV", value)
    config = load_serve_config(overrides={"colocated.count": 1, "decode.engine.max_running_requests": 8})
    placed = launch.with_debug_kv(config)
    groups = (placed.prefill, placed.decode, placed.colocated)
    assert [g.engine.debug_kv for g in groups] == [on] * 3
    assert placed.decode.engine.max_running_requests == 8  # the groups' own overrides kept
    assert (placed is config) is not on
