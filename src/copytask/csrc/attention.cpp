// Multi-head scaled dot-product attention for small heads, forward and backward, for
// copytask.kernels on CPU in float32: the Transformer's self- and cross-attention in a training step.
//
// At the Transformer's sizes (head size 8, 80 x 81 scores per head, 256 heads x sequences per call)
// torch's CPU attention (flash attention or batched products) runs far below the matmul rate: its
// products have an inner size of 8, and the score tensor (6.6 MB at length 80) goes through memory
// between every op. Here each (sequence, head) pair is one slice done in cache: its keys and
// values are copied transposed (D x S) into a buffer, and each query row's scores, softmax and
// output are computed in one pass over them. The backward pass recomputes each row's weights
// from the saved log-sum-exp (as flash attention does) instead of keeping the weights.
//
// Shapes: B sequences, T queries, S keys, H heads of size D (features H * D, head h at columns
// h * D .. h * D + D - 1, as nn.MultiheadAttention splits them). q (B, T, H * D), k and v
// (B, S, H * D) may be strided in their first two dimensions (slices of a fused projection), their
// features must be contiguous. mask (B, S) float (1 real, 0 padding) or empty (nothing padded);
// causal: query i sees keys j <= i only. A query with no key to see gets zero weights and a
// zero output (as attention.masked_softmax gives), not torch's NaN.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "common.h"

using at::Tensor;

