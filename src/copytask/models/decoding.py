"""What greedy decoding and beam search share: a model's `decoding`, fed one token a step.

`model.decoding(src, src_lengths, steps, need_weights)` runs the encoder once and returns a `Decoding`:
`step(tokens, t)` feeds the tokens (B,) of output step t and returns the logits (B, V) of the next token and
the attention weights (B, T_enc) that produced them (None without attention, and None unless `need_weights`:
a caller that reads only the tokens asks for none, and linear attention's step then reads only its fixed-size
summary, not every position's key); `reorder(rows)` makes row i of
the decoder's state row `rows[i]` of the present state (beam search keeps the beams' parents). Each
row of a decoding is independent of the others, so the same rows in any batch give the same numbers.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import Tensor

from ..data.vocab import BOS


class Decoding(Protocol):
    def step(self, tokens: Tensor, t: int) -> tuple[Tensor, Tensor | None]: ...

    def reorder(self, rows: Tensor) -> None: ...


def greedy_search(decoding: Decoding, batch: int, steps: int, device: torch.device) -> tuple[Tensor, Tensor | None]:
    """Each step fed its own previous argmax, `steps` steps: -> tokens (B, steps), weights
    (B, steps, T_enc) or None. Runs every step, past an EOS too: the scoring rule ends an output at
    its first EOS (`data.scoring`)."""
    tokens = torch.full((batch,), BOS, dtype=torch.long, device=device)
    outputs, weights = [], []
    for t in range(steps):
        logits, step_weights = decoding.step(tokens, t)
        tokens = logits.argmax(-1)
        outputs.append(tokens)
        weights.append(step_weights)
    return torch.stack(outputs, 1), (None if weights[0] is None else torch.stack(weights, 1))
