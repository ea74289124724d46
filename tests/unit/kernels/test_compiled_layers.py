"""The compiled CPU forward runs its decoder layers a group at a time: same outputs as eager."""

from __future__ import annotations

import pytest

from kernels.attention import build_attn_metadata
from kernels.cpu.compiled import CompiledLayers, group_size
from kernels.kv_layout import KVCacheTensors
from kernels.model.loader import make_tiny_llama

pytestmark = pytest.mark.isa  # inductor vectorises for this CPU


@pytest.mark.parametrize(("layers", "most", "group"), [(30, 6, 6), (32, 6, 4), (28, 6, 4), (7, 6, 1), (2, 6, 2),
                                                       (24, 6, 6), (30, 1, 1)])
def test_a_group_is_the_largest_divisor_of_the_layers_up_to_the_most(layers, most, group):
    assert group_size(layers, most) == group


def test_grouped_compiled_layers_give_eager_logits_hidden_and_aux_states():
    """Six layers in one compiled group: logits, hidden states and the states entering aux layers
    0, 2 and 5 (an EAGLE head's) equal the eager forward's, and the KV both write is the same; the
    compile traces the group once."""
    import torch._dynamo

    ours, _ = make_tiny_llama(seed=3, num_hidden_layers=6)
    arch, page_size = ours.arch, 4
    prompt = torch.randint(0, arch.vocab_size, (9,), generator=torch.Generator().manual_seed(1))

    def run(model, kv):
        pages = [1, 2, 3]
        meta, positions = build_attn_metadata(page_size, [9], [9], [pages], [8], "cpu")
        model.forward_with_aux(prompt, positions, meta, kv, ())  # prefill eagerly, then decode one row
        meta, positions = build_attn_metadata(page_size, [1], [10], [pages], [0], "cpu")
        return model.forward_with_aux(torch.tensor([5]), positions, meta, kv, (0, 2, 5))

    def fresh():
        return KVCacheTensors.allocate(arch.num_layers, 8, page_size, arch.num_kv_heads, arch.head_dim,
                                       torch.float32, "cpu")

    torch._dynamo.reset()
    compiled = CompiledLayers(ours)
    assert compiled.group_size == 6
    eager_kv, compiled_kv = fresh(), fresh()
    want = run(ours, eager_kv)
    with compiled.compiling():
        got = run(_EagerPrefill(ours, compiled), compiled_kv)
    try:
        # traced once: no second attempt after the floats read from the layers failed as symbols
        # (dynamo's metrics name each attempt; a restart adds "compile_attempt_1")
        assert "compile_attempt_1" not in torch._dynamo.utils.compile_times()
        for w, g in zip(want, got):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
        assert got[2].shape == (1, 3 * arch.hidden_size)
        for a, b in zip(eager_kv.k + eager_kv.v, compiled_kv.k + compiled_kv.v):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    finally:
        torch._dynamo.reset()


class _EagerPrefill:
    """The prompt through the eager model, the decode row through the compiled one."""

    def __init__(self, eager, compiled):
        self.eager, self.compiled, self.calls = eager, compiled, 0

    def forward_with_aux(self, *args):
        self.calls += 1
        return (self.eager if self.calls == 1 else self.compiled).forward_with_aux(*args)
