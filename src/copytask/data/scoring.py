"""The one scoring rule of every number: an output (greedy, beam search, the teacher-forced argmax)
against its target. An output ends at its first EOS, and a content position after it is wrong
whatever the decoder emits there. `accuracy` sums it up as every evaluation reports it."""

from __future__ import annotations

from typing import NamedTuple

import torch

from .batches import Batch
from .vocab import EOS


class Scores(NamedTuple):
    """Per sequence (B,): content symbols right, content symbols, whether the whole target is right
    (every symbol and the EOS), and whether the output ended early (an EOS before the target's)."""

    hits: torch.Tensor
    symbols: torch.Tensor
    exact: torch.Tensor
    early: torch.Tensor


def output_mask(tokens: torch.Tensor) -> torch.Tensor:
    """Output tokens (B, T_dec) -> (B, T_dec) True up to and with each output's first EOS: the
    output itself. An output without EOS runs to the end."""
    eos = tokens == EOS
    return (eos.cumsum(1) - eos.long()) == 0  # no EOS before this position


def right(tokens: torch.Tensor, batch: Batch) -> torch.Tensor:
    """(B, T_dec) True where the output `tokens` (B, T_dec) has the target's token and has not ended."""
    return (tokens == batch.tgt_out) & output_mask(tokens)


def position_scores(tokens: torch.Tensor, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """Output `tokens` (B, T_dec) against `batch`, by the same rule, per output position: content
    symbols right and content symbols at each position -> (T_dec,), (T_dec,)."""
    content = batch.content_mask
    return (right(tokens, batch) & content).sum(0), content.sum(0)


def sequence_scores(tokens: torch.Tensor, batch: Batch) -> Scores:
    """Output `tokens` (B, T_dec) against `batch`: an output ends at its first EOS, so a
    content position after it is wrong, whatever the decoder emitted there; an output that never
    emits EOS is scored over the target's length. The one scoring rule of every number."""
    correct = right(tokens, batch)
    content = batch.content_mask
    early = ((tokens == EOS) & content).any(1)
    return Scores((correct & content).sum(1), content.sum(1), (correct | ~batch.target_mask).all(1), early)


def accuracy(tokens: torch.Tensor, batch: Batch) -> dict:
    """Output `tokens` (B, T_dec) scored against `batch` by the one rule: token accuracy over the content
    positions, exact-sequence accuracy (every symbol and the EOS right), the share of outputs that ended
    early (an EOS before the target's end) and the token accuracy at each output position (content
    positions: a list of T_dec - 1 for a fixed length)."""
    scores = sequence_scores(tokens, batch)
    hits, symbols = position_scores(tokens, batch)
    content = symbols > 0
    return {
        "token_acc": scores.hits.sum().item() / scores.symbols.sum().item(),
        "seq_acc": scores.exact.float().mean().item(),
        "ended_early": scores.early.float().mean().item(),
        "by_position": (hits[content] / symbols[content]).tolist(),
    }
