"""The draft head's dense training forward: EAGLE-3's "training-time test", unrolled over a padded
batch with the attention each row sees at inference (`EagleDraftHead.forward` over paged KV).

Rows and steps. A sequence of target tokens ``t[0..n)`` with aux hidden states ``a[0..n)`` gives
draft rows ``i in [0, n-1)``: row i reads token ``t[i+1]`` and predicts ``t[i+2]``. Step s of row i
is what the s-th draft of a speculative round computes there::

    step 0   feature fc(a[i])        (the target's, real)         K/V "real" at i
    step s   feature x_{s-1}[i-1]    (the previous step's output, one position back)   valid for i >= s

Attention of step s at row i (the engine's draft KV at that moment, one slot per position)::

    step-0 K/V at positions [0, i - s]        the real-feature rows before the round
    step-j K/V at position  i - s + j         for j = 1..s: this round's earlier drafts, and itself

So a round at inference (real features up to n-1; drafts at positions n-1, n, n+1) is exactly rows
n-1, n, n+1 of steps 0, 1, 2 here, with the true tokens standing in for drafts that were accepted
(a draft only matters while every earlier one matched). Rows past a sequence's end are padding;
attention is causal in position, so they never reach a real row.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.model.eagle import EagleDraftHead
from kernels.model.rope import apply_rotary


def draft_rows(tokens: torch.Tensor, aux: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence ``[n]``, ``[n, 3h]`` -> its draft rows: input ids ``t[1..n)`` and aux ``a[0..n-1)``."""
    return tokens[1:], aux[:-1]


def unrolled_forward(head: EagleDraftHead, input_ids: torch.Tensor, aux: torch.Tensor,
                     num_steps: int) -> list[torch.Tensor]:
    """input_ids ``[B, L]`` (row i's token t[i+1]), aux ``[B, L, 3h]`` (a[i]) -> each step's x
    ``[B, L, h]``; draft logits are `logits(head, x)`. Differentiable; see the module docstring. The
    inputs move to the head's device."""
    device = head.embed.weight.device
    input_ids, aux = input_ids.to(device), aux.to(device)
    batch, length = input_ids.shape
    emb = head.embed(input_ids)  # [B, L, h]
    positions = torch.arange(length, device=input_ids.device)
    cos, sin = head.rotary.cos_sin(positions.repeat(batch), emb.dtype)  # [B*L, hd]
    normed_emb = head.input_layernorm(emb)
    feature = head.combine(aux)  # [B, L, h]
    keys: list[torch.Tensor] = []  # per step, as are values and xs
    values: list[torch.Tensor] = []
    xs: list[torch.Tensor] = []
    for step in range(num_steps):
        if step:  # x of the previous step, one position back; row 0 has none (and is never valid)
            feature = F.pad(xs[-1][:, :-1], (0, 0, 1, 0))
        q, k, v = _qkv(head, torch.cat((normed_emb, head.hidden_norm(feature)), -1), cos, sin)
        keys.append(k)
        values.append(v)
        r = feature + head.self_attn.o_proj(_attend(q, keys, values, head.self_attn.scale))
        xs.append(r + head.mlp(head.post_attention_layernorm(r)))
    return xs


def logits(head: EagleDraftHead, x: torch.Tensor) -> torch.Tensor:
    """Draft logits ``[..., draft_vocab]`` float32 for x ``[..., h]`` (as the head's forward computes them)."""
    return head.draft_logits(x)


def _qkv(head: EagleDraftHead, attn_in: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """attn_in ``[B, L, 2h]`` -> q ``[B, H, L, hd]``, k and v ``[B, H, L, hd]`` (kv heads repeated)."""
    attn = head.self_attn
    batch, length, _ = attn_in.shape
    heads, kv_heads, hd = attn.num_heads, attn.num_kv_heads, attn.head_dim
    qkv = attn.qkv_proj(attn_in).view(batch * length, heads + 2 * kv_heads, hd)
    qk = apply_rotary(qkv[:, :heads + kv_heads], cos, sin)
    q, k = qk.split((heads, kv_heads), dim=1)
    v = qkv[:, heads + kv_heads:]

    def as_heads(t: torch.Tensor) -> torch.Tensor:
        t = t.view(batch, length, -1, hd).transpose(1, 2)  # [B, heads, L, hd]
        return t.repeat_interleave(heads // t.shape[1], dim=1)

    return as_heads(q), as_heads(k), as_heads(v)


def _attend(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor], scale: float) -> torch.Tensor:
    """Step s = len(keys) - 1: row i attends to keys[0] at [0, i - s] and keys[j] at i - s + j
    (j >= 1). q, keys, values ``[B, H, L, hd]`` -> ``[B, L, H * hd]``."""
    step, length = len(keys) - 1, q.shape[2]
    real = (q @ keys[0].transpose(-1, -2)).float() * scale  # [B, H, L, L]
    causal = torch.ones(length, length, dtype=torch.bool, device=q.device).tril(-step)
    real = real.masked_fill(~causal, float("-inf"))
    shifted = [(_shift(k, step - j), _shift(v, step - j)) for j, (k, v) in enumerate(zip(keys, values)) if j]
    diag = [((q * k).sum(-1, keepdim=True)).float() * scale for k, _ in shifted]  # [B, H, L, 1] each
    probs = torch.cat([real, *diag], dim=-1).softmax(-1).to(q.dtype)
    out = probs[..., :length] @ values[0]
    for j, (_, v) in enumerate(shifted):
        out = out + probs[..., length + j:length + j + 1] * v
    batch, heads, _, hd = out.shape
    return out.transpose(1, 2).reshape(batch, length, heads * hd)


def _shift(t: torch.Tensor, by: int) -> torch.Tensor:
    """``t[..., i - by, :]`` at row i (zeros where i < by): ``[B, H, L, hd]``."""
    return F.pad(t[:, :, :t.shape[2] - by], (0, 0, by, 0)) if by else t
