"""model=transformer (torch's nn.Transformer) and attention=rnnencdec (Cho et al., 2014): their
definitions, decoding, masks, parameter counts and configs, and a tiny run through the real CLI."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from copytask import store
from copytask.bench.reference import ReferenceTransformer, reference_transformer_state
from copytask.config.checks import validate
from copytask.console import ConfigError
from copytask.data.batches import length_mask, make_batch
from copytask.data.vocab import BOS, PAD
from copytask.evaluation import analysis
from copytask.families.memory import parameter_count
from copytask.kernels import ops, transformer_ops
from copytask.models.build import build_model
from copytask.models.recurrent import count_parameters
from copytask.models.transformer import SinusoidalPositions, scaled_dot_product

from .conftest import TINY, run_cli

# A small Transformer: two layers so that the decoder's cache and the last layer both matter.
SMALL = ["model=transformer", "model.d_model=16", "model.heads=2", "model.layers=2", "model.ff_size=24"]
TINY_TRANSFORMER = [
    *TINY,
    "model=transformer",
    "model.d_model=8",
    "model.heads=2",
    "model.layers=1",
    "model.ff_size=16",
]


def trained_a_little(model: nn.Module, cfg, steps: int = 30) -> nn.Module:
    """A few Adam steps on the copy task: weights away from their initialisation, so that argmaxes differ
    between steps and positions and the tests below test something."""
    from copytask.data.splits import sample_batch
    from copytask.training.loop import train_step

    generator = torch.Generator().manual_seed(0)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    for _ in range(steps):
        train_step(model, optimizer, sample_batch(cfg, 16, generator), 1.0)
    return model.eval()


@pytest.fixture(
    params=[SMALL, [*SMALL, "model.positions=learned"], ["attention=rnnencdec", "model.hidden_size=16"]],
    ids=["sinusoidal", "learned", "rnnencdec"],
)
def model_and_config(request, make_config):
    cfg = make_config("task.length=7", "task.variable_length=true", "task.min_length=2", *request.param)
    torch.manual_seed(0)
    return trained_a_little(build_model(cfg), cfg), cfg


def mixed_batch(cfg, size: int = 6):
    return make_batch(
        "copy", size, cfg.task.length, cfg.task.vocab_size, torch.Generator().manual_seed(3), min_length=2
    )


def test_greedy_equals_the_teacher_forced_argmax_fed_its_own_outputs(model_and_config):
    model, cfg = model_and_config
    batch = mixed_batch(cfg)
    tokens, weights = model.greedy(batch.src, batch.src_lengths, steps=batch.tgt_out.size(1))
    fed = torch.cat(
        [torch.full_like(tokens[:, :1], BOS), tokens[:, :-1]], dim=1
    )  # its own outputs as the decoder input
    with torch.no_grad():
        logits, forced_weights = model(batch.src, batch.src_lengths, fed)
    assert torch.equal(logits.argmax(-1), tokens)
    assert len(set(tokens.flatten().tolist())) > 2  # trained enough to say different things
    if weights is not None:
        torch.testing.assert_close(weights, forced_weights, atol=1e-5, rtol=1e-4)


def test_a_mixed_length_batch_gives_each_sequence_what_it_gets_alone(model_and_config):
    model, cfg = model_and_config
    batch = mixed_batch(cfg)
    assert batch.src_lengths.unique().numel() > 1
    with torch.no_grad():
        logits, _ = model(batch.src, batch.src_lengths, batch.tgt_in)
        tokens, weights = model.greedy(batch.src, batch.src_lengths, steps=batch.tgt_out.size(1))
    for i in range(len(batch)):
        alone = batch.select(slice(i, i + 1))  # trimmed to its own length
        length = int(alone.src_lengths[0])
        with torch.no_grad():
            own_logits, _ = model(alone.src, alone.src_lengths, alone.tgt_in)
            own_tokens, own_weights = model.greedy(alone.src, alone.src_lengths, steps=length + 1)
        torch.testing.assert_close(logits[i, : length + 1], own_logits[0], atol=1e-5, rtol=1e-4)
        assert torch.equal(tokens[i, : length + 1], own_tokens[0])
        if weights is not None:
            torch.testing.assert_close(weights[i, : length + 1, :length], own_weights[0], atol=1e-5, rtol=1e-4)
            assert weights[i, :, length:].abs().max() == 0  # no weight on padding


def test_greedys_cross_attention_on_the_memory_projected_once_is_the_layers_attention_to_the_bit(make_config):
    """A greedy step's cross-attention, on keys and values of the memory projected once per decode,
    gives what the layer's Attention (nn.MultiheadAttention, projecting them itself) gives: the same
    context and weights, bit for bit, on mixed lengths with an empty source."""
    cfg = make_config("task.length=7", "task.variable_length=true", "task.min_length=2", *SMALL)
    torch.manual_seed(0)
    model = trained_a_little(build_model(cfg), cfg)
    batch = mixed_batch(cfg, size=9)
    lengths = batch.src_lengths.clone()
    lengths[4] = 0  # an empty source
    with torch.no_grad():
        memory, src_mask = model.encode(batch.src, lengths)
        heads = model.cross_attentions[0].heads
        mask_bias = (
            torch.zeros(src_mask.shape).masked_fill(~src_mask, float("-inf")).repeat_interleave(heads, 0)[:, None]
        )
        for layer, cross_attention in zip(model.transformer.decoder.layers, model.cross_attentions):
            keys, values = model._project_memory(layer.multihead_attn, memory)
            for step in range(3):
                x = torch.randn(len(batch), 1, model.d_model, generator=torch.Generator().manual_seed(step))
                context, weights = model._cached_cross_attention(
                    layer.multihead_attn, keys, values, mask_bias, ~src_mask.any(-1), x
                )
                want_context, want_weights = cross_attention(x, memory, memory, src_mask)
                assert torch.equal(context, want_context) and torch.equal(weights, want_weights)
    assert weights[4].abs().max() == 0 and weights[lengths > 0].sum(-1).sub(1).abs().max() < 1e-6


@pytest.mark.parametrize("mixed", [False, True], ids=["fixed", "mixed"])
@pytest.mark.parametrize("positions", ["sinusoidal", "learned"])
def test_greedy_with_each_steps_attention_in_the_kernel_decodes_what_torchs_ops_decode(
    make_config, monkeypatch, positions, mixed
):
    """Greedy decoding on CPU runs each step's attention in transformer_ops.attention_step (keys and values
    cached transposed); with fused=False, nn.MultiheadAttention's ops. The same tokens, and the
    same weights to float rounding, on sources of 12 (not a whole tile of 8), fixed or mixed lengths
    with an empty source, and a step count that is not a whole tile either."""
    if ops.kernel() is None:
        pytest.skip("the fused kernels are not built on this machine")
    cfg = make_config(
        "task.length=12", "task.variable_length=true", "task.min_length=2", *SMALL, f"model.positions={positions}"
    )
    torch.manual_seed(0)
    model = trained_a_little(build_model(cfg), cfg)
    batch = (
        mixed_batch(cfg, size=9)
        if mixed
        else make_batch("copy", 9, 12, cfg.task.vocab_size, torch.Generator().manual_seed(3))
    )
    lengths = batch.src_lengths.clone()
    if mixed:
        lengths[4] = 0  # an empty source
    calls = []
    step = transformer_ops.attention_step
    monkeypatch.setattr(transformer_ops, "attention_step", lambda *args: calls.append(args[-1]) or step(*args))
    results = []
    for fused in (True, False):
        model.fused = fused
        results.append(model.greedy(batch.src, lengths, steps=13))
    assert len(calls) == 13 * 2 * len(model.transformer.decoder.layers)  # the fused decode, and only it
    (tokens, weights), (want_tokens, want_weights) = results
    assert torch.equal(tokens, want_tokens) and len(set(tokens.flatten().tolist())) > 2
    torch.testing.assert_close(weights, want_weights, atol=1e-5, rtol=1e-4)
    if mixed:
        assert weights[4].abs().max() == 0  # the empty source: no weight anywhere


@pytest.mark.parametrize("head_size", [8, 5])
@pytest.mark.parametrize("keys_seen", [0, 5, 8, 13])
@pytest.mark.parametrize("masked", [False, True])
def test_the_decoding_steps_kernel_computes_torchs_batched_products(head_size, keys_seen, masked):
    """transformer_ops.attention_step, one query per sequence over the first keys of a cache held
    transposed and zero past them, against transformer.scaled_dot_product; and its weights."""
    if ops.kernel() is None:
        pytest.skip("the fused kernels are not built on this machine")
    torch.manual_seed(0)
    batch, heads = 4, 3
    d = heads * head_size
    q, k, v = torch.randn(batch, 1, d), torch.randn(batch, keys_seen, d), torch.randn(batch, keys_seen, d)
    key_mask = (
        length_mask(torch.tensor([keys_seen, keys_seen // 2, 0, 1]).clamp(max=keys_seen), keys_seen) if masked else None
    )
    cache = torch.zeros(2, batch, heads, head_size, transformer_ops.cache_length(keys_seen + 3))
    cache[..., :keys_seen] = torch.stack([k, v]).view(2, batch, keys_seen, heads, head_size).permute(0, 1, 3, 4, 2)
    mask = q.new_empty(0) if key_mask is None else ops.padding(key_mask)
    with torch.no_grad():
        out, weights = transformer_ops.attention_step(q[:, 0], cache[0], cache[1], mask, keys_seen)
    want = scaled_dot_product(q, k, v, heads, key_mask, causal=False)[:, 0]
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-4)
    assert weights.shape == (batch, heads, keys_seen)
    if keys_seen:
        torch.testing.assert_close(
            torch.einsum("bhs,bshc->bhc", weights, v.view(batch, keys_seen, heads, head_size)).flatten(1),
            out,
            atol=1e-5,
            rtol=1e-4,
        )
        seen = torch.ones(batch, keys_seen, dtype=torch.bool) if key_mask is None else key_mask
        assert torch.allclose(weights.sum(-1), seen.any(-1, keepdim=True).float().expand(-1, heads))
        assert weights.masked_fill(seen[:, None, :], 0.0).abs().max() == 0
    with pytest.raises(RuntimeError, match="no backward"):
        transformer_ops.attention_step(q[:, 0].requires_grad_(), cache[0], cache[1], mask, keys_seen)


def test_the_decoder_is_causal(model_and_config):
    model, cfg = model_and_config
    batch = mixed_batch(cfg)
    with torch.no_grad():
        logits, _ = model(batch.src, batch.src_lengths, batch.tgt_in)
        for t in range(1, batch.tgt_in.size(1)):
            changed = batch.tgt_in.clone()
            changed[:, t:] = torch.randint(3, 12, changed[:, t:].shape, generator=torch.Generator().manual_seed(t))
            changed_logits, _ = model(batch.src, batch.src_lengths, changed)
            torch.testing.assert_close(changed_logits[:, :t], logits[:, :t], atol=1e-5, rtol=1e-4)
            assert not torch.allclose(changed_logits[:, t:], logits[:, t:])  # what comes after does see it


def torch_transformer_logits(model, batch):
    """nn.Transformer's own forward on the model's embeddings and parameters, with the model's masks:
    padded source keys masked, the decoder's self-attention causal (and nothing else masked)."""
    steps = batch.tgt_in.size(1)
    causal = torch.ones(steps, steps, dtype=torch.bool).triu(1)  # True: masked
    decoded = model.transformer(
        model._embed(model.src_embedding, batch.src),
        model._embed(model.tgt_embedding, batch.tgt_in),
        tgt_mask=causal,
        src_key_padding_mask=~batch.src_mask,
        memory_key_padding_mask=~batch.src_mask,
        tgt_is_causal=True,
    )
    return model.out(decoded)


