"""Multi-head Luong attention: one head is the single-head score, heads are slices, errors name the value."""

import pytest
import torch
from hydra import compose, initialize_config_dir

from copytask.config.checks import validate
from copytask.config.schema import config_dir
from copytask.console import ConfigError
from copytask.data.batches import length_mask, make_batch
from copytask.data.vocab import total_vocab
from copytask.evaluation.analysis import head_weights
from copytask.models.attention import make_attention, masked_softmax
from copytask.models.build import check_buildable
from copytask.models.recurrent import Seq2Seq

B, T_DEC, T_ENC, H = 3, 4, 6, 8


def inputs(seed: int = 0):
    torch.manual_seed(seed)
    query, values = torch.randn(B, T_DEC, H), torch.randn(B, T_ENC, H)
    mask = length_mask(torch.tensor([6, 3, 1]), T_ENC)
    return query, values, mask


def test_one_head_is_the_single_head_general_score():
    query, values, mask = inputs()
    attention = make_attention("general", H, H, heads=1)
    context, weights = attention(query, attention.project_keys(values), values, mask)
    # s_t^T W h_i with W shared, written out as the single-head formula
    reference_weights = masked_softmax(query @ attention.key_proj(values).transpose(1, 2), mask)
    assert torch.equal(weights, reference_weights)
    assert torch.equal(context, reference_weights @ values)


def test_each_head_attends_with_its_own_slices_and_contexts_are_concatenated():
    query, values, mask = inputs(1)
    heads, size = 4, H // 4
    attention = make_attention("general", H, H, heads=heads)
    keys = attention.project_keys(values)  # (B, T_enc, H): W h, split per head below
    context, weights = attention(query, keys, values, mask)
    per_head = []
    for head in range(heads):
        part = slice(head * size, (head + 1) * size)
        # one head = dot attention of the query slice on the slice of W h, reading the slice of h
        head = make_attention("dot", size, size)
        head_context, head_weights = head(query[..., part], keys[..., part], values[..., part], mask)
        torch.testing.assert_close(context[..., part], head_context)
        per_head.append(head_weights)
    torch.testing.assert_close(weights, torch.stack(per_head).mean(0))  # the contract: mean over heads
    assert not torch.allclose(per_head[0], per_head[1])  # the heads really differ


def test_multi_head_model_shares_the_single_head_parameters_and_exposes_each_head():
    single = Seq2Seq(total_vocab(5), "luong", "general", embedding_size=8, hidden_size=H)
    multi = Seq2Seq(total_vocab(5), "luong", "general", embedding_size=8, hidden_size=H, heads=2)
    multi.load_state_dict(single.state_dict())  # same parameters: heads only split them
    batch = make_batch("copy", 5, 6, 5, torch.Generator().manual_seed(0), min_length=2)
    _, single_weights = single.greedy(batch.src, batch.src_lengths, steps=7)
    _, multi_weights = multi.greedy(batch.src, batch.src_lengths, steps=7)
    assert not torch.allclose(single_weights, multi_weights)
    heads = head_weights(multi, batch)
    assert heads.shape == (5, 2, 7, 6)
    torch.testing.assert_close(heads.mean(1), multi_weights)
    torch.testing.assert_close(heads.sum(-1), torch.ones(5, 2, 7))
    assert (heads[~batch.src_mask[:, None, None, :].expand_as(heads)] == 0).all()  # each head masks padding


def test_heads_are_refused_where_undefined_or_indivisible():
    with pytest.raises(ValueError, match="heads=2 needs a dot, scaled_dot, general, multihead score, got 'additive'"):
        make_attention("additive", H, H, attention_size=4, heads=2)
    with pytest.raises(ValueError, match="heads=3 must divide"):
        make_attention("general", H, H, heads=3)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["attention=bahdanau", "attention.heads=2"], "attention.heads=2 needs Luong attention"),
        (
            ["attention=luong_general", "attention.heads=3"],
            r"model.hidden_size \(64\) must be divisible by attention.heads \(3\)",
        ),
        (["attention=luong_general", "attention.heads=0"], "attention.heads must be an integer >= 1, got 0"),
        (["attention=multihead", "attention.heads=16"], "attention.heads must be at most 8, got 16"),
        (["attention=luong_local", "attention.window=0"], "attention.window must be an integer >= 1, got 0"),
        (
            ["attention=luong_local", "attention.local=sideways"],
            "attention.local must be one of None, predictive, monotonic, got 'sideways'",
        ),
        (
            ["attention=luong_local", "attention.heads=2"],
            "attention.local=predictive needs single-head Luong attention, got attention=luong_local with 2 heads",
        ),
        (
            ["attention=bahdanau", "attention.local=monotonic", "attention.window=3"],
            "attention.local=monotonic needs single-head Luong attention",
        ),
        (
            ["attention=luong_general", "attention.score=scaled"],
            "attention.score must be one of null, additive, dot, scaled_dot",
        ),
        # refused by the attention classes (check_buildable)
        (
            ["attention=luong_concat", "attention.heads=2"],
            "attention=luong_concat: heads=2 needs a dot, scaled_dot, general, multihead score, got 'additive'",
        ),
        (
            ["attention=multihead", "attention.heads=1", "attention.local=monotonic", "attention.window=2"],
            "attention=multihead: local attention needs one head of a single-head score",
        ),
        (
            ["attention=luong_concat", "attention.size=null"],
            "attention=luong_concat: additive attention needs attention_size >= 1",
        ),
        (["attention=luong_general", "attention.score=null"], "attention=luong_general: unknown attention score None"),
    ],
)
@pytest.mark.slow
def test_config_validation_names_the_bad_value(overrides, message):
    with initialize_config_dir(config_dir=config_dir(), version_base="1.3"):
        cfg = compose(config_name="config", overrides=overrides)
    with pytest.raises(ConfigError, match=message):
        validate(cfg)
        check_buildable(cfg)  # what only the attention classes know
