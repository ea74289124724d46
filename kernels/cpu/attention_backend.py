"""The "cpu" attention backend: the torch reference backend with its decode rows in C.

Decode rows (one query token a sequence) of float32 CPU models go to the native paged kernel
(`attention.c` through `native.paged_decode`): every query head of a GQA group at once, the pages
read in place, no gather copy. Everything the kernel does not take (extends, tree windows, bf16
attention, heads beyond its bounds) and every step traced by `torch.compile` (whose graph fuses the
torch path) runs the torch backend's own paths, so this serves whatever the torch backend serves.
`auto` picks it on a CPU where the kernel builds (`kernels.attention.resolve_backend`).
"""

from __future__ import annotations

import torch

from kernels.attention.torch_backend import TorchAttentionBackend
from kernels.cpu import native


class CpuAttentionBackend(TorchAttentionBackend):
    name = "cpu"

    @staticmethod
    def _decode(q, k_cache, v_cache, plan, scale: float) -> torch.Tensor:
        if not torch.compiler.is_compiling():
            q_dec = q if plan.every_row else q[plan.rows]  # [B_dec, H, hd]
            out = native.paged_decode(q_dec, k_cache, v_cache, plan.page_table, plan.seq_lens, scale)
            if out is not None:  # float32, as q (other dtypes it does not take)
                return out
        return TorchAttentionBackend._decode(q, k_cache, v_cache, plan, scale)
