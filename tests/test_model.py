import os
import re
import subprocess
import sys

import pytest
import torch

from copytask import store
from copytask.config.checks import validate
from copytask.console import ConfigError
from copytask.data.batches import make_batch
from copytask.data.vocab import total_vocab
from copytask.models.recurrent import Seq2Seq, count_parameters

from .conftest import ATTENTION_OPTIONS, NO_ATTENTION, pythonpath


def tiny_arguments(option) -> dict:
    """Seq2Seq's arguments for an attention option (configs/attention/), at a tiny size."""
    return dict(
        decoder=option.decoder,
        score=option.score,
        attention_size=option.size and 12,
        heads=option.get("heads", 1),
        local=option.get("local"),
        window=option.get("window") and 2,
    )


ATTENTION = {name: tiny_arguments(option) for name, option in ATTENTION_OPTIONS.items()}
WEIGHTS_SUM_TO_ONE = [  # local-p multiplies the weights by the paper's Gaussian
    name for name, arguments in ATTENTION.items() if name not in NO_ATTENTION and arguments["local"] != "predictive"
]


def make_model(name: str, bidirectional: bool = True) -> Seq2Seq:
    torch.manual_seed(0)
    return Seq2Seq(
        total_vocab(6), embedding_size=8, hidden_size=16, bidirectional=bidirectional, **ATTENTION[name]
    ).eval()


@pytest.mark.parametrize("name", ATTENTION)
def test_forward_shapes(name):
    model = make_model(name)
    batch = make_batch("copy", 3, 7, 6, torch.Generator().manual_seed(0))
    logits, weights = model(batch.src, batch.src_lengths, batch.tgt_in)
    assert logits.shape == (3, 8, total_vocab(6))
    if name in NO_ATTENTION:
        assert weights is None
    else:
        assert weights.shape == (3, 8, 7)
        if name in WEIGHTS_SUM_TO_ONE:
            torch.testing.assert_close(weights.sum(-1), torch.ones(3, 8))
        else:
            assert (weights.sum(-1) <= 1 + 1e-6).all() and (weights.sum(-1) > 0).all()


