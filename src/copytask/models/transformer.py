"""The Transformer encoder-decoder (Vaswani et al., 2017): torch's own nn.Transformer, batch first,
with the copy task's embeddings, positions and readout around it.

Shapes: B batch, T_enc source length, T_dec target length, d model width (`d_model`), V total
vocabulary. Masks: padded source positions are masked as keys in the encoder's self-attention
and in every cross-attention; the decoder's self-attention is causal (step t sees target positions
<= t only) and masks nothing else. The target's padding is a suffix, so a real position never sees
it, and with no mask by token value greedy decoding (which feeds back whatever the model emitted,
PAD included) computes what teacher forcing on the same tokens computes.

The parameters are nn.Transformer's modules (its state_dict, so a run's checkpoint loads as it did);
the layers' forward is written out here (post-norm, as torch's default), for three things torch's
does not give:
- a training step's attention in `transformer_ops.attention` on CPU (each (sequence, head) slice in cache,
  no weights kept: docs/bench.md has the profile that chose it), else in torch's batched products;
  and on CPU without dropout each layer in one call of `transformer_ops.transformer_layer` (the ops below
  and autograd's formulas for them in C++: the same numbers to the bit, without a dozen ops' and
  autograd nodes' dispatch a layer);
- cross-attention weights, per head: when weights are wanted (outside autograd, or with a
  counterfactual set), each decoder layer's cross-attention runs through
  `dot_attention.MultiHeadAttention` on that layer's nn.MultiheadAttention itself: the last layer's
  weights are the model's attention maps, and a counterfactual (`intervention`) replaces the weights
  of every layer, since cross-attention is the decoder's only way to the source;
- an incremental cache for greedy decoding and beam search (`decoding`).
tests/test_transformer.py checks every path against torch's own nn.Transformer, forward and gradients.

Decoding caches each decoder layer's self-attention keys and values at the positions decoded so far:
a step runs only the new position through every layer (the causal mask makes earlier positions'
outputs independent of later ones). The memory's cross-attention keys and values are projected once.
On CPU (float32, fused) a step's attention runs in `transformer_ops.attention_step` on caches that hold the
keys and values transposed: the tokens of nn.MultiheadAttention's ops (but where two logits tie
to float rounding), the weights to float rounding. Elsewhere (GPU, `fused=False`) it runs
nn.MultiheadAttention's own ops, and the tokens and weights are the module's to the bit.
docs/bench.md has the caches' costs.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..data.batches import length_mask
from ..data.vocab import PAD
from ..kernels import ops, transformer_ops
from .attention import masked_softmax
from .dot_attention import MultiHeadAttention
from .positions import LearnedPositions, SinusoidalPositions
from .protocol import Seq2SeqModel


def scaled_dot_product(
    q: Tensor, k: Tensor, v: Tensor, heads: int, key_mask: Tensor | None, causal: bool, dropout: float = 0.0
) -> Tensor:
    """softmax(q_h k_h^T / sqrt(d / heads) + masks) v_h for each head h, in torch's batched products
    (what `transformer_ops.attention` computes, with dropout on the weights as nn.MultiheadAttention's):
    q (B, T, d), k and v (B, S, d), key_mask (B, S) True on real keys or None, causal: query t sees
    keys <= t -> (B, T, d), the heads side by side. A query that sees no key gets a zero output."""
    (_, steps, d), keys = q.shape, k.size(1)
    split = lambda x: x.unflatten(-1, (heads, d // heads)).transpose(1, 2)  # noqa: E731  (B, heads, T, d / heads)
    scores = split(q) @ split(k).transpose(-1, -2) / math.sqrt(d // heads)  # (B, heads, T, S)
    allowed = torch.ones(1, steps, keys, dtype=torch.bool, device=q.device)
    if causal:
        allowed = allowed.tril()
    if key_mask is not None:
        allowed = allowed & key_mask[:, None, :]  # (B, T, S)
    weights = F.dropout(masked_softmax(scores, allowed[:, None]), dropout)
    return (weights @ split(v)).transpose(1, 2).flatten(2)


class TransformerSeq2Seq(Seq2SeqModel):
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
        fused: bool = True,  # a training step's attention in transformer_ops.attention on CPU
    ):
        super().__init__()
        self.d_model = d_model
        self.dropout = dropout
        self.fused = fused
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
        self.transformer = nn.Transformer(
            d_model, heads, layers, layers, ff_size, dropout, custom_encoder=encoder, batch_first=True
        )
        layers = self.transformer.decoder.layers
        assert not any(layer.norm_first or layer.activation is not F.relu for layer in [*layers, *encoder.layers]), (
            "the layers here are post-norm, ReLU"
        )
        # each layer's own nn.MultiheadAttention, read through MultiHeadAttention (the same parameters, not a copy)
        self.cross_attentions = nn.ModuleList(
            MultiHeadAttention(d_model, d_model, heads=heads, fused=fused, mha=layer.multihead_attn) for layer in layers
        )
        self.out = nn.Linear(d_model, vocab)

    @property
    def attention(self) -> MultiHeadAttention:
        """The attention whose weights are the model's maps: the last decoder layer's cross-attention."""
        return self.cross_attentions[-1]

    @property
    def attentions(self) -> list[MultiHeadAttention]:
        """Every attention a counterfactual replaces: each decoder layer's cross-attention."""
        return list(self.cross_attentions)

    @property
    def longest_source(self) -> int | None:
        """The longest source the positions cover (learned: the table's rows - 1); None: any."""
        return self.positions.table.num_embeddings - 1 if isinstance(self.positions, LearnedPositions) else None

    def state_floats(self, length: int) -> int:
        """Floats per sequence the decoder can read of a source of `length` symbols: the encoder's output,
        which every cross-attention reads (length x d)."""
        return length * self.d_model

    def _embed(self, embedding: nn.Embedding, tokens: Tensor, start: int = 0) -> Tensor:
        """tokens (B, T) at positions start .. start + T - 1 -> (B, T, d)."""
        positions = torch.arange(start, start + tokens.size(1), device=tokens.device)
        return embedding(tokens) * math.sqrt(self.d_model) + self.positions(positions)[None]

    def encode(self, src: Tensor, src_lengths: Tensor) -> tuple[Tensor, Tensor]:
        """src (B, T_enc), lengths (B,) -> memory (B, T_enc, d), src_mask (B, T_enc) True on real positions.
        nn.TransformerEncoderLayer's forward (post-norm), each layer, then the encoder's final norm."""
        src_mask = length_mask(src_lengths, src.size(1))
        x = self._embed(self.src_embedding, src)
        if self._layer_fused(x):
            mask = ops.padding(src_mask)
            for layer in self.transformer.encoder.layers:
                x = transformer_ops.transformer_layer(layer, x, None, mask)
        else:
            for layer in self.transformer.encoder.layers:
                x = layer.norm1(x + layer.dropout1(self._attend(layer.self_attn, x, None, src_mask)))
                x = layer.norm2(x + layer.dropout2(self._feed_forward(layer, x)))
        return self.transformer.encoder.norm(x), src_mask

    def _layer_fused(self, x: Tensor) -> bool:
        """Whether a layer runs in one call of `transformer_ops.transformer_layer`: fused, float32 on CPU, no
        dropout, and no autocast (whose lower precision is its ops' own: torch's ops run it)."""
        return (
            self.fused
            and not (self.training and self.dropout)
            and ops.usable(x)
            and not torch.is_autocast_enabled(x.device.type)
        )

    def _attend(
        self,
        attention: nn.MultiheadAttention,
        x: Tensor,
        memory: Tensor | None,
        key_mask: Tensor | None,
        causal: bool = False,
    ) -> Tensor:
        """nn.MultiheadAttention's output, without its weights, for the queries `x` (B, T, d) over
        `memory` (B, S, d), or over `x` itself (None: self-attention, one product for the query, key
        and value projections); key_mask (B, S) True on real keys, or None -> (B, T, d)."""
        d = x.size(-1)
        if memory is None:  # q | k | v (B, T, 3d)
            queries, keys_values = F.linear(x, attention.in_proj_weight, attention.in_proj_bias), None
        else:  # q (B, T, d), and k | v (B, S, 2d)
            (w_q, w_kv), (b_q, b_kv) = (
                attention.in_proj_weight.split([d, 2 * d]),
                attention.in_proj_bias.split([d, 2 * d]),
            )
            queries, keys_values = F.linear(x, w_q, b_q), F.linear(memory, w_kv, b_kv)
        dropout = attention.dropout if self.training else 0.0
        if self.fused and not dropout and ops.usable(queries):
            context = transformer_ops.attention(queries, keys_values, attention.num_heads, key_mask, causal)
        else:
            q, k, v = queries.chunk(3, -1) if keys_values is None else (queries, *keys_values.chunk(2, -1))
            context = scaled_dot_product(q, k, v, attention.num_heads, key_mask, causal, dropout)
        return attention.out_proj(context)

    @staticmethod
    def _feed_forward(layer: nn.TransformerEncoderLayer | nn.TransformerDecoderLayer, x: Tensor) -> Tensor:
        return layer.linear2(layer.dropout(layer.activation(layer.linear1(x))))

    def _decoder_layer(
        self,
        layer: nn.TransformerDecoderLayer,
        x: Tensor,
        attended: Tensor,
        cross_attend: Callable[[Tensor], tuple[Tensor, Tensor | None]],
    ) -> tuple[Tensor, Tensor | None]:
        """nn.TransformerDecoderLayer's forward (post-norm) for the layer inputs `x` (B, T, d), given
        `attended` (B, T, d), its self-attention's output there: then the cross-attention
        `cross_attend` (queries (B, T, d) -> context (B, T, d), weights (B, T, T_enc) or None), then
        the feed-forward block. -> (B, T, d), and the cross-attention's weights."""
        x = layer.norm1(x + layer.dropout1(attended))
        context, weights = cross_attend(x)
        x = layer.norm2(x + layer.dropout2(context))
        return layer.norm3(x + layer.dropout3(self._feed_forward(layer, x))), weights

    def forward(self, src: Tensor, src_lengths: Tensor, tgt_in: Tensor) -> tuple[Tensor, Tensor | None]:
        """Teacher forcing: -> logits (B, T_dec, V), and the last layer's cross-attention weights
        (B, T_dec, T_enc) where they are wanted: outside autograd (evaluation, analysis) or with a
        counterfactual set. A training step (autograd on) gets None and skips computing them."""
        memory, src_mask = self.encode(src, src_lengths)
        weighted = not torch.is_grad_enabled() or any(
            attention.intervention is not None for attention in self.cross_attentions
        )
        x = self._embed(self.tgt_embedding, tgt_in)
        if not weighted and self._layer_fused(x):
            mask = ops.padding(src_mask)
            for layer in self.transformer.decoder.layers:
                x = transformer_ops.transformer_layer(layer, x, memory, mask)
            return self.out(self.transformer.decoder.norm(x)), None
        for layer, cross_attention in zip(self.transformer.decoder.layers, self.cross_attentions):
            attended = self._attend(layer.self_attn, x, None, None, causal=True)
            if weighted:  # the layer's cross-attention as MultiHeadAttention: its weights, and a counterfactual's hook
                cross_attend = partial(cross_attention, keys=memory, values=memory, mask=src_mask)
            else:
                cross_attend = lambda queries: (self._attend(layer.multihead_attn, queries, memory, src_mask), None)  # noqa: E731
            x, weights = self._decoder_layer(layer, x, attended, cross_attend)
        x = self.transformer.decoder.norm(x)
        return self.out(x), weights

    @staticmethod
    def _cached_self_attention(attention: nn.MultiheadAttention, cache: Tensor, x: Tensor, t: int) -> Tensor:
        """nn.MultiheadAttention (eval mode) of step t's input `x` (B, 1, d) over steps 0 .. t, whose
        projected keys and values are in `cache` (2, B, heads, steps, d / heads); step t's are
        written there first. -> (B, 1, d)."""
        batch, _, d = x.shape
        heads = attention.num_heads
        query, key, value = (
            part.view(batch, heads, 1, d // heads)
            for part in F.linear(x, attention.in_proj_weight, attention.in_proj_bias).chunk(3, -1)
        )
        keys, values = cache
        keys[:, :, t : t + 1], values[:, :, t : t + 1] = key, value
        context = F.scaled_dot_product_attention(
            query, keys[:, :, : t + 1], values[:, :, : t + 1]
        )  # (B, heads, 1, d / heads)
        return attention.out_proj(context.reshape(batch, 1, d))

    @staticmethod
    def _step_self_attention(attention: nn.MultiheadAttention, cache: Tensor, x: Tensor, t: int) -> Tensor:
        """`_cached_self_attention` in transformer_ops.attention_step, the same numbers to float rounding:
        `cache` (2, B, heads, d / heads, C) holds the keys and values transposed. -> (B, 1, d)."""
        batch, _, d = x.shape
        query, key, value = F.linear(x[:, 0], attention.in_proj_weight, attention.in_proj_bias).chunk(
            3, -1
        )  # each (B, d)
        cache[0, ..., t], cache[1, ..., t] = (
            key.view(batch, attention.num_heads, -1),
            value.view(batch, attention.num_heads, -1),
        )
        context, _ = transformer_ops.attention_step(query, cache[0], cache[1], query.new_empty(0), t + 1)  # (B, d)
        return attention.out_proj(context)[:, None]

    @staticmethod
    def _project_memory(attention: nn.MultiheadAttention, memory: Tensor) -> tuple[Tensor, Tensor]:
        """A cross-attention's keys and values of `memory` (B, T_enc, d), each (B * heads, T_enc,
        d / heads), projected as F.multi_head_attention_forward projects them inside
        nn.MultiheadAttention (sequence first, one product for both, the same layout), so that
        `_cached_cross_attention` computes the module's numbers to the bit."""
        d, heads = attention.embed_dim, attention.num_heads
        projected = F.linear(
            memory.transpose(0, 1), attention.in_proj_weight[d:], attention.in_proj_bias[d:]
        )  # (T_enc, B, 2d)
        keys, values = projected.unflatten(-1, (2, d)).permute(2, 0, 1, 3).contiguous()  # each (T_enc, B, d)
        return tuple(part.view(part.size(0), -1, d // heads).transpose(0, 1) for part in (keys, values))

    @staticmethod
    def _cached_cross_attention(
        attention: nn.MultiheadAttention, keys: Tensor, values: Tensor, mask_bias: Tensor, empty: Tensor, x: Tensor
    ) -> tuple[Tensor, Tensor]:
        """What the layer's cross-attention as MultiHeadAttention (no counterfactual) computes for step t's
        queries `x` (B, 1, d), op for op (nn.MultiheadAttention's weighted path, an empty source's
        zero weights), given the memory's keys and values from `_project_memory`, `mask_bias`
        (B * heads, 1, T_enc): 0 on real positions, -inf on padding, and `empty` (B,): True where a
        source has no position at all. -> context (B, 1, d), weights (B, 1, T_enc), mean over heads."""
        batch, _, d = x.shape
        heads = attention.num_heads
        query = F.linear(x.transpose(0, 1), attention.in_proj_weight[:d], attention.in_proj_bias[:d])  # (1, B, d)
        query = query.view(1, batch * heads, d // heads).transpose(0, 1)  # (B * heads, 1, d / heads)
        weights = F.softmax(
            torch.baddbmm(mask_bias, query * math.sqrt(1.0 / (d // heads)), keys.transpose(-2, -1)), dim=-1
        )
        context = attention.out_proj(torch.bmm(weights, values).transpose(0, 1).reshape(batch, d))[:, None]  # (B, 1, d)
        # an empty source: Attention's zero weights and the output projection's bias, where torch gives NaN
        weights = weights.view(batch, heads, 1, -1).masked_fill(empty[:, None, None, None], 0.0)
        return torch.where(empty[:, None, None], attention.out_proj.bias, context), weights.mean(1)

    @staticmethod
    def _transposed_memory(attention: nn.MultiheadAttention, memory: Tensor) -> Tensor:
        """A cross-attention's keys and values of `memory` (B, T_enc, d) as transformer_ops.attention_step
        takes them: (2, B, heads, d / heads, C), transposed, zero from T_enc to C (a multiple of 8)."""
        batch, source, d = memory.shape
        heads = attention.num_heads
        projected = F.linear(memory, attention.in_proj_weight[d:], attention.in_proj_bias[d:])  # (B, T_enc, 2d): k | v
        cache = memory.new_zeros(2, batch, heads, d // heads, transformer_ops.cache_length(source))
        cache[..., :source] = projected.view(batch, source, 2, heads, d // heads).permute(2, 0, 3, 4, 1)
        return cache

    @staticmethod
    def _step_cross_attention(
        attention: nn.MultiheadAttention, cache: Tensor, mask: Tensor, source: int, x: Tensor
    ) -> tuple[Tensor, Tensor]:
        """`_cached_cross_attention` in transformer_ops.attention_step, the same numbers to float rounding (an
        empty source: zero weights, and the projection of a zero context, its bias), on the memory's
        keys and values from `_transposed_memory`, `mask` (ops.padding of the source's (B, T_enc))
        and its length T_enc -> context (B, 1, d), weights (B, 1, T_enc), mean over heads."""
        d = x.size(-1)
        query = F.linear(x[:, 0], attention.in_proj_weight[:d], attention.in_proj_bias[:d])  # (B, d)
        context, weights = transformer_ops.attention_step(query, cache[0], cache[1], mask, source)
        return attention.out_proj(context)[:, None], weights.mean(1, keepdim=True)

    def _step_self_attentions(self, memory: Tensor, steps: int) -> tuple[list[Callable], list[Tensor]]:
        """Each decoder layer's self-attention for one step at a time, and its keys' and values' caches, filled a step
        at a time: on CPU (fused) transposed, (2, B, heads, d / heads, C), else (2, B, heads, steps, d / heads)."""
        batch, heads = memory.size(0), self.cross_attentions[0].heads
        head_size = self.d_model // heads
        layers = self.transformer.decoder.layers
        if self.fused and ops.usable(memory):
            length = transformer_ops.cache_length(steps)
            caches = [memory.new_zeros(2, batch, heads, head_size, length) for _ in layers]
            attend = self._step_self_attention
        else:
            caches = [memory.new_zeros(2, batch, heads, steps, head_size) for _ in layers]
            attend = self._cached_self_attention
        return [partial(attend, layer.self_attn, cache) for layer, cache in zip(layers, caches)], caches

    def _step_cross_attentions(self, memory: Tensor, src_mask: Tensor) -> list[Callable]:
        """Each decoder layer's cross-attention for one step, the memory's keys and values projected
        once; with a counterfactual set, `MultiHeadAttention`, which projects them at every step (its
        hook sees the weights there)."""
        layers = list(zip(self.transformer.decoder.layers, self.cross_attentions))
        if any(cross_attention.intervention is not None for _, cross_attention in layers):
            return [partial(attention, keys=memory, values=memory, mask=src_mask) for _, attention in layers]
        if self.fused and ops.usable(memory):
            mask = ops.padding(src_mask)
            return [
                partial(
                    self._step_cross_attention,
                    layer.multihead_attn,
                    self._transposed_memory(layer.multihead_attn, memory),
                    mask,
                    memory.size(1),
                )
                for layer, _ in layers
            ]
        # nn.MultiheadAttention's mask as it builds it: 0 or -inf per key, one row per sequence and head
        heads = self.cross_attentions[0].heads
        mask_bias = memory.new_zeros(src_mask.shape).masked_fill_(~src_mask, float("-inf"))
        mask_bias = mask_bias[:, None, None, :].expand(-1, heads, -1, -1).reshape(-1, 1, src_mask.size(1))
        empty = ~src_mask.any(-1)  # (B,)
        return [
            partial(
                self._cached_cross_attention,
                layer.multihead_attn,
                *self._project_memory(layer.multihead_attn, memory),
                mask_bias,
                empty,
            )
            for layer, _ in layers
        ]

    def decoding(self, src: Tensor, src_lengths: Tensor, steps: int, need_weights: bool = True) -> TransformerDecoding:
        """The encoder run on `src` (B, T_enc) and each decoder layer's step attentions for up to `steps` steps:
        a decoding fed one token a step (`models.decoding`: greedy and beam search both drive it), its steps'
        weights only with `need_weights` (the attention computes them all the same)."""
        if self.longest_source is not None and steps - 1 > self.longest_source:
            raise ValueError(f"learned positions cover sources up to {self.longest_source} symbols, not {steps - 1}")
        memory, src_mask = self.encode(src, src_lengths)
        self_attends, caches = self._step_self_attentions(memory, steps)
        cross_attends = self._step_cross_attentions(memory, src_mask)
        return TransformerDecoding(
            self, caches, list(zip(self.transformer.decoder.layers, self_attends, cross_attends)), need_weights
        )


class TransformerDecoding:
    """A Transformer's decoder while it decodes (see the module); the self-attention caches hold the rows
    along dimension 1, the memory's keys and values stay."""

    def __init__(self, model: TransformerSeq2Seq, caches: list[Tensor], layers: list[tuple], need_weights: bool):
        self.model, self.caches, self.layers = model, caches, layers  # layers: (layer, self_attend, cross_attend)
        self.need_weights = need_weights

    def step(self, tokens: Tensor, t: int) -> tuple[Tensor, Tensor | None]:
        """tokens (B,) fed at output step t -> logits (B, V), weights (B, T_enc) of the last layer or None."""
        model = self.model
        x = model._embed(model.tgt_embedding, tokens[:, None], start=t)  # (B, 1, d)
        for layer, self_attend, cross_attend in self.layers:
            # the newest position attends to every step so far: the causal mask, with nothing to mask
            x, weights = model._decoder_layer(layer, x, self_attend(x, t), cross_attend)
        return model.out(model.transformer.decoder.norm(x))[:, 0], weights[:, 0] if self.need_weights else None

    def reorder(self, rows: Tensor) -> None:
        """Row i of every cache becomes row `rows[i]` (in place: the layers' partials hold the caches)."""
        for cache in self.caches:
            cache.copy_(cache.index_select(1, rows))
