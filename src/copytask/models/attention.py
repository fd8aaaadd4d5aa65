"""Attention scores, masked softmax and the context vector.

One module serves every attention type; the decoders decide *which* state is the query
(Bahdanau: the state before the step, s_{t-1}; Luong: the state after it, s_t):

- additive:   v^T tanh(W q + U h)   (Bahdanau's score, and Luong's "concat": W [s; h] = W_s s + W_h h)
- dot:        q^T h                 (needs d_s == d_h)
- scaled_dot: q^T h / sqrt(d)       (d the size of a head's slice; Vaswani et al., 2017)
- general:    q^T W h               (W is (d_s, d_h))
- multihead:  torch's nn.MultiheadAttention over the encoder states (query, key and value
              projections, scaled dot product per head, output projection); `heads` heads

Luong's local attention (Luong et al., 2015, section 3.2) restricts any single-head score to a
window [p_t - D, p_t + D] of source positions around an aligned position p_t:
- `local="monotonic"` (local-m): p_t = t, the output step; the softmax over the window alone.
- `local="predictive"` (local-p): p_t = S sigmoid(v_p^T tanh(W_p q)) with S the source length; the
  softmax over the window times a Gaussian exp(-(s - p_t)^2 / (2 sigma^2)), sigma = D / 2, as in
  the paper: its weights sum to less than 1 (the Gaussian is not renormalised), and p_t learns
  through the Gaussian. p_t = t is clamped to the source length on steps past it (padding), so
  that no window is empty.

The key projection (U h, or W h) does not depend on the decoder step: `project_keys` runs it
once per sequence and `forward` reuses it at every step.

Multi-head (dot, scaled_dot and general): with `heads` > 1 the query, the projected keys and the values
are split into `heads` equal slices along the feature axis; each head attends with its own slices
and the per-head contexts are concatenated back to d_h. With one head this is exactly the
single-head score. The returned weights are the mean over heads; each head's own weights are what
the `intervention` hook sees (below), which is how `analysis.head_weights` records them.

Contract: query (B, T_dec, d_s), keys from `project_keys`, values (B, T_enc, d_h), mask (B, T_enc),
positions (T_dec,) the query's output steps (local-m only) -> context (B, T_dec, d_h), weights
(B, T_dec, T_enc) summing to 1 over valid positions (local-p: at most 1, zero outside the window).
`step` is the same for one decoder position of the additive score (Bahdanau's decoder), without
the time axis: query (B, d_s) -> context (B, d_h), weights (B, T_enc).
"""

from __future__ import annotations

from typing import Callable

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..kernels import ops
from ..config.schema import LOCAL, MULTI_HEAD_SCORES, SCORES

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
    """Softmax over the last axis of `scores` (B, ..., T_enc); positions where `mask` (B, T_enc),
    or a mask of the scores' own shape, is False get exactly zero weight, and a row with no valid
    position at all (an empty source) gets zero weights rather than 0/0."""
    if mask.dim() == 2:
        mask = mask.view(mask.size(0), *(1,) * (scores.dim() - 2), mask.size(1))  # broadcast over the middle axes
    weights = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
    return weights.masked_fill(~mask.any(-1, keepdim=True), 0.0)


