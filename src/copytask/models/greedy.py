"""Greedy decoding (no teacher forcing) of a batch, scored by `data.scoring`'s one rule: what
training's evaluations, the analysis and the benchmark measure."""

from __future__ import annotations

import torch

from ..data.batches import Batch
from ..data.scoring import accuracy
from .build import Model
from .chunks import over_chunks, pad_to

# Sequences greedily decoded at once on CPU: smaller pieces keep a decoder step's tensors in cache
# (docs/bench.md, Speed levers).
EVAL_CHUNK = 128


def evaluate(model: Model, batch: Batch, chunk_size: int | None = None, need_weights: bool = True) -> dict:
    """Greedy decoding (no teacher forcing) on `batch`, scored by `data.scoring.accuracy` (token and
    exact-sequence accuracy, the share that ended early, accuracy by position), with the decoded
    tokens (B, T_dec) and attention weights (B, T_dec, T_enc), or None (no attention, or no `need_weights`:
    a caller that reads only the scores). `chunk_size` sequences are decoded at a time: by default
    EVAL_CHUNK on CPU, all at once on a GPU."""
    if chunk_size is None:
        chunk_size = len(batch) if batch.src.is_cuda else EVAL_CHUNK
    steps = batch.tgt_out.size(1)

    def decode(part: Batch) -> tuple[torch.Tensor, torch.Tensor | None]:
        out, weights = model.greedy(part.src, part.src_lengths, steps, need_weights)
        return pad_to(out, steps), None if weights is None else pad_to(weights, batch.src.size(1), dim=2)

    tokens, weights = over_chunks(model, batch, chunk_size, decode)
    return accuracy(tokens, batch) | {"tokens": tokens, "weights": weights}
