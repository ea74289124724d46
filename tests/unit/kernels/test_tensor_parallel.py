"""Tensor parallelism of the model (`kernels/model/tp.py`): how heads, columns and the vocabulary are
split, and two ranks (processes joined by gloo) each holding its shard of a tiny model of every
family, loaded through the real loader, giving transformers' logits for chunked prefill and decode
over paged KV (uneven splits: 3 KV heads as 2 + 1, an odd vocabulary)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from kernels.model.arch import LlamaArch
from kernels.model.tp import Shard, split
from tests.unit.engine.test_model_families import FAMILIES, reference

UNEVEN = dict(vocab_size=131, hidden_size=96, num_attention_heads=6, num_key_value_heads=3, head_dim=16,
              intermediate_size=100)
LENGTHS = (23, 11)
ATOL = 2e-5


def smollm2_like(**change) -> LlamaArch:
    base = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9, num_kv_heads=3,
                head_dim=64, rms_norm_eps=1e-5, rope_theta=1e5, max_position_embeddings=8192, tie_word_embeddings=True)
    return LlamaArch(**{**base, **change})


def test_splits_are_contiguous_and_as_even_as_the_counts_allow():
    assert [split(10, 3, i) for i in range(3)] == [range(0, 4), range(4, 7), range(7, 10)]
    arch = smollm2_like()
    zero, one = Shard.of(arch, 0, 2), Shard.of(arch, 1, 2)
    assert (zero.kv_heads, zero.q_heads, one.kv_heads, one.q_heads) == (range(0, 2), range(0, 6), range(2, 3),
                                                                        range(6, 9))
    assert (zero.vocab, one.vocab, zero.intermediate) == (range(0, 24576), range(24576, 49152), range(0, 768))
    assert one.local_arch(arch).num_heads == 3 and one.local_arch(arch).num_kv_heads == 1
    # fewer KV heads than ranks: each KV head on several ranks, which split its query heads
    six = [Shard.of(arch, r, 6) for r in range(6)]
    assert [s.kv_heads for s in six] == [range(0, 1), range(0, 1), range(1, 2), range(1, 2), range(2, 3), range(2, 3)]
    assert [s.q_heads for s in six] == [range(0, 2), range(2, 3), range(3, 5), range(5, 6), range(6, 8), range(8, 9)]
    with pytest.raises(ValueError, match="tensor parallel size 4 cannot share 3 KV heads"):
        Shard.of(arch, 0, 4)


def _rank_main(rank: int, size: int, root: str, names: list[str]) -> None:
    """One rank: its shard of each family's checkpoint under `root`, chunked prefill and decode of two
    sequences; rank 0 saves every position's logits."""
    from kernels.model.loader import build_model, read_config
    from kernels.model.tp import TPGroup
    from tests.unit.engine.test_model_parity import PageDealer, make_kv, make_seqs, run_step

    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", init_method=f"file://{root}/rendezvous", rank=rank, world_size=size)
    results = {}
    for name in names:
        path = Path(root) / name
        config = read_config(path)
        tp = TPGroup(Shard.of(LlamaArch.from_hf_config(config), rank, size))
        model = build_model(path, config, "cpu", torch.float32, "torch", tp=tp)
        kv = make_kv(model.arch, 32, 4)
        seqs = make_seqs(list(LENGTHS), 4, PageDealer(32, 1), UNEVEN["vocab_size"], seed=2)
        for chunk in ([8, 9], [8, 0], [5, 0], [1, 1], [1, 1]):
            live = [(s, n) for s, n in zip(seqs, chunk) if n]
            run_step(model, kv, 4, [s for s, _ in live], [n for _, n in live])
        results[name] = [(s.token_ids, dict(s.logits)) for s in seqs]
    if rank == 0:
        torch.save(results, f"{root}/logits.pt")
    torch.distributed.destroy_process_group()


def test_two_ranks_give_transformers_logits_for_every_family(tmp_path):
    from tests.unit.engine.test_model_parity import hf_logits

    references = {}
    for name in FAMILIES:
        references[name] = reference(name, **UNEVEN)
        references[name].save_pretrained(tmp_path / name)
    mp.spawn(_rank_main, args=(2, str(tmp_path), list(FAMILIES)), nprocs=2, join=True)
    results = torch.load(tmp_path / "logits.pt")
    for name, seqs in results.items():
        for token_ids, logits in seqs:
            expected = hf_logits(references[name], token_ids)
            for pos, got in logits.items():
                torch.testing.assert_close(got, expected[pos], atol=ATOL, rtol=0,
                                           msg=lambda m, pos=pos, name=name: f"{name} position {pos}: {m}")
