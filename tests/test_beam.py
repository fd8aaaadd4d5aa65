"""Beam search (issue 69), for every model: width 1 is greedy decoding to the bit; at every width the output,
its score and its attention maps are the model's own under teacher forcing; the search is the textbook
one (`reference_search`), for each model family's decoding and its `reorder`, with and without length
normalisation; a beam wide enough to keep every hypothesis finds the most probable output of a model small
enough to list them all; and a model in training mode decodes as in eval mode."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch

from copytask.config.schema import config_dir
from copytask.data.batches import make_batch
from copytask.data.scoring import output_mask
from copytask.data.vocab import BOS, EOS, PAD
from copytask.models.beam import beam_search
from copytask.models.build import build_model

from .conftest import TINY

ATTENTIONS = sorted(path.stem for path in (Path(config_dir()) / "attention").glob("*.yaml"))
# every GRU decoder with every attention type, the Transformer with either kind of positions, and Mamba
MODELS = [[f"attention={name}"] for name in ATTENTIONS] + [
    ["architecture=transformer"],
    ["architecture=transformer_learned"],
    ["architecture=transformer", "train.fused=false"],  # nn.MultiheadAttention's ops rather than the C++ step
    # Mamba on torch's ops: its kernels' exp and softplus are polynomials, whose float rounding the teacher-forced
    # scan and the decoding's steps meet in other orders (tests/test_mamba.py holds the kernels to torch's ops)
    ["architecture=mamba", "model.d_model=8", "model.d_state=4", "train.fused=false"],
]
# each decoding's own state and `reorder`: the GRU decoders' hidden states, the Transformer's caches in either layout
FAMILIES = [
    ["attention=none"],
    ["attention=rnnencdec"],
    ["attention=bahdanau"],
    ["attention=luong_general"],
    ["architecture=transformer"],
    ["architecture=transformer", "train.fused=false"],
    ["architecture=mamba", "model.d_model=8", "train.fused=false"],
]
# An untrained tiny model's next token hardly depends on its source or prefix, so its beams hardly part ways;
# with every parameter scaled up, they do: beams finish at different steps, the best beam's parents change
# from step to step, and length normalisation changes which beam wins.
SCALE = 3.0


def model_for(
    make_config, overrides: list[str], seed: int = 0, vocab_size: int = 9, length: int = 6, scale: float = 1.0
):
    """The tiny model of `overrides` from `seed`, in eval mode, every parameter times `scale` (see SCALE)."""
    cfg = make_config(*TINY, *overrides, f"task.vocab_size={vocab_size}", f"task.length={length}")
    torch.manual_seed(seed)
    model = build_model(cfg).eval()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.mul_(scale)
    return model, cfg


def sources(count: int = 24) -> tuple[torch.Tensor, torch.Tensor, int]:
    """`count` copy-task sources of 2 to 6 symbols (padding and masks too) and the steps to decode them."""
    batch = make_batch("copy", count, 6, 9, torch.Generator().manual_seed(1), min_length=2)
    return batch.src, batch.src_lengths, batch.tgt_out.size(1)


def teacher_forced(model, src, src_lengths, outputs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Each of `outputs` (N, steps) fed whole to the model on its source (src (N, T_enc)), under teacher
    forcing: -> log p(output | source) (N,), up to and with its first EOS (what follows an EOS changes no
    step before it), and the weights (N, steps, T_enc) or None."""
    tgt_in = torch.cat([torch.full((len(outputs), 1), BOS), outputs[:, :-1]], 1)
    with torch.no_grad():
        logits, weights = model(src, src_lengths, tgt_in)
    token_log_probs = torch.log_softmax(logits.double(), -1).gather(-1, outputs[..., None])[..., 0]
    return (token_log_probs * output_mask(outputs)).sum(1), weights


@pytest.mark.parametrize("overrides", MODELS, ids=lambda o: " ".join(o))
def test_width_1_is_greedy_to_the_bit_for_every_model(make_config, overrides):
    model, cfg = model_for(make_config, overrides)
    src, src_lengths, steps = sources()
    greedy, greedy_weights = model.greedy(src, src_lengths, steps)
    for normalise in (False, True):
        beams = beam_search(model, src, src_lengths, steps, width=1, length_normalise=normalise)
        ended = output_mask(greedy)  # greedy's output: up to and with its first EOS
        assert torch.equal(beams.tokens, torch.where(ended, greedy, PAD))
        if greedy_weights is None:
            assert beams.weights is None
        else:  # the attention of every step of the output, to the bit
            assert torch.equal(beams.weights[ended], greedy_weights[ended])


