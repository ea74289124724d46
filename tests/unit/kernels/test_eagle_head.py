"""EAGLE draft heads (kernels/model/eagle.py) against an independent dense reference built from HF
transformers' Llama modules, for both published layouts: a checkpoint is written in the layout its
authors publish (EAGLE-1/2 as pytorch_model.bin, EAGLE-3 as safetensors with `d2t` offsets), loaded
for the tiny target, and run over tandem's paged KV as a ragged batch in two steps (an extend of two
sequences, then one decode row each); every row's next feature and draft logits must match the
reference run over each whole sequence at once."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from kernels.attention.metadata import build_attn_metadata
from kernels.kv_layout import KVCacheTensors
from kernels.model.eagle import DraftStyle, load_eagle_checkpoint
from tests.helpers import tiny_models

PAGE_SIZE = 4
PAGES = {0: [3, 5, 7, 8], 1: [2, 9, 6]}  # per sequence, in position order (page 0 is scratch)
LENS = {0: 11, 1: 7}  # tokens per sequence; the last one of each comes in the decode step
DRAFT_VOCAB = 40


def _published(style: DraftStyle, hf_config, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random weights named as the published checkpoints name them."""
    gen = torch.Generator().manual_seed(seed)
    h, inter = hf_config.hidden_size, hf_config.intermediate_size
    hd, heads, kvh = hf_config.head_dim, hf_config.num_attention_heads, hf_config.num_key_value_heads
    eagle3 = style is DraftStyle.EAGLE3
    attn_in = 2 * h if eagle3 else h
    pre = "midlayer." if eagle3 else "layers.0."

    def w(*shape):
        return torch.randn(shape, generator=gen) * 0.1

    t = {pre + "self_attn.q_proj.weight": w(heads * hd, attn_in), pre + "self_attn.k_proj.weight": w(kvh * hd, attn_in),
         pre + "self_attn.v_proj.weight": w(kvh * hd, attn_in), pre + "self_attn.o_proj.weight": w(h, heads * hd),
         pre + "mlp.gate_proj.weight": w(inter, h), pre + "mlp.up_proj.weight": w(inter, h),
         pre + "mlp.down_proj.weight": w(h, inter), pre + "post_attention_layernorm.weight": 1 + w(h)}
    if eagle3:
        t |= {"fc.weight": w(h, 3 * h), pre + "input_layernorm.weight": 1 + w(h), pre + "hidden_norm.weight": 1 + w(h),
              "norm.weight": 1 + w(h), "lm_head.weight": w(DRAFT_VOCAB, h),
              # draft id i -> target id 3 i + 1: offsets 2 i + 1
              "d2t": 2 * torch.arange(DRAFT_VOCAB) + 1}
    else:
        t |= {"fc.weight": w(h, 2 * h), "fc.bias": w(h), "embed_tokens.weight": w(hf_config.vocab_size, h)}
    return t


def _write_checkpoint(path, style: DraftStyle, hf_config, tensors) -> None:
    config = {"architectures": ["LlamaForCausalLMEagle3" if style is DraftStyle.EAGLE3 else "LlamaForCausalLM"],
              "hidden_size": hf_config.hidden_size, "num_hidden_layers": 1}
    if style is DraftStyle.EAGLE3:
        from safetensors.torch import save_file

        config["draft_vocab_size"] = DRAFT_VOCAB
        save_file(tensors, str(path / "model.safetensors"))
    else:
        torch.save(tensors, path / "pytorch_model.bin")
    (path / "config.json").write_text(json.dumps(config))


