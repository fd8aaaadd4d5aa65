// Mamba's block (Gu and Dao, 2023) for copytask.kernels on CPU in float32, forward and backward: what
// models/mamba.py computes with torch's ops, in two kernels.
//
// The selective scan (Algorithm 2), from delta's softplus to the D skip and the gate: one time step at a time,
//   delta_t = softplus(dt_t),  h_t = exp(delta_t A) h_{t-1} + delta_t x_t B_t,   y_t = C_t h_t,
//   out_t = (y_t + D x_t) * SiLU(z_t),
// each channel e its own state of N numbers. In torch a step is a few ops on (B, E, N) tensors, forward and
// backward, and the discretised A and B x are (B, T, E, N) tensors made before the loop: at batch 64 and
// 80 steps those ops' dispatch and memory traffic are most of a Mamba training step. Here a sequence runs
// in one pass over its steps, each step one loop over its (N, E) state, exp(delta A) computed where it is
// used. The backward pass runs a sequence's forward steps again, keeping its T states and decays (2 x T x N x E
// floats, in cache at this project's sizes) for its steps back: to keep every sequence's states from the
// forward pass instead (B x T x N x E floats, tens of MB a layer) made the forward pass slower than this
// whole recomputation.
//
// The causal depthwise convolution and its SiLU: out_t = SiLU(b + sum_k w_k in_{t+k}) over a window of K - 1
// inputs and the T new ones, per channel. In torch, K shifted products and their gradients, each through a
// slice of the whole input, or nn.Conv1d, whose depthwise backward costs more than the rest of the layer.
//
// Shapes: B sequences, T steps, E channels, N states per channel, K the convolution's width. Every tensor is
// held with channels innermost (the state (N, E), the convolution's weight (K, E)), so that every loop runs
// over E contiguous floats and vectorises.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cstring>
#include <vector>

#include "common.h"

using at::Tensor;