class Attention(nn.Module):
    def __init__(
        self,
        score: str,
        query_size: int,
        key_size: int,
        attention_size: int | None = None,
        heads: int = 1,
        fused: bool = True,  # the additive score of many steps at once in ops.additive_scores on CPU
        local: str | None = None,  # Luong's local attention: None (global), "predictive" or "monotonic"
        window: int | None = None,  # local: D, the window's half-width
        mha: nn.MultiheadAttention | None = None,  # multihead: an existing module to read through (the Transformer's), else a new one
    ):
        super().__init__()
        if score not in SCORES:
            raise ValueError(f"unknown attention score {score!r}; choose one of {', '.join(SCORES)}")
        if heads < 1:
            raise ValueError(f"heads must be >= 1, got {heads}")
        if heads > 1 and score not in MULTI_HEAD_SCORES:
            raise ValueError(f"heads={heads} needs a {', '.join(MULTI_HEAD_SCORES)} score, got {score!r}")
        if query_size % heads or key_size % heads:
            raise ValueError(
                f"heads={heads} must divide the state sizes, got d_s={query_size} and d_h={key_size}"
            )
        if score in ("dot", "scaled_dot", "multihead") and query_size != key_size:
            raise ValueError(
                f"{score} attention needs the decoder state size to equal the encoder state size, "
                f"got d_s={query_size} and d_h={key_size}; use a general or concat score instead"
            )
        if local not in LOCAL:
            raise ValueError(f"unknown local attention {local!r}; choose one of {', '.join(map(str, LOCAL))}")
        if local is not None and (heads > 1 or score == "multihead"):
            raise ValueError(f"local attention needs one head of a single-head score, got {score!r} with {heads} heads")
        if local is not None and (not window or window < 1):
            raise ValueError(f"local attention needs window >= 1, got {window}")
        self.score, self.heads, self.local, self.window = score, heads, local, window
        self.query_size, self.key_size = query_size, key_size
        if score == "additive":
            if not attention_size or attention_size < 1:
                raise ValueError(f"additive attention needs attention_size >= 1, got {attention_size}")
            self.query_proj = nn.Linear(query_size, attention_size, bias=False)  # W_a
            self.key_proj = nn.Linear(key_size, attention_size)  # U_a (its bias is the score's bias)
            self.v = nn.Linear(attention_size, 1, bias=False)  # v_a
        elif score == "general":
            self.key_proj = nn.Linear(key_size, query_size, bias=False)  # W, applied to h
        elif score == "multihead":
            self.mha = mha or nn.MultiheadAttention(query_size, heads, batch_first=True)
            assert self.mha.batch_first and self.mha.num_heads == heads and self.mha.embed_dim == query_size, "mha does not match"
        if local == "predictive":
            self.position_proj = nn.Linear(query_size, query_size, bias=False)  # W_p
            self.position_v = nn.Linear(query_size, 1, bias=False)  # v_p
        self.intervention: Intervention | None = None
        self.fused = fused

    def project_keys(self, encoder_states: Tensor) -> Tensor:
        """(B, T_enc, d_h) -> keys (B, T_enc, A) for additive, (B, T_enc, d_s) otherwise (multihead:
        the states themselves, which nn.MultiheadAttention projects)."""
        if self.score in ("dot", "scaled_dot", "multihead"):
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
        if self.fused and ops.usable(projected):
            return ops.additive_scores(projected, keys, self.v.weight[0])
        steps = projected.size(1) if query.is_cuda else max(1, ADDITIVE_CHUNK // keys.numel())
        scores = [self._additive(part[:, :, None, :], keys[:, None, :, :]) for part in projected.split(steps, dim=1)]
        return torch.cat(scores, dim=1) if len(scores) > 1 else scores[0]

    def forward(
        self, query: Tensor, keys: Tensor, values: Tensor, mask: Tensor, positions: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        batch, t_dec, d_s = query.shape
        t_enc = values.size(1)
        assert d_s == self.query_size, f"query size {d_s} != {self.query_size}"
        assert values.shape == (batch, t_enc, self.key_size), f"values {tuple(values.shape)}"
        assert keys.shape[:2] == (batch, t_enc) and mask.shape == (batch, t_enc), "keys/mask do not match values"
        if self.score == "multihead" and self.intervention is None:
            # torch's own module; with an intervention the same numbers by hand below, so the hook sees each head's weights
            context, weights = self.mha(query, keys, values, key_padding_mask=~mask, average_attn_weights=False)
            empty = ~mask.any(-1)  # (B,) an empty source: torch gives NaN, the hand-written path below zero weights
            weights = weights.masked_fill(empty[:, None, None, None], 0.0)
            context = torch.where(empty[:, None, None], self.mha.out_proj.bias, context)
            return context, weights.mean(1)
        if self.score == "additive":
            scores = self.additive_scores(query, keys)[:, None]  # (B, 1, T_dec, T_enc): one head
        elif self.score == "multihead":
            query, keys, values = F.linear(query, *self._in_proj(0)), F.linear(keys, *self._in_proj(1)), F.linear(values, *self._in_proj(2))
            scores = self._split(query) @ self._split(keys).transpose(-1, -2) / math.sqrt(d_s / self.heads)
        else:
            scores = self._split(query) @ self._split(keys).transpose(-1, -2)  # (B, heads, T_dec, T_enc)
            if self.score == "scaled_dot":
                scores = scores / math.sqrt(d_s / self.heads)
        if self.local is None:
            # Heads and steps as rows, so the softmax and an intervention act on each head's row alone.
            weights = masked_softmax(scores.flatten(1, 2), mask)  # (B, heads * T_dec, T_enc)
        else:
            weights = self._local(scores[:, 0], query, mask, positions)  # (B, T_dec, T_enc): one head
        if self.intervention is not None:
            weights = self.intervention(weights, mask)
        weights = weights.view(batch, self.heads, t_dec, t_enc)
        context = (weights @ self._split(values)).transpose(1, 2).flatten(2)  # (B, T_dec, d_h), heads concatenated
        if self.score == "multihead":
            context = self.mha.out_proj(context)
        return context, weights.mean(1)

    def _in_proj(self, i: int) -> tuple[Tensor, Tensor]:
        """nn.MultiheadAttention's query (0), key (1) or value (2) projection: (weight, bias)."""
        size = self.query_size
        return self.mha.in_proj_weight[i * size : (i + 1) * size], self.mha.in_proj_bias[i * size : (i + 1) * size]

    def _local(self, scores: Tensor, query: Tensor, mask: Tensor, positions: Tensor | None) -> Tensor:
        """Luong's local attention: scores (B, T_dec, T_enc), query (B, T_dec, d_s) -> weights (B, T_dec, T_enc),
        zero outside [p_t - D, p_t + D] and on padding."""
        lengths = mask.sum(-1, keepdim=True).to(scores.dtype)  # (B, 1): S
        if self.local == "monotonic":
            assert positions is not None and positions.shape == (query.size(1),), "local-m needs each query's output step"
            aligned = torch.minimum(positions.to(scores.dtype)[None, :], lengths)  # (B, T_dec): p_t = t, at most S
        else:
            aligned = lengths * torch.sigmoid(self.position_v(torch.tanh(self.position_proj(query)))).squeeze(-1)
        source = torch.arange(scores.size(-1), device=scores.device, dtype=scores.dtype)
        distance = source[None, None, :] - aligned[:, :, None]  # (B, T_dec, T_enc): s - p_t
        window = (distance.abs() <= self.window) & mask[:, None, :]
        weights = masked_softmax(scores, window)
        if self.local == "predictive":
            sigma = self.window / 2
            weights = weights * torch.exp(-distance.square() / (2 * sigma**2))
        return weights

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
