"""Greedy decoding (no teacher forcing) of a batch, scored by `data.scoring`'s one rule: what
training's evaluations, the analysis and the benchmark measure."""

from __future__ import annotations

import torch

from ..data.batches import Batch
from ..data.scoring import sequence_scores
from .build import Model

# Sequences greedily decoded at once on CPU: smaller pieces keep a decoder step's tensors in cache
# (docs/bench.md, Speed levers).
EVAL_CHUNK = 128


@torch.no_grad()
def evaluate(model: Model, batch: Batch, chunk_size: int | None = None) -> dict:
    """Greedy decoding (no teacher forcing) on `batch`, scored by `sequence_scores`: token accuracy
    over the content positions, exact-sequence accuracy (every symbol and the EOS right) and the
    share of outputs that ended early (an EOS before the target's end). Also returns the decoded
    tokens (B, T_dec) and attention weights (B, T_dec, T_enc) or None. `chunk_size` sequences are
    decoded at a time: by default EVAL_CHUNK on CPU, all at once on a GPU."""
    if chunk_size is None:
        chunk_size = len(batch) if batch.src.is_cuda else EVAL_CHUNK
    was_training = model.training
    model.eval()
    tokens, weights = [], []
    for start in range(0, len(batch), chunk_size):
        part = batch.select(slice(start, start + chunk_size))
        out, w = model.greedy(part.src, part.src_lengths, steps=batch.tgt_out.size(1))
        tokens.append(_pad_to(out, batch.tgt_out.size(1)))
        weights.append(None if w is None else _pad_to(w, batch.src.size(1), dim=2))
    model.train(was_training)
    tokens = torch.cat(tokens)
    scores = sequence_scores(tokens, batch)
    return {
        "token_acc": scores.hits.sum().item() / scores.symbols.sum().item(),
        "seq_acc": scores.exact.float().mean().item(),
        "ended_early": scores.early.float().mean().item(),
        "tokens": tokens,
        "weights": None if weights[0] is None else torch.cat(weights),
    }


def rounded(weights: torch.Tensor) -> list:
    """Attention weights as nested lists with four decimals: small enough for a length-80 map in
    JSON, exact enough for a heatmap."""
    return weights.double().mul(1e4).round().div(1e4).tolist()


def _pad_to(t: torch.Tensor, size: int, dim: int = 1) -> torch.Tensor:
    missing = size - t.size(dim)
    if missing == 0:
        return t
    pad_shape = list(t.shape)
    pad_shape[dim] = missing
    return torch.cat([t, t.new_zeros(pad_shape)], dim=dim)
