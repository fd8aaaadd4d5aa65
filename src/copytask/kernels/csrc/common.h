// Inline pieces shared by copytask's CPU kernels. Written as plain loops over contiguous float
// rows with __restrict pointers so that the compiler vectorises them (the build uses -O3
// -ffast-math, and AVX2/FMA where the CPU has them).
#pragma once

#include <ATen/ATen.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <initializer_list>
#include <mutex>
#include <utility>

// The kernels read raw float pointers: every tensor they take must be contiguous float32 on CPU
// (kernels/ops.py sees to it; this guards against a caller that does not).
static inline void check_inputs(const char* kernel, std::initializer_list<const at::Tensor*> tensors) {
  for (const at::Tensor* t : tensors)
    TORCH_CHECK(t->numel() == 0 || (t->device().is_cpu() && t->scalar_type() == at::kFloat && t->is_contiguous()),
                kernel, " expects contiguous float32 CPU tensors, got one of shape ", t->sizes(), ", ",
                t->scalar_type(), ", on ", t->device());
}

// ...and they index those pointers by sizes taken from a few of the tensors, so every other
// tensor must have the shape those sizes imply, or it would be read out of bounds.
static inline void check_dim(const char* kernel, const char* name, const at::Tensor& t, int64_t dim) {
  TORCH_CHECK(t.dim() == dim, kernel, ": ", name, " must have ", dim, " dimensions, got shape ", t.sizes());
}
static inline void check_shape(const char* kernel, const char* name, const at::Tensor& t, at::IntArrayRef shape) {
  TORCH_CHECK(t.sizes() == shape, kernel, ": ", name, " must have shape ", shape, ", got ", t.sizes());
}
// A mask (or an optional gradient) may also be empty: nothing padded (nothing to add).
static inline void check_shape_or_empty(const char* kernel, const char* name, const at::Tensor& t, at::IntArrayRef shape) {
  if (t.numel() > 0) check_shape(kernel, name, t, shape);
}

// tanh as a rational function of x (odd degree 13 over even degree 6) on [-7.9, 7.9], where it
// reaches +-1 in float: Eigen's float tanh (generic_fast_tanh_float), within a few ulp. No exp,
// so it vectorises into multiplies and adds wherever the compiler vectorises the loop. The clamp
// is written with comparisons, false for NaN, so that NaN passes through as in torch (fmin and
// fmax would return the bound); inf is clamped to the bound, giving +-1 as torch does.
static inline float tanh_(float x) {
  constexpr float bound = 7.90531110763549805f;
  x = x < -bound ? -bound : (x > bound ? bound : x);
  const float x2 = x * x;
  float p = x2 * -2.76076847742355e-16f + 2.00018790482477e-13f;
  p = x2 * p + -8.60467152213735e-11f;
  p = x2 * p + 5.12229709037114e-08f;
  p = x2 * p + 1.48572235717979e-05f;
  p = x2 * p + 6.37261928875436e-04f;
  p = x2 * p + 4.89352455891786e-03f;
  float q = x2 * 1.19825839466702e-06f + 1.18534705686654e-04f;
  q = x2 * q + 2.26843463243900e-03f;
  q = x2 * q + 4.89352518554385e-03f;
  return x * p / q;
}
static inline float sigmoid_(float x) { return 0.5f + 0.5f * tanh_(0.5f * x); }

// One step of the GRU cell for one sequence, torch's gate order (r, z, n): gi = W_ih x + b_ih
// and gh = W_hh h + b_hh (3H each), h (H) the state before the step -> saved (4H: r, z, n, gh_n)
// for the backward pass, next (H) the state after the step.
static inline void gru_cell(const float* __restrict gi, const float* __restrict gh, const float* __restrict h,
                            int64_t H, float* __restrict saved, float* __restrict next) {
  for (int64_t j = 0; j < 2 * H; ++j) saved[j] = sigmoid_(gi[j] + gh[j]);  // r, z
  for (int64_t j = 0; j < H; ++j) {
    saved[2 * H + j] = tanh_(gi[2 * H + j] + saved[j] * gh[2 * H + j]);  // n
    saved[3 * H + j] = gh[2 * H + j];
  }
  for (int64_t j = 0; j < H; ++j) next[j] = (1.f - saved[H + j]) * saved[2 * H + j] + saved[H + j] * h[j];
}