namespace {

// exp(x) for x <= 0 (delta A: the kernels refuse a negative delta or a positive A), as 2^n p(r),
// x = n ln 2 + r, |r| <= ln 2 / 2, p Cephes' expf polynomial (the attention kernel's, csrc/attention.cpp), written
// on scalars so that the loops below vectorise it (-ffast-math with NaN kept does not vectorise std::exp): within
// about 1 ulp near 0, 1e-6 relative at -20. Below -87.3 (where float's exp leaves the normal numbers) it gives 0,
// so -inf gives 0; NaN stays NaN (r and so p are NaN; the clamp is a comparison, false for NaN).
constexpr float LOG2E = 1.44269504088896341f;
constexpr float EXP_LOWEST = -87.33654475f;
inline float exp_(float x) {
  const float clamped = x < EXP_LOWEST ? EXP_LOWEST : x;
  const float n = std::floor(clamped * LOG2E + 0.5f);
  const float r = clamped - n * 0.693359375f + n * 2.12194440e-4f;  // ln 2 in two parts, the first exact in float
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;  // 2^n from its exponent bits: n in [-126, 0]
  float power;
  std::memcpy(&power, &bits, sizeof power);
  return x < EXP_LOWEST ? 0.f : p * power;
}

// The scan's exp_ needs delta A <= 0: delta is a softplus, and A must be -exp(A_log); another A is refused, not
// computed wrong (NaN passes: it propagates). -> whether `values` (n floats) has one above 0.
inline bool has_positive(const float* __restrict values, int64_t n) {
  int found = 0;
  for (int64_t i = 0; i < n; ++i) found |= values[i] > 0.f;
  return found != 0;
}

// delta = softplus(dt) as torch's F.softplus computes it: dt itself above 20, else log(1 + exp(dt)) =
// max(dt, 0) + log1p(exp(-|dt|)), log1p(y) = 2 atanh(y / (2 + y)) by atanh's odd series in s = y / (2 + y) <= 1/3
// (to s^13: 1e-8 relative), all of it vectorisable; 0 at a padded step (mask 0), where the state stays as it was.
// Its derivative is sigmoid(dt) (1 above 20), from the same exp(-|dt|).
inline void softplus_row(const float* __restrict dt, float m, int64_t E, float* __restrict delta) {
  for (int64_t e = 0; e < E; ++e) {
    const float x = dt[e], y = exp_(x < 0.f ? x : -x), s = y / (2.f + y), s2 = s * s;
    float series = 1.f / 13.f;
    series = series * s2 + 1.f / 11.f;
    series = series * s2 + 1.f / 9.f;
    series = series * s2 + 1.f / 7.f;
    series = series * s2 + 1.f / 5.f;
    series = series * s2 + 1.f / 3.f;
    const float log1p = 2.f * (s + s * s2 * series);
    delta[e] = m * (x > 20.f ? x : (x > 0.f ? x : 0.f) + log1p);
  }
}
inline void softplus_backward(const float* __restrict dt, float m, const float* __restrict grad_delta, int64_t E,
                              float* __restrict grad_dt) {
  for (int64_t e = 0; e < E; ++e) {
    const float x = dt[e], y = exp_(x < 0.f ? x : -x);
    const float sigmoid = x > 20.f ? 1.f : (x < 0.f ? y : 1.f) / (1.f + y);
    grad_dt[e] = m * grad_delta[e] * sigmoid;
  }
}

// SiLU(x) = x sigmoid(x) (sigmoid_: common.h's) has the derivative sigmoid(x) (1 + x (1 - sigmoid(x))).
inline float silu_grad(float x, float s) { return s * (1.f + x * (1.f - s)); }

// One step of one sequence, forward: its delta, x, B, C, the state h (N, E) before it -> h after it, in
// place, y = C h (E), and exp(delta A) (N, E) in `decay`. dx (E) is scratch.
inline void scan_step(const float* __restrict d, const float* __restrict x, const float* __restrict Bt,
                      const float* __restrict Ct, const float* __restrict A, int64_t N, int64_t E,
                      float* __restrict h, float* __restrict y, float* __restrict decay, float* __restrict dx) {
  for (int64_t e = 0; e < E; ++e) dx[e] = d[e] * x[e], y[e] = 0.f;
  for (int64_t n = 0; n < N; ++n) {
    const float bn = Bt[n], cn = Ct[n];
    const float* __restrict a = A + n * E;
    float* __restrict hn = h + n * E;
    float* __restrict an = decay + n * E;
    for (int64_t e = 0; e < E; ++e) {
      an[e] = exp_(d[e] * a[e]);
      hn[e] = an[e] * hn[e] + dx[e] * bn;
      y[e] += cn * hn[e];
    }
  }
}

// The D skip and the gate of a step: y, x, z (E) -> out = (y + D x) SiLU(z) (E).
inline void gate(const float* __restrict y, const float* __restrict x, const float* __restrict z,
                 const float* __restrict D, int64_t E, float* __restrict out) {
  for (int64_t e = 0; e < E; ++e) out[e] = (y[e] + D[e] * x[e]) * (z[e] * sigmoid_(z[e]));
}

// Its backward: grad_out (E) -> grad_y (E), grad_x (E, the D skip's share), grad_z (E), and adds to grad_D (E).
inline void gate_backward(const float* __restrict grad_out, const float* __restrict y, const float* __restrict x,
                          const float* __restrict z, const float* __restrict D, int64_t E, float* __restrict grad_y,
                          float* __restrict grad_x, float* __restrict grad_z, float* __restrict grad_D) {
  for (int64_t e = 0; e < E; ++e) {
    const float s = sigmoid_(z[e]), skipped = y[e] + D[e] * x[e];
    grad_y[e] = grad_out[e] * z[e] * s;
    grad_x[e] = grad_y[e] * D[e];
    grad_D[e] += grad_y[e] * x[e];
    grad_z[e] = grad_out[e] * skipped * silu_grad(z[e], s);
  }
}

// The scan step's backward: grad_y (E), the step's decay exp(delta A) (N, E), the state after the step `now`
// and before it `before` (N, E), and G (N, E), the gradient reaching the state after the step (in place: -> the
// gradient reaching the state before it) -> adds delta * s to grad_x (E); grad_delta (E), grad_B, grad_C (N),
// and adds to grad_A (N, E). s (E) is scratch.
inline void scan_step_backward(const float* __restrict d, const float* __restrict x, const float* __restrict Bt,
                               const float* __restrict Ct, const float* __restrict A, int64_t N, int64_t E,
                               const float* __restrict decay, const float* __restrict grad_y,
                               const float* __restrict now, const float* __restrict before, float* __restrict G,
                               float* __restrict grad_x, float* __restrict grad_d, float* __restrict grad_B,
                               float* __restrict grad_C, float* __restrict grad_A, float* __restrict s) {
  for (int64_t e = 0; e < E; ++e) s[e] = 0.f, grad_d[e] = 0.f;
  for (int64_t n = 0; n < N; ++n) {
    const float bn = Bt[n], cn = Ct[n];
    const float* __restrict a = A + n * E;
    const float* __restrict hn = now + n * E;
    const float* __restrict hp = before + n * E;
    const float* __restrict an = decay + n * E;
    float* __restrict g = G + n * E;
    float* __restrict gA = grad_A + n * E;
    float grad_c = 0.f, grad_b = 0.f;
    for (int64_t e = 0; e < E; ++e) {
      grad_c += grad_y[e] * hn[e];
      const float gn = g[e] + grad_y[e] * cn;  // the gradient reaching h_t
      const float through = gn * hp[e] * an[e];  // ... reaching delta_t A, through the exp
      grad_d[e] += through * a[e];
      gA[e] += through * d[e];
      s[e] += gn * bn;
      grad_b += gn * d[e] * x[e];
      g[e] = gn * an[e];
    }
    grad_C[n] = grad_c;
    grad_B[n] = grad_b;
  }
  for (int64_t e = 0; e < E; ++e) {
    grad_x[e] += d[e] * s[e];
    grad_d[e] += x[e] * s[e];
  }
}

// The convolution before its SiLU at one step: inputs (K rows of E: the step's window and its input), weight (K, E),
// bias (E) -> pre (E).
inline void convolve(const float* __restrict inputs, const float* __restrict weight, const float* __restrict bias,
                     int64_t K, int64_t E, float* __restrict pre) {
  for (int64_t e = 0; e < E; ++e) pre[e] = bias[e];
  for (int64_t k = 0; k < K; ++k)
    for (int64_t e = 0; e < E; ++e) pre[e] += weight[k * E + e] * inputs[k * E + e];
}

// (B, E, N) <-> (N, E) of sequence b: the state as the model holds it and as the kernels do.
inline void to_rows(const float* state, int64_t b, int64_t E, int64_t N, float* rows) {
  for (int64_t n = 0; n < N; ++n)
    for (int64_t e = 0; e < E; ++e) rows[n * E + e] = state[(b * E + e) * N + n];
}
inline void from_rows(const float* rows, int64_t b, int64_t E, int64_t N, float* state) {
  for (int64_t n = 0; n < N; ++n)
    for (int64_t e = 0; e < E; ++e) state[(b * E + e) * N + n] = rows[n * E + e];
}

}  // namespace

