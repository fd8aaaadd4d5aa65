"""Beam search (issue 69): width 1 is greedy decoding to the bit, for every model; a beam wide enough
to keep every hypothesis finds the most probable output of a model small enough to list them all."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch

from copytask.config.schema import config_dir
from copytask.data.batches import make_batch
from copytask.data.scoring import output_mask
from copytask.data.vocab import BOS, PAD
from copytask.models.beam import beam_search
from copytask.models.build import build_model

from .conftest import TINY

ATTENTIONS = sorted(path.stem for path in (Path(config_dir()) / "attention").glob("*.yaml"))
# every GRU decoder with every attention type, the Transformer with either kind of positions, and Mamba
MODELS = [[f"attention={name}"] for name in ATTENTIONS] + [
    ["architecture=transformer"],
    ["architecture=transformer_learned"],
    ["architecture=transformer", "train.fused=false"],  # nn.MultiheadAttention's ops rather than the C++ step
    ["architecture=mamba", "model.d_model=8", "model.d_state=4"],
]


def model_for(make_config, overrides: list[str], seed: int = 0, vocab_size: int = 9, length: int = 6):
    cfg = make_config(*TINY, *overrides, f"task.vocab_size={vocab_size}", f"task.length={length}")
    torch.manual_seed(seed)
    return build_model(cfg).eval(), cfg


@pytest.mark.parametrize("overrides", MODELS, ids=lambda o: " ".join(o))
def test_width_1_is_greedy_to_the_bit_for_every_model(make_config, overrides):
    model, cfg = model_for(make_config, overrides)
    batch = make_batch("copy", 24, 6, 9, torch.Generator().manual_seed(1), min_length=2)  # padding and masks too
    steps = batch.tgt_out.size(1)
    greedy, greedy_weights = model.greedy(batch.src, batch.src_lengths, steps)
    for normalise in (False, True):
        beams = beam_search(model, batch.src, batch.src_lengths, steps, width=1, length_normalise=normalise)
        ended = output_mask(greedy)  # greedy's output: up to and with its first EOS
        assert torch.equal(beams.tokens, torch.where(ended, greedy, PAD))
        if greedy_weights is None:
            assert beams.weights is None
        else:  # the attention of every step of the output, to the bit
            assert torch.equal(beams.weights[ended], greedy_weights[ended])


def log_probs(model, src, src_lengths, outputs: torch.Tensor) -> torch.Tensor:
    """log p(output | src) of each of `outputs` (N, steps) under teacher forcing, up to and with its first
    EOS (each fed whole: what follows an EOS changes no step before it) -> (N,)."""
    tgt_in = torch.cat([torch.full((len(outputs), 1), BOS), outputs[:, :-1]], 1)
    rows = torch.zeros(len(outputs), dtype=torch.long)
    with torch.no_grad():
        logits, _ = model(src[rows], src_lengths[rows], tgt_in)
    token_log_probs = torch.log_softmax(logits.double(), -1).gather(-1, outputs[..., None])[..., 0]
    return (token_log_probs * output_mask(outputs)).sum(1)


@pytest.mark.parametrize(
    "overrides",
    [
        ["attention=none"],
        ["attention=bahdanau"],
        ["architecture=transformer"],
        ["architecture=mamba", "model.d_model=8"],
    ],
)
@pytest.mark.parametrize("normalise", [False, True])
def test_a_wide_beam_finds_the_most_probable_output_of_a_tiny_model(make_config, overrides, normalise):
    """Two content symbols and length 2: 5 tokens, 3 steps, 125 outputs, 25 prefixes of 2 steps, so a
    beam of 25 keeps every hypothesis; every source at once. Sharpened outputs make the best one stand
    out from the rest."""
    model, cfg = model_for(make_config, overrides, seed=3, vocab_size=2, length=2)
    with torch.no_grad():
        model.decoder.out.weight.mul_(6) if hasattr(model, "decoder") else model.out.weight.mul_(6)
    outputs = torch.tensor(list(itertools.product(range(5), repeat=3)))  # (125, 3) every output of 3 steps
    lengths = output_mask(outputs).sum(1)
    src = torch.tensor(list(itertools.product((3, 4), repeat=2)))  # every source: a batch of 4
    src_lengths = torch.full((4,), 2)
    beams = beam_search(model, src, src_lengths, 3, width=25, length_normalise=normalise)
    for i in range(4):
        scores = log_probs(model, src[i : i + 1], src_lengths[i : i + 1], outputs)
        best = (scores / lengths if normalise else scores).argmax()
        assert beams.tokens[i, : lengths[best]].tolist() == outputs[best, : lengths[best]].tolist()
        assert beams.scores[i].item() == pytest.approx(scores[best].item(), abs=1e-4)
