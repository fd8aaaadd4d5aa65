"""Fused CPU kernels (`csrc/`) for the sequential parts of a training step.

Torch on CPU runs every time step of a recurrence as tens of ATen ops and autograd nodes,
forward and backward (a GRU step about 24 ops and 14 nodes, a Bahdanau decoder step about 94 and
33). At this project's sizes (batch 64, hidden 32-64, 80 steps) that per-op cost, not arithmetic,
is most of a training step. Two recurrences and one score get a kernel that runs the whole
sequence in C++: a few matrix products and passes over contiguous rows per step.

- `GRU`: nn.GRU (same parameters, state_dict and equations) for the encoder and the plain and
  Luong decoders;
- `bahdanau_decode`: Bahdanau's decoder under teacher forcing (attention and GRU cell, step by
  step, as `recurrent.BahdanauDecoder` computes it);
- `additive_scores`: the additive score of every (decoder step, source position) pair, which
  Luong's concat score needs under teacher forcing (`attention.AdditiveAttention.scores`).
- `attention`: multi-head scaled dot-product attention, the Transformer's self- and
  cross-attention in a training step (`transformer.TransformerSeq2Seq`): not a recurrence, but
  at its sizes (heads of 8 features) torch's attention runs far below the matmul rate;
- `attention_step`: the same attention for one query row per sequence over a cache of keys and
  values, forward only: a greedy decoding step of the Transformer;
- `transformer_layer`: a whole Transformer layer, its ATen ops and autograd's formulas for them
  called from C++ around the attention kernel (the numbers of the ops in Python, to the bit):
  at length 20 a layer's dozen ops and autograd nodes cost more dispatch than arithmetic.

They are used for float32 on CPU; everywhere else (CUDA, float64, `fused=False`, no C++
compiler) the torch code runs. They agree with it to float rounding, NaN and inf included
(tests/test_kernels.py); `python -m copytask bench` measures the speed.

They are torch custom ops (`torch.ops.copytask.*`, torch.library) with their autograd formulas
and shapes for fake tensors, so that autograd and torch.compile treat them as torch's own ops;
under autocast they run in float32. `transformer_layer` is an autograd node written in C++ instead
(a custom op's wrapper of its 18 parameters and 20 saved tensors, or a Python autograd Function,
costs much of what the layer kernel saves: docs/bench.md); under autocast the model runs the layers'
ops in Python. There is no second
derivative: a double backward through them raises an error that says so (build the model with
`fused=False` for one).

The Transformer's kernels (`attention`, `attention_step`, `transformer_layer`) are in
`kernels.transformer_ops`, Mamba's (its convolution, and its scan with the gate) in `kernels.mamba_ops`, with the
same contract. They are built and loaded by `kernels.build`.
"""

from __future__ import annotations

from types import ModuleType

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

from ..data.batches import length_mask
from .build import kernel


def on_host(lengths: Tensor) -> bool:
    """Whether reading `lengths` (to pack a GRU's input) costs nothing: they are in host memory.
    On a GPU a read waits for every kernel queued before it."""
    return lengths.device.type == "cpu"


def padding(real: Tensor) -> Tensor:
    """A bool mask of real positions as the kernels take it: float (1 real, 0 padding), or empty
    where nothing is padded, so that they skip the masking."""
    return real.new_empty(0, dtype=torch.float32) if bool(real.all()) else real.float().contiguous()


def usable(*tensors: Tensor) -> bool:
    """Whether the kernels can run on these tensors: float32 on CPU, and the kernels built."""
    return all(t.device.type == "cpu" and t.dtype == torch.float32 for t in tensors) and kernel() is not None


def _library() -> ModuleType:
    library = kernel()
    if library is None:
        raise RuntimeError("copytask's fused CPU kernels are not built (the warning above says why); use fused=False")
    return library


def _no_double_backward(ctx, *grads):
    raise RuntimeError(
        "copytask's fused CPU kernels have no second derivative (double backward); "
        "build the model with fused=False (train.fused=false) for one"
    )


