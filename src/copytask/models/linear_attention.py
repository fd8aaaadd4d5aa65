"""Linear attention (Katharopoulos et al., 2020): `attention.score=linear`, in a module of its own so that
attention.py stays short; the package imports it, which registers it.

Where softmax attention reads every encoder state at every step, linear attention reads a summary of
the source of fixed size, d_k x (d_h + 1) floats whatever the length: it sits between the baseline
(one vector handed over) and softmax attention (every state).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .attention import Attention, register_attention


def feature_map(x: Tensor) -> Tensor:
    """phi(x) = elu(x) + 1 (Katharopoulos et al., 2020, eq. (7)): positive, so every weight is >= 0."""
    return F.elu(x) + 1


@register_attention("linear")
class LinearAttention(Attention):
    """Katharopoulos et al. (2020), eq. (4) and its factored form eq. (5), on the decoder state q_t:

        c_t = phi(Q_t)^T S / phi(Q_t)^T z,   S = sum_i phi(K_i) h_i^T  (d_k, d_h),   z = sum_i phi(K_i)  (d_k,)
        Q_t = W_q q_t,  K_i = W_k h_i  (each with a bias, as their attention layer's projections)

    over the valid positions i. d_k = attention_size, the feature size. The values are the encoder states
    themselves (d_v = d_h), as every other score's are: the context keeps the contract's size and what
    linear attention adds is only its feature size, which the copy experiments sweep. `summarise` computes
    S and z once per sequence, and the context reads only them: a decoder step reads d_k x (d_h + 1) floats,
    not T_enc x d_h, and its work does not grow with the source. The equal per-position form, eq. (4), gives
    the weights

        w_{t,i} = phi(Q_t)^T phi(K_i) / sum_j phi(Q_t)^T phi(K_j)

    which are >= 0 and sum to 1 over the source: `forward` returns them where they are asked for
    (`need_weights`: the maps of the analysis, `decode` and the heatmaps), and an intervention replaces them
    (the context is then the replaced weights' mean of the values). Those read every position's key. As a
    matrix (T_dec, T_enc) they have rank at most d_k. One head; no local window (a window would need the
    per-position form at every step)."""

    def __init__(
        self, query_size: int, key_size: int, attention_size: int | None = None, heads: int = 1, fused: bool = True
    ):
        super().__init__(query_size, key_size, attention_size, heads, fused)
        if not attention_size or attention_size < 1:
            raise ValueError(f"linear attention needs attention_size (its feature size d_k) >= 1, got {attention_size}")
        self.query_proj = nn.Linear(query_size, attention_size)  # W_q
        self.key_proj = nn.Linear(key_size, attention_size)  # W_k

    def restrict_to_window(self, local: str, window: int | None) -> None:
        raise ValueError(f"linear attention reads a summary of the whole source, not a window; got local={local!r}")

    def project_keys(self, encoder_states: Tensor) -> Tensor:
        """(B, T_enc, d_h) -> phi(W_k h) (B, T_enc, d_k)."""
        return feature_map(self.key_proj(encoder_states))

    def summarise(self, keys: Tensor, values: Tensor, mask: Tensor) -> Tensor:
        """keys phi(K) (B, T_enc, d_k), values (B, T_enc, d_h), mask (B, T_enc) -> [S | z] (B, d_k, d_h + 1):
        z as S's last column, so that one product with phi(Q_t) reads both. Padded positions add nothing."""
        features = keys.masked_fill(~mask[..., None], 0.0)
        return features.transpose(1, 2) @ torch.cat([values, values.new_ones(*values.shape[:2], 1)], dim=-1)

    def state_floats(self, length: int) -> int:
        """S and z: d_k x (d_h + 1) floats, whatever the source's `length`."""
        return self.query_proj.out_features * (self.key_size + 1)

    def forward(
        self,
        query: Tensor,
        keys: Tensor,
        values: Tensor,
        mask: Tensor,
        positions: Tensor | None = None,
        summary: Tensor | None = None,
        need_weights: bool = True,
    ) -> tuple[Tensor, Tensor | None]:
        """query (B, T_dec, d_s), keys phi(K) (B, T_enc, d_k), values (B, T_enc, d_h), mask (B, T_enc), summary
        [S | z] (B, d_k, d_h + 1) or None (then summarised here) -> context (B, T_dec, d_h), weights
        (B, T_dec, T_enc), or None without `need_weights`: then, without an intervention, only S and z are read.
        An empty source (z = 0) gets a zero context and zero weights, not 0/0."""
        self.check_shapes(query, keys, values, mask)
        if summary is None:
            summary = self.summarise(keys, values, mask)
        features = feature_map(self.query_proj(query))  # (B, T_dec, d_k): phi(Q_t)
        read = features @ summary  # (B, T_dec, d_h + 1): phi(Q_t)^T S and phi(Q_t)^T z
        normaliser = read[..., -1:]
        normaliser = normaliser.masked_fill(normaliser == 0, 1.0)
        if self.intervention is None:
            weights = self.per_position(features, keys, mask, normaliser) if need_weights else None
            return read[..., :-1] / normaliser, weights
        weights = self.per_position(features, keys, mask, normaliser)
        shape, weights = weights.shape, self.intervention(weights, mask)
        assert weights.shape == shape, f"an intervention gave weights {tuple(weights.shape)}, not {tuple(shape)}"
        return weights @ values, weights if need_weights else None

    @staticmethod
    def per_position(features: Tensor, keys: Tensor, mask: Tensor, normaliser: Tensor) -> Tensor:
        """Eq. (4)'s weights: phi(Q_t) (B, T_dec, d_k), keys phi(K) (B, T_enc, d_k), mask (B, T_enc), normaliser
        phi(Q_t)^T z (B, T_dec, 1) -> (B, T_dec, T_enc), zero on padding. T_enc x d_k products per step."""
        return (features @ keys.transpose(1, 2)).masked_fill(~mask[:, None, :], 0.0) / normaliser
