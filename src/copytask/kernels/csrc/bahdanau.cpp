// Bahdanau's decoder under teacher forcing, forward and backward, for copytask.kernels on CPU
// in float32: the same numbers as model.BahdanauDecoder's step loop (tests/test_kernels.py).
//
// That loop cannot be batched over time (the context is fed into the GRU), so every one of its
// T_dec steps is about 94 ATen ops and 33 autograd nodes, forward and backward (counted with
// torch.profiler at length 80). Here a step is
// four small matrix products and a few passes over the (B, T_enc, A) score tensor. Per step:
//   q = W_q s,  u = tanh(q + K),  e = v . u,  alpha = softmax(e) (0 at padding),
//   c = sum_i alpha_i V_i,  x = [emb; c],  s' = GRUCell(x, s)   (gates r, z, n as torch's).
// Weight gradients are one product over all steps after the backward loop.
// Shapes: T steps (T_dec), B sequences, S source positions (T_enc), A attention size,
// H hidden size, E embedding size; time-first buffers, so each step reads one block.
#include <ATen/ATen.h>

#include <algorithm>
#include <cfloat>
#include <cstring>
#include <vector>

#include "common.h"

using at::Tensor;

// embedded (T, B, E), s0 (B, H), keys (B, S, A) = U h + b, values (B, S, H), mask (B, S) float
// (1 real, 0 padding) or empty, w_q (A, H), v (A), w_ih (3H, E + H), b_ih (3H), w_hh (3H, H), b_hh (3H)
// -> states (T, B, H), contexts (T, B, H), weights (T, B, S), and for backward: u (T, B, S, A),
//    inputs x (T, B, E + H), gates (T, B, 4H: r, z, n, gh_n), state before each step (T, B, H).
std::vector<Tensor> bahdanau_forward(const Tensor& embedded, const Tensor& s0, const Tensor& keys,
                                     const Tensor& values, const Tensor& mask, const Tensor& w_q,
                                     const Tensor& v, const Tensor& w_ih, const Tensor& b_ih,
                                     const Tensor& w_hh, const Tensor& b_hh) {
  const char* kernel = "bahdanau_forward";
  check_inputs(kernel, {&embedded, &s0, &keys, &values, &mask, &w_q, &v, &w_ih, &b_ih, &w_hh, &b_hh});
  check_dim(kernel, "embedded", embedded, 3);
  check_dim(kernel, "s0", s0, 2);
  check_dim(kernel, "keys", keys, 3);
  const int64_t T = embedded.size(0), B = embedded.size(1), E = embedded.size(2);
  const int64_t S = keys.size(1), A = keys.size(2), H = s0.size(1);
  check_shape(kernel, "s0", s0, {B, H});
  check_shape(kernel, "keys", keys, {B, S, A});
  check_shape(kernel, "values", values, {B, S, H});
  check_shape_or_empty(kernel, "mask", mask, {B, S});
  check_shape(kernel, "w_q", w_q, {A, H});
  check_shape(kernel, "v", v, {A});
  check_shape(kernel, "w_ih", w_ih, {3 * H, E + H});
  check_shape(kernel, "b_ih", b_ih, {3 * H});
  check_shape(kernel, "w_hh", w_hh, {3 * H, H});
  check_shape(kernel, "b_hh", b_hh, {3 * H});
  const auto opts = embedded.options();
  auto states = at::empty({T, B, H}, opts);
  auto weights = at::empty({T, B, S}, opts);
  auto u = reusable_empty({T, B, S, A});
  auto inputs = at::empty({T, B, E + H}, opts);
  auto q = at::empty({B, A}, opts);
  auto gates = at::empty({T, B, 4 * H}, opts);
  auto before = at::empty({T, B, H}, opts);
  auto gi = at::empty({B, 3 * H}, opts);
  auto gh = at::empty({B, 3 * H}, opts);
  auto s = s0.contiguous().clone();
  const auto w_q_t = w_q.t(), w_ih_t = w_ih.t(), w_hh_t = w_hh.t();
  const bool masked = mask.numel() > 0;
  const float* mask_p = masked ? mask.data_ptr<float>() : nullptr;
  const float* emb_p = embedded.data_ptr<float>();
  const float* keys_p = keys.data_ptr<float>();
  const float* values_p = values.data_ptr<float>();
  const float* v_p = v.data_ptr<float>();
  const float* q_p = q.data_ptr<float>();
  const float* gi_p = gi.data_ptr<float>();
  const float* gh_p = gh.data_ptr<float>();
  float* s_p = s.data_ptr<float>();
  for (int64_t t = 0; t < T; ++t) {
    at::mm_out(q, s, w_q_t);
    float* x_t = inputs.data_ptr<float>() + t * B * (E + H);
    for (int64_t b = 0; b < B; ++b) {
      float* __restrict wb = weights.data_ptr<float>() + (t * B + b) * S;
      float* __restrict ub = u.data_ptr<float>() + (t * B + b) * S * A;
      additive_row(q_p + b * A, keys_p + b * S * A, v_p, S, A, ub, wb);
      float top = -FLT_MAX;  // a NaN score is passed over here and makes its row NaN below, as in torch
      for (int64_t i = 0; i < S; ++i)
        if (!masked || mask_p[b * S + i] != 0.f) top = std::max(top, wb[i]);
      float total = 0.f;
      for (int64_t i = 0; i < S; ++i) {
        wb[i] = masked && mask_p[b * S + i] == 0.f ? 0.f : std::exp(wb[i] - top);  // padding: exactly 0
        total += wb[i];
      }
      if (total != 0.f)  // 0 only where every position is padding (an empty source): its weights stay 0, not 0/0
        for (int64_t i = 0; i < S; ++i) wb[i] /= total;
      float* __restrict xb = x_t + b * (E + H);
      std::memcpy(xb, emb_p + (t * B + b) * E, sizeof(float) * E);
      float* __restrict c = xb + E;
      for (int64_t h = 0; h < H; ++h) c[h] = 0.f;
      for (int64_t i = 0; i < S; ++i) {
        const float* __restrict vi = values_p + (b * S + i) * H;
        const float w = wb[i];
        for (int64_t h = 0; h < H; ++h) c[h] += w * vi[h];
      }
    }
    at::addmm_out(gi, b_ih, inputs[t], w_ih_t);
    at::addmm_out(gh, b_hh, s, w_hh_t);
    for (int64_t b = 0; b < B; ++b) {
      const int64_t tb = t * B + b;
      const float* __restrict xg = gi_p + b * 3 * H;
      const float* __restrict g = gh_p + b * 3 * H;
      float* __restrict saved = gates.data_ptr<float>() + tb * 4 * H;
      float* __restrict sb = s_p + b * H;
      std::memcpy(before.data_ptr<float>() + tb * H, sb, sizeof(float) * H);
      float* __restrict next = states.data_ptr<float>() + tb * H;
      gru_cell(xg, g, sb, H, saved, next);
      std::memcpy(sb, next, sizeof(float) * H);
    }
  }
  // a copy, always: for one step of one sequence the narrowed block is contiguous already, and
  // .contiguous() would return a view of `inputs`, which a custom op may not return beside it
  auto contexts = inputs.narrow(2, E, H).clone(at::MemoryFormat::Contiguous);
  return {states, contexts, weights, u, inputs, gates, before};
}

