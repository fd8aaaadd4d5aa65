// The Transformer's layers in a training step on CPU, forward and backward, one call a layer:
// nn.TransformerEncoderLayer's and nn.TransformerDecoderLayer's forward (post-norm, ReLU, no
// dropout) in the ATen ops torch's own modules run, with the attention in csrc/attention.cpp.
//
// In Python a layer is a dozen ops forward and as many autograd nodes backward, each some
// microseconds of dispatch: at length 20 a step spent as long on that as on its attention. Here
// they are the same ATen ops called from C++, and the backward is autograd's formulas for them
// (AddmmBackward0, NativeLayerNormBackward0, ReluBackward0, the split of a cross-attention's
// in_proj), so the numbers are those of the layers in Python, to the bit (tests/test_transformer.py).
//
// Shapes: B sequences, T positions, F features, N = B * T rows. x (B, T, F); a decoder layer's
// memory (B, S, F), an encoder layer's empty (not 3-d); mask (B, S) float or empty, as in
// csrc/attention.cpp: the keys of an encoder layer's self-attention or of a decoder layer's
// cross-attention (its self-attention is causal, nothing masked). params, in this order:
//   encoder (12): self_attn in_proj weight, bias, out_proj weight, bias; linear1 weight, bias;
//                 linear2 weight, bias; norm1 weight, bias; norm2 weight, bias
//   decoder (18): self_attn (4, as above); multihead_attn (4); linear1, linear2 (4); norm1, norm2,
//                 norm3 (6)
// The forward returns the output (B, T, F) and what the backward needs ("saved"), block by block:
// an attention block's projections (q | k | v, or q and k | v), attention output and lse, a
// feed-forward block's ReLU output, then every block's residual sum, mean and rstd, and after each
// block but the first, its input (the block before's output).
//
// transformer_layer records a layer for autograd as one node, written in C++ (LayerFunction): as a
// Python autograd Function the layer's 18 parameters and 20 saved tensors crossed into Python and
// back at every call, a cost docs/bench.md measures.
#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/functions/basic_ops.h>

#include <array>
#include <vector>

#include "common.h"

using at::Tensor;

std::vector<Tensor> attention_forward(const Tensor& x, const Tensor& kv, const Tensor& mask, int64_t heads, bool causal);
std::vector<Tensor> attention_backward(const Tensor& grad_out, const Tensor& x, const Tensor& kv, const Tensor& out,
                                       const Tensor& lse, const Tensor& mask, int64_t heads, bool causal);

namespace {

// F.linear of contiguous rows (N, in), as at::linear computes it.
Tensor linear(const Tensor& x, const Tensor& w, const Tensor& b) { return at::addmm(b, x, w.t()); }

// AddmmBackward0 of linear(x, w, b) for the output's gradient g (N, out): -> the gradients of x, w and b.
std::array<Tensor, 3> linear_backward(const Tensor& g, const Tensor& x, const Tensor& w) {
  return {at::mm(g, w), at::mm(g.t(), x), g.sum(0)};
}

// A block's parameters are named by their offset in params, as in LayerBackward.
struct Layer {
  int64_t B, heads;
  double eps;
  const Tensor* params;
  std::vector<Tensor>& saved;

  // LayerNorm(x + sublayer), the norm's parameters params[n] and params[n + 1]: saves the sum, mean
  // and rstd.
  Tensor add_norm(const Tensor& x, const Tensor& sublayer, int64_t n) {
    const Tensor sum = at::add(x, sublayer);
    auto [out, mean, rstd] = at::native_layer_norm(sum, {sum.size(1)}, params[n], params[n + 1], eps);
    saved.insert(saved.end(), {sum, mean, rstd});
    return out;
  }