def loss_and_gradients(model, logits, batch):
    """A loss on every real target position -> the gradient of every parameter, by name."""
    model.zero_grad(set_to_none=True)
    weights = torch.randn(logits.shape, generator=torch.Generator().manual_seed(11))
    (logits * weights)[batch.target_mask].sum().backward()
    return {name: parameter.grad.clone() for name, parameter in model.named_parameters()}


@pytest.mark.parametrize("fused", [True, False], ids=["kernel", "torch_ops"])
@pytest.mark.parametrize("mixed", [False, True], ids=["fixed", "mixed"])
def test_every_path_computes_what_torchs_own_transformer_computes(make_config, fused, mixed):
    """The training step's path (autograd on: the attention kernel on CPU where it builds, else
    torch's batched products, no weights) and the weighted one (no_grad: each cross-attention
    through Attention), forward and gradients, against nn.Transformer's forward on the same
    parameters, at every target position."""
    if fused and ops.kernel() is None:
        pytest.skip("the fused kernels are not built on this machine")
    cfg = make_config("task.length=9", *SMALL, f"train.fused={str(fused).lower()}")
    torch.manual_seed(0)
    model = trained_a_little(build_model(cfg), cfg).train()
    batch = (
        mixed_batch(cfg) if mixed else make_batch("copy", 6, 9, cfg.task.vocab_size, torch.Generator().manual_seed(4))
    )
    assert ops.runs_fused(model) == fused
    want = torch_transformer_logits(model, batch)
    want_grads = loss_and_gradients(model, want, batch)
    logits, weights = model(batch.src, batch.src_lengths, batch.tgt_in)
    assert weights is None  # a training step computes no weights
    torch.testing.assert_close(logits, want, atol=1e-5, rtol=1e-4)
    for name, grad in loss_and_gradients(model, logits, batch).items():
        torch.testing.assert_close(grad, want_grads[name], atol=1e-5, rtol=1e-4, msg=name)
    with torch.no_grad():
        weighted_logits, weights = model(batch.src, batch.src_lengths, batch.tgt_in)
    torch.testing.assert_close(weighted_logits, want.detach(), atol=1e-5, rtol=1e-4)
    assert weights.shape == (len(batch), batch.tgt_in.size(1), batch.src.size(1))
    # the masks change nothing that is trained on: torch's with the target's padding masked too, at real positions
    valid = batch.target_mask
    padded = model.transformer(
        model._embed(model.src_embedding, batch.src),
        model._embed(model.tgt_embedding, batch.tgt_in),
        tgt_mask=torch.ones(batch.tgt_in.size(1), batch.tgt_in.size(1), dtype=torch.bool).triu(1),
        src_key_padding_mask=~batch.src_mask,
        memory_key_padding_mask=~batch.src_mask,
        tgt_key_padding_mask=batch.tgt_in == PAD,
    )
    torch.testing.assert_close(logits[valid], model.out(padded)[valid], atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("mixed", [False, True], ids=["fixed", "mixed"])
def test_the_layers_in_one_kernel_call_compute_their_ops_in_python_to_the_bit(make_config, monkeypatch, mixed):
    """transformer_ops.transformer_layer (a layer's ops and autograd's formulas for them in C++) against
    the same layers op by op in Python: logits and every gradient equal, in a training step and
    without autograd; under autocast the layers run torch's ops."""
    if ops.kernel() is None:
        pytest.skip("the fused kernels are not built on this machine")
    cfg = make_config("task.length=9", *SMALL)
    torch.manual_seed(0)
    model = trained_a_little(build_model(cfg), cfg).train()
    batch = (
        mixed_batch(cfg) if mixed else make_batch("copy", 6, 9, cfg.task.vocab_size, torch.Generator().manual_seed(4))
    )
    calls = []
    layer = transformer_ops.transformer_layer
    monkeypatch.setattr(transformer_ops, "transformer_layer", lambda *args: calls.append(args) or layer(*args))
    results = []
    for in_one_call in (True, False):
        if not in_one_call:
            model._layer_fused = lambda x: False  # the layers op by op
        logits, _ = model(batch.src, batch.src_lengths, batch.tgt_in)
        with torch.no_grad():
            memory, _ = model.encode(batch.src, batch.src_lengths)
        results.append((logits.detach(), memory, loss_and_gradients(model, logits, batch)))
        if in_one_call:
            assert len(calls) == 6  # training: 2 encoder and 2 decoder layers; the no_grad encode: 2 more
    (logits, memory, grads), (want, want_memory, want_grads) = results
    assert torch.equal(logits, want) and torch.equal(memory, want_memory)
    assert grads.keys() == want_grads.keys() and all(torch.equal(grads[name], want_grads[name]) for name in grads)
    del model._layer_fused
    calls.clear()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits, _ = model(batch.src, batch.src_lengths, batch.tgt_in)
    assert not calls and logits.dtype == torch.bfloat16


def test_a_double_backward_through_the_fused_layers_raises(make_config):
    """The layers in one kernel call have no second derivative: a gradient penalty raises an error
    that says so, never a silently missing term (fused=False has it)."""
    if ops.kernel() is None:
        pytest.skip("the fused kernels are not built on this machine")
    cfg = make_config("task.length=5", *SMALL)
    torch.manual_seed(0)
    model = build_model(cfg)
    batch = make_batch("copy", 4, 5, cfg.task.vocab_size, torch.Generator().manual_seed(4))
    logits, _ = model(batch.src, batch.src_lengths, batch.tgt_in)
    grads = torch.autograd.grad(logits.square().mean(), list(model.parameters()), create_graph=True)
    with pytest.raises(RuntimeError, match="differentiate twice"):
        sum(grad.square().sum() for grad in grads).backward()


@pytest.mark.parametrize("heads, d", [(4, 32), (2, 32), (2, 8), (3, 18), (1, 5)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("cross", [False, True])
def test_the_attention_kernel_computes_torchs_batched_products(heads, d, causal, cross):
    """transformer_ops.attention against transformer.scaled_dot_product: outputs and the gradients of the
    packed projections the model passes it (q | k | v of a self-attention; q, and k | v of a
    cross-attention over a source of another length), ragged key masks with an empty row, and key
    counts that are not a whole tile of 8; heads of 8 and 16 features (8 x 8 blocks transposed in
    registers) and of other sizes (element by element)."""
    if ops.kernel() is None:
        pytest.skip("the fused kernels are not built on this machine")
    torch.manual_seed(0)
    batch, steps, source = 4, 11, (13 if cross else 11)
    x = torch.randn(batch, steps, d if cross else 3 * d, requires_grad=True)
    kv = torch.randn(batch, source, 2 * d, requires_grad=True) if cross else None
    q, k, v = (x, *kv.chunk(2, -1)) if cross else x.chunk(3, -1)
    key_mask = None if causal else length_mask(torch.tensor([source, 3, 0, 9]), source)
    grad = torch.randn(batch, steps, d)
    results = []
    for attend in (
        lambda: transformer_ops.attention(x, kv, heads, key_mask, causal),
        lambda: scaled_dot_product(q, k, v, heads, key_mask, causal),
    ):
        out = attend()
        (out * grad).sum().backward()
        leaves = [t for t in (x, kv) if t is not None]
        results.append((out.detach(), *(t.grad.clone() for t in leaves)))
        for t in leaves:
            t.grad = None
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
    out, *grads = results[0]
    if key_mask is not None:  # the empty source: zero output and no gradient, not NaN
        assert out[2].abs().max() == 0 and all(grad[2].abs().max() == 0 for grad in grads)


@pytest.mark.parametrize(
    "overrides", [SMALL, [*SMALL, "model.positions=learned", "model.max_length=30"], ["model=transformer"]]
)
def test_parameter_counts(make_config, overrides):  # the GRU models': tests/test_limits.py
    cfg = make_config(*overrides)
    assert count_parameters(build_model(cfg)) == parameter_count(cfg)


def test_the_default_transformer_is_near_luong_generals_size(make_config):
    options = ("model=transformer", "attention=luong_general")
    transformer, luong = (count_parameters(build_model(make_config(option))) for option in options)
    assert abs(transformer - luong) / luong < 0.05


def test_a_learned_table_covers_max_length_and_no_more(make_config):
    cfg = make_config(*SMALL, "model.positions=learned", "model.max_length=9", "task.length=6")
    model = build_model(cfg).eval()
    assert model.longest_source == 9
    rows = analysis.length_generalisation(model, cfg, [6, 9, 12], eval_size=4)
    assert [row["token_acc"] is None for row in rows] == [False, False, True]
    assert "not defined" in rows[2]["note"]
    batch = make_batch("copy", 2, 12, cfg.task.vocab_size, torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="learned positions cover sources up to 9"):
        model.greedy(batch.src, batch.src_lengths, steps=13)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["model=transformer", "attention=bahdanau"],
            "attention=bahdanau (and every attention.* key) is model=gru's decoder",
        ),
        (["model=transformer", "attention.size=3"], "the attention group must stay at its default"),
        (["model=transformer", "model.heads=3"], "must be divisible by model.heads"),
        (["model=transformer", "model.positions=rotary"], "model.positions must be one of sinusoidal, learned"),
        (["model=transformer", "model.positions=learned", "model.max_length=10"], "must be at least task.length"),
        (["model=transformer", "model.dropout=1.0"], "model.dropout must be a number in [0, 1)"),
        (["model=transformer", "model.layers=0"], "model.layers must be an integer >= 1"),
        (["model=transformer", "model.d_model=null"], "model.d_model must not be null with model=transformer"),
        (["model.hidden_size=null"], "model.hidden_size must not be null with model=gru"),
        (["model=transformer", "model.name=gru"], "model.name must be transformer with model._target_="),
        (["model.name=transformer"], "model.name must be gru with model._target_=copytask.models.recurrent.Seq2Seq"),
        (["analysis.lengths=[0,5]"], "analysis.lengths must be null or a list of integers >= 1"),
    ],
)
def test_refusals_are_one_line(make_config, overrides, message):
    with pytest.raises(ConfigError) as refused:
        validate(make_config(*overrides))
    assert message in str(refused.value) and "\n" not in str(refused.value)


