"""Scaled dot-product, torch's multi-head attention and Luong's local attention (issue 14): each
against its definition written out by hand."""

import math

import pytest
import torch

from copytask.data.batches import length_mask
from copytask.models.attention import Attention, make_attention, masked_softmax

B, T_DEC, T_ENC, H = 3, 5, 7, 8


def inputs(seed: int = 0):
    torch.manual_seed(seed)
    query, values = torch.randn(B, T_DEC, H), torch.randn(B, T_ENC, H)
    mask = length_mask(torch.tensor([7, 4, 2]), T_ENC)
    return query, values, mask


def test_scaled_dot_is_the_dot_score_over_sqrt_d():
    query, values, mask = inputs()
    for heads in (1, 2):
        attention = make_attention("scaled_dot", H, H, heads=heads)
        context, weights = attention(query, attention.project_keys(values), values, mask)
        d = H // heads
        q, k = query.view(B, T_DEC, heads, d).transpose(1, 2), values.view(B, T_ENC, heads, d).transpose(1, 2)
        by_hand = masked_softmax(q @ k.transpose(-1, -2) / math.sqrt(d), mask[:, None, None, :])
        torch.testing.assert_close(weights, by_hand.mean(1))
        assert not torch.allclose(weights, make_attention("dot", H, H, heads=heads)(query, values, values, mask)[1])


def scaled_dot_product_by_hand(mha: torch.nn.MultiheadAttention, query, values, mask):
    """The Transformer's multi-head attention written out, with `mha`'s projection weights."""
    w_q, w_k, w_v = mha.in_proj_weight.chunk(3)
    b_q, b_k, b_v = mha.in_proj_bias.chunk(3)
    heads, d = mha.num_heads, H // mha.num_heads
    split = lambda x: x.view(x.size(0), x.size(1), heads, d).transpose(1, 2)  # noqa: E731
    q, k, v = split(query @ w_q.T + b_q), split(values @ w_k.T + b_k), split(values @ w_v.T + b_v)
    scores = (q @ k.transpose(-1, -2) / math.sqrt(d)).masked_fill(~mask[:, None, None, :], float("-inf"))
    weights = scores.softmax(-1)  # (B, heads, T_DEC, T_ENC)
    context = (weights @ v).transpose(1, 2).reshape(query.size(0), query.size(1), H)
    return context @ mha.out_proj.weight.T + mha.out_proj.bias, weights


@pytest.mark.parametrize("heads", [1, 2, 4, 8])
def test_multihead_is_torch_module_and_equals_scaled_dot_product_by_hand(heads):
    query, values, mask = inputs(1)
    attention = make_attention("multihead", H, H, heads=heads)
    assert isinstance(attention.mha, torch.nn.MultiheadAttention) and attention.mha.num_heads == heads
    context, weights = attention(query, attention.project_keys(values), values, mask)
    want_context, want_heads = scaled_dot_product_by_hand(attention.mha, query, values, mask)
    torch.testing.assert_close(context, want_context)
    torch.testing.assert_close(weights, want_heads.mean(1))
    assert (weights[~mask[:, None, :].expand_as(weights)] == 0).all()  # the key-padding mask
    # with an intervention hook (counterfactuals, per-head maps) the by-hand path runs: same numbers
    seen = []
    attention.intervention = lambda w, m: seen.append(w) or w
    hooked_context, hooked_weights = attention(query, values, values, mask)
    torch.testing.assert_close(hooked_context, context)
    torch.testing.assert_close(seen[0].view(B, heads, T_DEC, T_ENC), want_heads)


def local_attention(local: str, window: int, score: str = "general") -> Attention:
    torch.manual_seed(2)
    return make_attention(score, H, H, local=local, window=window)


@pytest.mark.parametrize("local", ["predictive", "monotonic"])
def test_local_weights_are_zero_outside_the_window_and_on_padding(local):
    query, values, mask = inputs(3)
    attention, window = local_attention(local, 1), 1
    weights = attention(query, attention.project_keys(values), values, mask, torch.arange(T_DEC))[1]
    lengths = mask.sum(-1)
    if local == "monotonic":
        aligned = torch.minimum(torch.arange(T_DEC)[None, :], lengths[:, None]).float()
    else:
        aligned = lengths[:, None] * torch.sigmoid(
            attention.position_v(torch.tanh(attention.position_proj(query)))
        ).squeeze(-1)
    outside = (torch.arange(T_ENC)[None, None, :] - aligned[:, :, None]).abs() > window
    assert outside.any() and (weights[outside] == 0).all()
    assert (weights[~mask[:, None, :].expand_as(weights)] == 0).all()
    assert (weights.sum(-1) > 0).all()  # no row is empty: past the source, p_t = t stops at its length
    if local == "monotonic":
        torch.testing.assert_close(weights.sum(-1), torch.ones(B, T_DEC))
    else:  # the Gaussian, not renormalised, as in Luong et al. (2015)
        assert (weights.sum(-1) < 1).all()


def test_local_m_with_a_window_wider_than_the_sequence_is_global_attention():
    query, values, mask = inputs(4)
    local = local_attention("monotonic", T_ENC + T_DEC)
    glob = make_attention("general", H, H)
    glob.load_state_dict(local.state_dict())
    got = local(query, local.project_keys(values), values, mask, torch.arange(T_DEC))
    want = glob(query, glob.project_keys(values), values, mask)
    torch.testing.assert_close(got, want)
    narrow = local_attention("monotonic", 1)
    narrow.load_state_dict(local.state_dict())
    assert not torch.allclose(narrow(query, narrow.project_keys(values), values, mask, torch.arange(T_DEC))[1], want[1])


def test_local_p_predicted_position_receives_a_gradient():
    query, values, mask = inputs(5)
    attention = local_attention("predictive", 2)
    context, _ = attention(query, attention.project_keys(values), values, mask)
    context.square().sum().backward()
    for parameter in (attention.position_proj.weight, attention.position_v.weight):
        assert parameter.grad is not None and parameter.grad.abs().sum() > 0


def test_local_p_follows_its_predicted_position():
    """Steer p_t to the end of each source: the weight moves there (the Gaussian's centre)."""
    query, values, mask = inputs(6)
    attention = local_attention("predictive", 1)
    with torch.no_grad():
        attention.position_proj.weight.copy_(torch.eye(H))
        attention.position_v.weight.fill_(0)
        attention.position_v.weight[0, 0] = 50.0  # sigmoid -> 1 where the query's first feature is positive
    query[..., 0] = 1.0
    weights = attention(query, attention.project_keys(values), values, mask)[1]
    lengths = mask.sum(-1)
    for b in range(B):
        assert weights[b, :, lengths[b] - 1].gt(weights[b, :, : lengths[b] - 2].sum(-1)).all()


def test_local_and_multihead_refuse_what_they_cannot_do():
    with pytest.raises(ValueError, match="local attention needs one head"):
        make_attention("general", H, H, heads=2, local="monotonic", window=2)
    with pytest.raises(ValueError, match="local attention needs one head of a single-head score, got 'multihead'"):
        make_attention("multihead", H, H, local="monotonic", window=2)
    with pytest.raises(ValueError, match="local attention needs window >= 1"):
        make_attention("general", H, H, local="predictive", window=0)
    with pytest.raises(ValueError, match="unknown local attention 'sideways'"):
        make_attention("general", H, H, local="sideways", window=2)
    with pytest.raises(ValueError, match="multihead attention needs the decoder state size to equal"):
        make_attention("multihead", H, 2 * H, heads=2)