// inputs (B, K - 1 + T, E), weight (K, E), bias (E) -> SiLU of the causal depthwise convolution (B, T, E).
Tensor causal_conv_forward(const Tensor& inputs, const Tensor& weight, const Tensor& bias) {
  const char* kernel = "causal_conv_forward";
  check_inputs(kernel, {&inputs, &weight, &bias});
  check_dim(kernel, "inputs", inputs, 3);
  check_dim(kernel, "weight", weight, 2);
  const int64_t B = inputs.size(0), K = weight.size(0), E = inputs.size(2), T = inputs.size(1) - K + 1;
  TORCH_CHECK(T >= 0, kernel, ": inputs must hold the K - 1 = ", K - 1, " steps of the window, got ", inputs.sizes());
  check_shape(kernel, "weight", weight, {K, E});
  check_shape(kernel, "bias", bias, {E});
  auto out = at::empty({B, T, E}, inputs.options());
  const float* in_p = inputs.data_ptr<float>();
  const float* w_p = weight.data_ptr<float>();
  const float* b_p = bias.data_ptr<float>();
  float* out_p = out.data_ptr<float>();
  at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> pre(E);
    for (int64_t b = begin; b < end; ++b)
      for (int64_t t = 0; t < T; ++t) {
        convolve(in_p + (b * (T + K - 1) + t) * E, w_p, b_p, K, E, pre.data());
        float* __restrict o = out_p + (b * T + t) * E;
        for (int64_t e = 0; e < E; ++e) o[e] = pre[e] * sigmoid_(pre[e]);
      }
  });
  return out;
}

