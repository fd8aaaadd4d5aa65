"""Fused CPU kernels (`csrc/`) for the sequential parts of a training step.

Torch on CPU runs every time step of a recurrence as tens of ATen ops and autograd nodes,
forward and backward (a GRU step about 24 ops and 14 nodes, a Bahdanau decoder step about 94 and 33). At this project's sizes (batch 64, hidden 32-64, 80 steps) that
per-op cost, not arithmetic, is most of a training step. Two recurrences and one score get a
kernel that runs the whole sequence in C++: a few matrix products and passes over contiguous
rows per step.

- `GRU`: nn.GRU (same parameters, state_dict and equations) for the encoder and the plain and
  Luong decoders;
- `bahdanau_decode`: Bahdanau's decoder under teacher forcing (attention and GRU cell, step by
  step, as `model.BahdanauDecoder` computes it);
- `additive_scores`: the additive score of every (decoder step, source position) pair, which
  Luong's concat score needs under teacher forcing (`attention.Attention.additive_scores`).

They are used for float32 on CPU; everywhere else (CUDA, float64, `fused=False`, no C++
compiler) the torch code runs. They agree with it to float rounding (tests/test_kernels.py);
`python -m copytask bench` measures the speed.

The kernels are compiled by torch.utils.cpp_extension the first time they are needed (30-60 s,
once per machine and torch version, cached under $TORCH_EXTENSIONS_DIR or
`torch.utils.cpp_extension.get_default_build_root()`); that needs a C++ compiler and ninja.
Where they cannot be built, one warning says why and the torch code runs. Loading them also
raises glibc's mmap threshold (csrc/bindings.cpp), so that large freed blocks are reused instead
of being mapped afresh, and page-faulted in, at every step. docs/bench.md has the figures.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import shutil
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

SOURCES = [Path(__file__).with_name("csrc") / name for name in ("bindings.cpp", "gru.cpp", "additive.cpp", "bahdanau.cpp")]
# -ffast-math lets the compiler vectorise the sums over a row; it is a compile flag only, so
# the library is not linked with the start-up code that would set flush-to-zero for the process.
CFLAGS = ["-O3", "-ffast-math"]
# AVX2 and FMA make the kernels' loops 1.2-1.7x faster where the CPU has them (torch says whether it
# does); the build is named after the instruction set, so machines that share a home directory
# (a cluster's nodes) never load a build their CPU cannot run.
AVX2 = ("AVX2", "AVX512")


RETRY = 'retry with `python -m copytask build`'


def build_name_and_flags() -> tuple[str, list[str]]:
    if torch.backends.cpu.get_cpu_capability() in AVX2:
        return "copytask_kernels_avx2", [*CFLAGS, "-mavx2", "-mfma"]
    return "copytask_kernels", CFLAGS


def toolchain() -> str:
    """What a build depends on besides its sources and flags: the compiler and ninja torch would call."""
    return json.dumps({"cxx": shutil.which(os.environ.get("CXX", "c++")), "ninja": shutil.which("ninja")})


@functools.cache
def kernel() -> ModuleType | None:
    """The compiled kernels, or None (after one warning that says why) where they cannot be built.
    A failed build is remembered in the build root until the toolchain changes, so that a machine
    without a compiler does not try again, and warn at length, in every run."""
    from torch.utils import cpp_extension

    name, flags = build_name_and_flags()
    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or cpp_extension.get_default_build_root())
    failed = root / f"{name}.failed"
    try:
        remembered = json.loads(failed.read_text())
        if remembered["toolchain"] == toolchain():
            warnings.warn(f"copytask: the fused CPU kernels did not build on this machine ({remembered['reason']}); "
                          f"using torch's ops, slower on CPU; {RETRY}")
            return None
    except (OSError, ValueError, KeyError, TypeError):  # no failure remembered (or an unreadable note): build
        pass
    if not any(root.glob(f"**/{name}/{name}*.so")):  # torch builds in root[/<python and CUDA versions>]/name
        print(f"copytask: compiling the fused CPU kernels under {root} (once, about a minute)", file=sys.stderr, flush=True)
    # torch's compiler banners (warnings and log records): a failure is reported below, once, in one line
    torch_log = logging.getLogger("torch.utils.cpp_extension")
    level = torch_log.level
    torch_log.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return cpp_extension.load(name, [str(path) for path in SOURCES], extra_cflags=flags, verbose=False)
    except Exception as error:  # no compiler, no ninja, unsupported platform: the torch code still works
        compiler = os.environ.get("CXX", "c++")
        reason = str(error).strip().splitlines()[0][:160] if str(error).strip() else type(error).__name__
        if shutil.which(compiler) is None:
            reason = f"no C++ compiler: {compiler!r} is not on PATH"
        root.mkdir(parents=True, exist_ok=True)
        failed.write_text(json.dumps({"toolchain": toolchain(), "reason": reason}))
        warnings.warn(f"copytask: could not build the fused CPU kernels ({reason}); using torch's ops, slower on CPU; {RETRY}")
        return None
    finally:
        torch_log.setLevel(level)


def retry_build() -> None:
    """Forget a remembered failed build, so that the next `kernel()` tries again."""
    from torch.utils import cpp_extension

    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or cpp_extension.get_default_build_root())
    (root / f"{build_name_and_flags()[0]}.failed").unlink(missing_ok=True)
    kernel.cache_clear()


def padding(real: Tensor) -> Tensor:
    """A bool mask of real positions as the kernels take it: float (1 real, 0 padding), or empty
    where nothing is padded, so that they skip the masking."""
    return real.new_empty(0, dtype=torch.float32) if bool(real.all()) else real.float().contiguous()


def usable(*tensors: Tensor) -> bool:
    """Whether the kernels can run on these tensors: float32 on CPU, and the kernels built."""
    return all(t.device.type == "cpu" and t.dtype == torch.float32 for t in tensors) and kernel() is not None


class _GRURecurrence(torch.autograd.Function):
    """One direction of one layer, time first: gi = W_ih x + b_ih (T, B, 3H) -> states (T, B, H), final (B, H)."""

    @staticmethod
    def forward(ctx, gi: Tensor, h0: Tensor, w_hh: Tensor, b_hh: Tensor, mask: Tensor, reverse: bool):
        states, final, gates, before = kernel().gru_forward(gi, h0, w_hh, b_hh, mask, reverse)
        ctx.save_for_backward(gates, before, w_hh, mask)
        ctx.reverse = reverse
        return states, final

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_states: Tensor | None, grad_final: Tensor | None):
        gates, before, w_hh, mask = ctx.saved_tensors
        grad_states = torch.zeros_like(before) if grad_states is None else grad_states.contiguous()
        grad_final = torch.zeros_like(before[0]) if grad_final is None else grad_final.contiguous()
        grad_gi, grad_h0, grad_w_hh, grad_b_hh = kernel().gru_backward(grad_states, grad_final, gates, before, w_hh, mask, ctx.reverse)
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
        if self.fused and usable(x):
            mask = x.new_empty(0) if lengths is None else padding(length_mask(lengths, x.size(1)).t())
            return self._fused(x, hx, mask)
        if lengths is not None and bool((lengths < x.size(1)).any()):
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
            gi = F.linear(x, w_ih, b_ih).contiguous()  # (T, B, 3H): the input's share of the gates, all steps at once
            direction_states, final = _GRURecurrence.apply(gi, hx[direction].contiguous(), w_hh, b_hh, mask, direction == 1)
            states.append(direction_states)
            finals.append(final)
        states = torch.cat(states, dim=-1) if directions == 2 else states[0]
        return states.transpose(0, 1), torch.stack(finals)


class _AdditiveScores(torch.autograd.Function):
    """queries W q (B, T_dec, A), keys U h + b (B, T_enc, A), v (A) -> v . tanh(W q_t + U h_i) (B, T_dec, T_enc)."""

    @staticmethod
    def forward(ctx, queries: Tensor, keys: Tensor, v: Tensor) -> Tensor:
        scores, u = kernel().additive_forward(queries.contiguous(), keys.contiguous(), v.contiguous())
        ctx.save_for_backward(u, v)
        return scores

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_scores: Tensor):
        u, v = ctx.saved_tensors
        return tuple(kernel().additive_backward(grad_scores.contiguous(), u, v.contiguous()))


additive_scores = _AdditiveScores.apply


class _BahdanauRecurrence(torch.autograd.Function):
    """Time first: embedded (T_dec, B, E), s0 (B, H), keys (B, T_enc, A), values (B, T_enc, H),
    mask (B, T_enc) float or empty, then the parameters -> states s_1..s_T, contexts (T_dec, B, H),
    weights (T_dec, B, T_enc)."""

    @staticmethod
    def forward(ctx, embedded, s0, keys, values, mask, w_q, v, w_ih, b_ih, w_hh, b_hh):
        states, contexts, weights, u, inputs, gates, before = kernel().bahdanau_forward(
            embedded, s0, keys, values, mask, w_q, v, w_ih, b_ih, w_hh, b_hh
        )
        ctx.save_for_backward(weights, u, inputs, gates, before, values, w_q, v, w_ih, w_hh)
        return states, contexts, weights

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_states, grad_contexts, grad_weights):
        weights, u, inputs, gates, before, values, w_q, v, w_ih, w_hh = ctx.saved_tensors
        grad_states = torch.zeros_like(before) if grad_states is None else grad_states.contiguous()
        grad_contexts = torch.zeros_like(before) if grad_contexts is None else grad_contexts.contiguous()
        grad_weights = weights.new_empty(0) if grad_weights is None else grad_weights.contiguous()
        grads = kernel().bahdanau_backward(grad_states, grad_contexts, grad_weights, weights, u, inputs, gates, before, values, w_q, v, w_ih, w_hh)
        grad_embedded, grad_s0, grad_keys, grad_values, grad_w_q, grad_v, *grad_cell = grads
        return (grad_embedded, grad_s0, grad_keys, grad_values, None, grad_w_q, grad_v, *grad_cell)


def bahdanau_decode(
    embedded: Tensor, s0: Tensor, keys: Tensor, values: Tensor, mask: Tensor, w_q: Tensor, v: Tensor, cell: nn.GRUCell
) -> tuple[Tensor, Tensor, Tensor]:
    """Bahdanau's teacher-forced decoder loop in the kernel, batch first: embedded (B, T_dec, E),
    s0 (B, H), keys U h + b (B, T_enc, A), values (B, T_enc, H), mask (B, T_enc) bool, w_q (A, H),
    v (A,) -> states s_1..s_T (B, T_dec, H), contexts (B, T_dec, H), weights (B, T_dec, T_enc)."""
    states, contexts, weights = _BahdanauRecurrence.apply(
        embedded.transpose(0, 1).contiguous(), s0.contiguous(), keys.contiguous(), values.contiguous(), padding(mask),
        w_q, v, cell.weight_ih, cell.bias_ih, cell.weight_hh, cell.bias_hh,
    )
    return states.transpose(0, 1), contexts.transpose(0, 1), weights.transpose(0, 1)


def runs_fused(model: nn.Module) -> bool:
    """Whether the model's recurrences run in the kernels (recorded in a run's metrics)."""
    fused = [m for m in model.modules() if getattr(m, "fused", False)]
    return bool(fused) and usable(*(p for m in fused for p in m.parameters(recurse=False)))
