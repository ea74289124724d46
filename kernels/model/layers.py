"""The decoder's building blocks beside attention: norms, the dense MLP and the MoE MLP."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kernels.model.arch import LlamaArch
from kernels.model.packed_linear import PackedLinear


class RMSNorm(nn.Module):
    """HF's RMS norms. Llama's (`gemma` False): normalise in float32, cast back, then scale by w in
    the input dtype. Gemma's: normalise and scale by (1 + w) in float32, then cast."""

    def __init__(self, hidden_size: int, eps: float, gemma: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(hidden_size) if gemma else torch.ones(hidden_size))
        self.eps, self.gemma = eps, gemma

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gemma:
            x32 = x.float()
            x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
            return (x32 * (1.0 + self.weight.float())).to(x.dtype)
        if x.dtype == torch.float32 == self.weight.dtype:
            # One fused op, bit-identical to the lines below in float32 (and faster on CPU);
            # half types keep HF's order (normalise, cast, then scale), which the fused op does not.
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def activate(gate: torch.Tensor, activation: str) -> torch.Tensor:
    """The gated MLP's activation of `gate` (`LlamaArch.hidden_act`)."""
    if activation == "silu":
        return F.silu(gate)
    return F.gelu(gate, approximate="tanh")


class LlamaMLP(nn.Module):
    """The gated MLP: down(act(gate(x)) * up(x)), gate and up in one matmul."""

    def __init__(self, arch: LlamaArch, intermediate_size: int | None = None) -> None:
        super().__init__()
        inter = arch.intermediate_size if intermediate_size is None else intermediate_size
        self.activation = arch.hidden_act
        self.gate_up_proj = PackedLinear(arch.hidden_size, (inter, inter), bias=arch.mlp_bias)
        self.down_proj = PackedLinear(inter, (arch.hidden_size,), bias=arch.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj.split(self.gate_up_proj(x))  # [T, inter] each
        return self.down_proj(activate(gate, self.activation) * up)


class Experts(nn.Module):
    """E experts' gated MLPs, stored as transformers (v5) stores them: ``gate_up_proj [E, 2I, H]``
    (each expert's gate rows, then its up rows) and ``down_proj [E, H, I]``."""

    def __init__(self, arch: LlamaArch) -> None:
        super().__init__()
        num, inter, hidden = arch.num_experts, arch.moe_intermediate_size, arch.hidden_size
        self.activation = arch.hidden_act
        self.gate_up_proj = nn.Parameter(torch.empty(num, 2 * inter, hidden))
        self.down_proj = nn.Parameter(torch.empty(num, hidden, inter))

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        from kernels.experts import experts  # the CPU path, or the fused Triton kernel on CUDA

        return experts(x, self.gate_up_proj, self.down_proj, topk_weights, topk_ids, self.activation)


class SparseMoeMLP(nn.Module):
    """A router choosing `num_experts_per_tok` of the experts per token (softmax over all experts in
    float32, top-k, renormalised where the model does), their weighted sum, and for Qwen2-MoE a shared
    expert every token passes through, scaled by a sigmoid gate."""

    def __init__(self, arch: LlamaArch) -> None:
        super().__init__()
        self.top_k, self.renormalise, self.float_weights = (arch.num_experts_per_tok, arch.norm_topk_prob,
                                                            arch.router_weights_float)
        self.gate = nn.Linear(arch.hidden_size, arch.num_experts, bias=False)
        self.experts = Experts(arch)
        self.shared_expert: LlamaMLP | None = None
        self.shared_expert_gate: nn.Linear | None = None
        if arch.shared_expert_intermediate_size:
            self.shared_expert = LlamaMLP(arch, arch.shared_expert_intermediate_size)
            self.shared_expert_gate = nn.Linear(arch.hidden_size, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = torch.softmax(self.gate(x).float(), dim=-1)  # [T, E]
        weights, ids = torch.topk(probs, self.top_k, dim=-1)  # [T, k]
        if self.renormalise:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if not self.float_weights:
            weights = weights.to(x.dtype).float()  # rounded as the model's dtype rounds them
        out = self.experts(x, weights, ids)
        if self.shared_expert is not None:
            assert self.shared_expert_gate is not None, "a shared expert without its gate: both come from __init__"
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out