@pytest.mark.slow
def test_run_names_keep_the_gru_runs_and_name_the_new_ones(make_config):
    # the names these runs have had since the validation set (commit d3a649a; before it, since commit 289b03a,
    # d488c388 and efc64378): the model group and architecture presets rename no GRU run
    assert (
        store.run_name(make_config("model=gru"))
        == store.run_name(make_config())
        == "luong_general-copy20-seed0-49c90a6e"
    )
    bahdanau = store.run_name(make_config("attention=bahdanau"))
    assert store.run_name(make_config("architecture=bahdanau")) == bahdanau == "bahdanau-copy20-seed0-5fa3dde3"
    assert store.run_name(make_config("model=transformer")).startswith("transformer-copy20-seed0-")
    assert store.run_name(make_config("architecture=transformer_learned")).startswith(
        "transformer_learned-copy20-seed0-"
    )
    assert store.run_name(make_config("attention=rnnencdec")).startswith("rnnencdec-copy20-seed0-")
    # the other model's keys are not read, so not part of the run
    assert store.run_name(make_config("model=transformer", "model.hidden_size=8")) == store.run_name(
        make_config("model=transformer")
    )
    assert store.run_name(make_config("model.d_model=8")) == store.run_name(make_config())
    assert store.run_name(make_config("model=transformer", "model.d_model=16")) != store.run_name(
        make_config("model=transformer")
    )


