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
// Shapes: B sequences, T queries, S keys, H heads of size D (features F = H * D, head h at columns
// h * D .. h * D + D - 1, as nn.MultiheadAttention splits them). The inputs are the projections as
// the model makes them: a self-attention's x (B, T, 3F) holds q | k | v side by side (one product
// for all three) and kv is absent (not 3-d); a cross-attention's x (B, T, F) is q and kv (B, S, 2F)
// holds k | v. The backward pass writes the gradients in the same packing, so that no
// concatenation follows it. mask (B, S) float (1 real, 0 padding) or empty (nothing padded);
// causal: query i sees keys j <= i only. A query with no key to see gets zero weights and a
// zero output (as attention.masked_softmax gives), not torch's NaN.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#if defined(__AVX__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <array>
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

// exp(x) for x <= 0 (a score less its row's largest, or less its row's log-sum-exp), as 2^n p(r),
// x = n ln 2 + r, |r| <= ln 2 / 2, p Cephes' expf polynomial: within about 1 ulp near 0 (the weights
// that matter), the error growing with |x| to about 1e-6 relative at x = -20, where a weight is
// below 1e-8. Below -87.3 (float's exp leaves the normal numbers) it gives 0, so -inf (a masked key)
// gives exactly 0; NaN stays NaN (r and so p are NaN).
constexpr float LOG2E = 1.44269504088896341f;
constexpr float EXP_LOWEST = -87.33654475f;
constexpr float EXP_POLYNOMIAL[] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f,
                                    1.6666665459e-1f, 5.0000001201e-1f};  // highest power first

inline f8 exp_(f8 x) {
  const f8 lowest = splat(EXP_LOWEST);
  const f8 t = x * LOG2E + 0.5f;
  i8 n = __builtin_convertvector(t, i8);  // toward zero, then down where that rounded up: floor(t)
  n += __builtin_convertvector(n, f8) > t;
  const f8 nf = __builtin_convertvector(n, f8);
  const f8 r = x - nf * 0.693359375f + nf * 2.12194440e-4f;  // ln 2 in two parts, the first exact in float
  f8 p = splat(EXP_POLYNOMIAL[0]);
  p = p * r + EXP_POLYNOMIAL[1];
  p = p * r + EXP_POLYNOMIAL[2];
  p = p * r + EXP_POLYNOMIAL[3];
  p = p * r + EXP_POLYNOMIAL[4];
  p = p * r + EXP_POLYNOMIAL[5];
  p = p * r * r + r + 1.f;
  const f8 y = p * (f8)((n + 127) << 23);  // 2^n from its exponent bits: n in [-126, 0]
  return x < lowest ? f8{} : y;
}

#if defined(__FMA__)
// exp_ of R vectors in place, the R step by step together: each step's R operations are independent,
// where one exp_ after another is a chain of a dozen dependent multiply-adds each; the floor in one
// rounding. The steps are the fused multiply-adds that -ffast-math makes of exp_'s expression with
// FMA (ln 2 as one float, p * r * r + r + 1 as (p * r + 1) * r + 1), written out so that the weights
// are exp_'s to the bit whatever the compiler makes of the code around them. (Without FMA the
// kernels call exp_ itself: a build without it keeps its numbers.)
template <int R>
inline void exp_rows(f8 (&x)[R]) {
  const auto fma = [](f8 a, f8 b, f8 c) { return (f8)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c); };
  f8 nf[R], r[R], p[R];
  for (int u = 0; u < R; ++u) nf[u] = (f8)_mm256_floor_ps((__m256)fma(x[u], splat(LOG2E), splat(0.5f)));
  for (int u = 0; u < R; ++u) r[u] = fma(nf[u], splat(-0.693147182f), x[u]), p[u] = splat(EXP_POLYNOMIAL[0]);
  for (float c : {EXP_POLYNOMIAL[1], EXP_POLYNOMIAL[2], EXP_POLYNOMIAL[3], EXP_POLYNOMIAL[4], EXP_POLYNOMIAL[5], 1.f, 1.f})
    for (int u = 0; u < R; ++u) p[u] = fma(p[u], r[u], splat(c));
  for (int u = 0; u < R; ++u) {
    const f8 y = p[u] * (f8)((__builtin_convertvector(nf[u], i8) + 127) << 23);  // 2^n: n in [-126, 0]
    x[u] = x[u] < splat(EXP_LOWEST) ? f8{} : y;
  }
}
#endif

