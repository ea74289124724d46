"""Training on the tiny target: examples and their labels, the loss going down, the published
checkpoint loading back into the same head, and resume ending where an uninterrupted run ends."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from cluster.train.checkpoint import new_head, trainable, write_published
from cluster.train.data import Sample
from cluster.train.trainer import (
    IGNORE,
    epoch_batches,
    make_example,
    pad_batch,
    pad_hidden,
    soft_labels,
    train_head,
    unrolled_loss,
    uses_bf16,
)
from cluster.train.unroll import logits, unrolled_forward
from cluster.train.vocab import DraftVocab
from kernels.model.eagle import load_eagle_checkpoint
from kernels.model.packed_linear import cpu_native_bf16
from tests.helpers import tiny_models
from tests.unit.train.conftest import tiny_corpus, tiny_examples, tiny_target_head, tiny_target_hidden, tiny_vocab


def test_examples_label_answer_tokens_from_the_first_verify_on():
    # prompt t[0..3), answer t[3..7); token 14 is outside the draft vocabulary
    sample = Sample((10, 11, 12, 13, 14, 15, 16), prompt_len=3)
    vocab = DraftVocab(torch.tensor([10, 11, 12, 13, 15, 16]), 20)
    aux = torch.arange(7.0)[:, None].repeat(1, 3)
    example = make_example(sample, aux, vocab.t2d())
    assert example.input_ids.tolist() == [11, 12, 13, 14, 15, 16]  # row i reads t[i+1]
    assert example.aux[:, 0].tolist() == [0, 1, 2, 3, 4, 5]  # and a[i]
    # row i predicts t[i+2]; rows from P-1 = 2 on; 14 is not draftable; the last row has no label
    assert example.labels.tolist() == [IGNORE, IGNORE, IGNORE, 4, 5, IGNORE]


def test_batches_cover_every_example_once_per_epoch_and_depend_on_seed_and_epoch():
    lengths = [5, 9, 3, 7, 1, 8, 2, 6, 4, 10, 11]
    batches = epoch_batches(lengths, batch_size=3, seed=0, epoch=0)
    assert sorted(i for b in batches for i in b) == list(range(11))
    assert all(len(b) <= 3 for b in batches)
    assert batches == epoch_batches(lengths, batch_size=3, seed=0, epoch=0)
    assert batches != epoch_batches(lengths, batch_size=3, seed=0, epoch=1)
    assert batches != epoch_batches(lengths, batch_size=3, seed=1, epoch=0)


def _mean_loss(head, examples, settings, soft=None) -> float:
    with torch.no_grad():
        loss, _ = unrolled_loss(head, *pad_batch(examples), settings.unroll_steps, settings.step_decay, soft)
    return loss.item()


def test_soft_labels_are_the_targets_distribution_at_the_row_that_predicts_the_label():
    """The target answered greedily, so at every labelled row its distribution over the draft
    vocabulary peaks at the label (the hidden state one position after the row's aux)."""
    samples, aux = tiny_corpus()
    vocab = tiny_vocab(samples)
    examples = tiny_examples(samples, aux, vocab, tiny_target_hidden())
    probs = soft_labels(pad_hidden(examples), tiny_target_head(vocab))  # [B, L, draft_vocab]
    _, _, labels = pad_batch(examples)
    rows = labels >= 0
    assert rows.sum() > 100
    torch.testing.assert_close(probs.sum(-1), torch.ones(probs.shape[:2]))
    agree = (probs[rows].argmax(-1) == labels[rows]).float().mean().item()
    assert agree > 0.97, f"the target's likeliest draft token matches the label at {agree:.0%} of rows: misaligned?"


def test_soft_labels_need_the_target_states(settings, tmp_path):
    samples, aux = tiny_corpus()
    vocab = tiny_vocab(samples)
    head = new_head(tiny_models()[0], vocab, settings.seed)
    with pytest.raises(ValueError, match="soft labels"):
        train_head(head, tiny_examples(samples, aux, vocab), settings, tmp_path / "state.pt", checkpoint_every=100)


@pytest.mark.parametrize("soft, precision", [(True, "fp32"), (True, "bf16"), (False, "fp32")],
                         ids=["soft-fp32", "soft-bf16", "hard-fp32"])
def test_training_lowers_the_loss_and_the_published_head_loads_back_identical(settings, tmp_path, soft, precision):
    samples, aux = tiny_corpus()
    vocab = tiny_vocab(samples)
    examples = tiny_examples(samples, aux, vocab, tiny_target_hidden() if soft else None)
    settings = dataclasses.replace(settings, soft_labels=soft, precision=precision)
    target, _, arch = tiny_models()
    head = new_head(target, vocab, settings.seed)
    _, _, labels = pad_batch(examples)
    probs = soft_labels(pad_hidden(examples)[labels >= 0], tiny_target_head(vocab)) if soft else None
    # what the loss cannot go below: the labels' entropy (0 for hard labels), summed like the steps
    floor = 0.0
    if soft:
        entropy = -(probs * probs.log()).sum(-1).mean().item()
        floor = entropy * sum(settings.step_decay ** s for s in range(settings.unroll_steps))
    before = _mean_loss(head, examples, settings, probs) - floor
    losses = train_head(head, examples, settings, tmp_path / "state.pt", checkpoint_every=100,
                        target_head=tiny_target_head(vocab) if soft else None)
    assert len(losses) == 3 * settings.epochs  # 12 examples, batches of 4
    after = _mean_loss(head, examples, settings, probs) - floor
    assert after < 0.8 * before, f"loss above its floor {before:.3f} -> {after:.3f}: training did not learn"

    out = tmp_path / "head"
    out.mkdir()
    write_published(out, head, vocab, arch)
    loaded = load_eagle_checkpoint(out, arch, target.model.embed_tokens, target.lm_head).eval()
    assert loaded.arch == head.arch
    assert torch.equal(loaded.token_map, vocab.target_ids)
    ids, row_aux, _ = pad_batch(examples[:3])
    with torch.no_grad():
        for ours, theirs in zip(unrolled_forward(head, ids, row_aux, 3), unrolled_forward(loaded, ids, row_aux, 3)):
            assert torch.equal(ours, theirs)
            assert torch.equal(logits(head, ours), logits(loaded, theirs))


@pytest.mark.isa
def test_precision_decides_autocast_and_bf16_training_stays_near_fp32(settings, tmp_path):
    """bf16 runs the head's matmuls in bfloat16 (so its weights differ from an fp32 run's), while
    the loss and the weights stay close to fp32 training: float32 master weights, float32 labels."""
    assert uses_bf16("bf16", "cpu") and not uses_bf16("fp32", "cpu")
    assert uses_bf16("auto", "cpu") == cpu_native_bf16()  # AVX512-BF16 or AMX, as oneDNN sees it
    samples, aux = tiny_corpus()
    vocab = tiny_vocab(samples)
    examples = tiny_examples(samples, aux, vocab, tiny_target_hidden())
    heads, losses = {}, {}
    for precision in ("fp32", "bf16"):
        heads[precision] = new_head(tiny_models()[0], vocab, settings.seed)
        losses[precision] = train_head(heads[precision], examples, dataclasses.replace(settings, precision=precision),
                                       tmp_path / f"{precision}.pt", checkpoint_every=100,
                                       target_head=tiny_target_head(vocab))
    fp32, bf16 = (trainable(heads[p]) for p in ("fp32", "bf16"))
    assert any(not torch.equal(fp32[name], bf16[name]) for name in fp32), "bf16 training ran in float32"
    assert all(bf16[name].dtype == torch.float32 for name in bf16)
    # bf16 rounding moves the trajectory, not away: at most ~9% on a CPU with native bf16 dot products,
    # ~26% on one without (AVX2: the matmuls round another way); the losses below stay within 1%
    for name in fp32:
        assert ((fp32[name] - bf16[name]).norm() / fp32[name].norm()).item() < 0.35, name
    for ours, theirs in zip(losses["bf16"], losses["fp32"]):
        assert abs(ours - theirs) < 0.01 * theirs


def test_a_resumed_run_ends_with_the_weights_of_an_uninterrupted_one(settings, tmp_path):
    samples, aux = tiny_corpus()
    vocab = tiny_vocab(samples)
    examples = tiny_examples(samples, aux, vocab, tiny_target_hidden())
    target = tiny_models()[0]
    target_head = tiny_target_head(vocab)
    settings = dataclasses.replace(settings, epochs=2)  # 6 steps; interrupted after 4 (mid-epoch)

    straight = new_head(target, vocab, settings.seed)
    train_head(straight, examples, settings, tmp_path / "straight.pt", checkpoint_every=100, target_head=target_head)

    state = tmp_path / "resumed.pt"
    first = train_head(new_head(target, vocab, settings.seed), examples, settings, state, checkpoint_every=2,
                       stop_after=4, target_head=target_head)
    resumed = new_head(target, vocab, settings.seed)  # a new process: fresh weights, then the state
    rest = train_head(resumed, examples, settings, state, checkpoint_every=2, target_head=target_head)
    assert (len(first), len(rest)) == (4, 2)
    for (name, a), b in zip(trainable(straight).items(), trainable(resumed).values()):
        assert torch.equal(a, b), f"{name} differs after resume"
    assert not torch.equal(trainable(straight)["fc.weight"], trainable(new_head(target, vocab, 0))["fc.weight"])
