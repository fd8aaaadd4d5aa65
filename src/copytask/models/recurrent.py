"""GRU encoder-decoders: no attention (the final state handed over once, or Cho et al.'s RNN
encoder-decoder), Bahdanau (additive) and Luong (any score registered in `attention`; global or local).

Shapes: B batch, T_enc source length, T_dec target length, E embedding size, H hidden size,
V total vocabulary (content symbols + PAD, BOS, EOS). The encoder's states and final state
have size H whether or not it is bidirectional (each direction then has H / 2), so the decoder
state size d_s and the encoder state size d_h are both H and `luong_dot` is always well-formed.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ..data.batches import length_mask
from ..data.vocab import PAD
from ..families.gru import DECODERS
from ..kernels import ops
from .attention import AdditiveAttention, Attention, make_attention
from .protocol import Seq2SeqModel

# What the attention reads at every step: (keys, values), and Luong's (keys, values, summary), the summary
# being what its score computes of the whole source once per sequence (`Attention.summarise`; None: none)
Memory = tuple[Tensor, Tensor] | tuple[Tensor, Tensor, Tensor | None] | None


class Encoder(nn.Module):
    def __init__(self, vocab: int, embedding_size: int, hidden_size: int, bidirectional: bool, fused: bool = True):
        super().__init__()
        if bidirectional and hidden_size % 2:
            raise ValueError(f"a bidirectional encoder needs an even hidden_size, got {hidden_size}")
        self.bidirectional = bidirectional
        self.embedding = nn.Embedding(vocab, embedding_size, padding_idx=PAD)
        per_direction = hidden_size // 2 if bidirectional else hidden_size
        self.rnn = ops.GRU(embedding_size, per_direction, bidirectional, fused)

    def forward(self, src: Tensor, lengths: Tensor) -> tuple[Tensor, Tensor]:
        """src (B, T_enc), lengths (B,) -> states (B, T_enc, H), final (B, H)."""
        # lengths keep padding out of the recurrence (and out of the backward direction)
        states, final = self.rnn(self.embedding(src), lengths=lengths)
        final = torch.cat([final[-2], final[-1]], dim=-1) if self.bidirectional else final[-1]
        return states, final


class Decoder(nn.Module):
    """What `Seq2Seq` asks of a decoder: `forward` (teacher forcing), `step` (one greedy step; its weights
    only with `need_weights`, else None), and these two, which by default pass the encoder's output through:
    `memory`, what every step reads of the encoder states (B, T_enc, H) and their mask (B, T_enc) (None:
    nothing), and `initial_state`, the first step's hidden state."""

    def memory(self, encoder_states: Tensor, src_mask: Tensor) -> Memory:
        return None

    def initial_state(self, final: Tensor) -> Tensor:
        return final


class PlainDecoder(Decoder):
    """No attention: the encoder's final state, as the initial state, is all the decoder sees."""

    def __init__(self, vocab: int, embedding_size: int, hidden_size: int, fused: bool = True):
        super().__init__()
        self.embedding = nn.Embedding(vocab, embedding_size, padding_idx=PAD)
        self.rnn = ops.GRU(embedding_size, hidden_size, fused=fused)
        self.out = nn.Linear(hidden_size, vocab)

    def forward(self, tgt_in: Tensor, encoder_states: Tensor, final: Tensor, src_mask: Tensor):
        states, _ = self.rnn(self.embedding(tgt_in), final[None])  # (B, T_dec, H)
        return self.out(states), None

    def step(
        self,
        tokens: Tensor,
        hidden: Tensor,
        memory: Memory,
        src_mask: Tensor,
        position: Tensor,
        need_weights: bool,
    ):
        state, _ = self.rnn(self.embedding(tokens)[:, None], hidden[None])  # (B, 1, H)
        return self.out(state[:, 0]), None, state[:, 0]


