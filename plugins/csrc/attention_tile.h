// Cached attention, written once for any vector width V (see vec.h). No torch or standard C++
// headers here: avx512.cpp includes this file too.
//
// Every query row is computed alone with a fixed summation order (scores: sequential over
// head_dim; values: sequential over keys), so its result does not depend on how many rows share
// the call. The key cache is [slots, kv_heads, head_dim, max_len] (transposed), the value cache
// [slots, kv_heads, max_len, head_dim].
#pragma once
#include <stdint.h>

#include "vec_exp.h"

namespace {

// scores[g][j - lo] = scale * q_g . k_j for G query heads against keys lo..hi (inclusive).
// Keys are stored transposed (kt[d * M + j]), so one vector holds V::lanes keys' partial scores
// and no horizontal sums are needed. Every score is the same FMA sequence over d = 0..D-1 (then
// one multiply by scale) whichever path computes it - vector block or scalar tail - so a row's
// scores never depend on its neighbours or on where its block boundaries fall.
template <class V, int G>
void score_keys(const float* const* q, const float* kt, int64_t M, int64_t lo, int64_t hi,
                int64_t D, float scale, float* const* scores) {
  constexpr int KB = V::lanes == 16 ? 4 : 3;  // key vectors per block (registers: G*KB + KB + 1)
  const typename V::reg sv = V::set1(scale);
  int64_t j = lo;
  for (; j + KB * V::lanes <= hi + 1; j += KB * V::lanes) {
    typename V::reg acc[G][KB];
    for (int g = 0; g < G; ++g)
      for (int b = 0; b < KB; ++b) acc[g][b] = V::zero();
    for (int64_t d = 0; d < D; ++d) {
      typename V::reg kv[KB];
      for (int b = 0; b < KB; ++b) kv[b] = V::load(kt + d * M + j + b * V::lanes);
      for (int g = 0; g < G; ++g) {
        const typename V::reg qd = V::set1(q[g][d]);
        for (int b = 0; b < KB; ++b) acc[g][b] = V::fma(qd, kv[b], acc[g][b]);
      }
    }
    for (int g = 0; g < G; ++g)
      for (int b = 0; b < KB; ++b) V::store(scores[g] + j - lo + b * V::lanes, V::mul(acc[g][b], sv));
  }
  // the rest one vector at a time; a last partial vector reads keys past hi (stale cache entries,
  // each lane independent) and keeps only the valid lanes, while it stays inside the cache row
  for (; j <= hi && j + V::lanes <= M; j += V::lanes) {
    typename V::reg acc[G];
    for (int g = 0; g < G; ++g) acc[g] = V::zero();
    for (int64_t d = 0; d < D; ++d) {
      const typename V::reg kv = V::load(kt + d * M + j);
      for (int g = 0; g < G; ++g) acc[g] = V::fma(V::set1(q[g][d]), kv, acc[g]);
    }
    const int64_t valid = hi + 1 - j < V::lanes ? hi + 1 - j : V::lanes;
    for (int g = 0; g < G; ++g) {
      float tmp[V::lanes];
      V::store(tmp, V::mul(acc[g], sv));
      for (int64_t l = 0; l < valid; ++l) scores[g][j - lo + l] = tmp[l];
    }
  }
  for (; j <= hi; ++j)  // only at the very end of the cache
    for (int g = 0; g < G; ++g) {
      float s = 0.f;
      for (int64_t d = 0; d < D; ++d) s = __builtin_fmaf(q[g][d], kt[d * M + j], s);
      scores[g][j - lo] = s * scale;
    }
}

// Turns one head's scores into unnormalised softmax weights in place; returns 1 / their sum.
// Vectorised (a scalar max and sum would be a chain of dependent adds, most of the attention's
// time at a few hundred keys): the max is exact in any order; the sum keeps 8 lanes (lane l adds
// keys j = l mod 8 in order), then a fixed horizontal sum, then the tail in order. The order
// depends on len only, so a row's weights still never depend on its neighbours.
inline float softmax_weights(float* scores, int64_t len) {
  const int64_t l8 = len & ~int64_t(7);
  __m256 mv8 = _mm256_set1_ps(-__builtin_inff());
  for (int64_t j = 0; j < l8; j += 8) mv8 = _mm256_max_ps(mv8, _mm256_loadu_ps(scores + j));
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mv8), _mm256_extractf128_ps(mv8, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
  float mx = _mm_cvtss_f32(m4);
  for (int64_t j = l8; j < len; ++j) mx = scores[j] > mx ? scores[j] : mx;
  const __m256 mv = _mm256_set1_ps(mx);
  __m256 acc = _mm256_setzero_ps();
  for (int64_t j = 0; j < l8; j += 8) {
    const __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(scores + j), mv));
    _mm256_storeu_ps(scores + j, e);
    acc = _mm256_add_ps(acc, e);
  }
  __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
  s4 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  s4 = _mm_add_ss(s4, _mm_movehdup_ps(s4));
  float total = _mm_cvtss_f32(s4);
  for (int64_t j = l8; j < len; ++j) {
    scores[j] = __builtin_expf(scores[j] - mx);
    total += scores[j];
  }
  return 1.0f / total;
}