// The row functions below take R query rows at once (BLOCK of them, then one at a time), so that each
// tile of keys or values loaded serves both: the loads, not the multiply-adds, bound these loops.
// Each row r has its own count of keys n[r] (ascending in r: the causal limit grows by one a row);
// every row is computed to round_up(n[R - 1]).
template <int R>
using Rows = float* const (&)[R];
template <int R>
using ConstRows = const float* const (&)[R];

// Scores: out[r][j] = sum_c x[r][c] * keys[c * stride + j] + bias[j] for j < n[r], -inf from there
// to round_up(n[R - 1]) (keys are zero-padded to a whole tile). -> top[r], each row's largest.
template <int R>
inline void scores(ConstRows<R> x, const float* __restrict keys, const float* __restrict bias, int64_t D, int64_t stride,
                   const int64_t (&n)[R], Rows<R> out, float (&top)[R]) {
  const i8 lane = {0, 1, 2, 3, 4, 5, 6, 7};
  f8 best[R];
  for (int r = 0; r < R; ++r) best[r] = splat(NEG_INF);
  const auto finish = [&](int64_t j, f8 (&acc)[R]) {
    for (int r = 0; r < R; ++r) {
      if (j + W > n[r]) acc[r] = lane + static_cast<int32_t>(j) < static_cast<int32_t>(n[r]) ? acc[r] : splat(NEG_INF);
      store(out[r] + j, acc[r]);
      best[r] = acc[r] > best[r] ? acc[r] : best[r];
    }
  };
  int64_t j = 0;
  for (; j + W < n[R - 1]; j += 2 * W) {  // two tiles at a time: each x[r][c] broadcast once for both
    f8 a[R], b[R];
    for (int r = 0; r < R; ++r) a[r] = load(bias + j), b[r] = load(bias + j + W);
    for (int64_t c = 0; c < D; ++c) {
      const f8 k0 = load(keys + c * stride + j), k1 = load(keys + c * stride + j + W);
      for (int r = 0; r < R; ++r) a[r] += x[r][c] * k0, b[r] += x[r][c] * k1;
    }
    finish(j, a);
    finish(j + W, b);
  }
  if (j < n[R - 1]) {
    f8 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = load(bias + j);
    for (int64_t c = 0; c < D; ++c) {
      const f8 k = load(keys + c * stride + j);
      for (int r = 0; r < R; ++r) acc[r] += x[r][c] * k;
    }
    finish(j, acc);
  }
  for (int r = 0; r < R; ++r) {
    top[r] = NEG_INF;
    for (int64_t u = 0; u < W; ++u) top[r] = std::max(top[r], best[r][u]);
  }
}

// out[r][j] = sum_c x[r][c] * rows[c * stride + j] for j < m (a multiple of W).
template <int R>
inline void products(ConstRows<R> x, const float* __restrict rows, int64_t D, int64_t stride, int64_t m, Rows<R> out) {
  int64_t j = 0;
  for (; j + 2 * W <= m; j += 2 * W) {
    f8 a[R] = {}, b[R] = {};
    for (int64_t c = 0; c < D; ++c) {
      const f8 k0 = load(rows + c * stride + j), k1 = load(rows + c * stride + j + W);
      for (int r = 0; r < R; ++r) a[r] += x[r][c] * k0, b[r] += x[r][c] * k1;
    }
    for (int r = 0; r < R; ++r) store(out[r] + j, a[r]), store(out[r] + j + W, b[r]);
  }
  if (j < m) {
    f8 acc[R] = {};
    for (int64_t c = 0; c < D; ++c) {
      const f8 k = load(rows + c * stride + j);
      for (int r = 0; r < R; ++r) acc[r] += x[r][c] * k;
    }
    for (int r = 0; r < R; ++r) store(out[r] + j, acc[r]);
  }
}

