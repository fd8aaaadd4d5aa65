// The additive score v . tanh(W q_t + U h_i) for every (decoder step, source position) pair,
// forward and backward, for copytask.kernels on CPU in float32: Luong's concat score under
// teacher forcing, where torch materialises the (B, T_dec, T_enc, A) tensor and its gradient
// piece by piece. Shapes: B sequences, T decoder steps, S source positions, A attention size.
#include <ATen/ATen.h>

#include <vector>

#include "common.h"

using at::Tensor;

// queries W q (B, T, A), keys U h + b (B, S, A), v (A) -> scores (B, T, S), and u (B, T, S, A).
std::vector<Tensor> additive_forward(const Tensor& queries, const Tensor& keys, const Tensor& v) {
  const char* kernel = "additive_forward";
  check_inputs(kernel, {&queries, &keys, &v});
  check_dim(kernel, "queries", queries, 3);
  check_dim(kernel, "keys", keys, 3);
  const int64_t B = queries.size(0), T = queries.size(1), A = queries.size(2), S = keys.size(1);
  check_shape(kernel, "keys", keys, {B, S, A});
  check_shape(kernel, "v", v, {A});
  auto scores = at::empty({B, T, S}, queries.options());
  auto u = reusable_empty({B, T, S, A});
  const float* q_p = queries.data_ptr<float>();
  const float* k_p = keys.data_ptr<float>();
  const float* v_p = v.data_ptr<float>();
  float* scores_p = scores.data_ptr<float>();
  float* u_p = u.data_ptr<float>();
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t) {
      const int64_t bt = b * T + t;
      additive_row(q_p + bt * A, k_p + b * S * A, v_p, S, A, u_p + bt * S * A, scores_p + bt * S);
    }
  return {scores, u};
}

// grad_scores (B, T, S), u, v -> gradients of queries (B, T, A), keys (B, S, A), v (A).
std::vector<Tensor> additive_backward(const Tensor& grad_scores, const Tensor& u, const Tensor& v) {
  const char* kernel = "additive_backward";
  check_inputs(kernel, {&grad_scores, &u, &v});
  check_dim(kernel, "u", u, 4);
  const int64_t B = u.size(0), T = u.size(1), S = u.size(2), A = u.size(3);
  check_shape(kernel, "grad_scores", grad_scores, {B, T, S});
  check_shape(kernel, "v", v, {A});
  auto grad_q = at::zeros({B, T, A}, u.options());
  auto grad_k = at::zeros({B, S, A}, u.options());
  auto grad_v = at::zeros({A}, u.options());
  const float* g_p = grad_scores.data_ptr<float>();
  const float* u_p = u.data_ptr<float>();
  const float* v_p = v.data_ptr<float>();
  float* grad_q_p = grad_q.data_ptr<float>();
  float* grad_k_p = grad_k.data_ptr<float>();
  float* grad_v_p = grad_v.data_ptr<float>();
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t) {
      const int64_t bt = b * T + t;
      additive_row_backward(g_p + bt * S, u_p + bt * S * A, v_p, S, A, grad_q_p + bt * A, grad_k_p + b * S * A, grad_v_p);
    }
  return {grad_q, grad_k, grad_v};
}