def test_maps_heads_and_counterfactuals_go_through_the_cross_attention(make_config):
    cfg = make_config("task.length=6", *SMALL)
    torch.manual_seed(0)
    model = trained_a_little(build_model(cfg), cfg)
    batch = make_batch("copy", 8, 6, cfg.task.vocab_size, torch.Generator().manual_seed(5))
    tokens, weights = model.greedy(batch.src, batch.src_lengths, steps=7)
    heads = analysis.head_weights(model, batch)  # (B, heads, T_dec, T_enc): the last layer's
    assert heads.shape == (8, 2, 7, 6)
    torch.testing.assert_close(heads.mean(1), weights, atol=1e-5, rtol=1e-4)
    assert len(model.attentions) == 2  # every layer's cross-attention is replaced by a counterfactual
    seen = []

    def uniform(w, mask):
        seen.append(w.shape)
        return analysis.uniform_weights(w, mask)

    with analysis.intervention(model.attentions[0], uniform), analysis.intervention(model.attentions[1], uniform):
        _, replaced = model.greedy(batch.src, batch.src_lengths, steps=7)
    assert len(seen) == 2 * 7  # both layers, every step
    torch.testing.assert_close(replaced, torch.full_like(replaced, 1 / 6))


@pytest.mark.slow
def test_a_tiny_transformer_run_through_the_cli_and_decode_on_it(tmp_path):
    runs_dir = tmp_path / "runs"
    trained = run_cli("train", *TINY_TRANSFORMER, f"runs_dir={runs_dir}")
    assert trained.returncode == 0, trained.stderr
    [folder] = store.complete_runs(runs_dir)
    assert folder.name.startswith("transformer-copy5-seed0-")
    metrics = store.read_json(folder / store.METRICS)
    assert metrics["attention"] == "transformer" and metrics["params"] == parameter_count_of(folder)
    samples = store.read_json(folder / store.ATTENTION)["samples"]
    assert len(samples[0]["weights"]) == 6 and len(samples[0]["weights"][0]) == 5  # (T_dec, T_enc) of the mean map
    decoded = run_cli("decode", str(folder), "a b c d e")
    assert decoded.returncode == 0, decoded.stderr
    assert "transformer, task copy" in decoded.stdout and "head 1" in decoded.stdout
    analysed = run_cli("analyze", f"runs_dir={runs_dir}", "analysis.lengths=[3,5,8]", "train.progress=false")
    assert analysed.returncode == 0, analysed.stderr
    result = store.read_json(folder / store.ANALYSIS)
    assert [row["test_length"] for row in result["length_generalisation"]] == [3, 5, 8]
    assert set(result["counterfactual"]) == {"own", "uniform", "permuted", "fixed"}
    assert len(result["head_weights"]["weights"]) == 2  # per head