namespace {

constexpr int64_t W = 8;  // keys per tile: one AVX2 register of floats (two SSE ones)
constexpr float NEG_INF = -std::numeric_limits<float>::infinity();

// The loops over a row of keys are written on 8-float vectors (GCC / Clang vector extensions,
// compiled to whatever the build's instruction set is): left to itself the compiler vectorised
// the short loop over a head's D features instead, with gathers, and kept exp scalar.
typedef float f8 __attribute__((vector_size(4 * W)));
typedef int32_t i8 __attribute__((vector_size(4 * W)));

inline int64_t round_up(int64_t n) { return (n + W - 1) / W * W; }
inline f8 load(const float* p) {
  f8 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline void store(float* p, f8 v) { std::memcpy(p, &v, sizeof v); }
inline f8 splat(float x) { return f8{} + x; }
inline float sum_of(f8 v) {
  float total = 0.f;
  for (int64_t u = 0; u < W; ++u) total += v[u];
  return total;
}

// exp(x) as 2^n p(r), x = n ln 2 + r, |r| <= ln 2 / 2, p Cephes' expf polynomial: within about 1 ulp
// near 0 (the weights that matter), the error growing with |x| to about 1e-6 relative at x = -20,
// where a weight is below 1e-8. Below -87.3 (float's exp leaves the normal numbers) it gives 0,
// so -inf (a masked key) gives exactly 0; NaN stays NaN.
inline f8 exp_(f8 x) {
  const f8 lowest = splat(-87.33654475f), highest = splat(88.f);
  f8 c = x < lowest ? lowest : x;
  c = c > highest ? highest : c;
  const f8 t = c * 1.44269504088896341f + 0.5f;
  i8 n = __builtin_convertvector(t, i8);  // toward zero, then down where that rounded up: floor(t)
  n += __builtin_convertvector(n, f8) > t;
  const f8 nf = __builtin_convertvector(n, f8);
  const f8 r = c - nf * 0.693359375f + nf * 2.12194440e-4f;  // ln 2 in two parts, the first exact in float
  f8 p = splat(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  const f8 y = p * (f8)((n + 127) << 23);  // 2^n from its exponent bits: n in [-126, 127]
  const f8 zero = f8{};
  return x == x ? (x < lowest ? zero : y) : x;
}

// A query's scores: out[j] = sum_c x[c] * rows[c * stride + j] + bias[j] for j < n, -inf from n to
// round_up(n), a tile of W keys at a time (rows are zero-padded to a whole tile) -> their largest.
inline float scores(const float* __restrict x, const float* __restrict rows, const float* __restrict bias, int64_t D,
                    int64_t stride, int64_t n, float* __restrict out) {
  const i8 lane = {0, 1, 2, 3, 4, 5, 6, 7};
  f8 top = splat(NEG_INF);
  for (int64_t j = 0; j < n; j += W) {
    f8 acc = load(bias + j);
    for (int64_t c = 0; c < D; ++c) acc += x[c] * load(rows + c * stride + j);
    if (j + W > n) acc = lane + static_cast<int32_t>(j) < static_cast<int32_t>(n) ? acc : splat(NEG_INF);
    store(out + j, acc);
    top = acc > top ? acc : top;
  }
  float largest = NEG_INF;
  for (int64_t u = 0; u < W; ++u) largest = std::max(largest, top[u]);
  return largest;
}

// out[j] = sum_c x[c] * rows[c * stride + j] for j < round_up(n).
inline void products(const float* __restrict x, const float* __restrict rows, int64_t D, int64_t stride, int64_t n,
                     float* __restrict out) {
  for (int64_t j = 0; j < n; j += W) {
    f8 acc = {};
    for (int64_t c = 0; c < D; ++c) acc += x[c] * load(rows + c * stride + j);
    store(out + j, acc);
  }
}

// out[c] = scale * sum_j a[j] * rows[c * stride + j] over j < round_up(n) (a is zero past n).
inline void weighted_sums(const float* __restrict a, const float* __restrict rows, int64_t D, int64_t stride, int64_t n,
                          float scale, float* __restrict out) {
  for (int64_t c = 0; c < D; ++c) {
    f8 acc = {};
    for (int64_t j = 0; j < n; j += W) acc += load(a + j) * load(rows + c * stride + j);
    out[c] = scale * sum_of(acc);
  }
}

// rows[c * stride + j] += x[c] * a[j] over j < round_up(n) (a is zero past n).
inline void add_outer(const float* __restrict x, const float* __restrict a, int64_t D, int64_t stride, int64_t n,
                      float* __restrict rows) {
  for (int64_t c = 0; c < D; ++c)
    for (int64_t j = 0; j < n; j += W) store(rows + c * stride + j, load(rows + c * stride + j) + x[c] * load(a + j));
}

// A row of scores (round_up(n) of them, -inf past n) -> its weights exp(score - shift) in place,
// zero past n. -> the weights' sum.
inline float weights_in_place(float* __restrict p, int64_t n, float shift) {
  f8 sum = {};
  for (int64_t j = 0; j < n; j += W) {
    const f8 w = exp_(load(p + j) - shift);
    store(p + j, w);
    sum += w;
  }
  return sum_of(sum);
}

// Head h of sequence b of x (B, S, H * D, rows `row_stride` apart) into out (D, stride) transposed,
// zero past S.
inline void gather_transposed(const float* x, int64_t batch_stride, int64_t row_stride, int64_t b, int64_t h, int64_t S,
                              int64_t D, int64_t stride, float* __restrict out) {
  std::fill(out, out + D * stride, 0.f);
  const float* base = x + b * batch_stride + h * D;
  for (int64_t j = 0; j < S; ++j)
    for (int64_t c = 0; c < D; ++c) out[c * stride + j] = base[j * row_stride + c];
}

// Per sequence: the scores' additive mask, 0 on real keys, -inf on padding and past S.
inline void key_bias(const float* mask, int64_t b, int64_t S, int64_t stride, float* __restrict bias) {
  std::fill(bias, bias + S, 0.f);
  std::fill(bias + S, bias + stride, NEG_INF);
  if (mask != nullptr)
    for (int64_t j = 0; j < S; ++j) bias[j] = mask[b * S + j] > 0.f ? 0.f : NEG_INF;
}

struct Sizes {
  int64_t B, T, S, H, D;
};

Sizes check(const char* kernel, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& mask, int64_t heads) {
  for (const Tensor* t : {&q, &k, &v})
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == at::kFloat && t->dim() == 3 && t->stride(2) == 1, kernel,
                " expects float32 CPU tensors of 3 dimensions with contiguous features, got one of shape ", t->sizes(),
                " and strides ", t->strides(), ", ", t->scalar_type(), ", on ", t->device());
  check_inputs(kernel, {&mask});
  const int64_t B = q.size(0), T = q.size(1), S = k.size(1), features = q.size(2);
  TORCH_CHECK(heads >= 1 && features % heads == 0, kernel, ": ", heads, " heads do not divide ", features, " features");
  check_shape(kernel, "k", k, {B, S, features});
  check_shape(kernel, "v", v, {B, S, features});
  check_shape_or_empty(kernel, "mask", mask, {B, S});
  return {B, T, S, heads, features / heads};
}

}  // namespace

// -> out (B, T, H * D), lse (B, H, T): each query row's log-sum-exp of its scores (-inf where it sees no key).
std::vector<Tensor> attention_forward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& mask, int64_t heads,
                                      bool causal) {
  const auto [B, T, S, H, D] = check("attention_forward", q, k, v, mask, heads);
  auto out = at::empty({B, T, H * D}, q.options());
  auto lse = at::empty({B, H, T}, q.options());
  const float scale = 1.f / std::sqrt(static_cast<float>(D));
  const int64_t Sp = round_up(S);
  const float *q_p = q.data_ptr<float>(), *k_p = k.data_ptr<float>(), *v_p = v.data_ptr<float>();
  const float* mask_p = mask.numel() > 0 ? mask.data_ptr<float>() : nullptr;
  float *out_p = out.data_ptr<float>(), *lse_p = lse.data_ptr<float>();
  at::parallel_for(0, B * H, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> buffer(2 * D * Sp + 2 * Sp + D);
    float *kt = buffer.data(), *vt = kt + D * Sp, *p = vt + D * Sp, *bias = p + Sp, *qs = bias + Sp;
    for (int64_t slice = begin; slice < end; ++slice) {
      const int64_t b = slice / H, h = slice % H;
      gather_transposed(k_p, k.stride(0), k.stride(1), b, h, S, D, Sp, kt);
      gather_transposed(v_p, v.stride(0), v.stride(1), b, h, S, D, Sp, vt);
      key_bias(mask_p, b, S, Sp, bias);
      for (int64_t i = 0; i < T; ++i) {
        const float* qi = q_p + b * q.stride(0) + i * q.stride(1) + h * D;
        for (int64_t c = 0; c < D; ++c) qs[c] = scale * qi[c];
        const int64_t n = causal ? std::min(i + 1, S) : S;
        float* oi = out_p + (b * T + i) * H * D + h * D;
        const float top = scores(qs, kt, bias, D, Sp, n, p);
        if (top == NEG_INF) {  // no key to see (an empty source): zero weights, zero output
          std::fill(oi, oi + D, 0.f);
          lse_p[slice * T + i] = NEG_INF;
          continue;
        }
        const float sum = weights_in_place(p, n, top);
        weighted_sums(p, vt, D, Sp, n, 1.f / sum, oi);
        lse_p[slice * T + i] = top + std::log(sum);
      }
    }
  });
  return {out, lse};
}

