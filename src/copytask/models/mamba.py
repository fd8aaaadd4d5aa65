"""Mamba (Gu and Dao, 2023, "Mamba: Linear-Time Sequence Modeling with Selective State Spaces") as an
encoder-decoder: a stack of Mamba layers reads the source, and a second stack starts from the first's final
state, layer by layer, and writes the target. Written from the paper's equations, after johnma2006's
mamba-minimal: each function cites the section or algorithm it computes, and the selective scan is a plain
loop over time steps (`selective_scan`), with C++ kernels of the same loops beside it for CPU training
(`kernels.mamba_ops`).

Shapes: B batch, T sequence length (T_enc the source's, T_dec the target's), d model width (`d_model`),
E = expand * d the block's inner width (the paper's D), N state size per channel (`d_state`), K the
convolution's width (`d_conv`), R the rank of Δ's projection (ceil(d / 16), section 3.6), V total
vocabulary.

The hand-over is the GRU baseline's, with more numbers: decoder layer i starts from encoder layer i's
state after the source's last real symbol, its SSM state h (B, E, N) and its convolution's window of the
last K - 1 inputs (B, K - 1, E). Nothing else of the source reaches the decoder: no attention, no encoder
outputs. The encoder's last layer therefore computes only its state: it has no gate, D or output
projection, whose output nothing would read (their parameters would count and never learn).

Padding: a padded source position has Δ = 0, so exp(Δ A) = 1 and Δ B x = 0 leave the SSM state as it
was; the window is read at each sequence's own length; the convolution is causal, so a real position never
sees padding. A mixed-length batch gives each sequence what it gets alone (tests/test_mamba.py).

The selection ablated (`selective=False`, `model.selective=false`): Δ, B and C are learned parameters, not
computed from the input, and everything else stays: the Mamba architecture with an LTI SSM in place of the
selective one, the "S4" row of Gu and Dao's Table 1 in the Mamba architecture. Δ is per channel (E), as the
selective Δ's bias is; B and C (N) are shared by the channels, as Mamba's own B_t and C_t are, rather than per
channel and state as S4D has them (Gu et al., 2022). So the LTI layer is exactly the selective layer whose
selection returns constants: the one thing ablated is that Δ, B and C depend on the input, not also how many
of them there are (per-channel B and C would add 2 E N parameters the selective layer does not have, and the
comparison would mix two changes). Each channel e is then the convolution of its input with the kernel
K_j = C exp(Δ_e A_e)^j Δ_e B (tests/test_mamba.py checks it against an explicit convolution); A keeps its
S4D-real initialisation, Δ its range, B starts at 1 and C normal, as S4D's.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..data.batches import length_mask
from ..data.vocab import PAD
from ..kernels import mamba_ops, ops
from .protocol import Seq2SeqModel

DT_MIN, DT_MAX, DT_FLOOR = 1e-3, 1e-1, 1e-4  # Δ's initial range (the paper's code, `mamba_simple.Mamba`)
NORM_EPS = 1e-5  # RMSNorm's, as the paper's models


class LayerState(NamedTuple):
    """What a layer carries from one step to the next: the SSM state h (B, E, N) and the
    convolution's window, its last K - 1 inputs, oldest first (B, K - 1, E)."""

    ssm: Tensor
    window: Tensor

    def select(self, rows: Tensor) -> LayerState:
        return LayerState(self.ssm.index_select(0, rows), self.window.index_select(0, rows))


def selective_scan(u: Tensor, delta: Tensor, A: Tensor, B: Tensor, C: Tensor, h0: Tensor) -> tuple[Tensor, Tensor]:
    """The selective SSM of Algorithm 2 (section 3.2), one time step at a time, each channel e of u its own
    SSM (section 2, eq. 2a-2b, discretised by eq. 4: A_bar = exp(Δ A); B_bar = Δ B, the first-order form of
    eq. 4's B_bar that the paper's code computes):

        h_t = exp(Δ_t A) h_{t-1} + Δ_t B_t x_t        (B, E, N)
        y_t = C_t h_t                                 (B, E)

    u: the input x (B, T, E); delta: Δ (B, T, E); A (E, N); B, C (B, T, N); h0 (B, E, N)
    -> y (B, T, E), h_T (B, E, N). The D skip is the caller's."""
    decay = torch.exp(delta[..., None] * A)  # A_bar (B, T, E, N)
    inputs = (delta * u)[..., None] * B[:, :, None, :]  # B_bar x (B, T, E, N)
    h, ys = h0, []
    for decay_t, input_t, c_t in zip(decay.unbind(1), inputs.unbind(1), C.unbind(1)):  # unbind: no per-step copies
        h = decay_t * h + input_t
        ys.append((h @ c_t[:, :, None])[..., 0])
    return (torch.stack(ys, 1) if ys else u.new_zeros(u.shape)), h  # (no step: a source of no symbols)


