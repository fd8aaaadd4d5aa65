"""Attention scores, masked softmax and the context vector.

One module serves every attention type; the decoders decide *which* state is the query
(Bahdanau: the state before the step, s_{t-1}; Luong: the state after it, s_t):

- additive: v^T tanh(W q + U h)   (Bahdanau's score, and Luong's "concat": W [s; h] = W_s s + W_h h)
- dot:      q^T h                 (needs d_s == d_h)
- general:  q^T W h               (W is (d_s, d_h))

The key projection (U h, or W h) does not depend on the decoder step: `project_keys` runs it
once per sequence and `forward` reuses it at every step.

Multi-head (dot and general only): with `heads` > 1 the query, the projected keys and the values
are split into `heads` equal slices along the feature axis; each head attends with its own slices
and the per-head contexts are concatenated back to d_h. With one head this is exactly the
single-head score. The returned weights are the mean over heads; each head's own weights are what
the `intervention` hook sees (below), which is how `analysis.head_weights` records them.

Contract: query (B, T_dec, d_s), keys from `project_keys`, values (B, T_enc, d_h), mask (B, T_enc)
-> context (B, T_dec, d_h), weights (B, T_dec, T_enc) summing to 1 over valid positions.
`step` is the same for one decoder position of the additive score (Bahdanau's decoder), without
the time axis: query (B, d_s) -> context (B, d_h), weights (B, T_enc).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor, nn

from . import kernels
from .config import MULTI_HEAD_SCORES

SCORES = ("additive", "dot", "general")

ADDITIVE_CHUNK = 2**19  # elements of the additive score's tanh tensor computed at once on CPU (2 MB)

# Replaces the weights after the softmax, for counterfactual checks: (weights, mask) -> weights,
# weights (B, heads * T_dec, T_enc) with one row per head and step, head-major (row h * T_dec + t),
# mask (B, T_enc). With one head that is simply (B, T_dec, T_enc).
Intervention = Callable[[Tensor, Tensor], Tensor]


class SigmoidTanh(torch.autograd.Function):
    """tanh computed as 2 sigmoid(2x) - 1, with tanh's backward grad (1 - y^2).

    On CPU torch's tanh kernel is about 6x slower than its sigmoid (measured 1.75 ms against
    0.28 ms on the (64, 1, 80, 64) tensor of a Bahdanau step at length 80; this function 0.6 ms),
    and the additive score's tanh is the largest single cost of a training step (30% of a
    Bahdanau step in a profile). Equal to tanh within ~1e-7."""

    @staticmethod
    def forward(ctx, x: Tensor) -> Tensor:
        y = x.mul(2).sigmoid_().mul_(2).sub_(1)  # one allocation, the rest in place
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:
        (y,) = ctx.saved_tensors
        return torch.ops.aten.tanh_backward(grad, y)


def fast_tanh(x: Tensor) -> Tensor:
    """tanh; on CPU through SigmoidTanh (on a GPU torch's own tanh is as fast)."""
    return torch.tanh(x) if x.is_cuda else SigmoidTanh.apply(x)


def masked_softmax(scores: Tensor, mask: Tensor) -> Tensor:
    """Softmax over the last axis of `scores` (B, ..., T_enc); positions where `mask` (B, T_enc)
    is False get exactly zero weight."""
    mask = mask.view(mask.size(0), *(1,) * (scores.dim() - 2), mask.size(1))  # broadcast over the middle axes
    return torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)


