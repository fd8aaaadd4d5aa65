"""Mamba's fused CPU kernels (`csrc/mamba.cpp`), with the contract of `kernels.ops`' (its docstring): the
causal depthwise convolution with its SiLU (`causal_conv_silu`), and the selective scan with the block's D skip
and gate (`selective_scan`), what `models.mamba.MambaBlock` computes with torch's ops, forward and backward."""

from __future__ import annotations

import torch
from torch import Tensor

from .ops import _library, _no_double_backward


@torch.library.custom_op("copytask::causal_conv_forward", mutates_args=())
def causal_conv_forward(inputs: Tensor, weight: Tensor, bias: Tensor) -> Tensor:
    """inputs (B, K - 1 + T, E): a window of K - 1 steps, then T new ones; weight (K, E), bias (E) -> SiLU(bias +
    sum_k weight_k inputs_{t + k}) (B, T, E). The backward pass computes the convolution again."""
    return _library().causal_conv_forward(inputs.contiguous(), weight.contiguous(), bias.contiguous())


@causal_conv_forward.register_fake
def _(inputs, weight, bias):
    return inputs.new_empty(inputs.size(0), inputs.size(1) - weight.size(0) + 1, inputs.size(2))


@torch.library.custom_op("copytask::causal_conv_backward", mutates_args=())
def causal_conv_backward(
    grad_out: Tensor, inputs: Tensor, weight: Tensor, bias: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """-> the gradients of inputs, weight and bias."""
    tensors = (grad_out, inputs, weight, bias)
    return tuple(_library().causal_conv_backward(*(t.contiguous() for t in tensors)))


@causal_conv_backward.register_fake
def _(grad_out, inputs, weight, bias):
    return inputs.new_empty(inputs.shape), weight.new_empty(weight.shape), bias.new_empty(bias.shape)


def _conv_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _conv_backward(ctx, grad_out):
    return causal_conv_backward(grad_out, *ctx.saved_tensors)


causal_conv_forward.register_autograd(_conv_backward, setup_context=_conv_setup)
causal_conv_backward.register_autograd(_no_double_backward)


@torch.library.custom_op("copytask::selective_scan_forward", mutates_args=())
def selective_scan_forward(
    u: Tensor, dt: Tensor, mask: Tensor, A: Tensor, B: Tensor, C: Tensor, h0: Tensor, D: Tensor, z: Tensor
) -> tuple[Tensor, Tensor]:
    """u (B, T, E); dt (B, T, E), Δ before its softplus; mask (B, T) float (1 real, 0 padding: Δ = 0) or empty;
    A (E, N) <= 0; B and C (B, T, N); h0 (B, E, N); and D (E) with z (B, T, E), or both empty -> the output
    (B, T, E), (y + D u) SiLU(z) or y = C h without D and z, and the last state (B, E, N). The backward pass
    computes the states again from the inputs."""
    tensors = (u, dt, mask, A, B, C, h0, D, z)
    return tuple(_library().selective_scan_forward(*(t.contiguous() for t in tensors)))


@selective_scan_forward.register_fake
def _(u, dt, mask, A, B, C, h0, D, z):
    (batch, steps, channels), states = u.shape, A.size(1)
    return u.new_empty(batch, steps, channels), u.new_empty(batch, channels, states)


@torch.library.custom_op("copytask::selective_scan_backward", mutates_args=())
def selective_scan_backward(
    grad_out: Tensor,
    grad_final: Tensor,
    u: Tensor,
    dt: Tensor,
    mask: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    h0: Tensor,
    D: Tensor,
    z: Tensor,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """grad_out (B, T, E) and grad_final (B, E, N), either empty (zero) -> the gradients of u, dt, A, B, C, h0,
    D and z (the last two empty where they are)."""
    tensors = (grad_out, grad_final, u, dt, mask, A, B, C, h0, D, z)
    return tuple(_library().selective_scan_backward(*(t.contiguous() for t in tensors)))


@selective_scan_backward.register_fake
def _(grad_out, grad_final, u, dt, mask, A, B, C, h0, D, z):
    return tuple(t.new_empty(t.shape) for t in (u, dt, A, B, C, h0, D, z))


def _scan_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)
    ctx.set_materialize_grads(False)


def _scan_backward(ctx, grad_out, grad_final):
    u, *_ = ctx.saved_tensors
    empty = u.new_empty(0)
    grad_u, grad_dt, *rest = selective_scan_backward(
        empty if grad_out is None else grad_out, empty if grad_final is None else grad_final, *ctx.saved_tensors
    )
    return grad_u, grad_dt, None, *rest  # the mask has none


selective_scan_forward.register_autograd(_scan_backward, setup_context=_scan_setup)
selective_scan_backward.register_autograd(_no_double_backward)
for _op in (causal_conv_forward, selective_scan_forward):
    torch.library.register_autocast(_op, "cpu", torch.float32)  # like torch's float32 ops: inputs cast up


def causal_conv_silu(inputs: Tensor, weight: Tensor, bias: Tensor) -> Tensor:
    """`MambaBlock`'s convolution and SiLU in the kernel: inputs (B, K - 1 + T, E), nn.Conv1d's depthwise weight
    (E, 1, K) and bias (E) -> (B, T, E)."""
    return causal_conv_forward(inputs, weight[:, 0].t(), bias)


def selective_scan(
    u: Tensor,
    dt: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    h0: Tensor,
    mask: Tensor | None = None,
    D: Tensor | None = None,
    z: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """What `models.mamba.MambaBlock` computes from Δ before its softplus to the gated output, in the kernel: Δ =
    softplus(dt) (0 where `mask` (B, T) is False), `models.mamba.selective_scan`, then the D skip and the SiLU(z)
    gate where D and z are given: u (B, T, E), dt (B, T, E), A (E, N), B and C (B, T, N), h0 (B, E, N), D (E),
    z (B, T, E) -> (y + D u) SiLU(z) or y (B, T, E), h_T (B, E, N)."""
    empty = u.new_empty(0)
    mask = empty if mask is None else mask.to(u.dtype)
    return selective_scan_forward(u, dt, mask, A, B, C, h0, empty if D is None else D, empty if z is None else z)
