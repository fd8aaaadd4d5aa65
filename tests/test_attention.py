import pytest
import torch

from copytask.models.attention import make_attention, masked_softmax

CASES = [("additive", 6, 8, 5), ("dot", 8, 8, None), ("general", 6, 8, None)]


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

