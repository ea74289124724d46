"""How a Hugging Face checkpoint's tensor names map onto the decoder's parameters.

Our q/k/v and gate/up projections are one `PackedLinear` each (`packing`); Phi-3 checkpoints store
them fused already. MoE experts are held as transformers v5 holds them (`gate_up_proj [E, 2I, H]`,
`down_proj [E, H, I]` per layer); checkpoints written before v5 (every one on the Hub) name each
expert's matrices apart, and Mixtral's block `block_sparse_moe` (`w1` gate, `w3` up, `w2` down):
`v5_names` stacks them.
"""

from __future__ import annotations

import re

import torch

from kernels.model.arch import LlamaArch

_MIXTRAL_EXPERT = re.compile(r"(model\.layers\.\d+)\.block_sparse_moe\.experts\.(\d+)\.(w1|w2|w3)\.weight")
_QWEN_EXPERT = re.compile(r"(model\.layers\.\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")
_MIXTRAL_PART = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


def packing(arch: LlamaArch) -> dict[str, tuple[str, ...]]:
    """Our PackedLinear module name -> the HF module names it packs, in order."""
    fused = arch.model_type == "phi3"
    table: dict[str, tuple[str, ...]] = {"lm_head": ("model.embed_tokens" if arch.tie_word_embeddings else "lm_head",)}
    for i in range(arch.num_layers):
        pre = f"model.layers.{i}."
        table[pre + "self_attn.qkv_proj"] = ((pre + "self_attn.qkv_proj",) if fused else
                                             tuple(pre + f"self_attn.{x}_proj" for x in "qkv"))
        table[pre + "self_attn.o_proj"] = (pre + "self_attn.o_proj",)
        moe = bool(arch.moe_layers) and arch.moe_layers[i]
        mlps = ([pre + "mlp.shared_expert"] if arch.shared_expert_intermediate_size else []) if moe else [pre + "mlp"]
        for mlp in mlps:
            table[mlp + ".gate_up_proj"] = ((mlp + ".gate_up_proj",) if fused else
                                            (mlp + ".gate_proj", mlp + ".up_proj"))
            table[mlp + ".down_proj"] = (mlp + ".down_proj",)
    return table


def ignored_key(key: str, arch: LlamaArch) -> bool:
    return key.endswith("rotary_emb.inv_freq") or (arch.tie_word_embeddings and key == "lm_head.weight")


def v5_names(state_dict: dict[str, torch.Tensor], arch: LlamaArch) -> dict[str, torch.Tensor]:
    """`state_dict` with experts named one by one (pre-v5 checkpoints) stacked into v5's tensors, and
    Mixtral's `block_sparse_moe.gate` named `mlp.gate`; any other name as it is."""
    if not arch.is_moe:
        return state_dict
    out: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    for key, tensor in state_dict.items():
        match = _MIXTRAL_EXPERT.fullmatch(key) or _QWEN_EXPERT.fullmatch(key)
        if match:
            layer, index, part = match.group(1), int(match.group(2)), match.group(3)
            experts.setdefault(layer, {}).setdefault(index, {})[_MIXTRAL_PART.get(part, part)] = tensor
        else:
            out[key.replace(".block_sparse_moe.gate.", ".mlp.gate.")] = tensor
    for layer, by_index in experts.items():
        if sorted(by_index) != list(range(arch.num_experts)):
            raise ValueError(f"{layer}: the checkpoint has experts {sorted(by_index)[:8]}..., the config "
                             f"{arch.num_experts}")
        missing = [f"{i}.{p}" for i, parts in by_index.items() for p in ("gate_proj", "up_proj", "down_proj")
                   if p not in parts]
        if missing:
            raise ValueError(f"{layer}: expert weights missing from the checkpoint: {missing[:5]}")
        ordered = [by_index[i] for i in range(arch.num_experts)]
        out[f"{layer}.mlp.experts.gate_up_proj"] = torch.stack(
            [torch.cat((p["gate_proj"], p["up_proj"])) for p in ordered])
        out[f"{layer}.mlp.experts.down_proj"] = torch.stack([p["down_proj"] for p in ordered])
    return out


def shard_tensors(state_dict: dict[str, torch.Tensor], arch: LlamaArch, shard) -> dict[str, torch.Tensor]:
    """`state_dict` (v5 names, the whole model of `arch`) cut to what `shard` (`kernels.model.tp.Shard`)
    holds, as views: query/KV heads' rows of q/k/v (Phi-3's fused q/k/v and gate/up cut part by part),
    intermediate columns' rows of gate/up and columns of down, each expert's likewise, the vocabulary's
    rows of the embedding and the head; row-parallel biases (o_proj, down_proj) on rank 0 alone, zeros
    elsewhere. Norms, routers and gates whole."""
    hd = arch.head_dim
    q_rows = _rows(shard.q_heads, hd)
    kv_rows = _rows(shard.kv_heads, hd)
    q_dim, kv_dim = arch.num_heads * hd, arch.num_kv_heads * hd
    out = {}
    for key, t in state_dict.items():
        inter = shard.shared_intermediate if ".shared_expert." in key else shard.intermediate
        if key in ("model.embed_tokens.weight", "lm_head.weight"):
            t = t[shard.vocab.start:shard.vocab.stop]
        elif key.endswith(("self_attn.q_proj.weight", "self_attn.q_proj.bias")):
            t = t[q_rows]
        elif key.endswith(("self_attn.k_proj.weight", "self_attn.k_proj.bias", "self_attn.v_proj.weight",
                           "self_attn.v_proj.bias")):
            t = t[kv_rows]
        elif key.endswith("self_attn.qkv_proj.weight"):  # Phi-3: q, k, v stacked
            q, k, v = t.split((q_dim, kv_dim, kv_dim))
            t = torch.cat((q[q_rows], k[kv_rows], v[kv_rows]))
        elif key.endswith("self_attn.o_proj.weight"):
            t = t[:, q_rows]
        elif key.endswith("mlp.gate_up_proj.weight"):  # Phi-3: gate, up stacked
            gate, up = t.chunk(2)
            t = torch.cat((gate[inter.start:inter.stop], up[inter.start:inter.stop]))
        elif key.endswith(("gate_proj.weight", "up_proj.weight")) and ".experts." not in key:
            t = t[inter.start:inter.stop]
        elif key.endswith("down_proj.weight") and ".experts." not in key:
            t = t[:, inter.start:inter.stop]
        elif key.endswith("experts.gate_up_proj"):
            cols, half = shard.moe_intermediate, t.shape[1] // 2
            t = torch.cat((t[:, cols.start:cols.stop], t[:, half + cols.start:half + cols.stop]), dim=1)
        elif key.endswith("experts.down_proj"):
            t = t[:, :, shard.moe_intermediate.start:shard.moe_intermediate.stop]
        elif key.endswith(("o_proj.bias", "down_proj.bias")) and shard.rank != 0:
            t = torch.zeros_like(t)
        out[key] = t
    return out


def _rows(heads: range, head_dim: int) -> slice:
    return slice(heads.start * head_dim, heads.stop * head_dim)