  // A self-attention (memory empty) or cross-attention block on rows x, its keys masked by mask: its 4
  // parameters from params[k], its norm's 2 from params[n].
  Tensor attention(const Tensor& x, const Tensor& memory, const Tensor& mask, bool causal, int64_t k, int64_t n) {
    const int64_t F = x.size(1);
    const Tensor* p = params + k;
    std::vector<Tensor> out;
    if (memory.dim() != 3) {
      const Tensor qkv = linear(x, p[0], p[1]);
      out = attention_forward(qkv.view({B, -1, 3 * F}), qkv.new_empty({0}), mask, heads, causal);
      saved.push_back(qkv);
    } else {
      const Tensor q = linear(x, p[0].narrow(0, 0, F), p[1].narrow(0, 0, F));
      const Tensor kv = linear(memory.view({-1, F}), p[0].narrow(0, F, 2 * F), p[1].narrow(0, F, 2 * F));
      out = attention_forward(q.view({B, -1, F}), kv.view({B, -1, 2 * F}), mask, heads, causal);
      saved.insert(saved.end(), {q, kv});
    }
    const Tensor context = out[0].view({-1, F});
    saved.insert(saved.end(), {context, out[1]});
    return add_norm(x, linear(context, p[2], p[3]), n);
  }

  Tensor feed_forward(const Tensor& x, int64_t k, int64_t n) {
    const Tensor* p = params + k;
    const Tensor hidden = at::relu(linear(x, p[0], p[1]));
    saved.push_back(hidden);
    return add_norm(x, linear(hidden, p[2], p[3]), n);
  }
};

// The backward pass takes `saved` from its end (the forward's order reversed). A block's parameters
// are named by their offset in params: params[k] has its gradient at grads[2 + k].
struct LayerBackward {
  int64_t B, heads;
  const Tensor* params;
  std::vector<Tensor>& saved;
  std::vector<Tensor>& grads;  // x's, the memory's, then the parameters' gradients

  Tensor pop() {
    Tensor t = saved.back();
    saved.pop_back();
    return t;
  }

  // The gradient of an add_norm's sum, and its norm's parameters' (params[n], params[n + 1]).
  Tensor add_norm(const Tensor& g, int64_t n) {
    const Tensor rstd = pop(), mean = pop(), sum = pop();
    auto [grad_sum, grad_weight, grad_bias] = at::native_layer_norm_backward(
        g, sum, {sum.size(1)}, mean, rstd, params[n], params[n + 1], {true, true, true});
    grads[2 + n] = grad_weight, grads[3 + n] = grad_bias;
    return grad_sum;
  }

  // An attention block's output gradient g -> its input's; a cross-attention's memory gradient into
  // grad_memory. Its parameters from params[k], its norm's from params[n]; x the block's input.
  Tensor attention(const Tensor& g, const Tensor& x, const Tensor& memory, const Tensor& mask, bool causal, int64_t k,
                   int64_t n, Tensor& grad_memory) {
    const int64_t F = g.size(1);
    const Tensor* p = params + k;
    Tensor* grad = grads.data() + 2 + k;
    const Tensor grad_sum = add_norm(g, n);
    const Tensor lse = pop(), context = pop();
    auto [grad_context, grad_w_out, grad_b_out] = linear_backward(grad_sum, context, p[2]);
    grad[2] = grad_w_out, grad[3] = grad_b_out;
    const Tensor grad_out = grad_context.view({B, -1, F}), out = context.view({B, -1, F});
    Tensor grad_x;
    if (memory.dim() != 3) {
      const Tensor qkv = pop();
      const Tensor grad_qkv = attention_backward(grad_out, qkv.view({B, -1, 3 * F}), qkv.new_empty({0}), out, lse,
                                                 mask, heads, causal)[0];
      auto [gx, gw, gb] = linear_backward(grad_qkv.view({-1, 3 * F}), x, p[0]);
      grad_x = gx, grad[0] = gw, grad[1] = gb;
    } else {
      const Tensor kv = pop(), q = pop();
      const auto qkv_grads = attention_backward(grad_out, q.view({B, -1, F}), kv.view({B, -1, 2 * F}), out, lse,
                                                mask, heads, causal);
      auto [gx, gw_q, gb_q] = linear_backward(qkv_grads[0].view({-1, F}), x, p[0].narrow(0, 0, F));
      auto [gm, gw_kv, gb_kv] = linear_backward(qkv_grads[1].view({-1, 2 * F}), memory.view({-1, F}), p[0].narrow(0, F, 2 * F));
      grad_x = gx, grad_memory = gm.view(memory.sizes());
      grad[0] = at::cat({gw_q, gw_kv}), grad[1] = at::cat({gb_q, gb_kv});
    }
    return at::add(grad_sum, grad_x);  // the residual's gradient and the projection's
  }

