"""The project's fast paths (keys projected once, Luong's decoder over all steps at once,
batched attention) against the classical step-by-step reference: same parameters, same numbers."""

from __future__ import annotations

import pytest
import torch
from hydra import compose, initialize_config_dir

from copytask.bench.reference import ReferenceSeq2Seq
from copytask.config.schema import config_dir
from copytask.data.batches import make_batch
from copytask.models.attention import SigmoidTanh
from copytask.models.build import build_model

ATTENTIONS = ("none", "rnnencdec", "bahdanau", "luong_dot", "luong_general", "luong_concat")
NO_ATTENTION = ("none", "rnnencdec")
LENGTH, VOCAB, BATCH = 12, 9, 16


def config(attention: str):
    with initialize_config_dir(config_dir=config_dir(), version_base="1.3"):
        return compose(
            "config", overrides=[f"attention={attention}", f"task.length={LENGTH}", f"task.vocab_size={VOCAB}"]
        )


def model_pair(attention: str):
    """A randomly initialised project model and the reference loaded with its state_dict."""
    cfg = config(attention)
    torch.manual_seed(0)
    project = build_model(cfg)
    reference = build_model(cfg, ReferenceSeq2Seq)
    reference.load_state_dict(project.state_dict())  # strict: names and shapes must match
    return project, reference


def batch(mixed: bool):
    return make_batch("copy", BATCH, LENGTH, VOCAB, torch.Generator().manual_seed(7), min_length=3 if mixed else None)


@pytest.mark.parametrize("mixed", [False, True], ids=["fixed", "mixed"])
@pytest.mark.parametrize("attention", ATTENTIONS)
def test_teacher_forced_logits_and_weights_equal_reference(attention, mixed):
    project, reference = model_pair(attention)
    b = batch(mixed)
    logits, weights = project(b.src, b.src_lengths, b.tgt_in)
    ref_logits, ref_weights = reference(b.src, b.src_lengths, b.tgt_in)
    torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-5)
    if attention in NO_ATTENTION:
        assert weights is None and ref_weights is None
    else:
        torch.testing.assert_close(weights, ref_weights, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("attention", ATTENTIONS)
def test_gradients_equal_reference(attention):
    """The backward pass of the fast paths (what training runs) gives the reference's gradients."""
    project, reference = model_pair(attention)
    b = batch(mixed=True)
    for model in (project, reference):
        model(b.src, b.src_lengths, b.tgt_in)[0].square().mean().backward()
    ref_grads = dict(reference.named_parameters())
    for name, param in project.named_parameters():
        torch.testing.assert_close(param.grad, ref_grads[name].grad, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("mixed", [False, True], ids=["fixed", "mixed"])
@pytest.mark.parametrize("attention", ATTENTIONS)
def test_greedy_equals_reference(attention, mixed):
    project, reference = model_pair(attention)
    b = batch(mixed)
    tokens, weights = project.greedy(b.src, b.src_lengths, steps=b.tgt_out.size(1))
    ref_tokens, ref_weights = reference.greedy(b.src, b.src_lengths, steps=b.tgt_out.size(1))
    assert torch.equal(tokens, ref_tokens)
    if attention not in NO_ATTENTION:
        torch.testing.assert_close(weights, ref_weights, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("steps_per_piece", [1, 5])
def test_additive_score_in_pieces_equals_reference(monkeypatch, steps_per_piece):
    """Luong concat's score computed a few decoder steps at a time (as on CPU at long lengths;
    5 leaves a remainder piece): logits, weights and gradients still equal the reference's."""
    project, reference = model_pair("luong_concat")
    b = batch(mixed=True)
    monkeypatch.setattr(
        "copytask.models.attention.ADDITIVE_CHUNK", steps_per_piece * BATCH * LENGTH * project.attention.v.in_features
    )
    logits, weights = project(b.src, b.src_lengths, b.tgt_in)
    ref_logits, ref_weights = reference(b.src, b.src_lengths, b.tgt_in)
    torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(weights, ref_weights, rtol=1e-5, atol=1e-6)
    logits.square().mean().backward()
    ref_logits.square().mean().backward()
    ref_grads = dict(reference.named_parameters())
    for name, param in project.named_parameters():
        torch.testing.assert_close(param.grad, ref_grads[name].grad, rtol=1e-4, atol=1e-6, msg=name)


def test_comparison_detects_a_changed_parameter():
    """Guards the tests above against passing vacuously (e.g. if attention had no effect)."""
    project, reference = model_pair("bahdanau")
    with torch.no_grad():
        reference.decoder.attention.v.weight.mul_(1.5)
    b = batch(mixed=True)
    logits, weights = project(b.src, b.src_lengths, b.tgt_in)
    ref_logits, ref_weights = reference(b.src, b.src_lengths, b.tgt_in)
    assert not torch.allclose(weights, ref_weights, atol=1e-4)
    assert not torch.allclose(logits, ref_logits, atol=1e-4)


@pytest.mark.parametrize("layer", ["summary", "summary_gates", "out"])
def test_comparison_detects_a_changed_summary_path(layer):
    """rnnencdec's summary c reaches the logits through V, through C (the gates and the candidate)
    and through the readout: a change to any of them in the reference shows in the logits."""
    project, reference = model_pair("rnnencdec")
    with torch.no_grad():
        weight = getattr(reference.decoder, layer).weight
        weight[:, -project.decoder.summary.out_features :].mul_(1.5)  # the readout: only c's columns
    b = batch(mixed=True)
    logits, _ = project(b.src, b.src_lengths, b.tgt_in)
    ref_logits, _ = reference(b.src, b.src_lengths, b.tgt_in)
    assert not torch.allclose(logits, ref_logits, atol=1e-4)


def test_sigmoid_tanh_equals_tanh():
    """The additive score's CPU tanh: values (saturation included) and gradients."""
    x = torch.cat([torch.linspace(-60, 60, 241), torch.randn(1000) * 3, torch.tensor([0.0, 1e-8, -1e-8])])
    torch.testing.assert_close(SigmoidTanh.apply(x), torch.tanh(x), rtol=0, atol=2e-7)
    assert torch.autograd.gradcheck(SigmoidTanh.apply, torch.randn(20, dtype=torch.double, requires_grad=True) * 3)