// out[r][c] = scale[r] * sum_{j < m} a[r][j] * rows[c * stride + j].
template <int R>
inline void weighted_sums(ConstRows<R> a, const float* __restrict rows, int64_t D, int64_t stride, int64_t m,
                          const float (&scale)[R], Rows<R> out) {
  for (int64_t c = 0; c < D; ++c) {
    f8 acc[R] = {};
    for (int64_t j = 0; j < m; j += W) {
      const f8 k = load(rows + c * stride + j);
      for (int r = 0; r < R; ++r) acc[r] += load(a[r] + j) * k;
    }
    for (int r = 0; r < R; ++r) out[r][c] = scale[r] * sum_of(acc[r]);
  }
}

// rows[c * stride + j] += sum_r x[r][c] * a[r][j] over j < m.
template <int R>
inline void add_outer(ConstRows<R> x, ConstRows<R> a, int64_t D, int64_t stride, int64_t m, float* __restrict rows) {
  for (int64_t j = 0; j < m; j += W) {
    f8 tile[R];
    for (int r = 0; r < R; ++r) tile[r] = load(a[r] + j);
    for (int64_t c = 0; c < D; ++c) {
      f8 sum = load(rows + c * stride + j);
      for (int r = 0; r < R; ++r) sum += x[r][c] * tile[r];
      store(rows + c * stride + j, sum);
    }
  }
}

// R rows of m scores (-inf past their keys) -> their weights exp(score - shift[r]) in place, zero
// past their keys, a tile of every row at a time (R independent chains of exp's multiply-adds); a
// row that sees no key (shift -inf) gets zeros. -> sum[r], each row's sum of weights.
template <int R>
inline void weights_rows(Rows<R> p, int64_t m, const float (&shift)[R], float (&sum)[R]) {
  f8 total[R] = {}, by[R];
  for (int r = 0; r < R; ++r) by[r] = splat(shift[r] == NEG_INF ? 0.f : shift[r]);
  for (int64_t j = 0; j < m; j += W) {
    f8 w[R];
#if defined(__FMA__)
    for (int r = 0; r < R; ++r) w[r] = load(p[r] + j) - by[r];
    exp_rows<R>(w);
#else
    for (int r = 0; r < R; ++r) w[r] = exp_(load(p[r] + j) - by[r]);
#endif
    for (int r = 0; r < R; ++r) store(p[r] + j, w[r]), total[r] += w[r];
  }
  for (int r = 0; r < R; ++r) sum[r] = sum_of(total[r]);
}

// An 8 x 8 block of floats transposed in registers: m[u][c] becomes m[c][u].
inline void transpose8(f8 (&m)[W]) {
#if defined(__AVX__)
  __m256 t[W], s[W];
  for (int u = 0; u < W; u += 2)
    t[u] = _mm256_unpacklo_ps((__m256)m[u], (__m256)m[u + 1]), t[u + 1] = _mm256_unpackhi_ps((__m256)m[u], (__m256)m[u + 1]);
  for (int u = 0; u < W; u += 4) {
    s[u] = _mm256_shuffle_ps(t[u], t[u + 2], 0x44), s[u + 1] = _mm256_shuffle_ps(t[u], t[u + 2], 0xee);
    s[u + 2] = _mm256_shuffle_ps(t[u + 1], t[u + 3], 0x44), s[u + 3] = _mm256_shuffle_ps(t[u + 1], t[u + 3], 0xee);
  }
  for (int u = 0; u < 4; ++u)
    m[u] = (f8)_mm256_permute2f128_ps(s[u], s[u + 4], 0x20), m[u + 4] = (f8)_mm256_permute2f128_ps(s[u], s[u + 4], 0x31);
#else
  f8 t[W];
  for (int u = 0; u < W; ++u)
    for (int c = 0; c < W; ++c) t[c][u] = m[u][c];
  std::copy(t, t + W, m);
#endif
}

