"""The Transformer encoder-decoder (Vaswani et al., 2017): torch's own nn.Transformer, batch first,
with the copy task's embeddings, positions and readout around it.

Shapes: B batch, T_enc source length, T_dec target length, d model width (`d_model`), V total
vocabulary. Masks: padded source positions are masked as keys in the encoder's self-attention
and in every cross-attention, padded target positions as keys in the decoder's self-attention,
and the decoder's self-attention is causal (step t sees target positions <= t only).

The encoder is nn.TransformerEncoder as torch runs it. The decoder layers are nn.TransformerDecoderLayer
modules whose forward is written out in `_decoder_layer` (post-norm, as torch's default), for two
things torch's does not give: cross-attention weights, per head, and an incremental cache for
greedy decoding. Each layer's cross-attention runs through `attention.Attention`, whose `multihead`
score is that layer's nn.MultiheadAttention itself: the last layer's weights are the model's
attention maps, and a counterfactual (`intervention`) replaces the weights of every layer, since
cross-attention is the decoder's only way to the source.
tests/test_transformer.py checks `_decoder_layer` against torch's own forward.

Greedy decoding caches each decoder layer's self-attention keys and values at the positions decoded
so far: a step runs only the new position through every layer (the causal mask makes earlier
positions' outputs independent of later ones, so nothing before is recomputed). docs/bench.md has
its cost against recomputing the prefix at every step.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .attention import Attention
from .data import BOS, PAD, length_mask


class SinusoidalPositions(nn.Module):
    """PE(p, 2i) = sin(p / 10000^(2i/d)), PE(p, 2i+1) = cos(p / 10000^(2i/d)) (Vaswani et al., 2017,
    section 3.5): no parameters, defined at every position."""

    def __init__(self, d_model: int):
        super().__init__()
        self.d_model = d_model

    def forward(self, positions: Tensor) -> Tensor:
        """positions (T,) -> (T, d)."""
        frequencies = torch.exp(torch.arange(0, self.d_model, 2, device=positions.device) * (-math.log(10000.0) / self.d_model))
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


class TransformerSeq2Seq(nn.Module):
    """Embeddings scaled by sqrt(d) plus positions -> nn.Transformer -> a linear readout to the vocabulary.
    Source and target have their own embeddings, as the GRU models' encoder and decoder do."""

    def __init__(
        self,
        vocab: int,
        d_model: int = 32,
        heads: int = 4,
        layers: int = 2,
        ff_size: int = 64,
        positions: str = "sinusoidal",
        position_rows: int | None = None,  # learned: the table's rows (longest source + 1)
        dropout: float = 0.0,
    ):
        super().__init__()
        self.d_model = d_model
        self.src_embedding = nn.Embedding(vocab, d_model, padding_idx=PAD)
        self.tgt_embedding = nn.Embedding(vocab, d_model, padding_idx=PAD)
        for embedding in (self.src_embedding, self.tgt_embedding):
            # N(0, 1 / d) as in Vaswani et al.'s code (tensor2tensor): times sqrt(d), on the scale of the
            # positions (torch's N(0, 1) would make them sqrt(d) times larger and drown the positions)
            nn.init.normal_(embedding.weight, std=d_model**-0.5)
            with torch.no_grad():
                embedding.weight[PAD].zero_()
        if positions == "sinusoidal":
            self.positions = SinusoidalPositions(d_model)
        elif positions == "learned":
            self.positions = LearnedPositions(position_rows, d_model)
        else:
            raise ValueError(f"unknown positions {positions!r}; choose sinusoidal or learned")
        # torch's encoder as nn.Transformer builds it, but off the prototype nested-tensor path (which warns)
        encoder_layer = nn.TransformerEncoderLayer(d_model, heads, ff_size, dropout, batch_first=True)
        encoder = nn.TransformerEncoder(encoder_layer, layers, nn.LayerNorm(d_model), enable_nested_tensor=False)
        self.transformer = nn.Transformer(d_model, heads, layers, layers, ff_size, dropout, custom_encoder=encoder, batch_first=True)
        layers = self.transformer.decoder.layers
        assert not any(layer.norm_first for layer in layers), "`_decoder_layer` is the post-norm layer"
        # each layer's own nn.MultiheadAttention, read through Attention (the same parameters, not a copy)
        self.cross_attentions = nn.ModuleList(Attention("multihead", d_model, d_model, heads=heads, mha=layer.multihead_attn) for layer in layers)
        self.out = nn.Linear(d_model, vocab)

    @property
    def attention(self) -> Attention:
        """The attention whose weights are the model's maps: the last decoder layer's cross-attention."""
        return self.cross_attentions[-1]

    @property
    def attentions(self) -> list[Attention]:
        """Every attention a counterfactual replaces: each decoder layer's cross-attention."""
        return list(self.cross_attentions)

    @property
    def longest_source(self) -> int | None:
        """The longest source the positions cover (learned: the table's rows - 1); None: any."""
        return self.positions.table.num_embeddings - 1 if isinstance(self.positions, LearnedPositions) else None

    def _embed(self, embedding: nn.Embedding, tokens: Tensor, start: int = 0) -> Tensor:
        """tokens (B, T) at positions start .. start + T - 1 -> (B, T, d)."""
        positions = torch.arange(start, start + tokens.size(1), device=tokens.device)
        return embedding(tokens) * math.sqrt(self.d_model) + self.positions(positions)[None]

    def encode(self, src: Tensor, src_lengths: Tensor) -> tuple[Tensor, Tensor]:
        """src (B, T_enc), lengths (B,) -> memory (B, T_enc, d), src_mask (B, T_enc) True on real positions."""
        src_mask = length_mask(src_lengths, src.size(1))
        memory = self.transformer.encoder(self._embed(self.src_embedding, src), src_key_padding_mask=~src_mask)
        return memory, src_mask

    def _decoder_layer(
        self, layer: nn.TransformerDecoderLayer, x: Tensor, attended: Tensor, memory: Tensor, src_mask: Tensor, cross_attention: Attention
    ) -> tuple[Tensor, Tensor]:
        """nn.TransformerDecoderLayer's forward (post-norm) for the layer inputs `x` (B, T, d), given
        `attended` (B, T, d), its self-attention's output there: then `cross_attention` (the layer's,
        as Attention) over `memory`, then the feed-forward block. -> (B, T, d), and the
        cross-attention weights (B, T, T_enc), mean over heads."""
        x = layer.norm1(x + layer.dropout1(attended))
        context, weights = cross_attention(x, memory, memory, src_mask)
        x = layer.norm2(x + layer.dropout2(context))
        feed_forward = layer.linear2(layer.dropout(layer.activation(layer.linear1(x))))
        return layer.norm3(x + layer.dropout3(feed_forward)), weights

    def forward(self, src: Tensor, src_lengths: Tensor, tgt_in: Tensor) -> tuple[Tensor, Tensor]:
        """Teacher forcing: -> logits (B, T_dec, V), the last layer's cross-attention weights (B, T_dec, T_enc)."""
        memory, src_mask = self.encode(src, src_lengths)
        t_dec = tgt_in.size(1)
        causal = torch.ones(t_dec, t_dec, dtype=torch.bool, device=src.device).triu(1)  # (T_dec, T_dec) True above the diagonal: masked
        padding = tgt_in == PAD  # (B, T_dec): a suffix, so no row is all masked (BOS comes first)
        x = self._embed(self.tgt_embedding, tgt_in)
        for layer, cross_attention in zip(self.transformer.decoder.layers, self.cross_attentions):
            attended = layer.self_attn(x, x, x, attn_mask=causal, key_padding_mask=padding, need_weights=False)[0]
            x, weights = self._decoder_layer(layer, x, attended, memory, src_mask, cross_attention)
        x = self.transformer.decoder.norm(x)
        return self.out(x), weights

    @staticmethod
    def _cached_self_attention(attention: nn.MultiheadAttention, x: Tensor, keys: Tensor, values: Tensor, t: int) -> Tensor:
        """nn.MultiheadAttention (eval mode) of step t's input `x` (B, 1, d) over steps 0 .. t, whose
        projected keys and values are in `keys`, `values` (B, heads, steps, d / heads); step t's are
        written there first. -> (B, 1, d)."""
        batch, _, d = x.shape
        heads = attention.num_heads
        query, key, value = (part.view(batch, heads, 1, d // heads) for part in F.linear(x, attention.in_proj_weight, attention.in_proj_bias).chunk(3, -1))
        keys[:, :, t : t + 1], values[:, :, t : t + 1] = key, value
        context = F.scaled_dot_product_attention(query, keys[:, :, : t + 1], values[:, :, : t + 1])  # (B, heads, 1, d / heads)
        return attention.out_proj(context.reshape(batch, 1, d))

    @torch.no_grad()
    def greedy(self, src: Tensor, src_lengths: Tensor, steps: int) -> tuple[Tensor, Tensor]:
        """Greedy decoding, each step fed its own previous prediction, with each layer's
        self-attention keys and values cached: -> tokens (B, steps), weights (B, steps, T_enc)."""
        if self.longest_source is not None and steps - 1 > self.longest_source:
            raise ValueError(f"learned positions cover sources up to {self.longest_source} symbols, not {steps - 1}")
        memory, src_mask = self.encode(src, src_lengths)
        tokens = torch.full((src.size(0), 1), BOS, dtype=torch.long, device=src.device)
        layers = list(zip(self.transformer.decoder.layers, self.cross_attentions))
        heads = self.cross_attentions[0].heads
        # per layer: keys and values (B, heads, steps, d / heads), filled one step at a time
        cache = [memory.new_zeros(2, src.size(0), heads, steps, self.d_model // heads) for _ in layers]
        outputs, weights = [], []
        for t in range(steps):
            x = self._embed(self.tgt_embedding, tokens, start=t)  # (B, 1, d)
            for (layer, cross_attention), (keys, values) in zip(layers, cache):
                # the newest position attends to every step so far: the causal mask, with nothing to mask
                attended = self._cached_self_attention(layer.self_attn, x, keys, values, t)
                x, step_weights = self._decoder_layer(layer, x, attended, memory, src_mask, cross_attention)
            tokens = self.out(self.transformer.decoder.norm(x)).argmax(-1)  # (B, 1)
            outputs.append(tokens)
            weights.append(step_weights)
        return torch.cat(outputs, 1), torch.cat(weights, 1)