class RNNEncDecDecoder(Decoder):
    """Cho et al. (2014)'s RNN encoder-decoder ("RNNencdec" in Bahdanau et al., 2014): no attention,
    but the encoder's fixed summary c reaches every step, not only the first. The decoder of Cho
    et al.'s appendix A.1, with h_N the encoder's final state and e(y) the decoder's embedding:

        c      = tanh(V h_N)
        s_0    = tanh(V' c)
        r_t    = sigmoid(W_r e(y_{t-1}) + U_r s_{t-1} + C_r c)
        z_t    = sigmoid(W_z e(y_{t-1}) + U_z s_{t-1} + C_z c)
        s~_t   = tanh(W e(y_{t-1}) + r_t * (U s_{t-1} + C c))
        s_t    = z_t * s_{t-1} + (1 - z_t) * s~_t
        p(y_t) = softmax(W_o [s_t; e(y_{t-1}); c] + b_o)

    Every W and U has a bias, as torch's GRU does; the readout is Cho et al.'s without its maxout
    layer. C c sits inside the reset-gated term of the candidate, where torch's GRU (and copytask's
    fused kernel) take only the state's own bias: so this recurrence runs here in torch, step by step
    also under teacher forcing, with the input's and the summary's shares of the gates computed once."""

    def __init__(self, vocab: int, embedding_size: int, hidden_size: int):
        super().__init__()
        self.embedding = nn.Embedding(vocab, embedding_size, padding_idx=PAD)
        self.summary = nn.Linear(hidden_size, hidden_size)  # V
        self.init = nn.Linear(hidden_size, hidden_size)  # V'
        self.input_gates = nn.Linear(embedding_size, 3 * hidden_size)  # W_r, W_z, W
        self.state_gates = nn.Linear(hidden_size, 3 * hidden_size)  # U_r, U_z, U
        self.summary_gates = nn.Linear(hidden_size, 3 * hidden_size, bias=False)  # C_r, C_z, C
        self.out = nn.Linear(2 * hidden_size + embedding_size, vocab)  # W_o

    def initial_state(self, final: Tensor) -> Tensor:
        """The encoder's final state h_N (B, H) -> [s_0; c] (B, 2H): the decoder's hidden state carries
        c beside s_t, so that greedy decoding needs no extra state."""
        summary = torch.tanh(self.summary(final))
        return torch.cat([torch.tanh(self.init(summary)), summary], dim=-1)

    def _run(self, embedded: Tensor, hidden: Tensor) -> tuple[Tensor, Tensor]:
        """embedded e(y_{t-1}) (B, T, E), hidden [s_0; c] (B, 2H) -> logits (B, T, V), [s_T; c] (B, 2H)."""
        state, summary = hidden.chunk(2, dim=-1)
        input_r, input_z, input_n = self.input_gates(embedded).chunk(3, dim=-1)  # (B, T, H) each, all steps at once
        summary_r, summary_z, summary_n = self.summary_gates(summary)[:, None].chunk(
            3, dim=-1
        )  # (B, 1, H): the same at every step
        input_r, input_z = input_r + summary_r, input_z + summary_z
        states = []
        for t in range(embedded.size(1)):
            state_r, state_z, state_n = self.state_gates(state).chunk(3, dim=-1)  # (B, H) each
            reset = torch.sigmoid(input_r[:, t] + state_r)
            update = torch.sigmoid(input_z[:, t] + state_z)
            candidate = torch.tanh(input_n[:, t] + reset * (state_n + summary_n[:, 0]))
            state = update * state + (1 - update) * candidate
            states.append(state)
        states = torch.stack(states, 1)  # (B, T, H)
        summaries = summary[:, None].expand(-1, embedded.size(1), -1)  # (B, T, H)
        return self.out(torch.cat([states, embedded, summaries], dim=-1)), torch.cat([state, summary], dim=-1)

    def forward(self, tgt_in: Tensor, encoder_states: Tensor, final: Tensor, src_mask: Tensor):
        logits, _ = self._run(self.embedding(tgt_in), self.initial_state(final))
        return logits, None

    def step(
        self,
        tokens: Tensor,
        hidden: Tensor,
        memory: Memory,
        src_mask: Tensor,
        position: Tensor,
        need_weights: bool,
    ):
        """hidden [s_{t-1}; c] (B, 2H) -> logits (B, V), None, [s_t; c] (B, 2H)."""
        logits, hidden = self._run(self.embedding(tokens)[:, None], hidden)
        return logits[:, 0], None, hidden