// A block of up to 8 x 8 floats transposed: the first `rows` of 8 rows from src (`src_stride`
// apart, zero past them) into the first `columns` of 8 rows of dst (`dst_stride` apart).
inline void transpose_block(const float* src, int64_t src_stride, int64_t rows, float* dst, int64_t dst_stride, int64_t columns) {
  f8 m[W];
  for (int u = 0; u < W; ++u) m[u] = u < rows ? load(src + u * src_stride) : f8{};
  transpose8(m);
  for (int c = 0; c < W && c < columns; ++c) store(dst + c * dst_stride, m[c]);
}

// Rows of D features, `row_stride` apart, into out (D, stride) transposed, zero from row `rows` to
// `stride` (a whole number of tiles); heads of whole 8-float vectors go 8 x 8 blocks at a time.
inline void transpose_in(const float* x, int64_t row_stride, int64_t rows, int64_t D, int64_t stride, float* __restrict out) {
  if (D % W != 0) {
    std::fill(out, out + D * stride, 0.f);
    for (int64_t j = 0; j < rows; ++j)
      for (int64_t c = 0; c < D; ++c) out[c * stride + j] = x[j * row_stride + c];
    return;
  }
  for (int64_t c = 0; c < D; c += W)
    for (int64_t j = 0; j < stride; j += W) transpose_block(x + j * row_stride + c, row_stride, rows - j, out + c * stride + j, stride, W);
}

// The inverse: in (D, stride) transposed into the first `rows` rows of D features, `row_stride` apart.
inline void transpose_out(const float* __restrict in, int64_t rows, int64_t D, int64_t stride, float* x, int64_t row_stride) {
  if (D % W != 0) {
    for (int64_t j = 0; j < rows; ++j)
      for (int64_t c = 0; c < D; ++c) x[j * row_stride + c] = in[c * stride + j];
    return;
  }
  for (int64_t c = 0; c < D; c += W)
    for (int64_t j = 0; j < rows; j += W) transpose_block(in + c * stride + j, stride, W, x + j * row_stride + c, row_stride, rows - j);
}

// Per sequence: the scores' additive mask, 0 on real keys, -inf on padding and past S.
inline void key_bias(const float* mask, int64_t b, int64_t S, int64_t stride, float* __restrict bias) {
  std::fill(bias, bias + S, 0.f);
  std::fill(bias + S, bias + stride, NEG_INF);
  if (mask != nullptr)
    for (int64_t j = 0; j < S; ++j) bias[j] = mask[b * S + j] > 0.f ? 0.f : NEG_INF;
}

// Slice (b, h)'s keys and values transposed into kt and vt (D, Sp), and its key bias (Sp).
inline void gather_slice(const Tensor& k, const Tensor& v, const float* mask, int64_t b, int64_t h, int64_t S, int64_t D,
                         int64_t Sp, float* kt, float* vt, float* bias) {
  transpose_in(k.data_ptr<float>() + b * k.stride(0) + h * D, k.stride(1), S, D, Sp, kt);
  transpose_in(v.data_ptr<float>() + b * v.stride(0) + h * D, v.stride(1), S, D, Sp, vt);
  key_bias(mask, b, S, Sp, bias);
}

struct Sizes {
  int64_t B, T, S, H, D;
};

// q, k and v inside the packed x and kv (see the top of this file): views, no copies.
std::array<Tensor, 3> unpack(const char* kernel, const Tensor& x, const Tensor& kv) {
  check_inputs(kernel, {&x, &kv});
  check_dim(kernel, "x", x, 3);
  if (kv.dim() != 3) {
    TORCH_CHECK(x.size(2) % 3 == 0, kernel, ": a self-attention's x holds q, k and v, got ", x.size(2), " features");
    const int64_t F = x.size(2) / 3;
    return {x.narrow(2, 0, F), x.narrow(2, F, F), x.narrow(2, 2 * F, F)};
  }
  const int64_t F = x.size(2);
  check_shape(kernel, "kv", kv, {x.size(0), kv.size(1), 2 * F});
  return {x, kv.narrow(2, 0, F), kv.narrow(2, F, F)};
}