  Tensor feed_forward(const Tensor& g, const Tensor& x, int64_t k, int64_t n) {
    const Tensor* p = params + k;
    const Tensor grad_sum = add_norm(g, n);
    const Tensor hidden = pop();
    auto [grad_hidden, grad_w2, grad_b2] = linear_backward(grad_sum, hidden, p[2]);
    auto [grad_x, grad_w1, grad_b1] = linear_backward(at::threshold_backward(grad_hidden, hidden, 0), x, p[0]);
    Tensor* grad = grads.data() + 2 + k;
    grad[0] = grad_w1, grad[1] = grad_b1, grad[2] = grad_w2, grad[3] = grad_b2;
    return at::add(grad_sum, grad_x);
  }
};

void check_layer(const char* kernel, const Tensor& x, const Tensor& memory, const std::vector<Tensor>& params) {
  check_dim(kernel, "x", x, 3);
  const size_t want = memory.dim() == 3 ? 18 : 12;
  TORCH_CHECK(params.size() == want, kernel, ": a ", want == 18 ? "decoder" : "encoder", " layer has ", want,
              " parameters, got ", params.size());
  for (const Tensor& t : params) check_inputs(kernel, {&t});
  check_inputs(kernel, {&x, &memory});
}

}  // namespace

// -> the layer's output (B, T, F), then what layer_backward needs (see the top of this file).
std::vector<Tensor> layer_forward(const Tensor& x, const Tensor& memory, const Tensor& mask, const std::vector<Tensor>& params,
                                  int64_t heads, double eps) {
  check_layer("layer_forward", x, memory, params);
  // The ops below go straight to their CPU kernels, past autograd's and the views' bookkeeping (the
  // layer is one autograd node: nothing inside it is recorded anyway). The same kernels, the same
  // numbers; a quarter less time on a small layer's dispatch.
  const at::AutoDispatchBelowADInplaceOrView below_autograd;
  std::vector<Tensor> saved;
  Layer layer{x.size(0), heads, eps, params.data(), saved};
  const Tensor empty = x.new_empty({0});
  const Tensor rows = x.reshape({-1, x.size(2)});
  Tensor out;
  if (memory.dim() != 3) {  // encoder: self-attention over the real (unpadded) positions, feed-forward
    const Tensor h1 = layer.attention(rows, empty, mask, false, 0, 8);
    out = layer.feed_forward(h1, 4, 10);
    saved.push_back(h1);
  } else {  // decoder: causal self-attention, cross-attention over the memory, feed-forward
    const Tensor h1 = layer.attention(rows, empty, empty, true, 0, 12);
    const Tensor h2 = layer.attention(h1, memory, mask, false, 4, 14);
    saved.push_back(h1);
    out = layer.feed_forward(h2, 8, 16);
    saved.push_back(h2);
  }
  saved.insert(saved.begin(), out.view(x.sizes()));
  return saved;
}