// grad_out (B, T, E) and the forward pass's inputs -> the gradients of inputs (B, K - 1 + T, E), weight (K, E)
// and bias (E). The convolution is computed again.
std::vector<Tensor> causal_conv_backward(const Tensor& grad_out, const Tensor& inputs, const Tensor& weight,
                                         const Tensor& bias) {
  const char* kernel = "causal_conv_backward";
  check_inputs(kernel, {&grad_out, &inputs, &weight, &bias});
  check_dim(kernel, "inputs", inputs, 3);
  check_dim(kernel, "weight", weight, 2);
  const int64_t B = inputs.size(0), K = weight.size(0), E = inputs.size(2), T = inputs.size(1) - K + 1;
  TORCH_CHECK(T >= 0, kernel, ": inputs must hold the K - 1 = ", K - 1, " steps of the window, got ", inputs.sizes());
  check_shape(kernel, "grad_out", grad_out, {B, T, E});
  check_shape(kernel, "weight", weight, {K, E});
  check_shape(kernel, "bias", bias, {E});
  auto grad_inputs = at::zeros(inputs.sizes(), inputs.options());
  auto grad_weight_rows = at::zeros({B, K, E}, inputs.options());  // each sequence's share, summed at the end
  auto grad_bias_rows = at::zeros({B, E}, inputs.options());
  const float* g_p = grad_out.data_ptr<float>();
  const float* in_p = inputs.data_ptr<float>();
  const float* w_p = weight.data_ptr<float>();
  const float* b_p = bias.data_ptr<float>();
  float* gi_p = grad_inputs.data_ptr<float>();
  float* gw_p = grad_weight_rows.data_ptr<float>();
  float* gb_p = grad_bias_rows.data_ptr<float>();
  at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> pre(E), grad_pre(E);
    for (int64_t b = begin; b < end; ++b)
      for (int64_t t = 0; t < T; ++t) {
        const float* in = in_p + (b * (T + K - 1) + t) * E;
        convolve(in, w_p, b_p, K, E, pre.data());
        const float* __restrict g = g_p + (b * T + t) * E;
        float* __restrict gp = grad_pre.data();
        float* __restrict gb = gb_p + b * E;
        for (int64_t e = 0; e < E; ++e) {
          gp[e] = g[e] * silu_grad(pre[e], sigmoid_(pre[e]));
          gb[e] += gp[e];
        }
        for (int64_t k = 0; k < K; ++k) {
          const float* __restrict x = in + k * E;
          const float* __restrict w = w_p + k * E;
          float* __restrict gx = gi_p + (b * (T + K - 1) + t + k) * E;
          float* __restrict gw = gw_p + (b * K + k) * E;
          for (int64_t e = 0; e < E; ++e) {
            gx[e] += w[e] * gp[e];
            gw[e] += gp[e] * x[e];
          }
        }
      }
  });
  return {grad_inputs, grad_weight_rows.sum(0), grad_bias_rows.sum(0)};
}