// out[g] = (sum_j w[g][j] * v_j) * inv[g] for G heads sharing the values: `len` contiguous rows
// [len, D], then `extra` more rows anywhere (a token tree's ancestors). Each output is one FMA
// chain over the keys in order, so a row reached through a tree rounds exactly as the same keys
// stored contiguously; the G heads run side by side so the chains overlap.
template <class V, int G>
void weighted_values(float* const* w, const float* inv, int64_t len, const float* values,
                     int64_t extra, const float* const* rows, int64_t D, float* const* out) {
  constexpr int NV = V::lanes == 16 ? 4 : 2;  // vectors per head per pass (registers: G*NV + 2)
  const int64_t body = D - D % V::lanes;
  for (int64_t d0 = 0; d0 < body; d0 += NV * V::lanes) {
    const int nv = int((body - d0 < NV * V::lanes ? body - d0 : NV * V::lanes) / V::lanes);
    typename V::reg acc[G][NV];
    for (int g = 0; g < G; ++g)
      for (int c = 0; c < NV; ++c) acc[g][c] = V::zero();
    for (int64_t j = 0; j < len + extra; ++j) {
      const float* v = (j < len ? values + j * D : rows[j - len]) + d0;
      for (int c = 0; c < nv; ++c) {
        const typename V::reg vv = V::load(v + c * V::lanes);
        for (int g = 0; g < G; ++g) acc[g][c] = V::fma(V::set1(w[g][j]), vv, acc[g][c]);
      }
    }
    for (int g = 0; g < G; ++g)
      for (int c = 0; c < nv; ++c)
        V::store(out[g] + d0 + c * V::lanes, V::mul(acc[g][c], V::set1(inv[g])));
  }
  for (int64_t d = body; d < D; ++d)
    for (int g = 0; g < G; ++g) {
      float a = 0.f;
      for (int64_t j = 0; j < len + extra; ++j)
        a = __builtin_fmaf(w[g][j], (j < len ? values + j * D : rows[j - len])[d], a);
      out[g][d] = a * inv[g];
    }
}

// Work items [a, b) of Hkv * N (kv head, row n): the `group` query heads of that kv head. Items
// run kv head by kv head, so the rows of one request (adjacent) reuse that head's keys and values
// while they are still in cache. Row n attends to its slot's keys lo..hi[n] (hi = pos when
// null), then to the keys at the `tree` positions tree[tbeg[n] .. tbeg[n + 1]) (a token tree's
// ancestors that are not stored contiguously; none when tbeg is null). buf holds
// group * (longest key list) floats, rows (longest tree list) pointers.
template <class V>
void attend_items(const float* qp, const float* kp, const float* vp, float* op,
                  const int64_t* slots, const int64_t* pos, const int64_t* hi,
                  const int64_t* tbeg, const int64_t* tree, int64_t N, int64_t H, int64_t Hkv,
                  int64_t M, int64_t D, int64_t window, float scale, int64_t a, int64_t b,
                  float* buf, const float** rows) {
  const int64_t group = H / Hkv;
  for (int64_t nk = a; nk < b; ++nk) {
    const int64_t n = nk % N, kvh = nk / N, p = hi ? hi[n] : pos[n];
    const int64_t extra = tbeg ? tbeg[n + 1] - tbeg[n] : 0;
    const int64_t* far = tbeg ? tree + tbeg[n] : nullptr;
    const int64_t lo = window > 0 && p - window + 1 > 0 ? p - window + 1 : 0;
    const int64_t len = p - lo + 1;
    const int64_t base = (slots[n] * Hkv + kvh) * M * D;  // same offset in k [D, M] and v [M, D]
    for (int64_t e = 0; e < extra; ++e) rows[e] = vp + base + far[e] * D;
    for (int64_t g0 = 0; g0 < group; g0 += 4) {
      const int gs = group - g0 < 4 ? int(group - g0) : 4;
      const float* qs[4];
      float* sc[4];
      float* os[4];
      float inv[4];
      for (int g = 0; g < gs; ++g) {
        qs[g] = qp + (n * H + kvh * group + g0 + g) * D;
        sc[g] = buf + (g0 + g) * (len + extra);
        os[g] = op + (n * H + kvh * group + g0 + g) * D;
      }
      const float* vals = vp + base + lo * D;
      switch (gs) {
        case 4: score_keys<V, 4>(qs, kp + base, M, lo, p, D, scale, sc); break;
        case 3: score_keys<V, 3>(qs, kp + base, M, lo, p, D, scale, sc); break;
        case 2: score_keys<V, 2>(qs, kp + base, M, lo, p, D, scale, sc); break;
        default: score_keys<V, 1>(qs, kp + base, M, lo, p, D, scale, sc);
      }
      // the tree's keys: the same FMA sequence over d, then the scale, as every other score
      for (int64_t e = 0; e < extra; ++e)
        for (int g = 0; g < gs; ++g) {
          float s = 0.f;
          for (int64_t d = 0; d < D; ++d) s = __builtin_fmaf(qs[g][d], kp[base + d * M + far[e]], s);
          sc[g][len + e] = s * scale;
        }
      for (int g = 0; g < gs; ++g) inv[g] = softmax_weights(sc[g], len + extra);
      switch (gs) {
        case 4: weighted_values<V, 4>(sc, inv, len, vals, extra, rows, D, os); break;
        case 3: weighted_values<V, 3>(sc, inv, len, vals, extra, rows, D, os); break;
        case 2: weighted_values<V, 2>(sc, inv, len, vals, extra, rows, D, os); break;
        default: weighted_values<V, 1>(sc, inv, len, vals, extra, rows, D, os);
      }
    }
  }
}

}  // namespace