Sizes check(const char* kernel, const Tensor& q, const Tensor& k, const Tensor& mask, int64_t heads) {
  check_inputs(kernel, {&mask});
  const int64_t B = q.size(0), T = q.size(1), S = k.size(1), features = q.size(2);
  TORCH_CHECK(heads >= 1 && features % heads == 0, kernel, ": ", heads, " heads do not divide ", features, " features");
  check_shape_or_empty(kernel, "mask", mask, {B, S});
  return {B, T, S, heads, features / heads};
}

}  // namespace

// One (sequence, head) slice: its keys and values transposed (D, Sp), their gradients, the key
// bias, and R rows of scratch each for the scaled queries, weights and their gradients.
struct Slice {
  int64_t T, S, D, Sp, H;
  bool causal;
  float scale;
  const float *kt, *vt, *bias;
};

inline int64_t keys_seen(const Slice& s, int64_t i) { return s.causal ? std::min(i + 1, s.S) : s.S; }

// Rows i0 .. i0 + R - 1 of a slice: the q rows scaled into qs, their scores into p and each row's
// largest score into top. -> the keys to sweep (the last row's seen keys, rounded up to a tile).
template <int R>
inline int64_t row_scores(const Slice& s, int64_t i0, ConstRows<R> q, Rows<R> qs, Rows<R> p, float (&top)[R]) {
  int64_t n[R];
  for (int r = 0; r < R; ++r) {
    for (int64_t c = 0; c < s.D; ++c) qs[r][c] = s.scale * q[r][c];
    n[r] = keys_seen(s, i0 + r);
  }
  scores<R>(reinterpret_cast<ConstRows<R>>(qs), s.kt, s.bias, s.D, s.Sp, n, p, top);
  return round_up(n[R - 1]);
}

// Rows i0 .. i0 + R - 1 of a slice, forward: q rows (scaled into qs), out rows and their log-sum-exp.
template <int R>
inline void forward_rows(const Slice& s, int64_t i0, ConstRows<R> q, Rows<R> qs, Rows<R> p, Rows<R> out, float* lse) {
  float top[R], inverse[R];
  const int64_t m = row_scores<R>(s, i0, q, qs, p, top);
  float sums[R];
  weights_rows<R>(p, m, top, sums);
  for (int r = 0; r < R; ++r) {
    const float sum = sums[r];
    inverse[r] = sum > 0.f ? 1.f / sum : 0.f;  // no key seen: zero weights, zero output
    lse[r] = top[r] == NEG_INF ? NEG_INF : top[r] + std::log(sum);
  }
  weighted_sums<R>(reinterpret_cast<ConstRows<R>>(p), s.vt, s.D, s.Sp, m, inverse, out);
}

// Rows i0 .. i0 + R - 1, backward: adds their share to the keys' and values' gradients (gkt, gvt,
// transposed) and writes the queries' gradients gq.
template <int R>
inline void backward_rows(const Slice& s, int64_t i0, ConstRows<R> q, ConstRows<R> g, ConstRows<R> o, const float* lse,
                          Rows<R> qs, Rows<R> p, Rows<R> dp, Rows<R> gq, float* gkt, float* gvt) {
  float top[R], scale[R];
  const int64_t m = row_scores<R>(s, i0, q, qs, p, top);          // the scores again, then
  float shift[R], sums[R];
  std::copy(lse, lse + R, shift);
  weights_rows<R>(p, m, shift, sums);  // the weights from the saved lse (their sums are 1)
  products<R>(g, s.vt, s.D, s.Sp, m, dp);  // the weights' gradient: grad_out . v_j
  for (int r = 0; r < R; ++r) {
    float dot = 0.f;  // sum_j p_j dp_j = grad_out . out
    for (int64_t c = 0; c < s.D; ++c) dot += g[r][c] * o[r][c];
    for (int64_t j = 0; j < m; j += W) store(dp[r] + j, load(p[r] + j) * (load(dp[r] + j) - dot));  // the scores' gradient
    scale[r] = s.scale;
  }
  weighted_sums<R>(reinterpret_cast<ConstRows<R>>(dp), s.kt, s.D, s.Sp, m, scale, gq);
  add_outer<R>(reinterpret_cast<ConstRows<R>>(qs), reinterpret_cast<ConstRows<R>>(dp), s.D, s.Sp, m, gkt);
  add_outer<R>(g, reinterpret_cast<ConstRows<R>>(p), s.D, s.Sp, m, gvt);
}

