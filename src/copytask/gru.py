"""nn.GRU whose recurrence runs in a small C++ kernel on CPU (`csrc/gru.cpp`).

nn.GRU on CPU executes each time step as a dozen ATen ops and autograd nodes. At this project's
sizes (batch 64, hidden 32-64, 80 steps) that per-op cost, not arithmetic, is most of a training
step. `GRU` is nn.GRU (same parameters, state_dict and gate equations) whose one-layer,
batch-first, float32 forward on CPU runs the recurrence in the kernel instead: one matrix
product and one pass over the gates per step, forward and backward. Everywhere else (CUDA,
float64, `fused=False`, no C++ compiler) it is torch's own. The two agree to float rounding
(tests/test_gru.py); `python -m copytask bench` measures the difference in speed.

The kernel is compiled by torch.utils.cpp_extension the first time it is needed (about 30 s,
once per machine and torch version, cached under `torch.utils.cpp_extension.get_default_build_root()`);
it needs a C++ compiler and ninja. Where it cannot be built, one warning says why and torch's
nn.GRU is used.
"""

from __future__ import annotations

import functools
import sys
import warnings
from pathlib import Path
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.autograd.function import once_differentiable
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

from .data import length_mask

NAME = "copytask_gru"
SOURCE = Path(__file__).with_name("csrc") / "gru.cpp"
# -ffast-math lets the compiler vectorise exp; it is a compile flag only, so the library is not
# linked with the start-up code that would switch the whole process to flush-to-zero.
CFLAGS = ["-O3", "-ffast-math"]


@functools.cache
def kernel() -> ModuleType | None:
    """The compiled kernel, or None (after one warning that says why) where it cannot be built."""
    from torch.utils import cpp_extension

    root = Path(cpp_extension.get_default_build_root())
    if not any(root.glob(f"**/{NAME}/{NAME}*.so")):  # torch builds in root/<python and CUDA versions>/NAME
        print(f"copytask: compiling the fused GRU kernel under {root} (once, about 30 s)", file=sys.stderr, flush=True)
    try:
        return cpp_extension.load(NAME, [str(SOURCE)], extra_cflags=CFLAGS, verbose=False)
    except Exception as error:  # no compiler, no ninja, unsupported platform: torch's nn.GRU still works
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        warnings.warn(f"copytask: could not build the fused GRU kernel ({reason}); using torch's nn.GRU, slower on CPU")
        return None


class _Recurrence(torch.autograd.Function):
    """One direction of one layer, time first: gi = W_ih x + b_ih (T, B, 3H) -> states (T, B, H), final (B, H)."""

    @staticmethod
    def forward(ctx, gi: Tensor, h0: Tensor, w_hh: Tensor, b_hh: Tensor, mask: Tensor, reverse: bool):
        states, final, gates, before = kernel().forward(gi, h0, w_hh, b_hh, mask, reverse)
        ctx.save_for_backward(gates, before, w_hh, mask)
        ctx.reverse = reverse
        return states, final

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_states: Tensor | None, grad_final: Tensor | None):
        gates, before, w_hh, mask = ctx.saved_tensors
        grad_states = torch.zeros_like(before) if grad_states is None else grad_states.contiguous()
        grad_final = torch.zeros_like(before[0]) if grad_final is None else grad_final
        grad_gi, grad_h0, grad_w_hh, grad_b_hh = kernel().backward(grad_states, grad_final, gates, before, w_hh, mask, ctx.reverse)
        return grad_gi, grad_h0, grad_w_hh, grad_b_hh, None, None


class GRU(nn.GRU):
    """One batch-first GRU layer, uni- or bidirectional, that also takes the sequences' lengths."""

    def __init__(self, input_size: int, hidden_size: int, bidirectional: bool = False, fused: bool = True):
        super().__init__(input_size, hidden_size, batch_first=True, bidirectional=bidirectional)
        self.fused = fused

    def forward(self, x: Tensor, hx: Tensor | None = None, lengths: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """x (B, T, I), hx (D, B, H) or None (zeros), lengths (B,) or None (all T) -> states
        (B, T, D*H), zero past each sequence's length, and final (D, B, H), each direction's
        last real state: what packing gives, and without packing's cost when all lengths are T."""
        ragged = lengths is not None and bool((lengths < x.size(1)).any())
        if self.fused and x.device.type == "cpu" and x.dtype == torch.float32 and kernel() is not None:
            mask = length_mask(lengths, x.size(1)).t().float().contiguous() if ragged else x.new_empty(0)
            return self._fused(x, hx, mask)
        if ragged:
            packed = pack_padded_sequence(x, lengths.cpu(), batch_first=True, enforce_sorted=False)
            states, final = super().forward(packed, hx)
            return pad_packed_sequence(states, batch_first=True, total_length=x.size(1))[0], final
        return super().forward(x, hx)

    def _fused(self, x: Tensor, hx: Tensor | None, mask: Tensor) -> tuple[Tensor, Tensor]:
        directions = 2 if self.bidirectional else 1
        if hx is None:
            hx = x.new_zeros(directions, x.size(0), self.hidden_size)
        x = x.transpose(0, 1)  # (T, B, I): the kernel works time first
        states, finals = [], []
        for direction, suffix in enumerate(("_l0", "_l0_reverse")[:directions]):
            w_ih, w_hh, b_ih, b_hh = (getattr(self, name + suffix) for name in ("weight_ih", "weight_hh", "bias_ih", "bias_hh"))
            gi = F.linear(x, w_ih, b_ih)  # (T, B, 3H): the input's share of the gates, all steps at once
            direction_states, final = _Recurrence.apply(gi, hx[direction].contiguous(), w_hh, b_hh, mask, direction == 1)
            states.append(direction_states)
            finals.append(final)
        states = torch.cat(states, dim=-1) if directions == 2 else states[0]
        return states.transpose(0, 1), torch.stack(finals)


def runs_fused(model: nn.Module) -> bool:
    """Whether the model's GRU layers run in the kernel (recorded in a run's metrics)."""
    layers = [m for m in model.modules() if isinstance(m, GRU) and m.fused]
    on_cpu = all(m.weight_hh_l0.device.type == "cpu" and m.weight_hh_l0.dtype == torch.float32 for m in layers)
    return bool(layers) and on_cpu and kernel() is not None