// Its backward: grad_next (H), the gradient reaching the new state -> grad_gi and grad_gh (3H),
// and grad_h (H), the gradient of h along the direct path h -> next (the path through
// gh = W_hh h is the caller's product grad_gh W_hh).
static inline void gru_cell_backward(const float* __restrict saved, const float* __restrict h,
                                     const float* __restrict grad_next, int64_t H, float* __restrict grad_gi,
                                     float* __restrict grad_gh, float* __restrict grad_h) {
  for (int64_t j = 0; j < H; ++j) {
    const float r = saved[j], z = saved[H + j], n = saved[2 * H + j], gh_n = saved[3 * H + j];
    const float d_n = grad_next[j] * (1.f - z) * (1.f - n * n);
    const float d_z = grad_next[j] * (h[j] - n) * z * (1.f - z);
    const float d_r = d_n * gh_n * r * (1.f - r);
    grad_gi[j] = d_r;
    grad_gi[H + j] = d_z;
    grad_gi[2 * H + j] = d_n;
    grad_gh[j] = d_r;
    grad_gh[H + j] = d_z;
    grad_gh[2 * H + j] = d_n * r;
    grad_h[j] = grad_next[j] * z;
  }
}

// The additive score's tanh, (T_dec, T_enc, A) per sequence, kept for the backward pass: tens of MB
// at long lengths, freed after every backward pass and asked for again by the next forward pass.
// glibc maps a block that large afresh at every request and page-faults it in (much of a Bahdanau
// forward pass: docs/bench.md), so the kernels keep the largest freed one for the next request:
// memory held by the kernels, where a process-wide setting of the allocator's thresholds would
// serve everyone.
namespace spare {
inline std::mutex mutex;
inline void* block = nullptr;
inline size_t bytes = 0;
}  // namespace spare

static inline void keep_or_free(void* data, size_t bytes) {
  std::lock_guard<std::mutex> lock(spare::mutex);
  if (bytes > spare::bytes) std::swap(data, spare::block), std::swap(bytes, spare::bytes);
  std::free(data);
}

// An uninitialised float32 CPU tensor, in the spare block where it is large enough.
static inline at::Tensor reusable_empty(at::IntArrayRef sizes) {
  size_t bytes = sizeof(float);
  for (int64_t size : sizes) bytes *= static_cast<size_t>(size);
  void* data = nullptr;
  {
    std::lock_guard<std::mutex> lock(spare::mutex);
    if (spare::block != nullptr && spare::bytes >= bytes) {
      data = spare::block, bytes = spare::bytes;
      spare::block = nullptr, spare::bytes = 0;
    }
  }
  if (data == nullptr) data = std::malloc(bytes > 0 ? bytes : 1);
  TORCH_CHECK(data != nullptr, "out of memory allocating ", bytes, " bytes");
  return at::from_blob(data, sizes, [data, bytes](void*) { keep_or_free(data, bytes); }, at::kFloat);
}

// The additive score of one query against S keys: scores[i] = v . tanh(q + keys[i]), q and v
// (A), keys (S, A); u (S, A) keeps the tanh for the backward pass.
static inline void additive_row(const float* __restrict q, const float* __restrict keys, const float* __restrict v,
                                int64_t S, int64_t A, float* __restrict u, float* __restrict scores) {
  for (int64_t i = 0; i < S; ++i) {
    const float* __restrict k = keys + i * A;
    float* __restrict ui = u + i * A;
    float score = 0.f;
    for (int64_t a = 0; a < A; ++a) {
      ui[a] = tanh_(q[a] + k[a]);
      score += v[a] * ui[a];
    }
    scores[i] = score;
  }
}

// Its backward: grad_scores (S) -> adds to grad_q (A), grad_keys (S, A) and grad_v (A). Every row,
// also one whose gradient is zero (padding): 0 times a NaN in u is NaN, as through torch's ops.
static inline void additive_row_backward(const float* __restrict grad_scores, const float* __restrict u,
                                         const float* __restrict v, int64_t S, int64_t A, float* __restrict grad_q,
                                         float* __restrict grad_keys, float* __restrict grad_v) {
  for (int64_t i = 0; i < S; ++i) {
    const float g = grad_scores[i];
    const float* __restrict ui = u + i * A;
    float* __restrict dk = grad_keys + i * A;
    for (int64_t a = 0; a < A; ++a) {
      const float pre = g * v[a] * (1.f - ui[a] * ui[a]);
      dk[a] += pre;
      grad_q[a] += pre;
      grad_v[a] += g * ui[a];
    }
  }
}
