"""The Transformer's fused CPU kernels (`csrc/attention.cpp`, `csrc/layers.cpp`), with the contract
of `kernels.ops`' (its docstring): multi-head scaled dot-product attention in a training step
(`attention`), one greedy decoding step's attention over a cache (`attention_step`), and a whole
encoder or decoder layer in one call (`transformer_layer`)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .ops import _library, _no_double_backward, padding


@torch.library.custom_op("copytask::attention_forward", mutates_args=())
def attention_forward(x: Tensor, kv: Tensor, mask: Tensor, heads: int, causal: bool) -> tuple[Tensor, Tensor]:
    """The projections as the model makes them: a self-attention's x (B, T, 3d) holds q | k | v and
    kv is absent (empty, not 3-d); a cross-attention's x (B, T, d) is q and kv (B, S, 2d) holds k | v.
    `heads` heads of d / heads features each, mask (B, S) float (1 real, 0 padding) or empty,
    causal: query i sees keys j <= i -> out (B, T, d), the heads' outputs side by side, and, saved
    for the backward pass (no gradient flows back through it), each query row's log-sum-exp of its
    scores (B, heads, T)."""
    return tuple(_library().attention_forward(x.contiguous(), kv.contiguous(), mask.contiguous(), heads, causal))


@attention_forward.register_fake
def _(x, kv, mask, heads, causal):
    batch, steps, features = x.shape
    return x.new_empty(batch, steps, features if kv.dim() == 3 else features // 3), x.new_empty(batch, heads, steps)


@torch.library.custom_op("copytask::attention_backward", mutates_args=())
def attention_backward(
    grad_out: Tensor, x: Tensor, kv: Tensor, out: Tensor, lse: Tensor, mask: Tensor, heads: int, causal: bool
) -> tuple[Tensor, Tensor]:
    """-> the gradients of x and of kv, packed as they are (kv's empty where kv is absent)."""
    tensors = (grad_out, x, kv, out, lse, mask)
    return tuple(_library().attention_backward(*(t.contiguous() for t in tensors), heads, causal))


@attention_backward.register_fake
def _(grad_out, x, kv, out, lse, mask, heads, causal):
    return x.new_empty(x.shape), kv.new_empty(kv.shape if kv.dim() == 3 else (0,))


def _attention_setup(ctx, inputs, output):
    x, kv, mask, heads, causal = inputs
    ctx.save_for_backward(x, kv, mask, *output)
    ctx.heads, ctx.causal = heads, causal
    ctx.set_materialize_grads(False)


def _attention_backward(ctx, grad_out, _grad_lse):
    x, kv, mask, out, lse = ctx.saved_tensors
    grad_x, grad_kv = attention_backward(grad_out, x, kv, out, lse, mask, ctx.heads, ctx.causal)
    return grad_x, grad_kv if kv.dim() == 3 else None, None, None, None


attention_forward.register_autograd(_attention_backward, setup_context=_attention_setup)


def attention(x: Tensor, kv: Tensor | None, heads: int, key_mask: Tensor | None, causal: bool) -> Tensor:
    """softmax(q_h k_h^T / sqrt(d / heads) + masks) v_h for each head h, in the kernel, on the
    projections as one product makes them: x (B, T, 3d) = q | k | v with kv None (a self-attention),
    or x (B, T, d) = q and kv (B, S, 2d) = k | v; key_mask (B, S) bool, True on real keys, or None
    -> (B, T, d), the heads side by side. A query that sees no key gets a zero output. The
    gradients come back packed as x and kv are, with no concatenation after the kernel."""
    mask = x.new_empty(0) if key_mask is None else padding(key_mask)
    return attention_forward(x, x.new_empty(0) if kv is None else kv, mask, heads, causal)[0]


def cache_length(steps: int) -> int:
    """The length of a cache that `attention_step` reads `steps` keys from: a whole number of its tiles of 8."""
    return -(-steps // 8) * 8


def attention_step(q: Tensor, keys: Tensor, values: Tensor, mask: Tensor, keys_seen: int) -> tuple[Tensor, Tensor]:
    """One greedy decoding step's multi-head attention, no autograd: q (B, d), each sequence's one
    query, over the first `keys_seen` keys and values of a cache that holds them transposed, keys and
    values (B, heads, d / heads, C), C = cache_length(at least keys_seen) and zero past what was
    written; mask from `padding` of the keys (B, keys_seen), or empty -> (B, d), the heads side by
    side, and the weights (B, heads, keys_seen). A query that sees no key gets zero weights and a
    zero output."""
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, keys, values)):
        raise RuntimeError("kernels.attention_step has no backward; call it under torch.no_grad()")
    return tuple(_library().attention_step(q.contiguous(), keys, values, mask, keys_seen))


def layer_parameters(layer: nn.TransformerEncoderLayer | nn.TransformerDecoderLayer) -> list[Tensor]:
    """A layer's parameters in the order csrc/layers.cpp takes them."""
    decoder = isinstance(layer, nn.TransformerDecoderLayer)
    attentions = [layer.self_attn, layer.multihead_attn] if decoder else [layer.self_attn]
    norms = [layer.norm1, layer.norm2, layer.norm3] if decoder else [layer.norm1, layer.norm2]
    return [
        *(t for a in attentions for t in (a.in_proj_weight, a.in_proj_bias, a.out_proj.weight, a.out_proj.bias)),
        layer.linear1.weight,
        layer.linear1.bias,
        layer.linear2.weight,
        layer.linear2.bias,
        *(t for norm in norms for t in (norm.weight, norm.bias)),
    ]


def transformer_layer(
    layer: nn.TransformerEncoderLayer | nn.TransformerDecoderLayer, x: Tensor, memory: Tensor | None, mask: Tensor
) -> Tensor:
    """`layer`'s forward (post-norm, ReLU, no dropout) in one call of the kernel, the same numbers
    as its ops in Python to the bit: x (B, T, d); memory (B, S, d) for a decoder layer, None for an
    encoder layer; mask from `padding` of the keys (B, S) an encoder layer's self-attention or a
    decoder layer's cross-attention sees -> (B, T, d)."""
    memory = x.new_empty(0) if memory is None else memory
    return _library().transformer_layer(
        x, memory, mask, layer_parameters(layer), layer.self_attn.num_heads, layer.norm1.eps
    )


attention_backward.register_autograd(_no_double_backward)
torch.library.register_autocast(attention_forward, "cpu", torch.float32)  # like torch's float32 ops: inputs cast up
