"""The classical implementation, written the way the well-known tutorials write it: the test
oracle for the fast paths in `recurrent` / `attention`, and the benchmark's yardstick.

Every decoder runs one target position at a time, also under teacher forcing and also for
Luong (the decoder GRU is called on a length-1 sequence per step), and attention re-projects
the encoder states at every step. Nothing is batched over time, nothing is cached.

Parameter names and shapes equal `Seq2Seq`'s, so a project state_dict loads here and both must
compute the same numbers. The encoder is the project's, on torch's own nn.GRU (one call, packed
when lengths differ): that is the classical form; the project runs the same layer in its fused
CPU kernel (`kernels`). The Transformer's (`ReferenceTransformer`, at the end) is the tutorials'
form too.
"""

from __future__ import annotations

import math
import re

import torch
from torch import Tensor, nn

from ..data.batches import length_mask
from ..data.vocab import BOS, PAD
from ..families.gru import DECODERS
from ..models.positions import LearnedPositions, SinusoidalPositions
from ..models.recurrent import Encoder

REFERENCE_SCORES = (None, "additive", "dot", "general")  # the classical ones (None: a decoder without attention)


class ReferenceAttention(nn.Module):
    """One decoder step: query (B, d_s) against encoder states (B, T_enc, d_h)."""

    def __init__(self, score: str, query_size: int, key_size: int, attention_size: int | None):
        super().__init__()
        self.score = score
        if score == "additive":
            self.query_proj = nn.Linear(query_size, attention_size, bias=False)
            self.key_proj = nn.Linear(key_size, attention_size)
            self.v = nn.Linear(attention_size, 1, bias=False)
        elif score == "general":
            self.key_proj = nn.Linear(key_size, query_size, bias=False)

    def forward(self, query: Tensor, encoder_states: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
        """-> context (B, d_h), weights (B, T_enc)."""
        if self.score == "additive":
            # the keys U_a h are projected again at every step, as the tutorials do
            hidden = torch.tanh(self.query_proj(query)[:, None, :] + self.key_proj(encoder_states))  # (B, T_enc, A)
            scores = self.v(hidden)[:, :, 0]
        elif self.score == "general":
            scores = torch.bmm(self.key_proj(encoder_states), query[:, :, None])[:, :, 0]
        else:
            scores = torch.bmm(encoder_states, query[:, :, None])[:, :, 0]  # (B, T_enc)
        weights = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
        context = torch.bmm(weights[:, None, :], encoder_states)[:, 0]  # (B, d_h)
        return context, weights


class ReferenceDecoder(nn.Module):
    """plain, bahdanau or luong, one step at a time; module names as in `recurrent`'s decoders."""

    def __init__(
        self,
        kind: str,
        vocab: int,
        embedding_size: int,
        hidden_size: int,
        score: str | None,
        attention_size: int | None,
    ):
        super().__init__()
        if kind not in DECODERS:
            raise ValueError(f"unknown decoder {kind!r}; choose one of {', '.join(DECODERS)}")
        self.kind = kind
        self.embedding = nn.Embedding(vocab, embedding_size, padding_idx=PAD)
        if kind == "bahdanau":
            self.attention = ReferenceAttention("additive", hidden_size, hidden_size, attention_size)
            self.cell = nn.GRUCell(embedding_size + hidden_size, hidden_size)
            self.out = nn.Linear(2 * hidden_size, vocab)
            return
        self.rnn = nn.GRU(embedding_size, hidden_size, batch_first=True)
        if kind == "luong":
            self.attention = ReferenceAttention(score, hidden_size, hidden_size, attention_size)
            self.combine = nn.Linear(2 * hidden_size, hidden_size)
        self.out = nn.Linear(hidden_size, vocab)

    def initial_state(self, final: Tensor) -> Tensor:
        return final  # s_0: the encoder's final state

    def step(self, tokens: Tensor, hidden: Tensor, encoder_states: Tensor, src_mask: Tensor):
        """tokens (B,), hidden s_{t-1} (B, H) -> logits (B, V), weights (B, T_enc) or None, s_t (B, H)."""
        embedded = self.embedding(tokens)  # (B, E)
        if self.kind == "bahdanau":
            context, weights = self.attention(hidden, encoder_states, src_mask)  # query s_{t-1}
            hidden = self.cell(torch.cat([embedded, context], dim=-1), hidden)
            return self.out(torch.cat([hidden, context], dim=-1)), weights, hidden
        _, hidden = self.rnn(embedded[:, None], hidden[None])
        hidden = hidden[0]
        if self.kind == "plain":
            return self.out(hidden), None, hidden
        context, weights = self.attention(hidden, encoder_states, src_mask)  # query s_t
        return self.out(torch.tanh(self.combine(torch.cat([hidden, context], dim=-1)))), weights, hidden


class ReferenceRNNEncDecDecoder(nn.Module):
    """Cho et al. (2014)'s decoder (appendix A.1), one step at a time with each gate written out;
    the summary's and the input's shares of the gates are computed again at every step. Module
    names as in `recurrent.RNNEncDecDecoder`:

        c = tanh(V h_N),  s_0 = tanh(V' c)
        r = sigmoid(W_r e + U_r s + C_r c),  z = sigmoid(W_z e + U_z s + C_z c)
        s' = z * s + (1 - z) * tanh(W e + r * (U s + C c)),  logits = W_o [s'; e; c]
    """

    def __init__(self, vocab: int, embedding_size: int, hidden_size: int):
        super().__init__()
        self.embedding = nn.Embedding(vocab, embedding_size, padding_idx=PAD)
        self.summary = nn.Linear(hidden_size, hidden_size)
        self.init = nn.Linear(hidden_size, hidden_size)
        self.input_gates = nn.Linear(embedding_size, 3 * hidden_size)
        self.state_gates = nn.Linear(hidden_size, 3 * hidden_size)
        self.summary_gates = nn.Linear(hidden_size, 3 * hidden_size, bias=False)
        self.out = nn.Linear(2 * hidden_size + embedding_size, vocab)

    def initial_state(self, final: Tensor) -> tuple[Tensor, Tensor]:
        """The encoder's final state h_N (B, H) -> (s_0, c), each (B, H)."""
        summary = torch.tanh(self.summary(final))
        return torch.tanh(self.init(summary)), summary

    def step(self, tokens: Tensor, hidden: tuple[Tensor, Tensor], encoder_states: Tensor, src_mask: Tensor):
        """tokens (B,), hidden (s_{t-1}, c) -> logits (B, V), None, (s_t, c)."""
        state, summary = hidden
        embedded = self.embedding(tokens)  # (B, E)
        input_r, input_z, input_n = self.input_gates(embedded).chunk(3, dim=-1)
        state_r, state_z, state_n = self.state_gates(state).chunk(3, dim=-1)
        summary_r, summary_z, summary_n = self.summary_gates(summary).chunk(3, dim=-1)
        reset = torch.sigmoid(input_r + state_r + summary_r)
        update = torch.sigmoid(input_z + state_z + summary_z)
        candidate = torch.tanh(input_n + reset * (state_n + summary_n))
        state = update * state + (1 - update) * candidate
        return self.out(torch.cat([state, embedded, summary], dim=-1)), None, (state, summary)


class ReferenceSeq2Seq(nn.Module):
    """Same constructor, parameters and interface as `recurrent.Seq2Seq`."""

    def __init__(
        self,
        vocab: int,
        decoder: str,
        score: str | None = None,
        embedding_size: int = 32,
        hidden_size: int = 64,
        attention_size: int | None = None,
        bidirectional: bool = True,
        heads: int = 1,
        fused: bool = False,  # taken for Seq2Seq's signature; the classical form always runs torch's ops
        local: str | None = None,
        window: int | None = None,
    ):
        super().__init__()
        if heads != 1:
            raise ValueError(f"the reference implementation is single-head, got heads={heads}")
        if local is not None or score not in REFERENCE_SCORES:
            raise ValueError(
                "the reference implementation has global additive, dot and general scores only, "
                f"got {score!r} local={local!r}"
            )
        self.hidden_size = hidden_size
        self.encoder = Encoder(vocab, embedding_size, hidden_size, bidirectional, fused=False)
        if decoder == "rnnencdec":
            self.decoder = ReferenceRNNEncDecDecoder(vocab, embedding_size, hidden_size)
        else:
            self.decoder = ReferenceDecoder(decoder, vocab, embedding_size, hidden_size, score, attention_size)

    @property
    def attention(self) -> ReferenceAttention | None:
        return getattr(self.decoder, "attention", None)

    def state_floats(self, length: int) -> int:
        """As `Seq2Seq.state_floats` for the classical scores: the final state, and every encoder state if attending."""
        return self.hidden_size * (1 + (0 if self.attention is None else length))

    def _decode(self, src: Tensor, src_lengths: Tensor, inputs: Tensor | None, steps: int):
        """Step by step; feeds `inputs[:, t]` (teacher forcing) or, without inputs, the previous
        argmax. -> logits (B, steps, V), weights (B, steps, T_enc) or None."""
        encoder_states, final = self.encoder(src, src_lengths)
        hidden = self.decoder.initial_state(final)
        src_mask = length_mask(src_lengths, src.size(1))
        tokens = torch.full((src.size(0),), BOS, dtype=torch.long, device=src.device)
        logits, weights = [], []
        for t in range(steps):
            if inputs is not None:
                tokens = inputs[:, t]
            step_logits, step_weights, hidden = self.decoder.step(tokens, hidden, encoder_states, src_mask)
            tokens = step_logits.argmax(-1)
            logits.append(step_logits)
            weights.append(step_weights)
        return torch.stack(logits, 1), (None if self.attention is None else torch.stack(weights, 1))

    def forward(self, src: Tensor, src_lengths: Tensor, tgt_in: Tensor) -> tuple[Tensor, Tensor | None]:
        """Teacher forcing: -> logits (B, T_dec, V), weights (B, T_dec, T_enc) or None."""
        return self._decode(src, src_lengths, tgt_in, tgt_in.size(1))

    @torch.no_grad()
    def greedy(
        self, src: Tensor, src_lengths: Tensor, steps: int, need_weights: bool = True
    ) -> tuple[Tensor, Tensor | None]:
        """-> tokens (B, steps), weights (B, steps, T_enc) or None (also without `need_weights`: the tutorials
        compute them all the same)."""
        logits, weights = self._decode(src, src_lengths, None, steps)
        return logits.argmax(-1), weights if need_weights else None


# -- The Transformer ---------------------------------------------------------------------------
#
# `model=transformer` written the way the tutorials write it (the "Attention is All You Need"
# notebook of bentrevett/pytorch-seq2seq, The Annotated Transformer): separate query, key and value
# projections per attention, the scores masked and softmaxed in torch's batched products, the
# weights kept, and greedy decoding running the whole decoder again over the prefix at every step
# (no cache). The layers are `transformer.TransformerSeq2Seq`'s: post-norm (as torch's default),
# ReLU, final encoder and decoder norms, and the same masks (the decoder's self-attention causal
# only). It loads a TransformerSeq2Seq's state_dict (`load_state_dict` translates the names), and
# tests/test_reference.py checks that both compute the same logits, weights, gradients and greedy outputs.


class ReferenceMultiHeadAttention(nn.Module):
    """Multi-head scaled dot-product attention as the tutorials write it."""

    def __init__(self, d_model: int, heads: int, dropout: float):
        super().__init__()
        self.heads, self.head_size = heads, d_model // heads
        self.fc_q, self.fc_k, self.fc_v, self.fc_o = (nn.Linear(d_model, d_model) for _ in range(4))
        self.dropout = nn.Dropout(dropout)

    def forward(self, query: Tensor, key: Tensor, value: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
        """query (B, T_q, d), key and value (B, T_k, d), mask (B or 1, T_q or 1, T_k) True where a query
        may attend -> (B, T_q, d), weights (B, heads, T_q, T_k)."""
        batch = query.size(0)
        q = (
            self.fc_q(query).view(batch, -1, self.heads, self.head_size).permute(0, 2, 1, 3)
        )  # (B, heads, T_q, d / heads)
        k = self.fc_k(key).view(batch, -1, self.heads, self.head_size).permute(0, 2, 1, 3)
        v = self.fc_v(value).view(batch, -1, self.heads, self.head_size).permute(0, 2, 1, 3)
        energy = torch.matmul(q, k.permute(0, 1, 3, 2)) / math.sqrt(self.head_size)
        energy = energy.masked_fill(~mask[:, None], float("-inf"))
        attention = torch.softmax(energy, dim=-1)
        x = torch.matmul(self.dropout(attention), v).permute(0, 2, 1, 3).contiguous()
        return self.fc_o(x.view(batch, -1, self.heads * self.head_size)), attention


class ReferenceFeedForward(nn.Module):
    def __init__(self, d_model: int, ff_size: int, dropout: float):
        super().__init__()
        self.fc_1, self.fc_2 = nn.Linear(d_model, ff_size), nn.Linear(ff_size, d_model)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc_2(self.dropout(torch.relu(self.fc_1(x))))


class ReferenceEncoderLayer(nn.Module):
    def __init__(self, d_model: int, heads: int, ff_size: int, dropout: float):
        super().__init__()
        self.self_attention = ReferenceMultiHeadAttention(d_model, heads, dropout)
        self.self_attention_norm = nn.LayerNorm(d_model)
        self.feed_forward = ReferenceFeedForward(d_model, ff_size, dropout)
        self.feed_forward_norm = nn.LayerNorm(d_model)
        self.dropout = nn.Dropout(dropout)

    def forward(self, src: Tensor, src_mask: Tensor) -> Tensor:
        attended, _ = self.self_attention(src, src, src, src_mask)
        src = self.self_attention_norm(src + self.dropout(attended))
        return self.feed_forward_norm(src + self.dropout(self.feed_forward(src)))


class ReferenceDecoderLayer(nn.Module):
    def __init__(self, d_model: int, heads: int, ff_size: int, dropout: float):
        super().__init__()
        self.self_attention = ReferenceMultiHeadAttention(d_model, heads, dropout)
        self.self_attention_norm = nn.LayerNorm(d_model)
        self.encoder_attention = ReferenceMultiHeadAttention(d_model, heads, dropout)
        self.encoder_attention_norm = nn.LayerNorm(d_model)
        self.feed_forward = ReferenceFeedForward(d_model, ff_size, dropout)
        self.feed_forward_norm = nn.LayerNorm(d_model)
        self.dropout = nn.Dropout(dropout)

    def forward(self, tgt: Tensor, memory: Tensor, tgt_mask: Tensor, src_mask: Tensor) -> tuple[Tensor, Tensor]:
        """-> (B, T_dec, d), the cross-attention weights (B, heads, T_dec, T_enc)."""
        attended, _ = self.self_attention(tgt, tgt, tgt, tgt_mask)
        tgt = self.self_attention_norm(tgt + self.dropout(attended))
        attended, weights = self.encoder_attention(tgt, memory, memory, src_mask)
        tgt = self.encoder_attention_norm(tgt + self.dropout(attended))
        return self.feed_forward_norm(tgt + self.dropout(self.feed_forward(tgt))), weights


# TransformerSeq2Seq's parameter names -> the reference's (regular expressions, in order)
TRANSFORMER_NAMES = [
    (r"^transformer\.encoder\.layers\.(\d+)\.self_attn\.", r"encoder_layers.\1.self_attention."),
    (r"^transformer\.encoder\.layers\.(\d+)\.norm1\.", r"encoder_layers.\1.self_attention_norm."),
    (r"^transformer\.encoder\.layers\.(\d+)\.norm2\.", r"encoder_layers.\1.feed_forward_norm."),
    (r"^transformer\.encoder\.layers\.(\d+)\.linear(\d)\.", r"encoder_layers.\1.feed_forward.fc_\2."),
    (r"^transformer\.decoder\.layers\.(\d+)\.self_attn\.", r"decoder_layers.\1.self_attention."),
    (r"^transformer\.decoder\.layers\.(\d+)\.multihead_attn\.", r"decoder_layers.\1.encoder_attention."),
    (r"^transformer\.decoder\.layers\.(\d+)\.norm1\.", r"decoder_layers.\1.self_attention_norm."),
    (r"^transformer\.decoder\.layers\.(\d+)\.norm2\.", r"decoder_layers.\1.encoder_attention_norm."),
    (r"^transformer\.decoder\.layers\.(\d+)\.norm3\.", r"decoder_layers.\1.feed_forward_norm."),
    (r"^transformer\.decoder\.layers\.(\d+)\.linear(\d)\.", r"decoder_layers.\1.feed_forward.fc_\2."),
    (r"^transformer\.(encoder|decoder)\.norm\.", r"\1_norm."),
    (r"\.out_proj\.", ".fc_o."),
]


def reference_transformer_state(project: dict[str, Tensor]) -> dict[str, Tensor]:
    """A TransformerSeq2Seq's state_dict (or any dict under its parameter names, such as its
    gradients) under ReferenceTransformer's names: nn.MultiheadAttention's fused `in_proj` split
    into fc_q, fc_k and fc_v; `cross_attentions.*` (the decoder layers' own attention modules under
    a second name) left out."""
    state = {}
    for name, value in project.items():
        if name.startswith("cross_attentions."):
            continue
        for pattern, replacement in TRANSFORMER_NAMES:
            name = re.sub(pattern, replacement, name)
        if name.endswith(("in_proj_weight", "in_proj_bias")):
            stem, kind = name.rsplit(".in_proj_", 1)
            for part, chunk in zip(("q", "k", "v"), value.chunk(3)):
                state[f"{stem}.fc_{part}.{kind}"] = chunk
        else:
            state[name] = value
    return state


class ReferenceTransformer(nn.Module):
    """Same constructor and interface as `transformer.TransformerSeq2Seq`."""

    def __init__(
        self,
        vocab: int,
        d_model: int = 32,
        heads: int = 4,
        layers: int = 2,
        ff_size: int = 64,
        positions: str = "sinusoidal",
        position_rows: int | None = None,
        dropout: float = 0.0,
        fused: bool = False,  # taken for TransformerSeq2Seq's signature; the tutorials' form runs torch's ops
    ):
        super().__init__()
        self.d_model = d_model
        self.scale = math.sqrt(d_model)
        self.src_embedding = nn.Embedding(vocab, d_model, padding_idx=PAD)
        self.tgt_embedding = nn.Embedding(vocab, d_model, padding_idx=PAD)
        self.positions = (
            SinusoidalPositions(d_model) if positions == "sinusoidal" else LearnedPositions(position_rows, d_model)
        )
        self.encoder_layers = nn.ModuleList(
            ReferenceEncoderLayer(d_model, heads, ff_size, dropout) for _ in range(layers)
        )
        self.encoder_norm = nn.LayerNorm(d_model)
        self.decoder_layers = nn.ModuleList(
            ReferenceDecoderLayer(d_model, heads, ff_size, dropout) for _ in range(layers)
        )
        self.decoder_norm = nn.LayerNorm(d_model)
        self.out = nn.Linear(d_model, vocab)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """Also takes a TransformerSeq2Seq's state_dict (`reference_transformer_state` translates it)."""
        if any(name.startswith("transformer.") for name in state_dict):
            state_dict = reference_transformer_state(state_dict)
        return super().load_state_dict(state_dict, strict, assign)

    def state_floats(self, length: int) -> int:
        """As `TransformerSeq2Seq.state_floats`: every encoder output."""
        return length * self.d_model

    def _embed(self, embedding: nn.Embedding, tokens: Tensor) -> Tensor:
        positions = torch.arange(tokens.size(1), device=tokens.device)
        return embedding(tokens) * self.scale + self.positions(positions)[None]

    def encode(self, src: Tensor, src_lengths: Tensor) -> tuple[Tensor, Tensor]:
        """-> memory (B, T_enc, d), src_mask (B, 1, T_enc) True on real positions."""
        src_mask = length_mask(src_lengths, src.size(1))[:, None, :]
        x = self._embed(self.src_embedding, src)
        for layer in self.encoder_layers:
            x = layer(x, src_mask)
        return self.encoder_norm(x), src_mask

    def decode(self, tgt_in: Tensor, memory: Tensor, src_mask: Tensor) -> tuple[Tensor, Tensor]:
        """Every target position at once, under the causal mask -> logits (B, T_dec, V), the last
        layer's cross-attention weights (B, T_dec, T_enc), mean over heads."""
        steps = tgt_in.size(1)
        tgt_mask = torch.ones(steps, steps, dtype=torch.bool, device=tgt_in.device).tril()[None]  # (1, T_dec, T_dec)
        x = self._embed(self.tgt_embedding, tgt_in)
        for layer in self.decoder_layers:
            x, weights = layer(x, memory, tgt_mask, src_mask)
        return self.out(self.decoder_norm(x)), weights.mean(1)

    def forward(self, src: Tensor, src_lengths: Tensor, tgt_in: Tensor) -> tuple[Tensor, Tensor]:
        """Teacher forcing: -> logits (B, T_dec, V), weights (B, T_dec, T_enc)."""
        memory, src_mask = self.encode(src, src_lengths)
        return self.decode(tgt_in, memory, src_mask)

    @torch.no_grad()
    def greedy(
        self, src: Tensor, src_lengths: Tensor, steps: int, need_weights: bool = True
    ) -> tuple[Tensor, Tensor | None]:
        """The decoder run again over the whole prefix at every step -> tokens (B, steps), weights (B, steps, T_enc)
        (None without `need_weights`: computed all the same)."""
        memory, src_mask = self.encode(src, src_lengths)
        tokens = torch.full((src.size(0), 1), BOS, dtype=torch.long, device=src.device)
        for _ in range(steps):
            logits, weights = self.decode(tokens, memory, src_mask)
            tokens = torch.cat([tokens, logits[:, -1:].argmax(-1)], dim=1)
        return tokens[:, 1:], weights if need_weights else None