class BahdanauDecoder(Decoder):
    """Query is the state *before* the step, s_{t-1}; the context c_t is part of the GRU input,
    so the decoder must run step by step even under teacher forcing."""

    def __init__(self, vocab: int, embedding_size: int, hidden_size: int, attention_size: int, fused: bool = True):
        super().__init__()
        self.embedding = nn.Embedding(vocab, embedding_size, padding_idx=PAD)
        self.attention = AdditiveAttention(hidden_size, hidden_size, attention_size, fused=fused)
        self.cell = nn.GRUCell(embedding_size + hidden_size, hidden_size)
        self.out = nn.Linear(2 * hidden_size, vocab)
        self.fused = fused  # teacher forcing on CPU in ops.bahdanau_decode

    def memory(self, encoder_states: Tensor, src_mask: Tensor) -> Memory:
        return self.attention.project_keys(encoder_states), encoder_states  # U_a h once per sequence

    def _advance(self, embedded: Tensor, hidden: Tensor, memory: Memory, src_mask: Tensor):
        """One step: embedded (B, E), hidden s_{t-1} (B, H) -> s_t (B, H), c_t (B, H), weights (B, T_enc)."""
        context, weights = self.attention.step(hidden, *memory, src_mask)
        hidden = self.cell(torch.cat([embedded, context], dim=-1), hidden)
        return hidden, context, weights

    def forward(self, tgt_in: Tensor, encoder_states: Tensor, final: Tensor, src_mask: Tensor):
        embedded = self.embedding(tgt_in)  # (B, T_dec, E)
        memory = self.memory(encoder_states, src_mask)
        attention = self.attention
        if self.fused and attention.intervention is None and ops.usable(embedded):
            w_q, v = attention.query_proj.weight, attention.v.weight[0]
            states, contexts, weights = ops.bahdanau_decode(embedded, final, *memory, src_mask, w_q, v, self.cell)
        else:
            hidden, states, contexts, weights = final, [], [], []
            for t in range(tgt_in.size(1)):
                hidden, context, step_weights = self._advance(embedded[:, t], hidden, memory, src_mask)
                states.append(hidden)
                contexts.append(context)
                weights.append(step_weights)
            states, contexts, weights = torch.stack(states, 1), torch.stack(contexts, 1), torch.stack(weights, 1)
        return self.out(torch.cat([states, contexts], dim=-1)), weights  # readout from (B, T_dec, 2H)

    def step(
        self,
        tokens: Tensor,
        hidden: Tensor,
        memory: Memory,
        src_mask: Tensor,
        position: Tensor,
        need_weights: bool,
    ):
        hidden, context, weights = self._advance(self.embedding(tokens), hidden, memory, src_mask)
        return self.out(torch.cat([hidden, context], dim=-1)), weights if need_weights else None, hidden


class LuongDecoder(Decoder):
    """Query is the state *after* the step, s_t; no input feeding, so the GRU never depends on
    attention: under teacher forcing it runs over the whole target at once and attention is
    one batched product over all steps. Output: tanh(W_c [s_t; c_t]) -> vocabulary."""

    def __init__(
        self,
        vocab: int,
        embedding_size: int,
        hidden_size: int,
        score: str,
        attention_size: int | None,
        heads: int = 1,
        fused: bool = True,
        local: str | None = None,
        window: int | None = None,
    ):
        super().__init__()
        self.embedding = nn.Embedding(vocab, embedding_size, padding_idx=PAD)
        self.rnn = ops.GRU(embedding_size, hidden_size, fused=fused)
        self.attention = make_attention(score, hidden_size, hidden_size, attention_size, heads, fused, local, window)
        self.combine = nn.Linear(2 * hidden_size, hidden_size)  # W_c
        self.out = nn.Linear(hidden_size, vocab)

    def memory(self, encoder_states: Tensor, src_mask: Tensor) -> Memory:
        keys = self.attention.project_keys(encoder_states)
        return keys, encoder_states, self.attention.summarise(keys, encoder_states, src_mask)

    def _readout(self, states: Tensor, memory: Memory, src_mask: Tensor, positions: Tensor, need_weights: bool):
        """states s_t (B, T_dec, H) at output steps `positions` (T_dec,) -> logits (B, T_dec, V),
        weights (B, T_dec, T_enc) or None without `need_weights`."""
        keys, values, summary = memory
        context, weights = self.attention(states, keys, values, src_mask, positions, summary, need_weights)
        attentional = torch.tanh(self.combine(torch.cat([states, context], dim=-1)))
        return self.out(attentional), weights

    def forward(self, tgt_in: Tensor, encoder_states: Tensor, final: Tensor, src_mask: Tensor):
        states, _ = self.rnn(self.embedding(tgt_in), final[None])  # (B, T_dec, H), all steps at once
        positions = torch.arange(tgt_in.size(1), device=tgt_in.device)
        return self._readout(states, self.memory(encoder_states, src_mask), src_mask, positions, need_weights=True)

    def step(
        self,
        tokens: Tensor,
        hidden: Tensor,
        memory: Memory,
        src_mask: Tensor,
        position: Tensor,
        need_weights: bool,
    ):
        """position (1,): the output step, on the device (local-m aligns with it)."""
        state, _ = self.rnn(self.embedding(tokens)[:, None], hidden[None])  # (B, 1, H)
        logits, weights = self._readout(state, memory, src_mask, position, need_weights)
        return logits[:, 0], None if weights is None else weights[:, 0], state[:, 0]