def parameter_count_of(folder) -> int:
    from omegaconf import OmegaConf

    return parameter_count(OmegaConf.load(folder / store.CONFIG))


@pytest.mark.slow
def test_a_sweep_mixing_gru_and_transformer_models_is_analysed_at_the_lengths_asked(tmp_path):
    runs_dir = tmp_path / "runs"
    grid = [
        "architecture=transformer,rnnencdec,luong_general",
        "~hydra.sweeper.params.attention",
        "task.length=3",
        "seed=0",
        "analysis.lengths=[3,5]",
    ]
    small = ["model.d_model=8", "model.heads=2", "model.layers=1", "model.ff_size=16"]
    swept = run_cli("sweep", *TINY, *small, *grid, f"runs_dir={runs_dir}")
    assert swept.returncode == 0, swept.stderr
    names = sorted(folder.name.split("-")[0] for folder in store.complete_runs(runs_dir))
    assert names == ["luong_general", "rnnencdec", "transformer"]
    for folder in store.complete_runs(runs_dir):
        tested = [row["test_length"] for row in store.read_json(folder / store.ANALYSIS)["length_generalisation"]]
        assert tested == [3, 5]
    compared = run_cli("compare", *TINY, *small, *grid, f"runs_dir={runs_dir}")
    assert compared.returncode == 0, compared.stderr
    assert "transformer" in compared.stdout and "rnnencdec" in compared.stdout
    assert (runs_dir / "report" / "extrapolation.png").is_file()
    assert "Transformer: torch's nn.Transformer, 1 layers each side" in (runs_dir / "report" / "report.md").read_text()