// grad_states, grad_contexts (T, B, H), grad_weights (T, B, S) or empty, forward's saved tensors
// and parameters -> gradients of embedded (T, B, E), s0 (B, H), keys (B, S, A), values (B, S, H),
// w_q (A, H), v (A), w_ih, b_ih, w_hh, b_hh.
std::vector<Tensor> bahdanau_backward(const Tensor& grad_states, const Tensor& grad_contexts,
                                      const Tensor& grad_weights, const Tensor& weights, const Tensor& u,
                                      const Tensor& inputs, const Tensor& gates, const Tensor& before,
                                      const Tensor& values, const Tensor& w_q, const Tensor& v,
                                      const Tensor& w_ih, const Tensor& w_hh) {
  const char* kernel = "bahdanau_backward";
  check_inputs(kernel, {&grad_states, &grad_contexts, &grad_weights, &weights, &u, &inputs, &gates, &before, &values,
                        &w_q, &v, &w_ih, &w_hh});
  check_dim(kernel, "u", u, 4);
  check_dim(kernel, "before", before, 3);
  check_dim(kernel, "w_ih", w_ih, 2);
  const int64_t T = u.size(0), B = u.size(1), S = u.size(2), A = u.size(3);
  const int64_t H = before.size(2), E = w_ih.size(1) - H;
  check_shape(kernel, "before", before, {T, B, H});
  check_shape(kernel, "grad_states", grad_states, {T, B, H});
  check_shape(kernel, "grad_contexts", grad_contexts, {T, B, H});
  check_shape_or_empty(kernel, "grad_weights", grad_weights, {T, B, S});
  check_shape(kernel, "weights", weights, {T, B, S});
  check_shape(kernel, "inputs", inputs, {T, B, E + H});
  check_shape(kernel, "gates", gates, {T, B, 4 * H});
  check_shape(kernel, "values", values, {B, S, H});
  check_shape(kernel, "w_q", w_q, {A, H});
  check_shape(kernel, "v", v, {A});
  check_shape(kernel, "w_ih", w_ih, {3 * H, E + H});
  check_shape(kernel, "w_hh", w_hh, {3 * H, H});
  const auto opts = before.options();
  auto grad_gi = at::empty({T, B, 3 * H}, opts);
  auto grad_gh = at::empty({T, B, 3 * H}, opts);
  auto grad_q = at::empty({T, B, A}, opts);
  auto grad_context = at::empty({T, B, H}, opts);  // dL/dc_t, all paths
  auto grad_embedded = at::empty({T, B, E}, opts);
  auto grad_keys = at::zeros({B, S, A}, opts);
  auto grad_v = at::zeros({A}, opts);
  auto grad_x = at::empty({B, E + H}, opts);
  auto grad_s = at::zeros({B, H}, opts);  // gradient reaching the state after step t from later steps
  const bool with_grad_weights = grad_weights.numel() > 0;
  const float* gs_p = grad_states.data_ptr<float>();
  const float* gc_p = grad_contexts.data_ptr<float>();
  const float* gw_p = with_grad_weights ? grad_weights.data_ptr<float>() : nullptr;
  const float* weights_p = weights.data_ptr<float>();
  const float* u_p = u.data_ptr<float>();
  const float* gates_p = gates.data_ptr<float>();
  const float* before_p = before.data_ptr<float>();
  const float* values_p = values.data_ptr<float>();
  const float* v_p = v.data_ptr<float>();
  const float* gx_p = grad_x.data_ptr<float>();
  float* grad_v_p = grad_v.data_ptr<float>();
  float* grad_keys_p = grad_keys.data_ptr<float>();
  float* grad_s_p = grad_s.data_ptr<float>();
  std::vector<float> d_alpha(S), grad_next(H);
  for (int64_t t = T - 1; t >= 0; --t) {
    // GRU cell
    for (int64_t b = 0; b < B; ++b) {
      const int64_t tb = t * B + b;
      const float* __restrict saved = gates_p + tb * 4 * H;
      const float* __restrict sb = before_p + tb * H;
      const float* __restrict go = gs_p + tb * H;
      float* __restrict gi_b = grad_gi.data_ptr<float>() + tb * 3 * H;
      float* __restrict gh_b = grad_gh.data_ptr<float>() + tb * 3 * H;
      float* __restrict d = grad_s_p + b * H;
      for (int64_t j = 0; j < H; ++j) grad_next[j] = d[j] + go[j];
      gru_cell_backward(saved, sb, grad_next.data(), H, gi_b, gh_b, d);
    }
    grad_s.addmm_(grad_gh[t], w_hh);
    at::mm_out(grad_x, grad_gi[t], w_ih);  // (B, E + H): the embedding's and the context's share
    // attention
    for (int64_t b = 0; b < B; ++b) {
      const int64_t tb = t * B + b;
      const float* __restrict gx = gx_p + b * (E + H);
      std::memcpy(grad_embedded.data_ptr<float>() + tb * E, gx, sizeof(float) * E);
      float* __restrict dc = grad_context.data_ptr<float>() + tb * H;
      const float* __restrict gc = gc_p + tb * H;
      for (int64_t h = 0; h < H; ++h) dc[h] = gx[E + h] + gc[h];
      const float* __restrict alpha = weights_p + tb * S;
      float mean = 0.f;
      for (int64_t i = 0; i < S; ++i) {
        const float* __restrict vi = values_p + (b * S + i) * H;
        float dot = with_grad_weights ? gw_p[tb * S + i] : 0.f;
        for (int64_t h = 0; h < H; ++h) dot += dc[h] * vi[h];
        d_alpha[i] = dot;
        mean += alpha[i] * dot;
      }
      for (int64_t i = 0; i < S; ++i) d_alpha[i] = alpha[i] * (d_alpha[i] - mean);  // softmax backward; 0 at padding
      float* __restrict dq = grad_q.data_ptr<float>() + tb * A;
      for (int64_t a = 0; a < A; ++a) dq[a] = 0.f;
      additive_row_backward(d_alpha.data(), u_p + tb * S * A, v_p, S, A, dq, grad_keys_p + b * S * A, grad_v_p);
    }
    grad_s.addmm_(grad_q[t], w_q);  // the path through the query q = W_q s
  }
  const auto flat = [](const Tensor& x) { return x.view({-1, x.size(-1)}); };
  // values: sum over steps of alpha_t^T dc_t, per sequence: (B, S, T) x (B, T, H)
  auto grad_values = at::bmm(weights.permute({1, 2, 0}), grad_context.transpose(0, 1));
  return {grad_embedded,
          grad_s,
          grad_keys,
          grad_values,
          flat(grad_q).t().mm(flat(before)),
          grad_v,
          flat(grad_gi).t().mm(flat(inputs)),
          flat(grad_gi).sum(0),
          flat(grad_gh).t().mm(flat(before)),
          flat(grad_gh).sum(0)};
}