// grad_out (B, T, F), the forward's inputs and its saved tensors (the forward's outputs but the
// first) -> the gradients of x, of the memory (empty for an encoder layer), then of each parameter.
std::vector<Tensor> layer_backward(const Tensor& grad_out, const Tensor& x, const Tensor& memory, const Tensor& mask,
                                   const std::vector<Tensor>& params, std::vector<Tensor> saved, int64_t heads) {
  check_layer("layer_backward", x, memory, params);
  check_inputs("layer_backward", {&grad_out});
  const at::AutoDispatchBelowADInplaceOrView below_autograd;  // as in layer_forward
  check_shape("layer_backward", "grad_out", grad_out, x.sizes());
  std::vector<Tensor> grads(2 + params.size());
  Tensor grad_memory = x.new_empty({0});
  LayerBackward layer{x.size(0), heads, params.data(), saved, grads};
  const Tensor empty = x.new_empty({0});
  const Tensor rows = x.reshape({-1, x.size(2)});
  Tensor g = grad_out.reshape({-1, x.size(2)});
  if (memory.dim() != 3) {
    const Tensor h1 = layer.pop();
    g = layer.feed_forward(g, h1, 4, 10);
    g = layer.attention(g, rows, empty, mask, false, 0, 8, grad_memory);
  } else {
    const Tensor h2 = layer.pop();
    g = layer.feed_forward(g, h2, 8, 16);
    const Tensor h1 = layer.pop();
    g = layer.attention(g, h1, memory, mask, false, 4, 14, grad_memory);
    g = layer.attention(g, rows, empty, empty, true, 0, 12, grad_memory);
  }
  grads[0] = g.view(x.sizes()), grads[1] = grad_memory;
  return grads;
}

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// A layer as one autograd node: x, the memory (empty for an encoder layer), the mask, then the
// layer's parameters as layer_forward takes them; its backward is layer_backward. There is no
// second derivative: a backward under create_graph returns gradients whose own backward raises, as
// torch's once_differentiable makes a Python Function's do.
struct LayerFunction : public torch::autograd::Function<LayerFunction> {
  static Tensor forward(AutogradContext* ctx, const Tensor& x, const Tensor& memory, const Tensor& mask, at::TensorList params,
                        int64_t heads, double eps) {
    const Tensor x_ = x.contiguous(), memory_ = memory.contiguous(), mask_ = mask.contiguous();
    const std::vector<Tensor> outputs = layer_forward(x_, memory_, mask_, params.vec(), heads, eps);
    variable_list saved{x_, memory_, mask_};  // then the parameters, then what layer_backward needs
    saved.insert(saved.end(), params.begin(), params.end());
    saved.insert(saved.end(), outputs.begin() + 1, outputs.end());
    ctx->save_for_backward(std::move(saved));  // freed as soon as the backward has run
    ctx->saved_data["parameters"] = static_cast<int64_t>(params.size());
    ctx->saved_data["heads"] = heads;
    return outputs.front();
  }

  // -> a gradient for each of forward's arguments, the parameters one by one (undefined: none).
  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    const variable_list saved = ctx->get_saved_variables();
    const int64_t n = ctx->saved_data["parameters"].toInt();
    const Tensor &x = saved[0], &memory = saved[1], &mask = saved[2];
    std::vector<Tensor> grads = layer_backward(grad_outputs[0].contiguous(), x, memory, mask, {saved.begin() + 3, saved.begin() + 3 + n},
                                               {saved.begin() + 3 + n, saved.end()}, ctx->saved_data["heads"].toInt());
    if (memory.dim() != 3) grads[1] = Tensor();
    if (at::GradMode::is_enabled()) {  // create_graph: gradients whose backward raises
      variable_list detached;
      for (const Tensor& grad : grads) detached.push_back(grad.defined() ? grad.detach().requires_grad_() : grad);
      const auto error = std::make_shared<torch::autograd::DelayedError>(
          "trying to differentiate twice the fused Transformer layer (copytask.kernels), which has no second "
          "derivative; build the model with fused=False for one",
          static_cast<int64_t>(detached.size()));
      grads = (*error)(std::move(detached));
    }
    variable_list result{grads[0], grads[1], Tensor()};  // x, memory, mask
    result.insert(result.end(), grads.begin() + 2, grads.end());
    result.insert(result.end(), {Tensor(), Tensor()});  // heads, eps
    return result;
  }
};

}  // namespace

// The layer's output (B, T, F), recorded for autograd as one node (LayerFunction).
Tensor transformer_layer(const Tensor& x, const Tensor& memory, const Tensor& mask, const std::vector<Tensor>& params,
                         int64_t heads, double eps) {
  return LayerFunction::apply(x, memory, mask, at::TensorList(params), heads, eps);  // a TensorList: each parameter an input
}