@pytest.mark.parametrize("overrides", MODELS, ids=lambda o: " ".join(o))
def test_asked_for_no_weights_every_model_decodes_the_same_to_the_bit_and_keeps_none(make_config, overrides):
    """`need_weights=False` (training's evaluations, the analysis' accuracies, beam search's tokens): the same
    tokens and scores as with the weights, greedy and at widths 1 and 4, and the weights None."""
    model, _ = model_for(make_config, overrides, scale=SCALE)
    src, src_lengths, steps = sources()
    greedy, _ = model.greedy(src, src_lengths, steps)
    assert torch.equal(model.greedy(src, src_lengths, steps, need_weights=False)[0], greedy)
    assert model.greedy(src, src_lengths, steps, need_weights=False)[1] is None
    for width in (1, 4):
        beams = beam_search(model, src, src_lengths, steps, width)
        unweighted = beam_search(model, src, src_lengths, steps, width, need_weights=False)
        assert torch.equal(unweighted.tokens, beams.tokens) and torch.equal(unweighted.scores, beams.scores)
        assert unweighted.weights is None


@pytest.mark.parametrize("overrides", MODELS, ids=lambda o: " ".join(o))
def test_each_width_returns_the_model_s_own_scores_and_maps_of_its_output(make_config, overrides):
    """The score and the attention weights returned with each sequence's best beam are those teacher forcing
    computes on that beam's output (up to and with its first EOS; PAD after it), at widths 1, 4 and 8: the
    weights of each step are those of the beam the step ran on, its parent, not of the beam that took its place."""
    model, _ = model_for(make_config, overrides, scale=SCALE)
    src, src_lengths, steps = sources()
    for width in (1, 4, 8):
        lengths = []
        for normalise in (False, True):
            beams = beam_search(model, src, src_lengths, steps, width, normalise)
            output = output_mask(beams.tokens)
            assert torch.equal(beams.tokens, beams.tokens.masked_fill(~output, PAD))
            scores, weights = teacher_forced(model, src, src_lengths, beams.tokens)
            torch.testing.assert_close(beams.scores.double(), scores, rtol=0, atol=1e-4)
            assert (beams.weights is None) == (weights is None)
            if weights is not None:
                torch.testing.assert_close(beams.weights[output], weights[output], rtol=0, atol=1e-5)
            lengths += output.sum(1).tolist()
        assert max(lengths) > 2  # outputs of more than two steps: steps whose beams took other parents


TIE = 1e-5  # rankings closer than this may order differently in the decoding's numbers and teacher forcing's


def reference_search(model, src, src_lengths, steps: int, width: int, normalise: bool) -> tuple[list, list[bool]]:
    """Beam search as the textbook states it, a hypothesis at a time: each step extends every live
    hypothesis by every token, at the log-probability teacher forcing gives it on the whole prefix; a
    finished hypothesis (its last token EOS) stays as it is; the `width` best by score (divided by its
    length, its tokens up to and with EOS, with `normalise`) are kept; the search stops when all are
    finished or after `steps` steps, and answers the best. -> each source's (tokens, score), and whether
    one of its choices was a near tie (within TIE)."""

    def rank(hypothesis: tuple) -> float:
        tokens, score = hypothesis
        return score / len(tokens) if normalise else score

    def finished(hypothesis: tuple) -> bool:
        return hypothesis[0][-1:] == (EOS,)

    beams = [[((), 0.0)] for _ in src]
    near_tie = [False] * len(src)
    for _ in range(steps):
        live = [(i, hypothesis) for i, kept in enumerate(beams) for hypothesis in kept if not finished(hypothesis)]
        if not live:
            break
        rows = torch.tensor([i for i, _ in live])
        with torch.no_grad():  # each live prefix fed whole: the log-probabilities of its next token
            logits, _ = model(src[rows], src_lengths[rows], torch.tensor([[BOS, *tokens] for _, (tokens, _) in live]))
        grown = [[hypothesis for hypothesis in kept if finished(hypothesis)] for kept in beams]
        for (i, (tokens, score)), log_probs in zip(live, torch.log_softmax(logits[:, -1].double(), -1).tolist()):
            grown[i] += [((*tokens, token), score + log_prob) for token, log_prob in enumerate(log_probs)]
        for i, candidates in enumerate(grown):
            candidates.sort(key=rank, reverse=True)
            near_tie[i] |= len(candidates) > width and rank(candidates[width - 1]) - rank(candidates[width]) < TIE
            beams[i] = candidates[:width]
    for i, kept in enumerate(beams):
        ranks = sorted(map(rank, kept), reverse=True)
        near_tie[i] |= len(ranks) > 1 and ranks[0] - ranks[1] < TIE
    return [max(kept, key=rank) for kept in beams], near_tie