def _reference(style: DraftStyle, hf_config, t, embed, target_lm_head, ids, features):
    """One whole sequence, dense: HF's Llama attention / MLP / RMSNorm / RoPE with the checkpoint's
    weights. Returns (x [n, h], logits over the target's vocabulary or the draft's [n, V])."""
    from transformers.models.llama.modeling_llama import LlamaAttention, LlamaMLP, LlamaRMSNorm, LlamaRotaryEmbedding

    eagle3 = style is DraftStyle.EAGLE3
    pre = "midlayer." if eagle3 else "layers.0."
    h, eps = hf_config.hidden_size, hf_config.rms_norm_eps
    attn = LlamaAttention(hf_config, layer_idx=0).eval()
    for name in "qkv":
        proj = nn.Linear(2 * h if eagle3 else h, getattr(attn, f"{name}_proj").out_features, bias=False)
        proj.weight.data = t[pre + f"self_attn.{name}_proj.weight"]
        setattr(attn, f"{name}_proj", proj)
    attn.o_proj.weight.data = t[pre + "self_attn.o_proj.weight"]
    mlp = LlamaMLP(hf_config).eval()
    for name in ("gate", "up", "down"):
        getattr(mlp, f"{name}_proj").weight.data = t[pre + f"mlp.{name}_proj.weight"]

    def norm(name):
        module = LlamaRMSNorm(h, eps)
        module.weight.data = t[name]
        return module

    emb = embed(ids)[None]  # [1, n, h]
    pos = LlamaRotaryEmbedding(hf_config)(emb, torch.arange(len(ids))[None])
    with torch.no_grad():
        if eagle3:
            feat = features[None]
            r = feat + attn(torch.cat((norm(pre + "input_layernorm.weight")(emb),
                                       norm(pre + "hidden_norm.weight")(feat)), -1), pos)[0]
            x = r + mlp(norm(pre + "post_attention_layernorm.weight")(r))
            logits = norm("norm.weight")(x) @ t["lm_head.weight"].t()
        else:
            x = torch.cat((emb, features[None]), -1) @ t["fc.weight"].t() + t["fc.bias"]
            x = x + attn(x, pos)[0]
            x = x + mlp(norm(pre + "post_attention_layernorm.weight")(x))
            logits = target_lm_head(x)
    return x[0], logits[0]


