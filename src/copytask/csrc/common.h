// Inline pieces shared by copytask's CPU kernels. Written as plain loops over contiguous float
// rows with __restrict pointers so that the compiler vectorises them (the build uses -O3
// -ffast-math, and AVX2/FMA where the CPU has them).
#pragma once

#include <cmath>
#include <cstdint>

static inline float sigmoid_(float x) { return 1.f / (1.f + std::exp(-x)); }
static inline float tanh_(float x) { return 2.f * sigmoid_(2.f * x) - 1.f; }

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

// Its backward: grad_scores (S) -> adds to grad_q (A), grad_keys (S, A) and grad_v (A).
static inline void additive_row_backward(const float* __restrict grad_scores, const float* __restrict u,
                                         const float* __restrict v, int64_t S, int64_t A, float* __restrict grad_q,
                                         float* __restrict grad_keys, float* __restrict grad_v) {
  for (int64_t i = 0; i < S; ++i) {
    const float g = grad_scores[i];
    if (g == 0.f) continue;  // padding (zero weight) and positions no loss reaches
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
