"""A source with no symbols (length 0) masks every position: its attention weights and context are
zero, never NaN, in torch's softmax and in the fused Bahdanau kernel (a library caller can build
such a batch; the command line cannot)."""

from __future__ import annotations

import pytest
import torch

from copytask.kernels import ops
from copytask.models.attention import ATTENTION_TYPES, make_attention, masked_softmax


def test_masked_softmax_gives_a_fully_masked_row_zero_weights_and_keeps_nan_scores_nan():
    scores = torch.tensor([[[1.0, 2.0, 3.0]], [[1.0, 2.0, 3.0]], [[float("nan"), 0.0, 0.0]]])  # (B, 1, T_enc)
    mask = torch.tensor([[True, True, False], [False, False, False], [True, True, True]])
    weights = masked_softmax(scores, mask)
    torch.testing.assert_close(weights[0, 0, :2].sum(), torch.tensor(1.0))
    assert weights[0, 0, 2] == 0 and weights[1].abs().sum() == 0  # padding and the empty source: exactly 0
    assert weights[2].isnan().all()  # a NaN score still propagates, as in torch


@pytest.mark.parametrize(
    "score, local", [(score, None) for score in ATTENTION_TYPES] + [("general", "predictive"), ("general", "monotonic")]
)
@pytest.mark.parametrize("intervention", [False, True])
def test_every_score_gives_an_empty_source_zero_weights(score, local, intervention):
    torch.manual_seed(0)
    heads = 2 if score == "multihead" else 1
    window = 2 if local else None
    attention = make_attention(
        score, query_size=8, key_size=8, attention_size=6, heads=heads, local=local, window=window
    )
    if intervention:  # the path the counterfactual checks take
        attention.intervention = lambda weights, mask: weights
    states = torch.randn(2, 4, 8)
    mask = torch.tensor([[True, True, False, False], [False] * 4])
    context, weights = attention(
        torch.randn(2, 3, 8), attention.project_keys(states), states, mask, positions=torch.arange(3)
    )
    assert torch.isfinite(context).all() and torch.isfinite(weights).all()
    assert weights[1].abs().sum() == 0


def test_the_fused_bahdanau_kernel_gives_an_empty_source_zero_weights():
    if ops.kernel() is None:
        pytest.skip("the fused kernels are not built on this machine")
    torch.manual_seed(0)
    cell = torch.nn.GRUCell(5 + 8, 8)
    embedded, s0 = torch.randn(2, 3, 5), torch.randn(2, 8)
    keys, values, w_q, v = torch.randn(2, 4, 6), torch.randn(2, 4, 8), torch.randn(6, 8), torch.randn(6)
    mask = torch.tensor([[True, True, True, False], [False] * 4])
    states, contexts, weights = ops.bahdanau_decode(embedded, s0, keys, values, mask, w_q, v, cell)
    assert torch.isfinite(states).all() and torch.isfinite(contexts).all() and torch.isfinite(weights).all()
    assert weights[1].abs().sum() == 0 and contexts[1].abs().sum() == 0