def test_scaled_embeddings_start_on_the_scale_of_the_positions(make_config):
    """Vaswani et al.'s N(0, 1/d) times sqrt(d): torch's N(0, 1) times sqrt(d) started 5.7 times larger
    than the sinusoids and drowned the positions (13% token accuracy at length 80 on the default budget)."""
    cfg = make_config("model=transformer")
    torch.manual_seed(0)
    model = build_model(cfg)
    tokens = torch.arange(3, 12)[None]  # every content symbol
    scaled = model.src_embedding(tokens) * model.d_model**0.5
    positions = model.positions(torch.arange(80))
    ratio = scaled.pow(2).mean().sqrt() / positions.pow(2).mean().sqrt()
    assert 0.5 < ratio < 2
    assert model.src_embedding.weight[0].abs().max() == 0 == model.tgt_embedding.weight[0].abs().max()  # PAD stays zero


@pytest.mark.parametrize("mixed", [False, True], ids=["fixed", "mixed"])
@pytest.mark.parametrize("positions", ["sinusoidal", "learned"])
def test_greedy_is_the_teacher_forced_argmax_also_for_a_model_that_emits_pad(make_config, mixed, positions):
    """Any model, not only a trained one (which never emits PAD): the readout's PAD bias raised until
    about a third of the teacher-forced argmaxes are PAD, so that greedy decoding feeds PADs back in
    mid-sequence. Masking the decoder's keys by token value (tgt_in == PAD) made the two differ."""
    cfg = make_config("task.length=8", *SMALL, f"model.positions={positions}")
    torch.manual_seed(0)
    model = build_model(cfg).eval()
    batch = (
        mixed_batch(cfg) if mixed else make_batch("copy", 6, 8, cfg.task.vocab_size, torch.Generator().manual_seed(3))
    )
    with torch.no_grad():
        logits, _ = model(batch.src, batch.src_lengths, batch.tgt_in)
        others = logits.clone()
        others[..., PAD] = float("-inf")
        model.out.bias[PAD] += (others.max(-1).values - logits[..., PAD]).quantile(0.3)
        tokens, weights = model.greedy(batch.src, batch.src_lengths, steps=batch.tgt_out.size(1))
        fed = torch.cat([torch.full_like(tokens[:, :1], BOS), tokens[:, :-1]], dim=1)
        forced, forced_weights = model(batch.src, batch.src_lengths, fed)
    assert (fed[:, 1:-1] == PAD).sum() >= 3 and (tokens != PAD).any()  # PADs fed back with steps after them
    assert torch.equal(forced.argmax(-1), tokens)
    torch.testing.assert_close(weights, forced_weights, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("d", [32, 7])
def test_sinusoidal_positions_are_the_papers_formula(d):
    """PE[pos, 2i] = sin(pos / 10000^(2i / d)), PE[pos, 2i + 1] = cos(pos / 10000^(2i / d)) (Vaswani et
    al., 2017, section 3.5), written out in float64: sin and cos swapped, or another base, fails."""
    table = SinusoidalPositions(d)(torch.arange(100))
    assert table.shape == (100, d)
    for position in (0, 1, 2, 7, 40, 99):
        for column in range(d):
            angle = position / 10000 ** (2 * (column // 2) / d)
            want = math.sin(angle) if column % 2 == 0 else math.cos(angle)
            assert table[position, column].item() == pytest.approx(want, abs=2e-5), (position, column)


@pytest.mark.parametrize("mixed", [False, True], ids=["fixed", "mixed"])
@pytest.mark.parametrize("positions", ["sinusoidal", "learned"])
def test_the_tutorials_transformer_computes_the_same_numbers(make_config, mixed, positions):
    """reference.ReferenceTransformer (separate q/k/v projections, masked softmax, no cache) loaded
    with a trained project model's state_dict: the same logits, weights and gradients (a training
    step, the project on its kernel where it builds) and the same greedy output."""
    cfg = make_config("task.length=7", *SMALL, f"model.positions={positions}")
    torch.manual_seed(0)
    project = trained_a_little(build_model(cfg), cfg).train()
    reference = build_model(cfg, ReferenceTransformer)
    reference.load_state_dict(project.state_dict())  # strict: every name translated, none left over
    batch = (
        mixed_batch(cfg) if mixed else make_batch("copy", 6, 7, cfg.task.vocab_size, torch.Generator().manual_seed(4))
    )
    logits = project(batch.src, batch.src_lengths, batch.tgt_in)[0]
    want = reference(batch.src, batch.src_lengths, batch.tgt_in)[0]
    torch.testing.assert_close(logits, want, atol=1e-5, rtol=1e-4)
    grads = reference_transformer_state(loss_and_gradients(project, logits, batch))
    for name, grad in loss_and_gradients(reference, want, batch).items():
        torch.testing.assert_close(grads[name], grad, atol=1e-5, rtol=1e-4, msg=name)
    project.eval()
    with torch.no_grad():
        _, weights = project(batch.src, batch.src_lengths, batch.tgt_in)
        _, want_weights = reference(batch.src, batch.src_lengths, batch.tgt_in)
        tokens, greedy_weights = project.greedy(batch.src, batch.src_lengths, steps=batch.tgt_out.size(1))
        want_tokens, want_greedy_weights = reference.greedy(batch.src, batch.src_lengths, steps=batch.tgt_out.size(1))
    torch.testing.assert_close(weights, want_weights, atol=1e-5, rtol=1e-4)
    assert torch.equal(tokens, want_tokens) and len(set(tokens.flatten().tolist())) > 2
    torch.testing.assert_close(greedy_weights, want_greedy_weights, atol=1e-5, rtol=1e-4)
