"""A trained head in and out of the published EAGLE-3 format (what `load_eagle_checkpoint` reads), its
initialisation, and the resume state of a training run.

Published layout: config.json (``architectures: ["LlamaForCausalLMEagle3"]``, ``draft_vocab_size``,
``hidden_size``, ``eagle_config.eagle_aux_hidden_state_layer_ids``, the layer's shapes) and
model.safetensors with HF-named [out, in] weights: ``fc.weight``, ``midlayer.self_attn.{q,k,v,o}_proj``,
``midlayer.mlp.{gate,up,down}_proj``, ``midlayer.{input_layernorm,hidden_norm,post_attention_layernorm}``,
``norm.weight``, ``lm_head.weight`` and ``d2t``. The head's `embed` is the target's and is not saved.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from cluster.train.vocab import DraftVocab
from kernels.model.arch import LlamaArch
from kernels.model.eagle import DraftArch, DraftStyle, EagleDraftHead
from kernels.model.llama import LlamaForCausalLM
from kernels.model.packed_linear import PackedLinear

WEIGHTS_FILE = "model.safetensors"
STATE_FILE = "state.pt"
INIT_STD = 0.02


def new_head(target: LlamaForCausalLM, vocab: DraftVocab, seed: int) -> EagleDraftHead:
    """A fresh float32 EAGLE-3 head for `target`: linears ~ N(0, 0.02) from `seed`, norms 1, except
    `lm_head` and `norm`, copied from the target's rows of the draft vocabulary and final norm (the
    head starts out speaking the target's output space). Only the head's own parameters train."""
    arch = DraftArch.for_target(target.arch, DraftStyle.EAGLE3, vocab.size)
    head = EagleDraftHead(arch, target.model.embed_tokens).float()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in trainable(head).items():
            if name.endswith(".weight") and isinstance(head.get_submodule(name.rsplit(".", 1)[0]), PackedLinear):
                param.copy_(torch.randn(param.shape, generator=gen) * INIT_STD)
        head.lm_head.weight.copy_(target.lm_head.weight[vocab.target_ids].float())
        head.norm.weight.copy_(target.model.norm.weight.float())
    head.token_map = vocab.target_ids.clone()
    head.embed.weight.requires_grad_(False)
    return head


def trainable(head: EagleDraftHead) -> dict[str, torch.nn.Parameter]:
    """The head's own parameters by name, in a fixed order (the target's embedding excluded)."""
    return {name: p for name, p in head.named_parameters() if not name.startswith("embed.")}


def published_tensors(head: EagleDraftHead, vocab: DraftVocab) -> dict[str, torch.Tensor]:
    """The head's weights under the published EAGLE-3 names, [out, in], float32, contiguous."""
    def unpack(module, names: tuple[str, ...]) -> dict[str, torch.Tensor]:
        parts = module.weight.detach().float().cpu().split(module.out_features, dim=0)
        out = {name + ".weight": part.contiguous() for name, part in zip(names, parts)}
        if module.bias is not None:  # Qwen2-style q/k/v biases
            biases = module.split(module.bias.detach().float().cpu())
            out |= {name + ".bias": b.contiguous() for name, b in zip(names, biases)}
        return out

    attn, mlp = head.self_attn, head.mlp
    tensors = unpack(head.fc, ("fc",)) | unpack(head.lm_head, ("lm_head",))
    tensors |= unpack(attn.qkv_proj, tuple(f"midlayer.self_attn.{p}_proj" for p in "qkv"))
    tensors |= unpack(attn.o_proj, ("midlayer.self_attn.o_proj",))
    tensors |= unpack(mlp.gate_up_proj, ("midlayer.mlp.gate_proj", "midlayer.mlp.up_proj"))
    tensors |= unpack(mlp.down_proj, ("midlayer.mlp.down_proj",))
    for ours, name in (("input_layernorm", "midlayer.input_layernorm"), ("hidden_norm", "midlayer.hidden_norm"),
                       ("post_attention_layernorm", "midlayer.post_attention_layernorm"), ("norm", "norm")):
        tensors[name + ".weight"] = getattr(head, ours).weight.detach().float().cpu().contiguous()
    tensors["d2t"] = vocab.d2t.contiguous()
    return tensors


def write_published(path: Path, head: EagleDraftHead, vocab: DraftVocab, target_arch: LlamaArch) -> None:
    """config.json and model.safetensors into the existing directory `path`."""
    from safetensors.torch import save_file

    save_file(published_tensors(head, vocab), str(path / WEIGHTS_FILE), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(_config(head.arch, target_arch), indent=2) + "\n")


def _config(arch: DraftArch, target: LlamaArch) -> dict:
    layer = arch.layer
    return {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "torch_dtype": "float32",
        "hidden_size": layer.hidden_size, "intermediate_size": layer.intermediate_size, "num_hidden_layers": 1,
        "num_attention_heads": layer.num_heads, "num_key_value_heads": layer.num_kv_heads,
        "head_dim": layer.head_dim, "rms_norm_eps": layer.rms_norm_eps, "rope_theta": layer.rope_theta,
        "max_position_embeddings": layer.max_position_embeddings, "vocab_size": target.vocab_size,
        "draft_vocab_size": arch.draft_vocab_size, "hidden_act": "silu", "tie_word_embeddings": False,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(arch.aux_layer_ids)},
    }


def save_state(path: Path, step: int, head: EagleDraftHead, optimizer: torch.optim.Optimizer) -> None:
    """The resume state after `step` optimizer steps, written to a temporary name then renamed (a
    crash mid-write leaves the previous state)."""
    tmp = path.with_suffix(".tmp")
    params = {name: p.detach().clone() for name, p in trainable(head).items()}
    torch.save({"step": step, "params": params, "optimizer": optimizer.state_dict()}, tmp)
    tmp.replace(path)


def load_state(path: Path, head: EagleDraftHead, optimizer: torch.optim.Optimizer) -> int:
    """Restore the head and optimizer from `path`; returns the steps already taken (0: no state)."""
    if not path.is_file():
        return 0
    state = torch.load(path, map_location="cpu", weights_only=True)
    with torch.no_grad():
        for name, param in trainable(head).items():
            param.copy_(state["params"][name])
    optimizer.load_state_dict(state["optimizer"])
    return int(state["step"])