constexpr int BLOCK = 4;  // query rows at a time (four beat two and eight: docs/bench.md, Speed levers)

// -> out (B, T, H * D), lse (B, H, T): each query row's log-sum-exp of its scores (-inf where it sees no key).
std::vector<Tensor> attention_forward(const Tensor& x, const Tensor& kv, const Tensor& mask, int64_t heads, bool causal) {
  // Named variables, not structured bindings: a lambda may capture those only from C++20 (clang refuses).
  const std::array<Tensor, 3> qkv = unpack("attention_forward", x, kv);
  const Tensor &q = qkv[0], &k = qkv[1], &v = qkv[2];
  const Sizes sizes = check("attention_forward", q, k, mask, heads);
  const int64_t B = sizes.B, T = sizes.T, S = sizes.S, H = sizes.H, D = sizes.D;
  auto out = at::empty({B, T, H * D}, q.options());
  auto lse = at::empty({B, H, T}, q.options());
  const int64_t Sp = round_up(S);
  const float* q_p = q.data_ptr<float>();
  const int64_t q_stride[2] = {q.stride(0), q.stride(1)};  // read once: Tensor::stride checks its argument
  const float* mask_p = mask.numel() > 0 ? mask.data_ptr<float>() : nullptr;
  float *out_p = out.data_ptr<float>(), *lse_p = lse.data_ptr<float>();
  at::parallel_for(0, B * H, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> buffer(2 * D * Sp + Sp + BLOCK * (Sp + D));
    float *kt = buffer.data(), *vt = kt + D * Sp, *bias = vt + D * Sp, *rows = bias + Sp;
    float* p[BLOCK];
    float* qs[BLOCK];
    for (int r = 0; r < BLOCK; ++r) p[r] = rows + r * Sp, qs[r] = rows + BLOCK * Sp + r * D;
    const Slice slice_{T, S, D, Sp, H, causal, 1.f / std::sqrt(static_cast<float>(D)), kt, vt, bias};
    for (int64_t slice = begin; slice < end; ++slice) {
      const int64_t b = slice / H, h = slice % H;
      gather_slice(k, v, mask_p, b, h, S, D, Sp, kt, vt, bias);
      const auto q_row = [&](int64_t i) { return q_p + b * q_stride[0] + i * q_stride[1] + h * D; };
      const auto out_row = [&](int64_t i) { return out_p + (b * T + i) * H * D + h * D; };
      int64_t i = 0;
      for (; i + BLOCK <= T; i += BLOCK) {
        const float* qr[BLOCK];
        float* orow[BLOCK];
        for (int r = 0; r < BLOCK; ++r) qr[r] = q_row(i + r), orow[r] = out_row(i + r);
        forward_rows<BLOCK>(slice_, i, qr, qs, p, orow, lse_p + slice * T + i);
      }
      for (; i < T; ++i) {
        const float* qr[1] = {q_row(i)};
        float* orow[1] = {out_row(i)};
        float* p1[1] = {p[0]};
        float* qs1[1] = {qs[0]};
        forward_rows<1>(slice_, i, qr, qs1, p1, orow, lse_p + slice * T + i);
      }
    }
  });
  return {out, lse};
}

