"""The memory budget: KV pools sized from what is left after the processes and the weights, no host
tier on a CPU unless asked, sizes set by hand kept and counted, a budget too small refused."""

from __future__ import annotations

import json
import struct

import pytest

from cluster.serve.config_load import load_serve_config
from cluster.serve.memory import (
    GIB,
    L3_STAGING_HOST_RATIO,
    NODE_OVERHEAD_BYTES,
    WORKER_OVERHEAD_BYTES,
    ModelShape,
    auto_budget,
    plan_memory,
)
from common.config import ConfigError

# SmolLM2-135M's shape: 30 layers, 3 KV heads of 64, 134.5M parameters (its lm_head is the embedding).
SHAPE = ModelShape(num_params=134_515_008, num_linear_params=134_479_872, num_layers=30, num_kv_heads=3, head_dim=64)
PAGE_BYTES = 2 * 30 * 16 * 3 * 64 * 4  # K and V, 30 layers, 16 tokens, fp32: 737,280


def plan(**overrides):
    return plan_memory(load_serve_config(None, overrides), SHAPE, ram_bytes=24 * GIB)


def test_the_default_plan_shares_what_the_weights_leave_and_fits_the_budget():
    config, p = plan(**{"memory.budget_gib": 6})
    assert p.budget_bytes == 6 * GIB and p.total_bytes <= 6 * GIB
    prefill, decode = p.workers
    assert (prefill.role, decode.role) == ("prefill", "decode")
    assert prefill.weight_bytes == SHAPE.num_params * 4  # no packed copy on a prefill worker
    assert decode.weight_bytes == (SHAPE.num_params + SHAPE.num_linear_params) * 4
    left = 6 * GIB - NODE_OVERHEAD_BYTES - 2 * WORKER_OVERHEAD_BYTES - prefill.weight_bytes - decode.weight_bytes \
        - decode.landing_pages * PAGE_BYTES
    assert prefill.kv_pages == int(left / 3 // PAGE_BYTES) and decode.kv_pages == int(2 * left / 3 // PAGE_BYTES)
    assert 6 * GIB - p.total_bytes < 2 * PAGE_BYTES  # nothing left unplanned but rounding
    # A decode worker lands twice what its prefill worker's window (2 x chunk_size) can have in flight.
    assert decode.landing_pages == 2 * 1024 // 16 + 1 and config.decode.host_pages == decode.landing_pages
    assert config.prefill.engine.num_pages == prefill.kv_pages and config.decode.engine.num_pages == decode.kv_pages
    # On a CPU the host tier is the same RAM as the device pool: off unless asked for.
    assert config.prefill.engine.host_cache_ratio == config.decode.engine.host_cache_ratio == 0.0
    assert prefill.host_pages == decode.host_pages == 0
    text = "\n".join(p.describe())
    assert "memory budget 6.0 GiB" in text and "host tier off" in text
    assert f"{(decode.kv_pages - 1) * 16:,} tokens" in text


def test_auto_is_a_quarter_of_ram_at_most_8_gib():
    assert auto_budget(24 * GIB)[0] == 6 * GIB
    assert auto_budget(256 * GIB)[0] == 8 * GIB
    assert plan()[1].budget_bytes == 6 * GIB


def test_sizes_set_by_hand_are_kept_and_counted():
    config, p = plan(**{"memory.budget_gib": 6, "decode.engine.num_pages": 1000, "decode.host_pages": 64,
                        "prefill.engine.host_cache_ratio": 1.0})
    prefill, decode = p.workers
    assert config.decode.engine.num_pages == decode.kv_pages == 1000 and decode.landing_pages == 64
    assert config.prefill.engine.host_cache_ratio == 1.0 and prefill.host_pages == prefill.kv_pages
    left = (6 * GIB - NODE_OVERHEAD_BYTES - 2 * WORKER_OVERHEAD_BYTES - prefill.weight_bytes - decode.weight_bytes
            - (1000 + 64) * PAGE_BYTES)
    assert prefill.kv_pages == int(left // (2 * PAGE_BYTES))  # the prefill pool and its host tier share the rest
    assert 6 * GIB - p.total_bytes < 3 * PAGE_BYTES


def test_a_budget_that_cannot_hold_the_weights_is_refused_with_what_it_needs():
    with pytest.raises(ConfigError, match=r"memory budget \(2.00 GiB, memory.budget_gib\) cannot hold .* at least"):
        plan(**{"memory.budget_gib": 2})
    with pytest.raises(ConfigError, match="memory.budget_gib"):
        load_serve_config(None, {"memory.budget_gib": 0})


def test_a_speculative_engine_pages_hold_the_draft_layer():
    _, p = plan(**{"memory.budget_gib": 6, "engine.speculative": "eagle"})
    assert p.workers[0].page_bytes == PAGE_BYTES * 31 // 30


def test_model_shape_reads_the_safetensors_headers_only(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"num_hidden_layers": 2, "num_attention_heads": 4,
                                                      "num_key_value_heads": 2, "hidden_size": 32,
                                                      "tie_word_embeddings": True}))
    header = {"model.embed_tokens.weight": {"dtype": "F32", "shape": [100, 32], "data_offsets": [0, 0]},
              "model.layers.0.mlp.up_proj.weight": {"dtype": "F32", "shape": [64, 32], "data_offsets": [0, 0]},
              "model.norm.weight": {"dtype": "F32", "shape": [32], "data_offsets": [0, 0]}, "__metadata__": {}}
    raw = json.dumps(header).encode()
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw)
    shape = ModelShape.read(tmp_path)
    assert shape == ModelShape(num_params=3200 + 2048 + 32, num_linear_params=2048 + 3200, num_layers=2,
                               num_kv_heads=2, head_dim=8)


def test_with_l3_a_cpu_worker_keeps_a_staging_host_tier_out_of_its_share():
    config, p = plan(**{"memory.budget_gib": 6, "kv_store.l3.url": "redis://127.0.0.1:6379/0"})
    for group, w in zip((config.prefill, config.decode), p.workers):
        assert group.engine.host_cache_ratio == L3_STAGING_HOST_RATIO and w.host_pages == int(w.kv_pages * 0.5)
    assert p.total_bytes <= 6 * GIB


def test_a_tiny_models_pools_hold_a_few_full_batches_not_the_whole_budget():
    """A tiny model's pages are so small that the budget alone would give it millions (each walked by
    every integrity check): a pool sized from memory holds at most `USEFUL_POOL_BATCHES` full batches."""
    from common.config import USEFUL_POOL_BATCHES, EngineConfig

    tiny = ModelShape(num_params=3_000_000, num_linear_params=3_000_000, num_layers=3, num_kv_heads=2, head_dim=16,
                      max_context=256)
    config, p = plan_memory(load_serve_config(None, {"memory.budget_gib": 6}), tiny, ram_bytes=24 * GIB)
    for worker, group in zip(p.workers, (config.prefill, config.decode)):
        running = group.engine.max_running_requests
        assert worker.kv_pages == 1 + USEFUL_POOL_BATCHES * running * 256 // 16, worker
    alone = EngineConfig(max_running_requests=8, page_size=16).resolve(bytes_per_page=1024, max_position_embeddings=256)
    assert alone.num_pages == 1 + USEFUL_POOL_BATCHES * 8 * 256 // 16
    assert EngineConfig().resolve(PAGE_BYTES, 8192).num_pages == 2 * GIB // PAGE_BYTES  # SmolLM2's: the memory's