@pytest.mark.parametrize("overrides", FAMILIES, ids=lambda o: " ".join(o))
def test_beam_search_is_the_textbook_search_for_every_model_family(make_config, overrides):
    """Beam search at widths 2 and 5, with and without length normalisation, answers what `reference_search`
    answers on teacher forcing's numbers: the same tokens (PAD after the first EOS) and score, for every
    source whose search had no near tie. The models are such that normalisation changes the answer, and
    the best output is at times a beam that finished early, at times one that ran every step."""
    model, _ = model_for(make_config, overrides, scale=SCALE)
    src, src_lengths, steps = sources()
    for width in (2, 5):
        answers = {}
        for normalise in (False, True):
            beams = beam_search(model, src, src_lengths, steps, width, normalise)
            answers[normalise], near_tie = reference_search(model, src, src_lengths, steps, width, normalise)
            assert sum(near_tie) <= len(src) // 4
            for i, (tokens, score) in enumerate(answers[normalise]):
                if not near_tie[i]:
                    assert beams.tokens[i].tolist() == [*tokens, *[PAD] * (steps - len(tokens))], (width, normalise, i)
                    assert beams.scores[i].item() == pytest.approx(score, abs=1e-4), (width, normalise, i)
        assert answers[False] != answers[True]
        lengths = {len(tokens) for tokens, _ in answers[False] + answers[True]}
        assert min(lengths) < steps and steps in lengths


# (overrides, seed): models whose most probable output is longer than the immediate EOS for some sources
EXHAUSTIVE = [
    (["attention=none"], 2),
    (["attention=rnnencdec"], 1),
    (["attention=bahdanau"], 0),
    (["attention=luong_general"], 3),
    (["architecture=transformer"], 2),
    (["architecture=mamba", "model.d_model=8", "train.fused=false"], 0),
]


@pytest.mark.parametrize(("overrides", "seed"), EXHAUSTIVE, ids=[f"{' '.join(o)} seed {s}" for o, s in EXHAUSTIVE])
@pytest.mark.parametrize("normalise", [False, True])
def test_a_wide_beam_finds_the_most_probable_output_of_a_tiny_model(make_config, overrides, seed, normalise):
    """Two content symbols and length 2: 5 tokens, 3 steps, 125 outputs, 25 prefixes of 2 steps, so a
    beam of 25 keeps every hypothesis; every source at once. The most probable output of each model is
    longer than the immediate EOS for some of the sources: the search past its first step is what is tested."""
    model, _ = model_for(make_config, overrides, seed=seed, vocab_size=2, length=2, scale=SCALE)
    outputs = torch.tensor(list(itertools.product(range(5), repeat=3)))  # (125, 3) every output of 3 steps
    lengths = output_mask(outputs).sum(1)
    src = torch.tensor(list(itertools.product((3, 4), repeat=2)))  # every source: a batch of 4
    src_lengths = torch.full((4,), 2)
    beams = beam_search(model, src, src_lengths, 3, width=25, length_normalise=normalise)
    best_lengths = []
    for i in range(4):
        scores, _ = teacher_forced(model, src[[i] * len(outputs)], src_lengths[[i] * len(outputs)], outputs)
        best = (scores / lengths if normalise else scores).argmax()
        best_lengths.append(lengths[best].item())
        assert beams.tokens[i, : lengths[best]].tolist() == outputs[best, : lengths[best]].tolist()
        assert beams.scores[i].item() == pytest.approx(scores[best].item(), abs=1e-4)
    assert max(best_lengths) > 1


def test_beam_search_decodes_in_eval_mode_and_leaves_the_model_s_mode_as_it_was(make_config):
    """A Transformer with dropout, in training mode, decodes as in eval mode (no dropout), and is left in
    training mode; one in eval mode is left in eval mode."""
    model, _ = model_for(make_config, ["architecture=transformer", "model.dropout=0.5"], scale=SCALE)
    src, src_lengths, steps = sources()
    expected = beam_search(model, src, src_lengths, steps, width=4)
    assert not model.training
    model.train()
    tgt_in = torch.full_like(src, BOS)
    with torch.no_grad():  # dropout is on in training mode: a decoding there would differ
        assert not torch.equal(model(src, src_lengths, tgt_in)[0], model(src, src_lengths, tgt_in)[0])
    beams = beam_search(model, src, src_lengths, steps, width=4)
    assert model.training
    for got, want in zip(beams, expected):
        assert torch.equal(got, want)
