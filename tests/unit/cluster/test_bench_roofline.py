"""cluster/bench/roofline.py: the bytes a decode step reads (the weights counted from the shape equal
the model's parameters less the input embedding; the KV per request over the timed steps), the HBM
peak by device name or memory clock and bus width, the random-weights model, and `tandem bench decode
--random-weights tiny` end to end on the CPU with the bandwidth section in its JSON."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from cluster.bench import roofline
from cluster.bench.decode import DecodeRow
from cluster.cli.main import main
from common.config import EngineConfig
from kernels.model.llama import LlamaForCausalLM


@pytest.mark.parametrize("shape", sorted(roofline.RANDOM_SHAPES))
def test_weight_bytes_are_the_parameters_less_the_input_embedding(shape):
    arch = roofline.RANDOM_SHAPES[shape]
    with torch.device("meta"):
        model = LlamaForCausalLM(arch).to(torch.bfloat16)
    params = sum(p.numel() for p in model.parameters()) - model.model.embed_tokens.weight.numel()
    assert roofline.weight_bytes_read(arch, 2) == 2 * params


def test_kv_read_per_step_counts_prompt_earlier_outputs_and_the_fed_token():
    assert roofline.kv_bytes_per_token(roofline.RANDOM_SHAPES["llama-3-8b"], 2) == 2 * 32 * 8 * 128 * 2
    # 4 timed steps, 16-token prompts; request 0 ends with 7 outputs (3 before the first timed step,
    # so 19, 20, 21, 22 tokens read), request 1 with 6 (18 .. 21)
    row = DecodeRow("tandem", "torch", "graph", 2, (0.01,) * 4, ((1,) * 7, (1,) * 6))
    assert roofline.mean_kv_tokens_read(row, prompt_len=16) == 20.5 + 19.5


@pytest.mark.parametrize("name, props, peak", [
    ("NVIDIA H200", {}, 4.8e12),
    ("NVIDIA H100 80GB HBM3", {}, 3.35e12),
    ("NVIDIA A100-SXM4-80GB", {}, 2.0e12),
    ("NVIDIA L40S", {"memory_clock_rate": 9_001_000, "memory_bus_width": 384}, 2 * 9.001e9 * 48),
    ("NVIDIA H100 PCIe", {}, None),  # not in the table, no clock and bus width from this torch
])
def test_peak_from_the_name_else_the_memory_clock_and_bus(monkeypatch, name, props, peak):
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(name=name, **props))
    got, source = roofline.peak_hbm_bytes_per_s("cuda")
    assert got == pytest.approx(peak) if peak else got is None
    assert name in source
    assert roofline.peak_hbm_bytes_per_s("cpu") == (None, "no HBM figure for a cpu device")


def test_random_llama_is_seeded_on_the_device_norms_one():
    arch = roofline.RANDOM_SHAPES["tiny"]
    a, b = (roofline.random_llama(arch, "cpu", torch.bfloat16, "torch", seed=3) for _ in range(2))
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert p.device.type == "cpu" and p.dtype == torch.bfloat16 and torch.equal(p, q), name
        if "norm" in name:
            assert torch.all(p == 1), name
    assert abs(a.model.layers[0].mlp.down_proj.weight.float().std().item() - roofline.INIT_STD) < 2e-3


def test_bench_decode_random_weights_writes_the_bandwidth_of_every_run(tmp_path, capsys):
    path = tmp_path / "decode.json"
    assert main(["bench", "decode", "--random-weights", "tiny", "--backends", "torch", "--batch-sizes", "1,2",
                 "--prompt-len", "8", "--steps", "3", "--warmup-steps", "1", "--page-size", "4",
                 "--json", str(path)]) == 0
    summary = json.loads(path.read_text())
    assert summary["config"]["model"] == "random:tiny" and summary["first_request_identical_to_hf"] == {}
    assert [r["system"] for r in summary["rows"]] == ["tandem"] * 4  # no HF twin of random weights
    bw = summary["bandwidth"]
    arch = roofline.RANDOM_SHAPES["tiny"]
    assert (bw["weight_bytes"], bw["kv_bytes_per_token"]) == (roofline.weight_bytes_read(arch, 4),
                                                              roofline.kv_bytes_per_token(arch, 4))
    assert sorted(bw["rows"]) == ["torch/eager/1", "torch/eager/2", "torch/graph/1", "torch/graph/2"]
    for key, r in bw["rows"].items():
        assert r["fraction_of_peak"] is None and r["bytes_per_step"] > bw["weight_bytes"], key
    assert "HBM reads a decode step: weights" in capsys.readouterr().out


def test_random_weights_refuse_an_unknown_shape_and_speculation():
    with pytest.raises(ValueError, match="unknown --random-weights shape 'llama-9'"):
        roofline.RandomModels(EngineConfig(), "llama-9")
    assert main(["bench", "decode", "--random-weights", "tiny", "--speculative", "eagle"]) == 2
