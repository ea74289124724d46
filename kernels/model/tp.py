"""Tensor parallelism of the decoder: which part of each weight a rank holds (`Shard`), and the
collectives that put the parts together (`TPGroup`).

A rank holds whole KV heads and the query heads that read them (its attention runs on its own, over
its own pages), a slice of each MLP's (and each expert's) intermediate columns, and a slice of the
vocabulary for the embedding and the head. Per layer, the attention's and the MLP's outputs are
partial sums, added up by one all-reduce each; the embedding's rows are each on one rank (the others
give zeros), one all-reduce; the head's logits are gathered. Row-parallel biases are held by rank 0
alone, so the sum counts them once. Splits are contiguous and as even as the counts allow: SmolLM2's
3 KV heads split 2 + 1 at TP=2 (its 9 query heads 6 + 3); where there are fewer KV heads than ranks,
each KV head is held by several ranks, which split its query heads.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from kernels.model.arch import LlamaArch


def split(n: int, parts: int, index: int) -> range:
    """Part `index` of `parts` contiguous ranges covering `range(n)`, the first `n % parts` one longer."""
    base, extra = divmod(n, parts)
    start = index * base + min(index, extra)
    return range(start, start + base + (1 if index < extra else 0))


@dataclass(frozen=True)
class Shard:
    """What rank `rank` of `size` holds of a model (module docstring)."""

    rank: int
    size: int
    kv_heads: range
    q_heads: range
    intermediate: range  # dense MLPs' columns
    moe_intermediate: range  # each expert's columns
    shared_intermediate: range  # the shared expert's columns
    vocab: range

    @classmethod
    def of(cls, arch: LlamaArch, rank: int, size: int) -> Shard:
        if not 0 <= rank < size:
            raise ValueError(f"rank {rank} is not in a group of {size}")
        group = arch.num_heads // arch.num_kv_heads
        if arch.num_kv_heads >= size:
            kv = split(arch.num_kv_heads, size, rank)
            q = range(kv.start * group, kv.stop * group)
        else:
            if size % arch.num_kv_heads or group < size // arch.num_kv_heads:
                raise ValueError(f"tensor parallel size {size} cannot share {arch.num_kv_heads} KV heads of "
                                 f"{group} query heads each: use a size that divides the KV heads, or a multiple "
                                 "of them at most the query heads")
            copies = size // arch.num_kv_heads
            head = rank // copies
            kv = range(head, head + 1)
            part = split(group, copies, rank % copies)
            q = range(head * group + part.start, head * group + part.stop)
        empty = range(0)
        return cls(rank, size, kv, q, split(arch.intermediate_size, size, rank),
                   split(arch.moe_intermediate_size, size, rank) if arch.num_experts else empty,
                   split(arch.shared_expert_intermediate_size, size, rank), split(arch.vocab_size, size, rank))

    def local_arch(self, arch: LlamaArch) -> LlamaArch:
        """`arch` with this rank's head and column counts (the vocabulary stays whole: logits are gathered)."""
        return dataclasses.replace(arch, num_heads=len(self.q_heads), num_kv_heads=len(self.kv_heads),
                                   intermediate_size=len(self.intermediate),
                                   moe_intermediate_size=len(self.moe_intermediate),
                                   shared_expert_intermediate_size=len(self.shared_intermediate))


class TPGroup:
    """A rank's view of its tensor-parallel group (`torch.distributed`, initialised by the caller: gloo
    on the CPU, NCCL on CUDA): its `Shard` and the collectives the model calls."""

    def __init__(self, shard: Shard, group=None) -> None:
        self.shard, self.group = shard, group

    @property
    def rank(self) -> int:
        return self.shard.rank

    @property
    def size(self) -> int:
        return self.shard.size

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's `x` (in place; returned)."""
        torch.distributed.all_reduce(x, group=self.group)
        return x

    def gather_vocab(self, logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """``[N, its vocab slice]`` on every rank -> ``[N, vocab_size]`` on every rank."""
        sizes = [len(split(vocab_size, self.size, r)) for r in range(self.size)]
        widest = max(sizes)
        if logits.shape[-1] < widest:  # all_gather takes equal shapes: pad, then cut
            logits = torch.nn.functional.pad(logits, (0, widest - logits.shape[-1]))
        parts = [torch.empty_like(logits) for _ in range(self.size)]
        torch.distributed.all_gather(parts, logits.contiguous(), group=self.group)
        return torch.cat([part[..., :n] for part, n in zip(parts, sizes)], dim=-1)

    def embed(self, embedding: torch.nn.Embedding, input_ids: torch.Tensor) -> torch.Tensor:
        """Rows of a vocabulary-parallel embedding: each id's row from the rank holding it."""
        vocab = self.shard.vocab
        local = input_ids - vocab.start
        held = (local >= 0) & (local < len(vocab))
        x = embedding(local.clamp(0, len(vocab) - 1)) * held[:, None].to(embedding.weight.dtype)
        return self.all_reduce(x)
