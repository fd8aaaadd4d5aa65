from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

import copytask
from copytask.config.schema import config_dir
from copytask.models.attention import ATTENTION_TYPES, Attention, make_attention, masked_softmax, register_attention

from .conftest import TINY

# Every registered score at equal sizes (a dot product needs d_s == d_h), and at unequal ones the
# scores that map one size onto the other.
CASES = [(score, 8, 8, 5) for score in ATTENTION_TYPES] + [("additive", 6, 8, 5), ("general", 6, 8, None)]


@pytest.mark.parametrize("score, d_s, d_h, size", CASES)
def test_shapes_and_rows_sum_to_one(score, d_s, d_h, size):
    torch.manual_seed(0)
    attention = make_attention(score, d_s, d_h, size)
    states = torch.randn(3, 7, d_h)
    mask = torch.ones(3, 7, dtype=torch.bool)
    context, weights = attention(torch.randn(3, 4, d_s), attention.project_keys(states), states, mask)
    assert context.shape == (3, 4, d_h)
    assert weights.shape == (3, 4, 7)
    torch.testing.assert_close(weights.sum(-1), torch.ones(3, 4))


@pytest.mark.parametrize("score, d_s, d_h, size", CASES)
def test_padded_positions_get_exactly_zero_weight(score, d_s, d_h, size):
    torch.manual_seed(0)
    attention = make_attention(score, d_s, d_h, size)
    states = torch.randn(2, 6, d_h)
    mask = torch.tensor([[True] * 6, [True] * 3 + [False] * 3])
    states[1, 3:] = 1e3  # padding must not leak in however large it is
    query = torch.randn(2, 5, d_s)
    context, weights = attention(query, attention.project_keys(states), states, mask)
    assert (weights[1, :, 3:] == 0).all()
    torch.testing.assert_close(weights[1].sum(-1), torch.ones(5))
    short = states[1:, :3]
    alone_context, alone_weights = attention(query[1:], attention.project_keys(short), short, mask[1:, :3])
    torch.testing.assert_close(context[1:], alone_context)
    torch.testing.assert_close(weights[1:, :, :3], alone_weights)


def test_one_step_equals_forward_on_one_decoder_position():
    """`step` (query (B, d_s), as Bahdanau's decoder calls it) computes forward's numbers, masking
    and intervention included, without the time axis."""
    torch.manual_seed(0)
    d_s, d_h = 6, 8
    attention = make_attention("additive", d_s, d_h, 5)
    states = torch.randn(2, 6, d_h)
    mask = torch.tensor([[True] * 6, [True] * 4 + [False] * 2])
    query, keys = torch.randn(2, d_s), attention.project_keys(states)
    for intervention in (None, lambda weights, mask: mask[:, None, :] / mask.sum(-1)[:, None, None]):  # uniform
        attention.intervention = intervention
        context, weights = attention(query[:, None], keys, states, mask)
        step_context, step_weights = attention.step(query, keys, states, mask)
        assert step_context.shape == (2, d_h) and step_weights.shape == (2, 6)
        torch.testing.assert_close(step_context, context[:, 0])
        torch.testing.assert_close(step_weights, weights[:, 0])
    assert (step_weights[1, 4:] == 0).all() and torch.allclose(step_weights[1, :4], torch.full((4,), 0.25))


def test_masked_softmax_ignores_masked_scores():
    scores = torch.tensor([[[1.0, 2.0, 100.0]]])
    weights = masked_softmax(scores, torch.tensor([[True, True, False]]))
    torch.testing.assert_close(weights, torch.softmax(torch.tensor([[[1.0, 2.0, -torch.inf]]]), -1))
    assert weights[0, 0, 2] == 0


def test_dot_attention_worked_example():
    """The attention lesson's example, to three decimals."""
    states = torch.tensor([[[1.0, 0.0, 0.2], [0.5, 0.5, 0.1], [0.1, 0.9, 0.3]]])
    query = torch.tensor([[[0.9, 0.1, 0.2]]])
    attention = make_attention("dot", 3, 3)
    _, weights = attention(query, attention.project_keys(states), states, torch.ones(1, 3, dtype=torch.bool))
    assert [round(w, 3) for w in weights[0, 0].tolist()] == [0.464, 0.305, 0.231]


def test_dot_refuses_size_mismatch():
    with pytest.raises(ValueError, match=r"d_s=6 and d_h=8"):
        make_attention("dot", 6, 8)


def test_unknown_score_refused():
    with pytest.raises(ValueError, match="'cosine'"):
        make_attention("cosine", 4, 4)


def test_every_score_an_attention_option_names_has_its_class():
    options = (Path(config_dir()) / "attention").glob("*.yaml")
    assert {OmegaConf.load(path).get("score") for path in options} - {None} <= set(ATTENTION_TYPES)


def test_an_attention_type_is_its_class_and_nothing_else(tmp_path):
    """Issue 62: a score registered here, with no other file edited, composes under `attention.score`,
    trains, reloads from its run folder and takes the shared mechanics (Luong's local window)."""

    @register_attention("toy")
    class NegativeDistanceAttention(Attention):
        """e_{t,i} = -|q_t - h_i|_1: the nearer an encoder state, the more weight."""

        def scores(self, query, keys):
            """query (B, T_dec, d_s), keys (B, T_enc, d_s) -> (B, 1, T_dec, T_enc): one head."""
            return -(query[:, :, None, :] - keys[:, None, :, :]).abs().sum(-1)[:, None]

    try:
        one_step = ["train.steps=1", "train.eval_every=1", f"runs_dir={tmp_path}"]
        cfg = copytask.compose([*TINY, "attention=luong_dot", "attention.score=toy", "attention.name=toy", *one_step])
        metrics = copytask.train(cfg)
        model, _ = copytask.load_run(tmp_path / metrics["run"])
        assert type(model.attention) is NegativeDistanceAttention and metrics["steps"] == 1
        local = make_attention("toy", 4, 4, local="monotonic", window=1)
        states, mask = torch.randn(2, 5, 4), torch.ones(2, 5, dtype=torch.bool)
        _, weights = local(torch.randn(2, 3, 4), local.project_keys(states), states, mask, torch.arange(3))
        assert (weights[:, 0, 2:] == 0).all()  # the window [t - 1, t + 1] at t = 0
        torch.testing.assert_close(weights.sum(-1), torch.ones(2, 3))
    finally:
        del ATTENTION_TYPES["toy"]