// grad_out (B, T, H * D), the forward's x, kv, mask, out and lse -> the gradients of x and kv, packed
// as they are (kv's absent where kv is).
std::vector<Tensor> attention_backward(const Tensor& grad_out, const Tensor& x, const Tensor& kv, const Tensor& out,
                                       const Tensor& lse, const Tensor& mask, int64_t heads, bool causal) {
  // Named variables, not structured bindings: a lambda may capture those only from C++20 (clang refuses).
  const std::array<Tensor, 3> qkv = unpack("attention_backward", x, kv);
  const Tensor &q = qkv[0], &k = qkv[1], &v = qkv[2];
  const Sizes sizes = check("attention_backward", q, k, mask, heads);
  const int64_t B = sizes.B, T = sizes.T, S = sizes.S, H = sizes.H, D = sizes.D;
  check_inputs("attention_backward", {&grad_out, &out, &lse});
  check_shape("attention_backward", "grad_out", grad_out, {B, T, H * D});
  check_shape("attention_backward", "out", out, {B, T, H * D});
  check_shape("attention_backward", "lse", lse, {B, H, T});
  auto grad_x = at::empty_like(x), grad_kv = kv.dim() == 3 ? at::empty_like(kv) : at::empty({0}, x.options());
  const std::array<Tensor, 3> grads = unpack("attention_backward", grad_x, grad_kv);
  const Tensor &grad_q = grads[0], &grad_k = grads[1], &grad_v = grads[2];
  const int64_t Sp = round_up(S);
  const float* q_p = q.data_ptr<float>();
  const int64_t q_stride[2] = {q.stride(0), q.stride(1)};  // read once: Tensor::stride checks its argument
  const float *g_p = grad_out.data_ptr<float>(), *out_p = out.data_ptr<float>(), *lse_p = lse.data_ptr<float>();
  const float* mask_p = mask.numel() > 0 ? mask.data_ptr<float>() : nullptr;
  float *gq_p = grad_q.data_ptr<float>(), *gk_p = grad_k.data_ptr<float>(), *gv_p = grad_v.data_ptr<float>();
  const int64_t gq_stride[2] = {grad_q.stride(0), grad_q.stride(1)}, gkv_stride[2] = {grad_k.stride(0), grad_k.stride(1)};
  at::parallel_for(0, B * H, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> buffer(4 * D * Sp + Sp + BLOCK * (2 * Sp + D));
    float *kt = buffer.data(), *vt = kt + D * Sp, *gkt = vt + D * Sp, *gvt = gkt + D * Sp, *bias = gvt + D * Sp;
    float *rows = bias + Sp, *p[BLOCK], *dp[BLOCK], *qs[BLOCK];
    for (int r = 0; r < BLOCK; ++r) p[r] = rows + r * Sp, dp[r] = rows + (BLOCK + r) * Sp, qs[r] = rows + 2 * BLOCK * Sp + r * D;
    const Slice slice_{T, S, D, Sp, H, causal, 1.f / std::sqrt(static_cast<float>(D)), kt, vt, bias};
    for (int64_t slice = begin; slice < end; ++slice) {
      const int64_t b = slice / H, h = slice % H;
      gather_slice(k, v, mask_p, b, h, S, D, Sp, kt, vt, bias);
      std::fill(gkt, gkt + 2 * D * Sp, 0.f);  // gkt and gvt
      const auto q_row = [&](int64_t i) { return q_p + b * q_stride[0] + i * q_stride[1] + h * D; };
      const auto at_row = [&](int64_t i) { return (b * T + i) * H * D + h * D; };
      const auto gq_row = [&](int64_t i) { return gq_p + b * gq_stride[0] + i * gq_stride[1] + h * D; };
      int64_t i = 0;
      for (; i + BLOCK <= T; i += BLOCK) {
        const float *qr[BLOCK], *gr[BLOCK], *orow[BLOCK];
        float* gqr[BLOCK];
        for (int r = 0; r < BLOCK; ++r)
          qr[r] = q_row(i + r), gr[r] = g_p + at_row(i + r), orow[r] = out_p + at_row(i + r), gqr[r] = gq_row(i + r);
        backward_rows<BLOCK>(slice_, i, qr, gr, orow, lse_p + slice * T + i, qs, p, dp, gqr, gkt, gvt);
      }
      for (; i < T; ++i) {
        const float* qr[1] = {q_row(i)};
        const float* gr[1] = {g_p + at_row(i)};
        const float* orow[1] = {out_p + at_row(i)};
        float* gqr[1] = {gq_row(i)};
        float *qs1[1] = {qs[0]}, *p1[1] = {p[0]}, *dp1[1] = {dp[0]};
        backward_rows<1>(slice_, i, qr, gr, orow, lse_p + slice * T + i, qs1, p1, dp1, gqr, gkt, gvt);
      }
      transpose_out(gkt, S, D, Sp, gk_p + b * gkv_stride[0] + h * D, gkv_stride[1]);
      transpose_out(gvt, S, D, Sp, gv_p + b * gkv_stride[0] + h * D, gkv_stride[1]);
    }
  });
  return {grad_x, grad_kv};
}