@pytest.mark.parametrize("style", [DraftStyle.EAGLE, DraftStyle.EAGLE3])
def test_published_head_over_paged_kv_matches_the_dense_reference(style, tmp_path):
    target, hf_target, arch = tiny_models()
    hf_config = hf_target.config
    tensors = _published(style, hf_config)
    _write_checkpoint(tmp_path, style, hf_config, tensors)
    embed, lm_head = target.model.embed_tokens, target.lm_head
    head = load_eagle_checkpoint(tmp_path, arch, embed, lm_head).eval()
    assert head.arch.style is style

    gen = torch.Generator().manual_seed(1)
    feature_size = 3 * arch.hidden_size if style is DraftStyle.EAGLE3 else arch.hidden_size
    ids = {b: torch.randint(3, arch.vocab_size, (n,), generator=gen) for b, n in LENS.items()}
    raw = {b: torch.randn(n, feature_size, generator=gen) for b, n in LENS.items()}
    feats = {b: head.combine(f) if style is DraftStyle.EAGLE3 else f for b, f in raw.items()}
    kv = KVCacheTensors.allocate(1, 12, PAGE_SIZE, arch.num_kv_heads, arch.head_dim, torch.float32, "cpu")

    def step(starts: dict[int, int], ends: dict[int, int]):
        """Rows [starts[b], ends[b]) of each sequence as one ragged step; logits for each row."""
        q_lens = [ends[b] - starts[b] for b in LENS]
        meta, positions = build_attn_metadata(PAGE_SIZE, q_lens, [ends[b] for b in LENS], [PAGES[b] for b in LENS],
                                              list(range(sum(q_lens))), "cpu")
        cat = lambda parts: torch.cat([parts[b][starts[b]:ends[b]] for b in LENS])  # noqa: E731
        return head(cat(ids), cat(feats), positions, meta, kv)

    prefill = {b: n - 1 for b, n in LENS.items()}
    x1, logits1 = step({b: 0 for b in LENS}, prefill)
    x2, logits2 = step(prefill, LENS)

    offset = 0
    for b, n in LENS.items():
        ref_x, ref_logits = _reference(style, hf_config, tensors, embed, lm_head, ids[b], feats[b])
        got_x = torch.cat((x1[offset:offset + n - 1], x2[b:b + 1]))
        got_logits = torch.cat((logits1[offset:offset + n - 1], logits2[b:b + 1]))
        offset += n - 1
        torch.testing.assert_close(got_x, ref_x, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(got_logits, ref_logits.float(), atol=1e-4, rtol=1e-4)
    # the draft's K/V sit on the target's pages only: every other page (scratch 0 included) is untouched
    used = {p for pages in PAGES.values() for p in pages}
    assert all(not kv.k[0][p].any() and not kv.v[0][p].any() for p in range(12) if p not in used)


def test_eagle3_token_map_turns_draft_ids_into_target_ids(tmp_path):
    target, hf_target, arch = tiny_models()
    _write_checkpoint(tmp_path, DraftStyle.EAGLE3, hf_target.config, _published(DraftStyle.EAGLE3, hf_target.config))
    head = load_eagle_checkpoint(tmp_path, arch, target.model.embed_tokens, target.lm_head)
    assert head.arch.draft_vocab_size == DRAFT_VOCAB
    assert head.to_target_ids(torch.tensor([0, 1, 39])).tolist() == [1, 4, 118]  # id + d2t = 3 id + 1
    assert head.arch.aux_layer_ids == (1, 1, 0)  # the tiny target has 2 layers: min(2, L-1), L // 2, max(L-3, 0)


def test_checkpoints_that_do_not_fit_the_target_are_refused(tmp_path):
    target, hf_target, arch = tiny_models()
    tensors = _published(DraftStyle.EAGLE, hf_target.config)
    del tensors["layers.0.mlp.up_proj.weight"]
    _write_checkpoint(tmp_path, DraftStyle.EAGLE, hf_target.config, tensors)
    with pytest.raises(ValueError, match="no 'layers.0.mlp.up_proj.weight'"):
        load_eagle_checkpoint(tmp_path, arch, target.model.embed_tokens, target.lm_head)

    tensors = _published(DraftStyle.EAGLE, hf_target.config)
    tensors["fc.weight"] = tensors["fc.weight"][:, :-1]
    _write_checkpoint(tmp_path, DraftStyle.EAGLE, hf_target.config, tensors)
    with pytest.raises(ValueError, match="fc.weight: shape"):
        load_eagle_checkpoint(tmp_path, arch, target.model.embed_tokens, target.lm_head)

    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "hidden_size": 4096}))
    with pytest.raises(ValueError, match="draft hidden size 4096"):
        load_eagle_checkpoint(tmp_path, arch, target.model.embed_tokens, target.lm_head)


def test_aux_hidden_states_are_those_entering_the_layers_as_hf_reports_them():
    target, hf_target, arch = tiny_models()
    ids = torch.randint(3, arch.vocab_size, (9,), generator=torch.Generator().manual_seed(2))
    kv = KVCacheTensors.allocate(arch.num_layers, 8, PAGE_SIZE, arch.num_kv_heads, arch.head_dim, torch.float32, "cpu")
    meta, positions = build_attn_metadata(PAGE_SIZE, [9], [9], [[4, 1, 6]], [8], "cpu")
    hidden, logits, aux = target.forward_with_aux(ids, positions, meta, kv, (1, 0))
    with torch.no_grad():
        ref = hf_target(ids[None], output_hidden_states=True)
    # HF's hidden_states[i] is what enters layer i (index 0: the embeddings)
    torch.testing.assert_close(aux, torch.cat((ref.hidden_states[1][0], ref.hidden_states[0][0]), -1),
                               atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(logits, ref.logits[0, -1:].float(), atol=1e-4, rtol=1e-4)
    assert target.forward_with_aux(ids, positions, meta, kv, ())[2] is None
