"""Beam search for every model (the GRU decoders with any attention, and the Transformer), batched
over sequences and beams: the B sequences' k beams are the B * k rows of one `decoding`
(`models.decoding`), and each step is a handful of tensor operations on all of them.

A step extends each live beam by its k most likely tokens, and keeps each sequence's k best of those
k * k hypotheses by the sum of their tokens' log-probabilities (divided by the hypothesis' length, its
tokens up to and with EOS, with `length_normalise`). A beam that has written EOS is finished: it stays
among the k with its score, extended only by PAD at no cost, until a better hypothesis pushes it out;
the search stops when every beam of every sequence is finished, or after `steps` steps. The output is
each sequence's best beam.

With width 1 the one candidate of each step is the argmax (a stable sort takes the first of equal
logits, as `argmax` does) of the same logits greedy decoding computes: the output is greedy's to the bit,
up to and with its first EOS (PAD after it, where greedy runs on; the scoring rule ends an output there).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from ..data.vocab import BOS, EOS, PAD
from .build import Model


class Beams(NamedTuple):
    tokens: Tensor  # (B, steps) each sequence's best hypothesis, PAD after its EOS
    scores: Tensor  # (B,) its log-probability (not normalised)
    # (B, steps, T_enc) the attention that produced it (past its EOS: of the PAD steps, no part of the output; zero
    # past the last step searched), or None
    weights: Tensor | None


def beam_search(
    model: Model,
    src: Tensor,
    src_lengths: Tensor,
    steps: int,
    width: int,
    length_normalise: bool = False,
    need_weights: bool = True,
) -> Beams:
    """Beam search of `width` beams for each of the B sequences of `src` (B, T_enc), up to `steps` steps,
    the model in eval mode (no dropout); it is left in the mode it came in. Without `need_weights` the beams
    keep no weights (`Beams.weights` None): a caller that reads only the tokens and scores."""
    was_training = model.training
    model.eval()
    try:
        return _search(model, src, src_lengths, steps, width, length_normalise, need_weights)
    finally:
        model.train(was_training)


@torch.no_grad()
def _search(
    model: Model, src: Tensor, src_lengths: Tensor, steps: int, width: int, length_normalise: bool, need_weights: bool
) -> Beams:
    batch, k = src.size(0), width
    device = src.device
    rows = torch.arange(batch, device=device).repeat_interleave(k)  # (B * k,) beam j of sequence b is row b * k + j
    decoding = model.decoding(src[rows], src_lengths[rows], steps, need_weights)
    tokens = torch.full((batch * k,), BOS, dtype=torch.long, device=device)
    scores = torch.full((batch, k), -torch.inf, device=device)
    scores[:, 0] = 0.0  # the beams start alike: one of them is live, or each would be found k times
    finished = torch.zeros(batch, k, dtype=torch.bool, device=device)
    lengths = torch.zeros(batch, k, device=device)  # tokens written, up to and with EOS
    # per step: each kept beam's token (B, k) and parent (B, k), and the weights (B, k, T_enc) or None of the
    # beams before pruning, those the step ran on: a kept beam's token came from its parent's
    history = []
    offsets = torch.arange(batch, device=device)[:, None] * k  # (B, 1)
    for t in range(steps):
        logits, weights = decoding.step(tokens, t)  # (B * k, V)
        log_probs = torch.log_softmax(logits.float(), -1).view(batch, k, -1)
        candidates = logits.sort(dim=-1, descending=True, stable=True).indices[:, :k].view(batch, k, -1)  # (B, k, <=k)
        extended = scores[..., None] + log_probs.gather(-1, candidates)
        # a finished beam has one continuation, PAD, at no cost
        kept = torch.full_like(extended, -torch.inf)
        kept[..., 0] = scores
        extended = torch.where(finished[..., None], kept, extended)
        candidates = candidates.masked_fill(finished[..., None], PAD)
        grown = lengths[..., None] + (~finished[..., None]).float()  # (B, k, 1)
        ranking = extended / grown if length_normalise else extended
        choice = ranking.flatten(1).sort(dim=-1, descending=True, stable=True).indices[:, :k]  # (B, k) of k * k
        parents = choice // candidates.size(-1)
        tokens = candidates.flatten(1).gather(1, choice)  # (B, k)
        scores = extended.flatten(1).gather(1, choice)
        lengths = grown.expand_as(extended).flatten(1).gather(1, choice)
        finished = finished.gather(1, parents) | (tokens == EOS)
        decoding.reorder((offsets + parents).flatten())
        history.append((tokens, parents, None if weights is None else weights.view(batch, k, -1)))
        tokens = tokens.flatten()
        if (finished | scores.isneginf()).all():
            break
    ranking = scores / lengths.clamp(min=1) if length_normalise else scores
    best = ranking.argmax(-1)  # (B,)
    tokens, weights = _backtrack(history, best, steps)
    return Beams(tokens, scores.gather(1, best[:, None])[:, 0], weights)


def _backtrack(history: list[tuple], beam: Tensor, steps: int) -> tuple[Tensor, Tensor | None]:
    """Each sequence's hypothesis ending in `beam` (B,) at the last step, followed back through its
    parents: -> tokens (B, steps) and weights (B, steps, T_enc) or None, PAD and zero past the last step."""
    rows = torch.arange(len(beam), device=beam.device)
    tokens, weights = [], []
    for step_tokens, parents, step_weights in reversed(history):
        tokens.append(step_tokens[rows, beam])
        beam = parents[rows, beam]  # the beam the step ran on: its weights produced the token
        weights.append(None if step_weights is None else step_weights[rows, beam])
    tokens = torch.stack(tokens[::-1], 1)
    tokens = torch.cat([tokens, tokens.new_full((len(rows), steps - tokens.size(1)), PAD)], 1)
    if weights[0] is None:
        return tokens, None
    weights = torch.stack(weights[::-1], 1)
    return tokens, torch.cat([weights, weights.new_zeros(len(rows), steps - weights.size(1), weights.size(2))], 1)
