// Cached attention, written once for any vector width V (see vec.h). No torch or standard C++
// headers here: avx512.cpp includes this file too.
//
// Every query row is computed alone with a fixed summation order (scores: sequential over
// head_dim; values: sequential over keys), so its result does not depend on how many rows share
// the call. The key cache is [slots, kv_heads, max_len / 16, head_dim, 16]: tiles of 16 keys,
// each stored transposed (head_dim rows of 16 keys), so one vector holds a run of keys' partial
// scores (no horizontal sums) and scoring a run of keys streams contiguous memory; the value
// cache is [slots, kv_heads, max_len, head_dim]. The caches hold float32 or bf16 (T = uint16_t:
// widened exactly as they are read; the arithmetic is float32 either way).
#pragma once
#include <stdint.h>

#include "vec_exp.h"
#include "widen.h"

namespace {

constexpr int64_t kKeyTile = 16;  // keys per tile of the key cache (a multiple of every V::lanes)

// Offset of key j's entry for dimension 0 in one head's key cache; dimension d is kKeyTile
// floats further per d.
inline int64_t key_at(int64_t j, int64_t D) { return (j / kKeyTile) * kKeyTile * D + j % kKeyTile; }

// scores[g][j - base] = scale * q_g . k_j for G query heads against keys base..hi (inclusive) and
// on to the end of the last vector: base is a multiple of V::lanes, and the lanes before the
// caller's first key or past hi are other (stale) entries of the same tile, computed lane by
// lane and ignored. Every score is the same FMA sequence over d = 0..D-1, then one multiply by
// scale, so a row's scores never depend on its neighbours or on where vectors start.
template <class V, int G, class T>
void score_keys(const float* const* q, const T* kt, int64_t D, int64_t base, int64_t hi,
                float scale, float* const* scores) {
  constexpr int L = V::lanes;
  constexpr int KB = L == 16 ? 4 : 3;  // key vectors per block (registers: G*KB + KB + 1)
  const typename V::reg sv = V::set1(scale);
  int64_t j = base;
  for (; j <= hi; j += KB * L) {
    const int kb = hi + 1 - j >= KB * L ? KB : int((hi + L - j) / L);  // the last block: fewer
    const T* kv0[KB];
    for (int b = 0; b < kb; ++b) kv0[b] = kt + key_at(j + b * L, D);
    typename V::reg acc[G][KB];
    for (int g = 0; g < G; ++g)
      for (int b = 0; b < KB; ++b) acc[g][b] = V::zero();
    if (kb == KB) {
      // the next block's tiles, a row at a time (each tile is a page of its own to the prefetcher)
      const int64_t next = j + KB * L, last = next + KB * L - 1 < hi ? next + KB * L - 1 : hi;
      const T* pf = kt + key_at(next, D) - next % kKeyTile;
      const int tiles = next <= hi ? int(last / kKeyTile - next / kKeyTile) + 1 : 0;
      for (int64_t d = 0; d < D; ++d) {
        for (int t = 0; t < tiles; ++t)
          _mm_prefetch(reinterpret_cast<const char*>(pf + t * kKeyTile * D + d * kKeyTile), _MM_HINT_T0);
        typename V::reg kv[KB];
        for (int b = 0; b < KB; ++b) kv[b] = V::load(kv0[b] + d * kKeyTile);
        for (int g = 0; g < G; ++g) {
          const typename V::reg qd = V::set1(q[g][d]);
          for (int b = 0; b < KB; ++b) acc[g][b] = V::fma(qd, kv[b], acc[g][b]);
        }
      }
    } else {
      for (int64_t d = 0; d < D; ++d)
        for (int b = 0; b < kb; ++b) {
          const typename V::reg kv = V::load(kv0[b] + d * kKeyTile);
          for (int g = 0; g < G; ++g) acc[g][b] = V::fma(V::set1(q[g][d]), kv, acc[g][b]);
        }
    }
    for (int g = 0; g < G; ++g)
      for (int b = 0; b < kb; ++b) V::store(scores[g] + j - base + b * L, V::mul(acc[g][b], sv));
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
// stored contiguously; the G heads run side by side so the chains overlap. Keys go in blocks
// whose rows stay in L1 across the passes over head_dim (out holds the sums between blocks, which
// rounds nothing), and the first pass over a block fetches the next block's rows ahead.
template <class V, int G, class T>
void weighted_values(float* const* w, const float* inv, int64_t len, const T* values,
                     int64_t extra, const T* const* rows, int64_t D, float* const* out) {
  constexpr int NV = V::lanes == 16 ? 4 : 2;  // vectors per head per pass (registers: G*NV + 2)
  constexpr int64_t KB = 32;                  // keys per block
  const int64_t body = D - D % V::lanes, total = len + extra;
  auto row = [&](int64_t j) { return j < len ? values + j * D : rows[j - len]; };
  for (int64_t j0 = 0; j0 < total; j0 += KB) {
    const int64_t j1 = total - j0 < KB ? total : j0 + KB;
    for (int64_t d0 = 0; d0 < body; d0 += NV * V::lanes) {
      const int nv = int((body - d0 < NV * V::lanes ? body - d0 : NV * V::lanes) / V::lanes);
      typename V::reg acc[G][NV];
      for (int g = 0; g < G; ++g)
        for (int c = 0; c < nv; ++c) acc[g][c] = j0 ? V::load(out[g] + d0 + c * V::lanes) : V::zero();
      for (int64_t j = j0; j < j1; ++j) {
        const T* v = row(j) + d0;
        if (d0 == 0 && j + KB < total)
          for (int64_t b = 0; b < D; b += 16) _mm_prefetch(  // a 64-byte line per 16 floats
              reinterpret_cast<const char*>(row(j + KB) + b), _MM_HINT_T0);
        for (int c = 0; c < nv; ++c) {
          const typename V::reg vv = V::load(v + c * V::lanes);
          for (int g = 0; g < G; ++g) acc[g][c] = V::fma(V::set1(w[g][j]), vv, acc[g][c]);
        }
      }
      for (int g = 0; g < G; ++g)
        for (int c = 0; c < nv; ++c)
          V::store(out[g] + d0 + c * V::lanes, j1 == total ? V::mul(acc[g][c], V::set1(inv[g])) : acc[g][c]);
    }
  }
  for (int64_t d = body; d < D; ++d)
    for (int g = 0; g < G; ++g) {
      float a = 0.f;
      for (int64_t j = 0; j < total; ++j) a = __builtin_fmaf(w[g][j], widen(row(j)[d]), a);
      out[g][d] = a * inv[g];
    }
}

// Work items [a, b) of Hkv * N * parts (kv head, row n, part): part p of the `group` query heads
// of that kv head (parts of ceil(group / parts) heads; each head's numbers are the same however
// heads are grouped). Items run kv head by kv head, so the rows of one request (adjacent) reuse
// that head's keys and values while they are still in cache. Row n attends to its slot's keys
// lo..hi[n] (hi = pos when null), then to the keys at the `tree` positions tree[tbeg[n] ..
// tbeg[n + 1]) (a token tree's ancestors that are not stored contiguously; none when tbeg is
// null). buf holds group * (longest key list + 2 * kKeyTile) floats, rows (longest tree list)
// pointers.
template <class V, class T>
void attend_items(const float* qp, const T* kp, const T* vp, float* op,
                  const int64_t* slots, const int64_t* pos, const int64_t* hi,
                  const int64_t* tbeg, const int64_t* tree, int64_t N, int64_t H, int64_t Hkv,
                  int64_t parts, int64_t M, int64_t D, int64_t window, float scale, int64_t a,
                  int64_t b, float* buf, const T** rows) {
  const int64_t group = H / Hkv, per = (group + parts - 1) / parts;
  for (int64_t item = a; item < b; ++item) {
    const int64_t nk = item / parts, h0 = item % parts * per, h1 = h0 + per < group ? h0 + per : group;
    const int64_t n = nk % N, kvh = nk / N, p = hi ? hi[n] : pos[n];
    const int64_t extra = tbeg ? tbeg[n + 1] - tbeg[n] : 0;
    const int64_t* far = tbeg ? tree + tbeg[n] : nullptr;
    const int64_t lo = window > 0 && p - window + 1 > 0 ? p - window + 1 : 0;
    const int64_t len = p - lo + 1, skip = lo % V::lanes;  // scores start at the vector before lo
    const int64_t stride = skip + len + extra + V::lanes;  // room for the last vector's overrun
    const int64_t base = (slots[n] * Hkv + kvh) * M * D;  // same offset in k and v
    for (int64_t e = 0; e < extra; ++e) rows[e] = vp + base + far[e] * D;
    for (int64_t g0 = h0; g0 < h1; g0 += 4) {
      const int gs = h1 - g0 < 4 ? int(h1 - g0) : 4;
      const float* qs[4];
      float* raw[4];
      float* sc[4];
      float* os[4];
      float inv[4];
      for (int g = 0; g < gs; ++g) {
        qs[g] = qp + (n * H + kvh * group + g0 + g) * D;
        raw[g] = buf + (g0 + g) * stride;
        sc[g] = raw[g] + skip;
        os[g] = op + (n * H + kvh * group + g0 + g) * D;
      }
      const T* vals = vp + base + lo * D;
      switch (gs) {
        case 4: score_keys<V, 4>(qs, kp + base, D, lo - skip, p, scale, raw); break;
        case 3: score_keys<V, 3>(qs, kp + base, D, lo - skip, p, scale, raw); break;
        case 2: score_keys<V, 2>(qs, kp + base, D, lo - skip, p, scale, raw); break;
        default: score_keys<V, 1>(qs, kp + base, D, lo - skip, p, scale, raw);
      }
      // the tree's keys: the same FMA sequence over d, then the scale, as every other score
      for (int64_t e = 0; e < extra; ++e)
        for (int g = 0; g < gs; ++g) {
          const T* kf = kp + base + key_at(far[e], D);
          float s = 0.f;
          for (int64_t d = 0; d < D; ++d) s = __builtin_fmaf(qs[g][d], widen(kf[d * kKeyTile]), s);
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