@torch.library.custom_op("copytask::gru_forward", mutates_args=())
def gru_forward(
    gi: Tensor, h0: Tensor, w_hh: Tensor, b_hh: Tensor, mask: Tensor, reverse: bool
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """One direction of one layer, time first: gi = W_ih x + b_ih (T, B, 3H), h0 (B, H), w_hh (3H, H),
    b_hh (3H), mask (T, B) float (1 real, 0 padding) or empty -> states (T, B, H), final (B, H),
    and, saved for the backward pass (no gradient flows back through them), gates (T, B, 4H) and
    the state before each step (T, B, H)."""
    return tuple(
        _library().gru_forward(
            gi.contiguous(), h0.contiguous(), w_hh.contiguous(), b_hh.contiguous(), mask.contiguous(), reverse
        )
    )


@gru_forward.register_fake
def _(gi, h0, w_hh, b_hh, mask, reverse):
    (steps, batch, _), hidden = gi.shape, h0.size(1)
    return (
        gi.new_empty(steps, batch, hidden),
        h0.new_empty(batch, hidden),
        gi.new_empty(steps, batch, 4 * hidden),
        gi.new_empty(steps, batch, hidden),
    )


@torch.library.custom_op("copytask::gru_backward", mutates_args=())
def gru_backward(
    grad_states: Tensor, grad_final: Tensor, gates: Tensor, before: Tensor, w_hh: Tensor, mask: Tensor, reverse: bool
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """-> gradients of gi (T, B, 3H), h0 (B, H), w_hh (3H, H), b_hh (3H)."""
    tensors = (grad_states, grad_final, gates, before, w_hh, mask)
    return tuple(_library().gru_backward(*(t.contiguous() for t in tensors), reverse))


@gru_backward.register_fake
def _(grad_states, grad_final, gates, before, w_hh, mask, reverse):
    (steps, batch, hidden) = before.shape
    return (
        before.new_empty(steps, batch, 3 * hidden),
        before.new_empty(batch, hidden),
        w_hh.new_empty(w_hh.shape),
        w_hh.new_empty(w_hh.size(0)),
    )


def _gru_setup(ctx, inputs, output):
    _, _, w_hh, _, mask, reverse = inputs
    ctx.save_for_backward(output[2], output[3], w_hh, mask)
    ctx.reverse = reverse
    ctx.set_materialize_grads(False)  # an unused output's gradient stays None, not a tensor of zeros


def _gru_backward(ctx, grad_states, grad_final, _grad_gates, _grad_before):
    gates, before, w_hh, mask = ctx.saved_tensors
    grad_states = torch.zeros_like(before) if grad_states is None else grad_states
    grad_final = torch.zeros_like(before[0]) if grad_final is None else grad_final
    return *gru_backward(grad_states, grad_final, gates, before, w_hh, mask, ctx.reverse), None, None


gru_forward.register_autograd(_gru_backward, setup_context=_gru_setup)


class GRU(nn.GRU):
    """One batch-first GRU layer, uni- or bidirectional, that also takes the sequences' lengths."""

    def __init__(self, input_size: int, hidden_size: int, bidirectional: bool = False, fused: bool = True):
        super().__init__(input_size, hidden_size, batch_first=True, bidirectional=bidirectional)
        self.fused = fused

    def forward(self, x: Tensor, hx: Tensor | None = None, lengths: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """x (B, T, I), hx (D, B, H) or None (zeros), lengths (B,) or None (all T) -> states
        (B, T, D*H), zero past each sequence's length, and final (D, B, H), each direction's
        last real state: what packing gives, and without packing's cost when all lengths are T."""
        if self.fused and usable(x):
            mask = x.new_empty(0) if lengths is None else padding(length_mask(lengths, x.size(1)).t())
            return self._fused(x, hx, mask)
        if lengths is None:
            return super().forward(x, hx)
        if not on_host(lengths):
            return self._unpacked(x, hx, lengths)
        if bool((lengths < x.size(1)).any()):
            packed = pack_padded_sequence(x, lengths.cpu(), batch_first=True, enforce_sorted=False)
            states, final = super().forward(packed, hx)
            return pad_packed_sequence(states, batch_first=True, total_length=x.size(1))[0], final
        return super().forward(x, hx)

    def _unpacked(self, x: Tensor, hx: Tensor | None, lengths: Tensor) -> tuple[Tensor, Tensor]:
        """What packing gives (`forward`), without reading the lengths on the host, which on a GPU
        waits for it: the recurrence runs over the padding too, where nothing it computes is kept.
        Each direction must meet a sequence's padding after its symbols. The forward direction reads
        the batch as it is; the backward direction reads a copy with each sequence rolled to end at T
        (padding first), and both run in one call over the two copies (2B rows): on a GPU twice the
        rows cost little more than B, since a step of a small GRU is far from filling a GPU."""
        batch, steps = x.shape[:2]
        time = torch.arange(steps, device=x.device)
        real = (time[None, :] < lengths[:, None])[..., None]  # (B, T, 1)
        last = (lengths - 1)[:, None, None]  # (B, 1, 1): each sequence's last position
        if not self.bidirectional:
            states, _ = super().forward(x, hx)  # (B, T, H)
            final = states.gather(1, last.expand(-1, -1, self.hidden_size)).transpose(0, 1)  # (1, B, H)
            return states.masked_fill(~real, 0.0), final
        pad = steps - lengths[:, None]  # (B, 1)
        rolled = x.gather(
            1, ((time[None, :] - pad) % steps)[..., None].expand_as(x)
        )  # (B, T, I): symbols at T - L .. T - 1
        both, _ = super().forward(torch.cat([x, rolled]), None if hx is None else hx.repeat(1, 2, 1))  # (2B, T, 2H)
        size = self.hidden_size
        forward_states = both[:batch, :, :size]
        unrolled = ((time[None, :] + pad) % steps)[..., None].expand(-1, -1, size)  # position t of a sequence, rolled
        backward_states = both[batch:, :, size:].gather(1, unrolled)  # (B, T, H), back at positions 0 .. L - 1
        final = torch.stack(
            [forward_states.gather(1, last.expand(-1, -1, size))[:, 0], backward_states[:, 0]]
        )  # (2, B, H)
        return torch.cat([forward_states, backward_states], dim=-1).masked_fill(~real, 0.0), final

    def _fused(self, x: Tensor, hx: Tensor | None, mask: Tensor) -> tuple[Tensor, Tensor]:
        directions = 2 if self.bidirectional else 1
        if hx is None:
            hx = x.new_zeros(directions, x.size(0), self.hidden_size)
        x = x.transpose(0, 1)  # (T, B, I): the kernel works time first
        states, finals = [], []
        for direction, suffix in enumerate(("_l0", "_l0_reverse")[:directions]):
            w_ih, w_hh, b_ih, b_hh = (
                getattr(self, name + suffix) for name in ("weight_ih", "weight_hh", "bias_ih", "bias_hh")
            )
            gi = F.linear(x, w_ih, b_ih)  # (T, B, 3H): the input's share of the gates, all steps at once
            direction_states, final, _, _ = gru_forward(gi, hx[direction], w_hh, b_hh, mask, direction == 1)
            states.append(direction_states)
            finals.append(final)
        states = torch.cat(states, dim=-1) if directions == 2 else states[0]
        return states.transpose(0, 1), torch.stack(finals)


@torch.library.custom_op("copytask::additive_forward", mutates_args=())
def additive_forward(queries: Tensor, keys: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    """queries W q (B, T_dec, A), keys U h + b (B, T_enc, A), v (A) -> v . tanh(W q_t + U h_i)
    (B, T_dec, T_enc), and, saved for the backward pass (no gradient flows back through it), the
    tanh (B, T_dec, T_enc, A)."""
    return tuple(_library().additive_forward(queries.contiguous(), keys.contiguous(), v.contiguous()))


@additive_forward.register_fake
def _(queries, keys, v):
    (batch, steps, attention), source = queries.shape, keys.size(1)
    return queries.new_empty(batch, steps, source), queries.new_empty(batch, steps, source, attention)


@torch.library.custom_op("copytask::additive_backward", mutates_args=())
def additive_backward(grad_scores: Tensor, u: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """-> gradients of queries (B, T_dec, A), keys (B, T_enc, A) and v (A)."""
    return tuple(_library().additive_backward(grad_scores.contiguous(), u.contiguous(), v.contiguous()))


@additive_backward.register_fake
def _(grad_scores, u, v):
    return (
        u.new_empty(u.size(0), u.size(1), u.size(3)),
        u.new_empty(u.size(0), u.size(2), u.size(3)),
        v.new_empty(v.shape),
    )


def _additive_setup(ctx, inputs, output):
    ctx.save_for_backward(output[1], inputs[2])
    ctx.set_materialize_grads(False)


def _additive_backward(ctx, grad_scores, _grad_u):
    return additive_backward(grad_scores, *ctx.saved_tensors)


additive_forward.register_autograd(_additive_backward, setup_context=_additive_setup)


def additive_scores(queries: Tensor, keys: Tensor, v: Tensor) -> Tensor:
    """queries W q (B, T_dec, A), keys U h + b (B, T_enc, A), v (A) -> v . tanh(W q_t + U h_i) (B, T_dec, T_enc)."""
    return additive_forward(queries, keys, v)[0]


@torch.library.custom_op("copytask::bahdanau_forward", mutates_args=())
def bahdanau_forward(
    embedded: Tensor,
    s0: Tensor,
    keys: Tensor,
    values: Tensor,
    mask: Tensor,
    w_q: Tensor,
    v: Tensor,
    w_ih: Tensor,
    b_ih: Tensor,
    w_hh: Tensor,
    b_hh: Tensor,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Time first: embedded (T_dec, B, E), s0 (B, H), keys (B, T_enc, A), values (B, T_enc, H),
    mask (B, T_enc) float or empty, then the attention's w_q (A, H) and v (A) and the GRU cell's
    parameters -> states s_1..s_T, contexts (T_dec, B, H), weights (T_dec, B, T_enc), and, saved
    for the backward pass (no gradient flows back through them), the score's tanh
    (T_dec, B, T_enc, A), GRU inputs (T_dec, B, E + H), gates (T_dec, B, 4H) and the state before
    each step (T_dec, B, H)."""
    tensors = (embedded, s0, keys, values, mask, w_q, v, w_ih, b_ih, w_hh, b_hh)
    return tuple(_library().bahdanau_forward(*(t.contiguous() for t in tensors)))


@bahdanau_forward.register_fake
def _(embedded, s0, keys, values, mask, w_q, v, w_ih, b_ih, w_hh, b_hh):
    (steps, batch, embedding), (_, source, attention), hidden = embedded.shape, keys.shape, s0.size(1)
    new = embedded.new_empty
    return (
        new(steps, batch, hidden),
        new(steps, batch, hidden),
        new(steps, batch, source),
        new(steps, batch, source, attention),
        new(steps, batch, embedding + hidden),
        new(steps, batch, 4 * hidden),
        new(steps, batch, hidden),
    )


@torch.library.custom_op("copytask::bahdanau_backward", mutates_args=())
def bahdanau_backward(
    grad_states: Tensor,
    grad_contexts: Tensor,
    grad_weights: Tensor,
    weights: Tensor,
    u: Tensor,
    inputs: Tensor,
    gates: Tensor,
    before: Tensor,
    values: Tensor,
    w_q: Tensor,
    v: Tensor,
    w_ih: Tensor,
    w_hh: Tensor,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """grad_weights may be empty (no gradient reaches the weights) -> gradients of embedded, s0,
    keys, values, w_q, v, w_ih, b_ih, w_hh, b_hh."""
    tensors = (grad_states, grad_contexts, grad_weights, weights, u, inputs, gates, before, values, w_q, v, w_ih, w_hh)
    return tuple(_library().bahdanau_backward(*(t.contiguous() for t in tensors)))


@bahdanau_backward.register_fake
def _(grad_states, grad_contexts, grad_weights, weights, u, inputs, gates, before, values, w_q, v, w_ih, w_hh):
    (_, batch, source, attention), embedding = u.shape, w_ih.size(1) - before.size(2)
    keys = u.new_empty(batch, source, attention)
    like = [inputs[..., :embedding], before[0], keys, values, w_q, v, w_ih, w_ih[:, 0], w_hh, w_hh[:, 0]]
    return tuple(t.new_empty(t.shape) for t in like)


def _bahdanau_setup(ctx, inputs, output):
    _, _, _, values, _, w_q, v, w_ih, _, w_hh, _ = inputs
    weights, u, gru_inputs, gates, before = output[2:]
    ctx.save_for_backward(weights, u, gru_inputs, gates, before, values, w_q, v, w_ih, w_hh)
    ctx.set_materialize_grads(False)


def _bahdanau_backward(ctx, grad_states, grad_contexts, grad_weights, *_grad_saved):
    weights, u, inputs, gates, before, values, w_q, v, w_ih, w_hh = ctx.saved_tensors
    grad_states = torch.zeros_like(before) if grad_states is None else grad_states
    grad_contexts = torch.zeros_like(before) if grad_contexts is None else grad_contexts
    grad_weights = weights.new_empty(0) if grad_weights is None else grad_weights
    grads = bahdanau_backward(
        grad_states, grad_contexts, grad_weights, weights, u, inputs, gates, before, values, w_q, v, w_ih, w_hh
    )
    grad_embedded, grad_s0, grad_keys, grad_values, *grad_parameters = grads
    return grad_embedded, grad_s0, grad_keys, grad_values, None, *grad_parameters


bahdanau_forward.register_autograd(_bahdanau_backward, setup_context=_bahdanau_setup)


for _op in (gru_backward, additive_backward, bahdanau_backward):
    _op.register_autograd(_no_double_backward)
for _op in (gru_forward, additive_forward, bahdanau_forward):
    torch.library.register_autocast(_op, "cpu", torch.float32)  # like torch's float32 ops: inputs cast up


def bahdanau_decode(
    embedded: Tensor, s0: Tensor, keys: Tensor, values: Tensor, mask: Tensor, w_q: Tensor, v: Tensor, cell: nn.GRUCell
) -> tuple[Tensor, Tensor, Tensor]:
    """Bahdanau's teacher-forced decoder loop in the kernel, batch first: embedded (B, T_dec, E),
    s0 (B, H), keys U h + b (B, T_enc, A), values (B, T_enc, H), mask (B, T_enc) bool, w_q (A, H),
    v (A,) -> states s_1..s_T (B, T_dec, H), contexts (B, T_dec, H), weights (B, T_dec, T_enc)."""
    states, contexts, weights, *_ = bahdanau_forward(
        embedded.transpose(0, 1),
        s0,
        keys,
        values,
        padding(mask),
        w_q,
        v,
        cell.weight_ih,
        cell.bias_ih,
        cell.weight_hh,
        cell.bias_hh,
    )
    return states.transpose(0, 1), contexts.transpose(0, 1), weights.transpose(0, 1)


def runs_fused(model: nn.Module) -> bool:
    """Whether the model's recurrences run in the kernels (recorded in a run's metrics)."""
    fused = [m for m in model.modules() if getattr(m, "fused", False)]
    return bool(fused) and usable(*(p for m in fused for p in m.parameters(recurse=False)))
