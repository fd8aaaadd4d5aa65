"""The Transformer's position encodings: sinusoidal (defined at every position) or a learned table.
Each maps positions (T,) to (T, d), added to the embeddings scaled by sqrt(d)."""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn


class SinusoidalPositions(nn.Module):
    """PE(p, 2i) = sin(p / 10000^(2i/d)), PE(p, 2i+1) = cos(p / 10000^(2i/d)) (Vaswani et al., 2017,
    section 3.5): no parameters, defined at every position."""

    def __init__(self, d_model: int):
        super().__init__()
        self.d_model = d_model

    def forward(self, positions: Tensor) -> Tensor:
        """positions (T,) -> (T, d)."""
        frequencies = torch.exp(
            torch.arange(0, self.d_model, 2, device=positions.device) * (-math.log(10000.0) / self.d_model)
        )
        angles = positions.float()[:, None] * frequencies[None, :]  # (T, ceil(d / 2))
        table = torch.stack([angles.sin(), angles.cos()], dim=-1).flatten(1)  # sin, cos interleaved
        return table[:, : self.d_model]


class LearnedPositions(nn.Module):
    """A learned table, one row per position 0 .. rows - 1 (Gehring et al., 2017; BERT). Rows past
    the lengths trained on keep their initialisation; a position past the table is an error."""

    def __init__(self, rows: int, d_model: int):
        super().__init__()
        self.table = nn.Embedding(rows, d_model)

    def forward(self, positions: Tensor) -> Tensor:
        """positions (T,) -> (T, d)."""
        return self.table(positions)