@pytest.mark.parametrize("name", ATTENTION)
@pytest.mark.parametrize("bidirectional", [True, False])
def test_mixed_lengths_match_each_sequence_alone(name, bidirectional):
    model = make_model(name, bidirectional)
    batch = make_batch("copy", 6, 9, 6, torch.Generator().manual_seed(1), min_length=2)
    assert len(set(batch.src_lengths.tolist())) > 1
    logits, weights = model(batch.src, batch.src_lengths, batch.tgt_in)
    tokens, greedy_weights = model.greedy(batch.src, batch.src_lengths, steps=10)
    for i in range(len(batch)):
        alone = batch.select([i])
        length = int(alone.src_lengths[0])
        alone_logits, alone_weights = model(alone.src, alone.src_lengths, alone.tgt_in)
        torch.testing.assert_close(logits[i, : length + 1], alone_logits[0], atol=1e-5, rtol=1e-5)
        alone_tokens, alone_greedy = model.greedy(alone.src, alone.src_lengths, steps=10)
        assert torch.equal(tokens[i], alone_tokens[0])
        if weights is not None:
            assert (weights[i, :, length:] == 0).all() and (greedy_weights[i, :, length:] == 0).all()
            torch.testing.assert_close(weights[i, : length + 1, :length], alone_weights[0], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(greedy_weights[i, :, :length], alone_greedy[0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", ATTENTION)
def test_greedy_agrees_with_teacher_forcing_on_its_own_outputs(name):
    """Feeding greedy's outputs back as the teacher-forced input gives the same predictions,
    so the batched training path and the step-by-step decoding path compute one model."""
    model = make_model(name)
    batch = make_batch("copy", 4, 6, 6, torch.Generator().manual_seed(2))
    tokens, greedy_weights = model.greedy(batch.src, batch.src_lengths, steps=7)
    tgt_in = torch.cat([batch.tgt_in[:, :1], tokens[:, :-1]], dim=1)
    logits, weights = model(batch.src, batch.src_lengths, tgt_in)
    assert torch.equal(logits.argmax(-1), tokens)
    if weights is not None:
        torch.testing.assert_close(weights, greedy_weights)


def capture_queries(model: Seq2Seq, method: str = "forward") -> list:
    """Records the query of every call of the attention's `method` (Bahdanau's decoder calls
    `step`, once per decoder step; Luong's calls the module itself)."""
    queries, call = [], getattr(model.attention, method)

    def recording(query, *args):
        queries.append(query.detach())
        return call(query, *args)

    setattr(model.attention, method, recording)  # an instance attribute shadows the method
    return queries


def test_bahdanau_queries_the_state_before_the_step():
    model = make_model("bahdanau")
    model.decoder.fused = False  # the step loop; tests/test_kernels.py checks the CPU kernel against it
    batch = make_batch("copy", 2, 5, 6, torch.Generator().manual_seed(3))
    queries = capture_queries(model, "step")
    model(batch.src, batch.src_lengths, batch.tgt_in)
    assert len(queries) == batch.tgt_in.size(1)
    _, final = model.encoder(batch.src, batch.src_lengths)
    decoder = model.decoder
    # s_0 is the encoder's final state; s_1 follows from it, the first input and the first context.
    torch.testing.assert_close(queries[0], final)
    context, _ = decoder.attention.step(
        final, *decoder.memory(model.encoder(batch.src, batch.src_lengths)[0], batch.src_mask), batch.src_mask
    )
    s1 = decoder.cell(torch.cat([decoder.embedding(batch.tgt_in[:, 0]), context], -1), final)
    torch.testing.assert_close(queries[1], s1)


class WeightUses(torch.overrides.TorchFunctionMode):
    """Counts the torch functions called with `weight` among their arguments (its products)."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.weight, self.uses = weight, 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.uses += any(arg is self.weight for arg in (*args, *kwargs.values()))
        return func(*args, **kwargs)


@pytest.mark.parametrize("fused", [True, False], ids=["kernel", "torch_ops"])
def test_bahdanau_computes_u_a_h_once_per_sequence(fused):
    """U_a h_i does not depend on the decoder step: one product with U_a per forward pass, under
    teacher forcing and in greedy decoding, not one per step (DESIGN.md)."""
    torch.manual_seed(0)
    model = Seq2Seq(total_vocab(9), "bahdanau", "additive", attention_size=16, fused=fused)
    batch = make_batch("copy", 4, 7, 9, torch.Generator().manual_seed(0), min_length=3)
    for forward in (
        lambda: model(batch.src, batch.src_lengths, batch.tgt_in),
        lambda: model.greedy(batch.src, batch.src_lengths, batch.tgt_in.size(1)),
    ):
        with WeightUses(model.attention.key_proj.weight) as counted:
            forward()
        assert counted.uses == 1


def test_luong_queries_the_state_after_the_step():
    model = make_model("luong_general")
    batch = make_batch("copy", 2, 5, 6, torch.Generator().manual_seed(3))
    queries = capture_queries(model)
    model(batch.src, batch.src_lengths, batch.tgt_in)
    _, final = model.encoder(batch.src, batch.src_lengths)
    states, _ = model.decoder.rnn(model.decoder.embedding(batch.tgt_in), final[None])  # s_1 .. s_T
    torch.testing.assert_close(queries[0], states)
    assert not torch.allclose(queries[0][:, 0], final)  # the pre-step state would be the encoder's


def test_attention_adds_parameters_and_none_has_no_attention():
    sizes = {name: count_parameters(make_model(name)) for name in ATTENTION}
    assert make_model("none").attention is None
    assert sizes["luong_dot"] < sizes["luong_general"] and sizes["none"] < sizes["luong_dot"]


def test_rnnencdec_is_cho_et_als_decoder():
    """Cho et al. (2014), appendix A.1, written out by hand one step at a time: the summary
    c = tanh(V h_N), s_0 = tanh(V' c), C c in both gates and inside the reset-gated term of the
    candidate, and the readout W_o [s_t; e(y_{t-1}); c] (without the paper's maxout)."""
    model = make_model("rnnencdec")
    decoder = model.decoder
    batch = make_batch("copy", 3, 5, 6, torch.Generator().manual_seed(4), min_length=2)
    with torch.no_grad():
        _, final = model.encoder(batch.src, batch.src_lengths)  # h_N (B, H)
        logits, weights = model(batch.src, batch.src_lengths, batch.tgt_in)
        w_r, w_z, w = decoder.input_gates.weight.chunk(3)
        b_wr, b_wz, b_w = decoder.input_gates.bias.chunk(3)
        u_r, u_z, u = decoder.state_gates.weight.chunk(3)
        b_ur, b_uz, b_u = decoder.state_gates.bias.chunk(3)
        c_r, c_z, c = decoder.summary_gates.weight.chunk(3)
        summary = torch.tanh(final @ decoder.summary.weight.T + decoder.summary.bias)
        state = torch.tanh(summary @ decoder.init.weight.T + decoder.init.bias)
        for t in range(batch.tgt_in.size(1)):
            embedded = decoder.embedding.weight[batch.tgt_in[:, t]]
            r = torch.sigmoid(embedded @ w_r.T + b_wr + state @ u_r.T + b_ur + summary @ c_r.T)
            z = torch.sigmoid(embedded @ w_z.T + b_wz + state @ u_z.T + b_uz + summary @ c_z.T)
            candidate = torch.tanh(embedded @ w.T + b_w + r * (state @ u.T + b_u + summary @ c.T))
            state = z * state + (1 - z) * candidate
            by_hand = torch.cat([state, embedded, summary], dim=-1) @ decoder.out.weight.T + decoder.out.bias
            torch.testing.assert_close(logits[:, t], by_hand, atol=1e-5, rtol=1e-4)
    assert weights is None and model.attention is None  # no attention: the summary is the bottleneck


def test_rnnencdec_runs_are_named_apart_from_those_of_its_earlier_equations(make_config):
    """attention.variant=cho2014 is part of an rnnencdec run's identity: the runs made before the
    decoder computed Cho et al.'s equations (commit 0cb4bce) are never read as new ones, and no other
    run is renamed."""
    cfg = make_config("attention=rnnencdec")
    validate(cfg)
    assert store.identity(cfg)["attention"]["variant"] == "cho2014"
    assert store.run_name(cfg) != "rnnencdec-copy20-seed0-19c01655"  # its name at commit 0cb4bce
    assert (
        store.run_name(make_config("attention=none")) == "none-copy20-seed0-255ad0c3"
    )  # unchanged since the validation set
    assert "variant" not in store.identity(make_config("attention=none"))["attention"]


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["attention=rnnencdec", "attention.variant=null"],
            "attention.variant must be cho2014 with attention.decoder=rnnencdec, got null",
        ),
        (
            ["attention=bahdanau", "attention.variant=cho2014"],
            "attention.variant must be null with attention.decoder=bahdanau, got 'cho2014'",
        ),
    ],
)
def test_a_variant_no_decoder_computes_is_refused(make_config, overrides, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        validate(make_config(*overrides))


@pytest.mark.parametrize("model", ["model=gru", "model=transformer", "model=mamba", "model=mamba_lti"])
def test_checking_a_model_draws_no_random_number_and_loads_no_compiler(model):
    """check_buildable builds the model once before a run: the run's random numbers stay untouched, and torch's
    compiler stack (which the meta device's initialisers import, about two seconds) stays unloaded."""
    code = (
        "import sys, torch; from copytask import compose; from copytask.models.build import check_buildable; "
        f"cfg = compose([{model!r}]); torch.manual_seed(0); state = torch.random.get_rng_state(); "
        "check_buildable(cfg); "
        "print(torch.equal(state, torch.random.get_rng_state()), 'torch._dynamo' in sys.modules)"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=os.environ | {"PYTHONPATH": pythonpath()}
    )
    assert done.stdout.split() == ["True", "False"], done.stderr