// u = x (B, T, E), dt (B, T, E) the step sizes before their softplus, mask (B, T) float (1 real, 0 padding: delta 0)
// or empty, A (E, N), Bm and Cm (B, T, N), h0 (B, E, N), and D (E) with z (B, T, E) or both empty
// -> out (B, T, E): (y + D x) SiLU(z), or y without them, and the last state (B, E, N). Nothing is kept for the
// backward pass but the inputs: it runs the forward steps again.
std::vector<Tensor> selective_scan_forward(const Tensor& u, const Tensor& dt, const Tensor& mask, const Tensor& A,
                                           const Tensor& Bm, const Tensor& Cm, const Tensor& h0, const Tensor& D,
                                           const Tensor& z) {
  const char* kernel = "selective_scan_forward";
  check_inputs(kernel, {&u, &dt, &mask, &A, &Bm, &Cm, &h0, &D, &z});
  check_dim(kernel, "u", u, 3);
  check_dim(kernel, "A", A, 2);
  const int64_t B = u.size(0), T = u.size(1), E = u.size(2), N = A.size(1);
  check_shape(kernel, "dt", dt, {B, T, E});
  check_shape_or_empty(kernel, "mask", mask, {B, T});
  check_shape(kernel, "A", A, {E, N});
  check_shape(kernel, "B", Bm, {B, T, N});
  check_shape(kernel, "C", Cm, {B, T, N});
  check_shape(kernel, "h0", h0, {B, E, N});
  const bool gated = D.numel() > 0;
  TORCH_CHECK(gated == (z.numel() > 0) || B * T == 0, kernel, ": D and z go together, got ", D.sizes(), " and ",
              z.sizes());
  check_shape_or_empty(kernel, "D", D, {E});
  check_shape_or_empty(kernel, "z", z, {B, T, E});
  TORCH_CHECK(!has_positive(A.data_ptr<float>(), A.numel()), kernel, ": A must be <= 0 (-exp(A_log))");
  auto out = at::empty({B, T, E}, u.options());
  auto final = at::empty({B, E, N}, u.options());
  const auto At = A.t().contiguous();  // (N, E)
  const float* u_p = u.data_ptr<float>();
  const float* dt_p = dt.data_ptr<float>();
  const float* mask_p = mask.numel() > 0 ? mask.data_ptr<float>() : nullptr;
  const float* A_p = At.data_ptr<float>();
  const float* B_p = Bm.data_ptr<float>();
  const float* C_p = Cm.data_ptr<float>();
  const float* h0_p = h0.data_ptr<float>();
  const float* D_p = gated ? D.data_ptr<float>() : nullptr;
  const float* z_p = gated && z.numel() > 0 ? z.data_ptr<float>() : nullptr;
  float* out_p = out.data_ptr<float>();
  float* final_p = final.data_ptr<float>();
  at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> h(N * E), decay(N * E), delta(E), y(E), scratch(E);
    for (int64_t b = begin; b < end; ++b) {
      to_rows(h0_p, b, E, N, h.data());
      for (int64_t t = 0; t < T; ++t) {
        const int64_t bt = b * T + t;
        float* y_t = gated ? y.data() : out_p + bt * E;
        softplus_row(dt_p + bt * E, mask_p ? mask_p[bt] : 1.f, E, delta.data());
        scan_step(delta.data(), u_p + bt * E, B_p + bt * N, C_p + bt * N, A_p, N, E, h.data(), y_t, decay.data(),
                  scratch.data());
        if (gated) gate(y_t, u_p + bt * E, z_p + bt * E, D_p, E, out_p + bt * E);
      }
      from_rows(h.data(), b, E, N, final_p);
    }
  });
  return {out, final};
}