class MambaBlock(nn.Module):
    """The Mamba block (section 3.4, figure 3): project the input to x and z, a causal depthwise
    convolution of x, SiLU, the selective SSM with input-dependent Δ, B and C (section 3.2, Algorithm 2),
    the D skip, the output gated by SiLU(z), and the output projection. Without `readout` (the encoder's
    last layer) only x and the SSM are computed: the block's state and nothing else. Without `selective`,
    Δ (E), B and C (N) are parameters: an LTI SSM (the module's docstring says why these shapes)."""

    def __init__(
        self,
        d_model: int,
        d_inner: int,
        d_state: int,
        d_conv: int,
        dt_rank: int,
        readout: bool = True,
        selective: bool = True,
    ):
        super().__init__()
        self.d_inner, self.d_state, self.d_conv, self.dt_rank, self.readout = d_inner, d_state, d_conv, dt_rank, readout
        self.selective = selective
        self.in_proj = nn.Linear(d_model, (2 if readout else 1) * d_inner, bias=False)  # x | z
        self.conv1d = nn.Conv1d(d_inner, d_inner, d_conv, groups=d_inner)  # depthwise: weight (E, 1, K), bias (E)
        if selective:
            self.x_proj = nn.Linear(d_inner, dt_rank + 2 * d_state, bias=False)  # Δ (rank R) | B | C
            self.dt_proj = nn.Linear(dt_rank, d_inner)
        else:  # the LTI SSM's own: Δ before its softplus (E), B and C (N); S4D's B = 1 and C ~ N(0, 1)
            self.dt_bias = nn.Parameter(torch.empty(d_inner))
            self.B = nn.Parameter(torch.ones(d_state))
            self.C = nn.Parameter(torch.randn(d_state))
        # S4D-real (section 3.6, Gu et al. 2022): A = -(n + 1) for state n of every channel, kept as log(-A)
        self.A_log = nn.Parameter(torch.log(torch.arange(1, d_state + 1, dtype=torch.float32)).repeat(d_inner, 1))
        if readout:
            self.D = nn.Parameter(torch.ones(d_inner))
            self.out_proj = nn.Linear(d_inner, d_model, bias=False)
        self._init_dt()

    def _init_dt(self) -> None:
        """Δ = softplus(dt_proj(·) + bias) starts in [DT_MIN, DT_MAX], log-uniformly (section 3.6 and the paper's
        code): the bias is softplus's inverse of such a draw, the weight uniform in +-R^-1/2. The LTI SSM's Δ
        starts in the same range: its bias alone."""
        if self.selective:
            nn.init.uniform_(self.dt_proj.weight, -(self.dt_rank**-0.5), self.dt_rank**-0.5)
        dt = torch.exp(torch.rand(self.d_inner) * (math.log(DT_MAX) - math.log(DT_MIN)) + math.log(DT_MIN))
        dt = dt.clamp(min=DT_FLOOR)
        with torch.no_grad():
            (self.dt_proj.bias if self.selective else self.dt_bias).copy_(dt + torch.log(-torch.expm1(-dt)))

    def initial_state(self, batch: int, like: Tensor) -> LayerState:
        """Zero state and window: a sequence's start."""
        return LayerState(
            like.new_zeros(batch, self.d_inner, self.d_state), like.new_zeros(batch, self.d_conv - 1, self.d_inner)
        )

    def _selection(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """The selection mechanism (section 3.2, Algorithm 2; Δ's low-rank projection, section 3.6): x (..., E)
        -> Δ before its softplus (..., E), B and C (..., N). Without `selective`, the same parameters at every
        position, whatever x holds (broadcast views: the scan reads them as it reads the selective ones)."""
        if not self.selective:
            leading = x.shape[:-1]
            return self.dt_bias.expand(*leading, -1), self.B.expand(*leading, -1), self.C.expand(*leading, -1)
        low_rank, B, C = self.x_proj(x).split([self.dt_rank, self.d_state, self.d_state], dim=-1)
        return self.dt_proj(low_rank), B, C

    def _gate(self, y: Tensor, x: Tensor, z: Tensor) -> Tensor:
        """The D skip and the SiLU(z) gate (figure 3): y, x, z (..., E) -> (..., E)."""
        return (y + x * self.D) * F.silu(z)

    def _convolve(self, inputs: Tensor) -> Tensor:
        """The causal depthwise convolution (section 3.4) of `inputs` (B, K - 1 + T, E), a window of K - 1 inputs
        then T new ones -> (B, T, E): output t is bias + sum_k w_k inputs[t + k], K products of shifted views."""
        steps = inputs.size(1) - (self.d_conv - 1)
        weight = self.conv1d.weight[:, 0].t()  # (K, E)
        output = self.conv1d.bias + inputs[:, :steps] * weight[0]
        for k in range(1, self.d_conv):
            output = output + inputs[:, k : k + steps] * weight[k]
        return output

    def forward(
        self, hidden: Tensor, state: LayerState, lengths: Tensor | None = None, fused: bool = True
    ) -> tuple[Tensor | None, LayerState]:
        """The whole sequence: hidden (B, T, d) from `state` -> output (B, T, d) (None without readout), and the
        state after each sequence's last real position (`lengths` (B,); None: all T are real). With `fused` on
        CPU the convolution, and Δ's softplus, the scan, the D skip and the gate, run in `kernels.mamba_ops`."""
        steps = hidden.size(1)
        x, *gate = self.in_proj(hidden).split(self.d_inner, dim=-1)  # x (B, T, E), and z with readout
        inputs = torch.cat([state.window, x], dim=1)  # (B, K - 1 + T, E): the window, then the sequence
        fused = fused and ops.usable(inputs)
        if fused:
            x = mamba_ops.causal_conv_silu(inputs, self.conv1d.weight, self.conv1d.bias)
        else:
            x = F.silu(self._convolve(inputs))  # (B, T, E)
        dt, B, C = self._selection(x)  # (B, T, E), (B, T, N), (B, T, N)
        real = None if lengths is None else length_mask(lengths, steps)  # (B, T): Δ = 0 past a sequence's end
        if real is None:
            window = inputs[:, steps:]
        else:  # the window ends at the sequence's last symbol
            ends = lengths[:, None] + torch.arange(self.d_conv - 1, device=lengths.device)  # (B, K - 1)
            window = inputs.gather(1, ends[..., None].expand(-1, -1, self.d_inner))
        A = -torch.exp(self.A_log)  # (E, N)
        if fused:
            gated = {"D": self.D, "z": gate[0]} if self.readout else {}
            y, ssm = mamba_ops.selective_scan(x, dt, A, B, C, state.ssm, real, **gated)
        else:
            delta = F.softplus(dt) if real is None else F.softplus(dt) * real[..., None]  # Δ = 0 leaves the state
            y, ssm = selective_scan(x, delta, A, B, C, state.ssm)
            y = self._gate(y, x, *gate) if self.readout else y
        return (self.out_proj(y) if self.readout else None), LayerState(ssm, window)

    def step(self, hidden: Tensor, state: LayerState) -> tuple[Tensor, LayerState]:
        """One time step, the recurrent mode of section 3.3 (what the paper's code decodes with): hidden (B, d)
        and the state before it -> output (B, d) and the state after it."""
        x, z = self.in_proj(hidden).chunk(2, dim=-1)  # (B, E) each
        inputs = torch.cat([state.window, x[:, None]], dim=1)  # (B, K, E): the window, then this step's x
        x = F.silu(self._convolve(inputs)[:, 0])
        dt, B, C = self._selection(x)  # (B, E), (B, N), (B, N)
        delta, A = F.softplus(dt), -torch.exp(self.A_log)
        ssm = torch.exp(delta[..., None] * A) * state.ssm + (delta * x)[..., None] * B[:, None, :]  # (B, E, N)
        y = (ssm @ C[:, :, None])[..., 0]  # (B, E)
        return self.out_proj(self._gate(y, x, z)), LayerState(ssm, inputs[:, 1:])


class MambaLayer(nn.Module):
    """A pre-norm residual layer around the block (the paper's models, mamba-minimal's ResidualBlock):
    hidden + block(RMSNorm(hidden))."""

    def __init__(self, d_model: int, block: MambaBlock):
        super().__init__()
        self.norm = nn.RMSNorm(d_model, eps=NORM_EPS)
        self.block = block

    def forward(
        self, hidden: Tensor, state: LayerState, lengths: Tensor | None = None, fused: bool = True
    ) -> tuple[Tensor | None, LayerState]:
        """hidden (B, T, d) -> (B, T, d) (None without readout), the state after it (`MambaBlock.forward`)."""
        output, state = self.block(self.norm(hidden), state, lengths, fused)
        return None if output is None else hidden + output, state

    def step(self, hidden: Tensor, state: LayerState) -> tuple[Tensor, LayerState]:
        """hidden (B, d) -> (B, d), the state after the step."""
        output, state = self.block.step(self.norm(hidden), state)
        return hidden + output, state


class MambaSeq2Seq(Seq2SeqModel):
    """Source and target embeddings (each its own, as the other models'), `layers` Mamba layers on each side,
    the decoder's layers starting from the encoder's final states, a final RMSNorm and a linear readout;
    every layer's SSM selective (Mamba's) or, without `selective`, LTI (the selection ablated)."""

    def __init__(
        self,
        vocab: int,
        d_model: int = 40,
        layers: int = 2,
        d_state: int = 4,
        d_conv: int = 4,
        expand: int = 2,
        fused: bool = True,  # on CPU the convolution and the scan of a training step in kernels.mamba_ops
        selective: bool = True,  # False: Δ, B and C learned, not computed from the input (the selection ablated)
    ):
        super().__init__()
        d_inner, dt_rank = expand * d_model, math.ceil(d_model / 16)
        self.fused = fused
        self.src_embedding = nn.Embedding(vocab, d_model, padding_idx=PAD)
        self.tgt_embedding = nn.Embedding(vocab, d_model, padding_idx=PAD)

        def layer(readout: bool = True) -> MambaLayer:
            return MambaLayer(d_model, MambaBlock(d_model, d_inner, d_state, d_conv, dt_rank, readout, selective))

        self.encoder_layers = nn.ModuleList([*(layer() for _ in range(layers - 1)), layer(readout=False)])
        self.decoder_layers = nn.ModuleList(layer() for _ in range(layers))
        self.norm = nn.RMSNorm(d_model, eps=NORM_EPS)
        self.out = nn.Linear(d_model, vocab)

    def encode(self, src: Tensor, src_lengths: Tensor) -> list[LayerState]:
        """src (B, T_enc), lengths (B,) -> each encoder layer's state after the last real symbol."""
        hidden, states = self.src_embedding(src), []
        for layer in self.encoder_layers:
            hidden, state = layer(hidden, layer.block.initial_state(src.size(0), hidden), src_lengths, self.fused)
            states.append(state)
        return states

    def forward(self, src: Tensor, src_lengths: Tensor, tgt_in: Tensor) -> tuple[Tensor, None]:
        """Teacher forcing, every decoder layer a scan over the whole target: -> logits (B, T_dec, V), None."""
        hidden = self.tgt_embedding(tgt_in)
        for layer, state in zip(self.decoder_layers, self.encode(src, src_lengths)):
            hidden, _ = layer(hidden, state, fused=self.fused)
        return self.out(self.norm(hidden)), None

    def summary_state(self, src: Tensor, src_lengths: Tensor) -> Tensor:
        """Everything the decoder reads of the source, per sequence: every encoder layer's SSM state and
        window, flattened -> (B, `state_floats`)."""
        states = self.encode(src, src_lengths)
        return torch.cat([part.flatten(1) for state in states for part in state], dim=1)

    def state_floats(self, length: int) -> int:
        """Floats per sequence the decoder can read of a source of `length` symbols: layers x (E x N +
        E x (K - 1)), whatever the length."""
        return sum(
            layer.block.d_inner * (layer.block.d_state + layer.block.d_conv - 1) for layer in self.encoder_layers
        )

    def decoding(self, src: Tensor, src_lengths: Tensor, steps: int, need_weights: bool = True) -> MambaDecoding:
        """The encoder run on `src` (B, T_enc): a decoding fed one token a step (`models.decoding`); no
        attention, so no weights, whatever `need_weights` asks."""
        return MambaDecoding(self, self.encode(src, src_lengths))


class MambaDecoding:
    """The decoder's layers while it decodes: each layer's state, from the encoder's, advanced a step at a time."""

    def __init__(self, model: MambaSeq2Seq, states: list[LayerState]):
        self.model, self.states = model, states

    def step(self, tokens: Tensor, t: int) -> tuple[Tensor, None]:
        """tokens (B,) fed at output step t -> logits (B, V), None."""
        hidden = self.model.tgt_embedding(tokens)  # (B, d)
        for i, layer in enumerate(self.model.decoder_layers):
            hidden, self.states[i] = layer.step(hidden, self.states[i])
        return self.model.out(self.model.norm(hidden)), None

    def reorder(self, rows: Tensor) -> None:
        """Row i of every layer's SSM state and window becomes row `rows[i]` (beam search's parents)."""
        self.states = [state.select(rows) for state in self.states]