class Attention(nn.Module):
    def __init__(
        self,
        score: str,
        query_size: int,
        key_size: int,
        attention_size: int | None = None,
        heads: int = 1,
        fused: bool = True,  # the additive score of many steps at once in kernels.additive_scores on CPU
    ):
        super().__init__()
        if score not in SCORES:
            raise ValueError(f"unknown attention score {score!r}; choose one of {', '.join(SCORES)}")
        if heads < 1:
            raise ValueError(f"heads must be >= 1, got {heads}")
        if heads > 1 and score not in MULTI_HEAD_SCORES:
            raise ValueError(f"heads={heads} needs a {' or '.join(MULTI_HEAD_SCORES)} score, got {score!r}")
        if query_size % heads or key_size % heads:
            raise ValueError(
                f"heads={heads} must divide the state sizes, got d_s={query_size} and d_h={key_size}"
            )
        if score == "dot" and query_size != key_size:
            raise ValueError(
                f"dot attention needs the decoder state size to equal the encoder state size, "
                f"got d_s={query_size} and d_h={key_size}; use a general or concat score instead"
            )
        self.score, self.heads = score, heads
        self.query_size, self.key_size = query_size, key_size
        if score == "additive":
            if not attention_size or attention_size < 1:
                raise ValueError(f"additive attention needs attention_size >= 1, got {attention_size}")
            self.query_proj = nn.Linear(query_size, attention_size, bias=False)  # W_a
            self.key_proj = nn.Linear(key_size, attention_size)  # U_a (its bias is the score's bias)
            self.v = nn.Linear(attention_size, 1, bias=False)  # v_a
        elif score == "general":
            self.key_proj = nn.Linear(key_size, query_size, bias=False)  # W, applied to h
        self.intervention: Intervention | None = None
        self.fused = fused

    def project_keys(self, encoder_states: Tensor) -> Tensor:
        """(B, T_enc, d_h) -> keys (B, T_enc, A) for additive, (B, T_enc, d_s) otherwise."""
        if self.score == "dot":
            return encoder_states
        return self.key_proj(encoder_states)

    def _split(self, x: Tensor) -> Tensor:
        """(B, T, d) -> (B, heads, T, d / heads)."""
        return x.view(x.size(0), x.size(1), self.heads, -1).transpose(1, 2)

    def _additive(self, projected_query: Tensor, keys: Tensor) -> Tensor:
        """v^T tanh(W q + U h) over the last axis of two broadcastable (..., A) tensors."""
        return self.v(fast_tanh(projected_query + keys)).squeeze(-1)

    def additive_scores(self, query: Tensor, keys: Tensor) -> Tensor:
        """v^T tanh(W q + U h): query (B, T_dec, d_s), keys U h (B, T_enc, A) -> (B, T_dec, T_enc).

        The (B, T_dec, T_enc, A) tensor inside does not fit in a CPU cache when many decoder steps
        come at once (Luong concat under teacher forcing: 106 MB at length 80, where forward and
        backward of the score took 393 ms in one piece and 71-154 ms in pieces of 1-4 steps), so on
        CPU it is computed ADDITIVE_CHUNK elements at a time, or in the fused kernel where it builds."""
        projected = self.query_proj(query)  # (B, T_dec, A)
        if self.fused and kernels.usable(projected):
            return kernels.additive_scores(projected, keys, self.v.weight[0])
        steps = projected.size(1) if query.is_cuda else max(1, ADDITIVE_CHUNK // keys.numel())
        scores = [self._additive(part[:, :, None, :], keys[:, None, :, :]) for part in projected.split(steps, dim=1)]
        return torch.cat(scores, dim=1) if len(scores) > 1 else scores[0]

    def forward(self, query: Tensor, keys: Tensor, values: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
        batch, t_dec, d_s = query.shape
        t_enc = values.size(1)
        assert d_s == self.query_size, f"query size {d_s} != {self.query_size}"
        assert values.shape == (batch, t_enc, self.key_size), f"values {tuple(values.shape)}"
        assert keys.shape[:2] == (batch, t_enc) and mask.shape == (batch, t_enc), "keys/mask do not match values"
        if self.score == "additive":
            scores = self.additive_scores(query, keys)[:, None]  # (B, 1, T_dec, T_enc): one head
        else:
            scores = self._split(query) @ self._split(keys).transpose(-1, -2)  # (B, heads, T_dec, T_enc)
        # Heads and steps as rows, so the softmax and an intervention act on each head's row alone.
        weights = masked_softmax(scores.flatten(1, 2), mask)  # (B, heads * T_dec, T_enc)
        if self.intervention is not None:
            weights = self.intervention(weights, mask)
        weights = weights.view(batch, self.heads, t_dec, t_enc)
        context = (weights @ self._split(values)).transpose(1, 2).flatten(2)  # (B, T_dec, d_h), heads concatenated
        return context, weights.mean(1)

    def step(self, query: Tensor, keys: Tensor, values: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
        """One decoder step of the additive score: query (B, d_s) -> context (B, d_h), weights (B, T_enc).
        The numbers of `forward` on a (B, 1, d_s) query, without the time axis: Bahdanau's decoder
        calls this at every step, where that axis's views cost about a tenth of a training step."""
        assert self.score == "additive", f"step serves the additive score, got {self.score!r}"
        assert query.shape == (values.size(0), self.query_size), f"query {tuple(query.shape)}"
        scores = self._additive(self.query_proj(query)[:, None, :], keys)  # (B, T_enc)
        weights = masked_softmax(scores, mask)
        if self.intervention is not None:
            weights = self.intervention(weights[:, None], mask)[:, 0]
        return torch.bmm(weights[:, None], values).squeeze(1), weights