// grad_out (B, T, H * D), the forward's q, k, v, mask, out and lse -> gradients of q (B, T, H * D),
// k and v (B, S, H * D).
std::vector<Tensor> attention_backward(const Tensor& grad_out, const Tensor& q, const Tensor& k, const Tensor& v,
                                       const Tensor& out, const Tensor& lse, const Tensor& mask, int64_t heads, bool causal) {
  const auto [B, T, S, H, D] = check("attention_backward", q, k, v, mask, heads);
  check_inputs("attention_backward", {&grad_out, &out, &lse});
  check_shape("attention_backward", "grad_out", grad_out, {B, T, H * D});
  check_shape("attention_backward", "out", out, {B, T, H * D});
  check_shape("attention_backward", "lse", lse, {B, H, T});
  auto grad_q = at::empty({B, T, H * D}, q.options());
  auto grad_k = at::empty({B, S, H * D}, q.options());
  auto grad_v = at::empty({B, S, H * D}, q.options());
  const float scale = 1.f / std::sqrt(static_cast<float>(D));
  const int64_t Sp = round_up(S);
  const float *q_p = q.data_ptr<float>(), *k_p = k.data_ptr<float>(), *v_p = v.data_ptr<float>();
  const float *g_p = grad_out.data_ptr<float>(), *out_p = out.data_ptr<float>(), *lse_p = lse.data_ptr<float>();
  const float* mask_p = mask.numel() > 0 ? mask.data_ptr<float>() : nullptr;
  float *gq_p = grad_q.data_ptr<float>(), *gk_p = grad_k.data_ptr<float>(), *gv_p = grad_v.data_ptr<float>();
  at::parallel_for(0, B * H, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> buffer(4 * D * Sp + 4 * Sp + D);
    float *kt = buffer.data(), *vt = kt + D * Sp, *gkt = vt + D * Sp, *gvt = gkt + D * Sp;
    float *p = gvt + D * Sp, *dp = p + Sp, *bias = dp + Sp, *ds = bias + Sp, *qs = ds + Sp;
    for (int64_t slice = begin; slice < end; ++slice) {
      const int64_t b = slice / H, h = slice % H;
      gather_transposed(k_p, k.stride(0), k.stride(1), b, h, S, D, Sp, kt);
      gather_transposed(v_p, v.stride(0), v.stride(1), b, h, S, D, Sp, vt);
      key_bias(mask_p, b, S, Sp, bias);
      std::fill(gkt, gkt + 2 * D * Sp, 0.f);  // gkt and gvt
      for (int64_t i = 0; i < T; ++i) {
        const int64_t row = (b * T + i) * H * D + h * D;
        float* gqi = gq_p + row;
        const float row_lse = lse_p[slice * T + i];
        if (row_lse == NEG_INF) {  // saw no key: nothing flows back
          std::fill(gqi, gqi + D, 0.f);
          continue;
        }
        const float* qi = q_p + b * q.stride(0) + i * q.stride(1) + h * D;
        const float *gi = g_p + row, *oi = out_p + row;
        for (int64_t c = 0; c < D; ++c) qs[c] = scale * qi[c];
        const int64_t n = causal ? std::min(i + 1, S) : S, m = round_up(n);
        scores(qs, kt, bias, D, Sp, n, p);  // the scores again, then the weights from the saved log-sum-exp
        weights_in_place(p, n, row_lse);
        products(gi, vt, D, Sp, n, dp);  // the weights' gradient: grad_out . v_j
        float dot = 0.f;  // sum_j p_j dp_j = grad_out . out
        for (int64_t c = 0; c < D; ++c) dot += gi[c] * oi[c];
        for (int64_t j = 0; j < m; j += W) store(ds + j, load(p + j) * (load(dp + j) - dot));  // the scores' gradient (zero past n)
        weighted_sums(ds, kt, D, Sp, n, scale, gqi);
        add_outer(qs, ds, D, Sp, n, gkt);
        add_outer(gi, p, D, Sp, n, gvt);
      }
      for (int64_t j = 0; j < S; ++j)
        for (int64_t c = 0; c < D; ++c) {
          const int64_t at = (b * S + j) * H * D + h * D + c;
          gk_p[at] = gkt[c * Sp + j];
          gv_p[at] = gvt[c * Sp + j];
        }
    }
  });
  return {grad_q, grad_k, grad_v};
}