// grad_out (B, T, E) and grad_final (B, E, N) (either empty: zero) and the forward pass's inputs -> the gradients
// of u, dt (B, T, E), A (E, N), Bm, Cm (B, T, N), h0 (B, E, N), and of D (E) and z (B, T, E) (empty where they
// are). Each step, back from the last, with G the gradient reaching h_t and h_{t-1} the state before it (grad_y the
// gate's backward of grad_out, or grad_out itself without the gate):
//   G += grad_y_t C_t;  grad_C_t = sum_e grad_y_t h_t;  s = sum_n G B_t
//   grad_delta_t = sum_n G h_{t-1} exp(delta_t A) A + x_t s;  grad_x_t = delta_t s (+ the D skip's share)
//   grad_A += G h_{t-1} exp(delta_t A) delta_t;  grad_B_t = sum_e G delta_t x_t;  G = G exp(delta_t A),
// and grad_dt_t = grad_delta_t sigmoid(dt_t) (softplus's derivative; 0 at a padded step).
std::vector<Tensor> selective_scan_backward(const Tensor& grad_out, const Tensor& grad_final, const Tensor& u,
                                            const Tensor& dt, const Tensor& mask, const Tensor& A, const Tensor& Bm,
                                            const Tensor& Cm, const Tensor& h0, const Tensor& D, const Tensor& z) {
  const char* kernel = "selective_scan_backward";
  check_inputs(kernel, {&grad_out, &grad_final, &u, &dt, &mask, &A, &Bm, &Cm, &h0, &D, &z});
  check_dim(kernel, "u", u, 3);
  check_dim(kernel, "A", A, 2);
  const int64_t B = u.size(0), T = u.size(1), E = u.size(2), N = A.size(1);
  check_shape_or_empty(kernel, "grad_out", grad_out, {B, T, E});
  check_shape_or_empty(kernel, "grad_final", grad_final, {B, E, N});
  check_shape(kernel, "dt", dt, {B, T, E});
  check_shape_or_empty(kernel, "mask", mask, {B, T});
  check_shape(kernel, "A", A, {E, N});
  check_shape(kernel, "B", Bm, {B, T, N});
  check_shape(kernel, "C", Cm, {B, T, N});
  check_shape(kernel, "h0", h0, {B, E, N});
  const bool gated = D.numel() > 0;
  TORCH_CHECK(gated == (z.numel() > 0) || B * T == 0, kernel, ": D and z go together, got ", D.sizes(), " and ",
              z.sizes());
  check_shape_or_empty(kernel, "D", D, {E});
  check_shape_or_empty(kernel, "z", z, {B, T, E});
  TORCH_CHECK(!has_positive(A.data_ptr<float>(), A.numel()), kernel, ": A must be <= 0 (-exp(A_log))");
  auto grad_u = at::empty({B, T, E}, u.options());
  auto grad_dt = at::empty({B, T, E}, u.options());
  auto grad_B = at::empty({B, T, N}, u.options());
  auto grad_C = at::empty({B, T, N}, u.options());
  auto grad_h0 = at::empty({B, E, N}, u.options());
  auto grad_A_rows = at::zeros({B, N, E}, u.options());  // each sequence's share, summed at the end
  auto grad_D_rows = at::zeros({gated ? B : 0, E}, u.options());
  auto grad_z = gated ? at::empty({B, T, E}, u.options()) : at::empty({0}, u.options());
  const auto At = A.t().contiguous();  // (N, E)
  const bool has_grad_out = grad_out.numel() > 0, has_grad_final = grad_final.numel() > 0;
  const float* go_p = has_grad_out ? grad_out.data_ptr<float>() : nullptr;
  const float* gf_p = has_grad_final ? grad_final.data_ptr<float>() : nullptr;
  const float* u_p = u.data_ptr<float>();
  const float* dt_p = dt.data_ptr<float>();
  const float* mask_p = mask.numel() > 0 ? mask.data_ptr<float>() : nullptr;
  const float* A_p = At.data_ptr<float>();
  const float* B_p = Bm.data_ptr<float>();
  const float* C_p = Cm.data_ptr<float>();
  const float* h0_p = h0.data_ptr<float>();
  const float* D_p = gated ? D.data_ptr<float>() : nullptr;
  const float* z_p = gated && z.numel() > 0 ? z.data_ptr<float>() : nullptr;
  float* gu_p = grad_u.data_ptr<float>();
  float* gdt_p = grad_dt.data_ptr<float>();
  float* gB_p = grad_B.data_ptr<float>();
  float* gC_p = grad_C.data_ptr<float>();
  float* gh0_p = grad_h0.data_ptr<float>();
  float* gA_p = grad_A_rows.data_ptr<float>();
  float* gD_p = gated ? grad_D_rows.data_ptr<float>() : nullptr;
  float* gz_p = gated && grad_z.numel() > 0 ? grad_z.data_ptr<float>() : nullptr;
  at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
    // one sequence's states h_{-1} = h0, h_0 .. h_{T-1} and decays exp(delta_t A), each (N, E), and its delta and
    // y (T, E)
    std::vector<float> states((T + 1) * N * E), decays(T * N * E), deltas(T * E), ys(T * E), G(N * E),
        zeros(E, 0.f), grad_y(E), grad_delta(E), scratch(E);
    for (int64_t b = begin; b < end; ++b) {
      to_rows(h0_p, b, E, N, states.data());
      if (has_grad_final) {
        to_rows(gf_p, b, E, N, G.data());
      } else {
        std::fill(G.begin(), G.end(), 0.f);
      }
      for (int64_t t = 0; t < T; ++t) {  // the forward pass again
        const int64_t bt = b * T + t;
        float* now = states.data() + (t + 1) * N * E;
        std::memcpy(now, now - N * E, sizeof(float) * N * E);
        softplus_row(dt_p + bt * E, mask_p ? mask_p[bt] : 1.f, E, deltas.data() + t * E);
        scan_step(deltas.data() + t * E, u_p + bt * E, B_p + bt * N, C_p + bt * N, A_p, N, E, now,
                  ys.data() + t * E, decays.data() + t * N * E, scratch.data());
      }
      for (int64_t t = T - 1; t >= 0; --t) {
        const int64_t bt = b * T + t;
        const float* grad_out_t = has_grad_out ? go_p + bt * E : zeros.data();
        const float* grad_y_t = grad_out_t;
        if (gated) {  // the gate's backward: grad_y, and grad_u starts at the D skip's share
          gate_backward(grad_out_t, ys.data() + t * E, u_p + bt * E, z_p + bt * E, D_p, E, grad_y.data(),
                        gu_p + bt * E, gz_p + bt * E, gD_p + b * E);
          grad_y_t = grad_y.data();
        } else {
          std::fill(gu_p + bt * E, gu_p + (bt + 1) * E, 0.f);
        }
        const float* now = states.data() + (t + 1) * N * E;
        scan_step_backward(deltas.data() + t * E, u_p + bt * E, B_p + bt * N, C_p + bt * N, A_p, N, E,
                           decays.data() + t * N * E, grad_y_t, now, now - N * E, G.data(), gu_p + bt * E,
                           grad_delta.data(), gB_p + bt * N, gC_p + bt * N, gA_p + b * N * E, scratch.data());
        softplus_backward(dt_p + bt * E, mask_p ? mask_p[bt] : 1.f, grad_delta.data(), E, gdt_p + bt * E);
      }
      from_rows(G.data(), b, E, N, gh0_p);
    }
  });
  return {grad_u,  grad_dt, grad_A_rows.sum(0).t().contiguous(), grad_B, grad_C, grad_h0,
          gated ? grad_D_rows.sum(0) : grad_D_rows.new_empty({0}), grad_z};
}