// One step of greedy decoding, no backward: each sequence's query row q (B, H * D) over the first S
// keys and values of a cache that holds them transposed, keys and values (B, H, D, C), C a whole
// number of tiles and zero past what was written; mask (B, S) float or empty -> out (B, H * D), the
// heads side by side, and the weights (B, H, S). The rows are forward_rows' for one query, with the
// normalised weights written out (a greedy step's cross-attention weights are the model's maps);
// the cache's layout spares the gather of a slice at every step.
std::vector<Tensor> attention_step(const Tensor& q, const Tensor& keys, const Tensor& values, const Tensor& mask, int64_t S) {
  check_inputs("attention_step", {&q, &keys, &values, &mask});
  check_dim("attention_step", "keys", keys, 4);
  const int64_t B = keys.size(0), H = keys.size(1), D = keys.size(2), C = keys.size(3);
  TORCH_CHECK(C % W == 0 && S >= 0 && S <= C, "attention_step: ", S, " keys in a cache of ", C, " (a multiple of ", W, ")");
  check_shape("attention_step", "values", values, keys.sizes());
  check_shape("attention_step", "q", q, {B, H * D});
  check_shape_or_empty("attention_step", "mask", mask, {B, S});
  auto out = at::empty({B, H * D}, q.options());
  auto weights = at::empty({B, H, S}, q.options());
  const float *q_p = q.data_ptr<float>(), *keys_p = keys.data_ptr<float>(), *values_p = values.data_ptr<float>();
  const float* mask_p = mask.numel() > 0 ? mask.data_ptr<float>() : nullptr;
  float *out_p = out.data_ptr<float>(), *weights_p = weights.data_ptr<float>();
  at::parallel_for(0, B * H, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> buffer(2 * C + D);
    float *bias = buffer.data(), *p[1] = {bias + C}, *qs[1] = {bias + 2 * C};
    for (int64_t slice = begin; slice < end; ++slice) {  // slice = b * H + h: q's and out's row b, head h
      key_bias(mask_p, slice / H, S, C, bias);
      const Slice slice_{1, S, D, C, H, false, 1.f / std::sqrt(static_cast<float>(D)), keys_p + slice * D * C,
                         values_p + slice * D * C, bias};
      const float* q_row[1] = {q_p + slice * D};
      float* out_row[1] = {out_p + slice * D};
      float top[1], sums[1];
      const int64_t m = row_scores<1>(slice_, 0, q_row, qs, p, top);
      weights_rows<1>(p, m, top, sums);
      const float inverse[1] = {sums[0] > 0.f ? 1.f / sums[0] : 0.f};  // no key seen: zero weights, zero output
      weighted_sums<1>(reinterpret_cast<ConstRows<1>>(p), slice_.vt, D, C, m, inverse, out_row);
      for (int64_t j = 0; j < S; ++j) weights_p[slice * S + j] = p[0][j] * inverse[0];
    }
  });
  return {out, weights};
}