class Seq2Seq(Seq2SeqModel):
    def __init__(
        self,
        vocab: int,
        decoder: str,
        score: str | None = None,
        embedding_size: int = 32,
        hidden_size: int = 64,
        attention_size: int | None = None,
        bidirectional: bool = True,
        heads: int = 1,  # Luong, with a multi-head score only
        fused: bool = True,  # recurrences in copytask.kernels on CPU where they build; False: torch's ops
        local: str | None = None,  # Luong only: None (global), "predictive" (local-p) or "monotonic" (local-m)
        window: int | None = None,  # local: the window's half-width D
    ):
        super().__init__()
        self.hidden_size = hidden_size
        self.encoder = Encoder(vocab, embedding_size, hidden_size, bidirectional, fused)
        if decoder == "plain":
            self.decoder = PlainDecoder(vocab, embedding_size, hidden_size, fused)
        elif decoder == "bahdanau":
            self.decoder = BahdanauDecoder(vocab, embedding_size, hidden_size, attention_size, fused)
        elif decoder == "luong":
            self.decoder = LuongDecoder(
                vocab, embedding_size, hidden_size, score, attention_size, heads, fused, local, window
            )
        elif decoder == "rnnencdec":
            self.decoder = RNNEncDecDecoder(vocab, embedding_size, hidden_size)
        else:
            raise ValueError(f"unknown decoder {decoder!r}; choose one of {', '.join(DECODERS)}")

    @property
    def attention(self) -> Attention | None:
        return getattr(self.decoder, "attention", None)

    def state_floats(self, length: int) -> int:
        """Floats per sequence the decoder can read of a source of `length` symbols: the encoder's final
        state handed over (H), and what its attention reads (`Attention.state_floats`: every encoder state,
        length x H, for a softmax score; linear attention's S and z)."""
        return self.hidden_size + (0 if self.attention is None else self.attention.state_floats(length))

    def forward(self, src: Tensor, src_lengths: Tensor, tgt_in: Tensor) -> tuple[Tensor, Tensor | None]:
        """Teacher forcing: -> logits (B, T_dec, V), weights (B, T_dec, T_enc) or None."""
        encoder_states, final = self.encoder(src, src_lengths)
        src_mask = length_mask(src_lengths, src.size(1))
        return self.decoder(tgt_in, encoder_states, final, src_mask)

    def summary_state(self, src: Tensor, src_lengths: Tensor) -> Tensor:
        """The summary vector of each source: the decoder's initial state (B, S), what the baseline's decoder
        gets of the source and all (`evaluation.probe` reads it)."""
        _, final = self.encoder(src, src_lengths)
        return self.decoder.initial_state(final)

    def decoding(self, src: Tensor, src_lengths: Tensor, steps: int, need_weights: bool = True) -> RecurrentDecoding:
        """The encoder run on `src` (B, T_enc): a decoding of up to `steps` steps, fed one token a step
        (`models.decoding`: greedy and beam search both drive it), its steps' weights only with `need_weights`."""
        encoder_states, final = self.encoder(src, src_lengths)
        src_mask = length_mask(src_lengths, src.size(1))
        memory = self.decoder.memory(encoder_states, src_mask)
        return RecurrentDecoding(self.decoder, self.decoder.initial_state(final), memory, src_mask, steps, need_weights)


class RecurrentDecoding:
    """A GRU decoder's state while it decodes: its hidden state (B, ...) changes every step; the
    memory and the source mask stay. `reorder` follows beam search's choice of parents."""

    def __init__(
        self, decoder: Decoder, hidden: Tensor, memory: Memory, src_mask: Tensor, steps: int, need_weights: bool
    ):
        self.decoder, self.hidden, self.memory, self.src_mask = decoder, hidden, memory, src_mask
        self.need_weights = need_weights
        # made once: a tensor per step would be a copy to the GPU per step
        self.positions = torch.arange(steps, device=src_mask.device)

    def step(self, tokens: Tensor, t: int) -> tuple[Tensor, Tensor | None]:
        """tokens (B,) fed at output step t -> logits (B, V), weights (B, T_enc) or None."""
        logits, weights, self.hidden = self.decoder.step(
            tokens, self.hidden, self.memory, self.src_mask, self.positions[t : t + 1], self.need_weights
        )
        return logits, weights

    def reorder(self, rows: Tensor) -> None:
        """Row i of the state becomes row `rows[i]` of the present one (rows (B,), within a sequence's beams)."""
        self.hidden = self.hidden.index_select(0, rows)


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)
