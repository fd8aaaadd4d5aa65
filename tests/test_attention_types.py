"""Scaled dot-product, torch's multi-head attention and Luong's local attention (issue 14): each
against its definition written out by hand."""

import math

import pytest
import torch

from copytask.data.batches import length_mask, make_batch
from copytask.data.vocab import total_vocab
from copytask.models.attention import Attention, make_attention, masked_softmax
from copytask.models.recurrent import Seq2Seq

from .conftest import ATTENTION_OPTIONS

B, T_DEC, T_ENC, H = 3, 5, 7, 8
LOCAL_OPTIONS = {name: option for name, option in ATTENTION_OPTIONS.items() if option.get("local")}


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


def outside_the_window(attention: Attention, query, mask, steps) -> torch.Tensor:
    """(B, T_dec, T_enc) True at the source positions outside [p_t - D, p_t + D] for the queries of output
    steps `steps` (T_dec,), p_t written out from Luong et al. (2015), section 3.2: local-m's the step t
    (at most the source length S), local-p's S sigmoid(v_p^T tanh(W_p q_t)) from the query."""
    lengths = mask.sum(-1, keepdim=True).float()  # (B, 1)
    if attention.local == "monotonic":
        aligned = torch.minimum(steps[None, :].float(), lengths)
    else:
        aligned = lengths * torch.sigmoid(attention.position_v(torch.tanh(attention.position_proj(query)))).squeeze(-1)
    source = torch.arange(mask.size(-1))
    return (source[None, None, :] - aligned[:, :, None]).abs() > attention.window


@pytest.mark.parametrize("local", ["predictive", "monotonic"])
def test_local_weights_are_zero_outside_the_window_and_on_padding(local):
    query, values, mask = inputs(3)
    attention = local_attention(local, 1)
    weights = attention(query, attention.project_keys(values), values, mask, torch.arange(T_DEC))[1]
    outside = outside_the_window(attention, query, mask, torch.arange(T_DEC))
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


@pytest.mark.parametrize("name", sorted(LOCAL_OPTIONS))
def test_local_attention_in_a_model_reads_its_window_alone(name):
    """At a source no longer than 2D + 1 the window holds every position and local attention computes
    global attention's numbers, so a model with it is tested here at sources of 12-16 with D = 2:
    every call of its attention, teacher-forced and in each greedy step, gives weights exactly zero
    outside [p_t - D, p_t + D] (p_t of the step the call is for, or of the decoder state it is given),
    and its logits are not those of the same model with global attention."""
    option, window = LOCAL_OPTIONS[name], 2
    shape = {"vocab": total_vocab(6), "decoder": option.decoder, "score": option.score}
    torch.manual_seed(0)
    model = Seq2Seq(**shape, embedding_size=8, hidden_size=16, local=option.local, window=window).eval()
    batch = make_batch("copy", 3, 16, 6, torch.Generator().manual_seed(0), min_length=12)
    assert 2 * window + 1 < int(batch.src_lengths.min())
    calls = []
    hook = model.attention.register_forward_hook(lambda module, args, output: calls.append((args, output[1])))
    with torch.no_grad():
        logits, _ = model(batch.src, batch.src_lengths, batch.tgt_in)
        model.greedy(batch.src, batch.src_lengths, steps=batch.tgt_out.size(1))
    hook.remove()
    steps = torch.arange(batch.tgt_out.size(1))
    assert len(calls) == 1 + len(steps)  # teacher forcing (every step), then greedy decoding (a step a call)
    for ((query, _, _, mask, *_), weights), call_steps in zip(calls, [steps, *steps[:, None]], strict=True):
        outside = outside_the_window(model.attention, query, mask, call_steps)
        assert outside.any() and (weights[outside] == 0).all()
    global_model = Seq2Seq(**shape, embedding_size=8, hidden_size=16).eval()
    missing, unexpected = global_model.load_state_dict(model.state_dict(), strict=False)
    assert not missing and all(".position_" in key for key in unexpected)  # local-p's predictor of p_t
    with torch.no_grad():
        global_logits, _ = global_model(batch.src, batch.src_lengths, batch.tgt_in)
    assert not torch.allclose(logits, global_logits)


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
