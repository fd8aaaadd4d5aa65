"""A model run over a batch a chunk of sequences at a time, in eval mode: what every evaluation of a
batch does (greedy decoding, teacher forcing, beam search, the probe's summary vectors), written once.
A chunk is trimmed to its own longest source, so a result by position is padded back to the batch's
width (`pad_to`) before the chunks join."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch
from torch import Tensor

from ..data.batches import Batch
from .build import Model

Result = TypeVar("Result", Tensor, tuple[Tensor | None, ...])


@torch.no_grad()
def over_chunks(model: Model, batch: Batch, chunk_size: int, run: Callable[[Batch], Result]) -> Result:
    """`run` on each piece of `chunk_size` sequences of `batch` in turn (`Batch.select`: each trimmed to
    its own longest source), `model` in eval mode (no dropout) and left in the mode it came in -> the
    pieces' results concatenated along the batch: a tensor (B, ...), or a tuple of them (an element that
    is None in the pieces stays None)."""
    was_training = model.training
    model.eval()
    try:
        parts = [run(batch.select(slice(start, start + chunk_size))) for start in range(0, len(batch), chunk_size)]
    finally:
        model.train(was_training)
    if isinstance(parts[0], Tensor):
        return torch.cat(parts)
    return tuple(None if column[0] is None else torch.cat(column) for column in zip(*parts))


def pad_to(t: Tensor, size: int, dim: int = 1) -> Tensor:
    """`t` padded with zeros (PAD, for tokens) along `dim` to `size`: a chunk's result as wide as its batch's."""
    missing = size - t.size(dim)
    if missing == 0:
        return t
    pad_shape = list(t.shape)
    pad_shape[dim] = missing
    return torch.cat([t, t.new_zeros(pad_shape)], dim=dim)
