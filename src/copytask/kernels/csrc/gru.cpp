// One GRU layer's recurrence, forward and backward, for copytask.kernels on CPU in float32.
//
// nn.GRU on CPU runs every time step as about 24 ATen ops and 14 autograd nodes, forward and
// backward (counted with torch.profiler); at
// batch 64 and hidden size 32-64 those per-op costs, not arithmetic, are most of a training
// step. Here a step is one matrix product (the recurrent projection) and one pass over the
// gates; the backward pass keeps the per-step product it needs and does the weight gradient
// as one product over all steps. Same gate equations and order as torch (r, z, n):
//   r = sigmoid(gi_r + gh_r), z = sigmoid(gi_z + gh_z), n = tanh(gi_n + r * gh_n),
//   h' = (1 - z) * n + z * h,   gh = W_hh h + b_hh,  gi = W_ih x + b_ih (computed by the caller).
// Shapes are time first, so that each step reads and writes one contiguous block: T steps,
// B sequences, H hidden units.
#include <ATen/ATen.h>

#include <cstring>
#include <vector>

#include "common.h"

using at::Tensor;

// gi (T, B, 3H), h0 (B, H), w_hh (3H, H), b_hh (3H), mask (T, B) float (1 real, 0 padding) or empty.
// -> states (T, B, H) (zero at padding), final state (B, H), and for backward the gates
//    (T, B, 4H: r, z, n, gh_n) and the state before each step (T, B, H).
std::vector<Tensor> gru_forward(const Tensor& gi, const Tensor& h0, const Tensor& w_hh, const Tensor& b_hh,
                            const Tensor& mask, bool reverse) {
  const char* kernel = "gru_forward";
  check_inputs(kernel, {&gi, &h0, &w_hh, &b_hh, &mask});
  check_dim(kernel, "gi", gi, 3);
  check_dim(kernel, "h0", h0, 2);
  const int64_t T = gi.size(0), B = gi.size(1), H = h0.size(1);
  check_shape(kernel, "gi", gi, {T, B, 3 * H});
  check_shape(kernel, "h0", h0, {B, H});
  check_shape(kernel, "w_hh", w_hh, {3 * H, H});
  check_shape(kernel, "b_hh", b_hh, {3 * H});
  check_shape_or_empty(kernel, "mask", mask, {T, B});
  auto states = at::empty({T, B, H}, gi.options());
  auto gates = at::empty({T, B, 4 * H}, gi.options());
  auto before = at::empty({T, B, H}, gi.options());
  auto gh = at::empty({B, 3 * H}, gi.options());
  auto h = h0.contiguous().clone();
  const auto w_hh_t = w_hh.t();
  std::vector<float> next(H);
  const bool masked = mask.numel() > 0;
  const float* gi_p = gi.data_ptr<float>();
  const float* mask_p = masked ? mask.data_ptr<float>() : nullptr;
  const float* gh_p = gh.data_ptr<float>();
  float* states_p = states.data_ptr<float>();
  float* gates_p = gates.data_ptr<float>();
  float* before_p = before.data_ptr<float>();
  float* h_p = h.data_ptr<float>();
  for (int64_t s = 0; s < T; ++s) {
    const int64_t t = reverse ? T - 1 - s : s;
    at::addmm_out(gh, b_hh, h, w_hh_t);
    for (int64_t b = 0; b < B; ++b) {
      const int64_t bt = t * B + b;
      const float* __restrict x = gi_p + bt * 3 * H;
      const float* __restrict g = gh_p + b * 3 * H;
      float* __restrict saved = gates_p + bt * 4 * H;
      float* __restrict hb = h_p + b * H;
      float* __restrict out = states_p + bt * H;
      const float m = masked ? mask_p[bt] : 1.f;
      std::memcpy(before_p + bt * H, hb, sizeof(float) * H);
      gru_cell(x, g, hb, H, saved, next.data());
      // padding leaves the state alone and outputs zero, as packing does; chosen, not multiplied
      // by the mask, so that a NaN computed at a padded position stays out as in torch
      if (m != 0.f) {
        std::memcpy(out, next.data(), sizeof(float) * H);
        std::memcpy(hb, next.data(), sizeof(float) * H);
      } else {
        std::memset(out, 0, sizeof(float) * H);
      }
    }
  }
  return {states, h, gates, before};
}

// grad_states (T, B, H), grad_final (B, H) and forward's saved tensors
// -> gradients of gi (T, B, 3H), h0 (B, H), w_hh (3H, H), b_hh (3H).
std::vector<Tensor> gru_backward(const Tensor& grad_states, const Tensor& grad_final, const Tensor& gates,
                             const Tensor& before, const Tensor& w_hh, const Tensor& mask, bool reverse) {
  const char* kernel = "gru_backward";
  check_inputs(kernel, {&grad_states, &grad_final, &gates, &before, &w_hh, &mask});
  check_dim(kernel, "before", before, 3);
  const int64_t T = before.size(0), B = before.size(1), H = before.size(2);
  check_shape(kernel, "grad_states", grad_states, {T, B, H});
  check_shape(kernel, "grad_final", grad_final, {B, H});
  check_shape(kernel, "gates", gates, {T, B, 4 * H});
  check_shape(kernel, "w_hh", w_hh, {3 * H, H});
  check_shape_or_empty(kernel, "mask", mask, {T, B});
  auto grad_gi = at::empty({T, B, 3 * H}, gates.options());
  auto grad_gh = at::empty({T, B, 3 * H}, gates.options());
  auto grad_h = grad_final.contiguous().clone();  // gradient reaching the state after step t
  std::vector<float> grad_next(H);
  const bool masked = mask.numel() > 0;
  const float* mask_p = masked ? mask.data_ptr<float>() : nullptr;
  const float* grad_states_p = grad_states.data_ptr<float>();
  const float* gates_p = gates.data_ptr<float>();
  const float* before_p = before.data_ptr<float>();
  float* grad_gi_p = grad_gi.data_ptr<float>();
  float* grad_gh_p = grad_gh.data_ptr<float>();
  float* grad_h_p = grad_h.data_ptr<float>();
  for (int64_t s = T - 1; s >= 0; --s) {
    const int64_t t = reverse ? T - 1 - s : s;
    for (int64_t b = 0; b < B; ++b) {
      const int64_t bt = t * B + b;
      const float* __restrict saved = gates_p + bt * 4 * H;
      const float* __restrict hb = before_p + bt * H;
      const float* __restrict go = grad_states_p + bt * H;
      float* __restrict gi_b = grad_gi_p + bt * 3 * H;
      float* __restrict gh_b = grad_gh_p + bt * 3 * H;
      float* __restrict d = grad_h_p + b * H;
      if (masked && mask_p[bt] == 0.f) {  // padding passes the gradient through, untouched by its gates
        std::memset(gi_b, 0, sizeof(float) * 3 * H);
        std::memset(gh_b, 0, sizeof(float) * 3 * H);
        continue;
      }
      for (int64_t j = 0; j < H; ++j) grad_next[j] = d[j] + go[j];
      gru_cell_backward(saved, hb, grad_next.data(), H, gi_b, gh_b, d);
    }
    grad_h.addmm_(grad_gh[t], w_hh);  // the path through gh = W_hh h
  }
  const auto flat_gh = grad_gh.view({T * B, 3 * H});
  return {grad_gi, grad_h, flat_gh.t().mm(before.view({T * B, H})), flat_gh.sum(0)};
}
