"""The dot-product scores: Luong's dot and general, the Transformer's scaled dot product, and torch's
nn.MultiheadAttention read as one (`MultiHeadAttention`, which the Transformer's cross-attention runs
through where its weights are wanted). Each registered under its `attention.score` over the mechanics
of `attention.Attention`; registered after the additive score (models/__init__.py imports this module),
in the order the scores are listed everywhere."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .attention import Attention, register_attention


@register_attention("dot")
class DotAttention(Attention):
    """Luong et al. (2015), eq. (8), dot:

        score(q_t, h_i) = q_t^T h_i

    (needs d_s == d_h). With heads, each head's query slice against its slice of h."""

    multi_head = True
    same_sizes = True

    def scores(self, query: Tensor, keys: Tensor) -> Tensor:
        """query (B, T_dec, d_s), keys (B, T_enc, d_s) -> (B, heads, T_dec, T_enc)."""
        return self.split(query) @ self.split(keys).transpose(-1, -2)


@register_attention("scaled_dot")
class ScaledDotAttention(DotAttention):
    """Vaswani et al. (2017), eq. (1), on the decoder state and the encoder states:

        score(q_t, h_i) = q_t^T h_i / sqrt(d)

    d the size of a head's slice (d_s / heads)."""

    def scores(self, query: Tensor, keys: Tensor) -> Tensor:
        """query (B, T_dec, d_s), keys (B, T_enc, d_s) -> (B, heads, T_dec, T_enc)."""
        return super().scores(query, keys) / math.sqrt(self.query_size / self.heads)


@register_attention("general")
class GeneralAttention(DotAttention):
    """Luong et al. (2015), eq. (8), general:

        score(q_t, h_i) = q_t^T W h_i

    W (d_s, d_h): the dot score on W h, which `project_keys` computes once per sequence. With heads,
    each head's query slice against its slice of W h."""

    same_sizes = False

    def __init__(
        self, query_size: int, key_size: int, attention_size: int | None = None, heads: int = 1, fused: bool = True
    ):
        super().__init__(query_size, key_size, attention_size, heads, fused)
        self.key_proj = nn.Linear(key_size, query_size, bias=False)  # W, applied to h

    def project_keys(self, encoder_states: Tensor) -> Tensor:
        """(B, T_enc, d_h) -> W h (B, T_enc, d_s)."""
        return self.key_proj(encoder_states)


@register_attention("multihead")
class MultiHeadAttention(Attention):
    """torch's nn.MultiheadAttention over the encoder states (Vaswani et al., 2017, section 3.2.2):

        MultiHead(q, H) = [head_1; ...; head_h] W^O,  head_j = softmax(q W_j^Q (H W_j^K)^T / sqrt(d / h)) H W_j^V

    (needs d_s == d_h = d). `mha`: an existing module to read through (a Transformer layer's
    cross-attention), else a new one. Without an intervention the module itself runs; with one, the
    same numbers by hand (`scores`, `read`), so that the hook sees each head's weights."""

    multi_head = True
    same_sizes = True
    local_window = False

    def __init__(
        self,
        query_size: int,
        key_size: int,
        attention_size: int | None = None,
        heads: int = 1,
        fused: bool = True,
        mha: nn.MultiheadAttention | None = None,
    ):
        super().__init__(query_size, key_size, attention_size, heads, fused)
        self.mha = mha or nn.MultiheadAttention(query_size, heads, batch_first=True)
        mha_fits = self.mha.batch_first and self.mha.num_heads == heads and self.mha.embed_dim == query_size
        assert mha_fits, "mha does not match"

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
        """As `Attention.forward`; keys are the encoder states (B, T_enc, d). The module runs with its weights
        whatever `need_weights` says: without them torch takes another path (its fused attention), whose numbers may
        differ in rounding."""
        if self.intervention is not None:
            return super().forward(query, keys, values, mask, positions, need_weights=need_weights)
        self.check_shapes(query, keys, values, mask)
        context, weights = self.mha(query, keys, values, key_padding_mask=~mask, average_attn_weights=False)
        empty = ~mask.any(-1)  # (B,) an empty source: torch gives NaN, the hand-written path zero weights
        context = torch.where(empty[:, None, None], self.mha.out_proj.bias, context)
        if not need_weights:
            return context, None
        return context, weights.masked_fill(empty[:, None, None, None], 0.0).mean(1)

    def scores(self, query: Tensor, keys: Tensor) -> Tensor:
        """query (B, T_dec, d), keys the encoder states (B, T_enc, d) -> (B, heads, T_dec, T_enc)."""
        query, keys = F.linear(query, *self._in_proj(0)), F.linear(keys, *self._in_proj(1))
        return self.split(query) @ self.split(keys).transpose(-1, -2) / math.sqrt(self.query_size / self.heads)

    def read(self, weights: Tensor, values: Tensor) -> Tensor:
        """weights (B, heads, T_dec, T_enc), values the encoder states (B, T_enc, d) -> W^O of the heads'
        contexts over the projected values, (B, T_dec, d)."""
        return self.mha.out_proj(super().read(weights, F.linear(values, *self._in_proj(2))))

    def _in_proj(self, i: int) -> tuple[Tensor, Tensor]:
        """nn.MultiheadAttention's query (0), key (1) or value (2) projection: (weight, bias)."""
        size = self.query_size
        return self.mha.in_proj_weight[i * size : (i + 1) * size], self.mha.in_proj_bias[i * size : (i + 1) * size]
