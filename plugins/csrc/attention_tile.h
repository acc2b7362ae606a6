// Cached attention, written once for any vector width V (see vec.h). No torch or standard C++
// headers here: avx512.cpp includes this file too.
//
// Every query row is computed alone with a fixed summation order (keys in order, V::lanes FMA
// lanes over head_dim, V::hsum), so its result does not depend on how many rows share the call.
#pragma once
#include <stdint.h>

#include "vec_exp.h"

namespace {

// scores[g][j - lo] = scale * q_g . k_j for G query heads against keys lo..hi (inclusive).
// Three keys at a time keep 3G independent FMA chains in flight; each score's own order is fixed.
template <class V, int G>
void score_keys(const float* const* q, const float* keys, int64_t lo, int64_t hi, int64_t D,
                float scale, float* const* scores) {
  constexpr int KB = 3;
  const int64_t body = D - D % V::lanes;
  for (int64_t j = lo; j <= hi;) {
    const int kb = hi + 1 - j >= KB ? KB : 1;  // the tail goes key by key, same per-score order
    typename V::reg acc[KB][G];
    for (int b = 0; b < kb; ++b)
      for (int g = 0; g < G; ++g) acc[b][g] = V::zero();
    for (int64_t d = 0; d < body; d += V::lanes) {
      typename V::reg kv[KB];
      for (int b = 0; b < kb; ++b) kv[b] = V::load(keys + (j + b) * D + d);
      for (int g = 0; g < G; ++g) {
        const typename V::reg qv = V::load(q[g] + d);
        for (int b = 0; b < kb; ++b) acc[b][g] = V::fma(qv, kv[b], acc[b][g]);
      }
    }
    for (int b = 0; b < kb; ++b)
      for (int g = 0; g < G; ++g) {
        float s = V::hsum(acc[b][g]);
        for (int64_t d = body; d < D; ++d) s = __builtin_fmaf(q[g][d], keys[(j + b) * D + d], s);
        scores[g][j + b - lo] = s * scale;
      }
    j += kb;
  }
}

// softmax(scores) @ values for one head, written to out [D]; `scores` is overwritten.
template <class V>
void softmax_values(float* scores, int64_t len, const float* values, int64_t D, float* out) {
  float mx = -__builtin_inff();
  for (int64_t j = 0; j < len; ++j) mx = scores[j] > mx ? scores[j] : mx;
  const int64_t l8 = len & ~int64_t(7);
  const __m256 mv = _mm256_set1_ps(mx);
  for (int64_t j = 0; j < l8; j += 8)
    _mm256_storeu_ps(scores + j, exp256(_mm256_sub_ps(_mm256_loadu_ps(scores + j), mv)));
  for (int64_t j = l8; j < len; ++j) scores[j] = __builtin_expf(scores[j] - mx);
  float total = 0.f;
  for (int64_t j = 0; j < len; ++j) total += scores[j];
  const float inv = 1.0f / total;
  // up to 8 registers of output stay in registers across all keys
  constexpr int64_t chunk = 8 * V::lanes;
  const int64_t body = D - D % V::lanes;
  for (int64_t d0 = 0; d0 < body; d0 += chunk) {
    const int nv = int((body - d0 < chunk ? body - d0 : chunk) / V::lanes);
    typename V::reg acc[8];
    for (int c = 0; c < 8; ++c) acc[c] = V::zero();
    for (int64_t j = 0; j < len; ++j) {
      const typename V::reg e = V::set1(scores[j]);
      const float* v = values + j * D + d0;
      for (int c = 0; c < nv; ++c) acc[c] = V::fma(e, V::load(v + c * V::lanes), acc[c]);
    }
    for (int c = 0; c < nv; ++c) V::store(out + d0 + c * V::lanes, V::mul(acc[c], V::set1(inv)));
  }
  for (int64_t d = body; d < D; ++d) {
    float a = 0.f;
    for (int64_t j = 0; j < len; ++j) a = __builtin_fmaf(scores[j], values[j * D + d], a);
    out[d] = a * inv;
  }
}

// Work items [a, b) of N * Hkv (row n, kv head): the `group` query heads of that kv head.
// buf holds group * (max position + 1) floats.
template <class V>
void attend_items(const float* qp, const float* kp, const float* vp, float* op,
                  const int64_t* slots, const int64_t* pos, int64_t H, int64_t Hkv, int64_t M,
                  int64_t D, int64_t window, float scale, int64_t a, int64_t b, float* buf) {
  const int64_t group = H / Hkv;
  for (int64_t nk = a; nk < b; ++nk) {
    const int64_t n = nk / Hkv, kvh = nk % Hkv, p = pos[n];
    const int64_t lo = window > 0 && p - window + 1 > 0 ? p - window + 1 : 0;
    const int64_t len = p - lo + 1;
    const int64_t base = (slots[n] * Hkv + kvh) * M * D;
    for (int64_t g0 = 0; g0 < group; g0 += 4) {
      const int gs = group - g0 < 4 ? int(group - g0) : 4;
      const float* qs[4];
      float* sc[4];
      for (int g = 0; g < gs; ++g) {
        qs[g] = qp + (n * H + kvh * group + g0 + g) * D;
        sc[g] = buf + (g0 + g) * len;
      }
      switch (gs) {
        case 4: score_keys<V, 4>(qs, kp + base, lo, p, D, scale, sc); break;
        case 3: score_keys<V, 3>(qs, kp + base, lo, p, D, scale, sc); break;
        case 2: score_keys<V, 2>(qs, kp + base, lo, p, D, scale, sc); break;
        default: score_keys<V, 1>(qs, kp + base, lo, p, D, scale, sc);
      }
    }
    for (int64_t g = 0; g < group; ++g)
      softmax_values<V>(buf + g * len, len, vp + base + lo * D, D,
                        op + (n * H + kvh * group + g) * D);
  }
}

}  // namespace
