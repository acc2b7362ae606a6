// Attention of packed query rows against the static KV cache (which it first writes).
//
// Every query row is computed alone with a fixed summation order (keys in order, 8 FMA lanes over
// head_dim, a fixed horizontal sum), so its result does not depend on how many rows share the
// call - a k-token verification forward reproduces k one-token forwards bit for bit (torch's SDPA
// picks blockings by shape and does not). The query heads of one KV group are scored together so
// each key is loaded once per group.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "vec_exp.h"

namespace {

inline float hsum8(__m256 v) {
  __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
  __m128 s = _mm_add_ps(lo, hi);
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// scores[g][j - lo] = scale * q_g . k_j for G query heads against keys lo..hi (inclusive).
// Three keys at a time keep 3G independent FMA chains in flight; each score's own order is fixed.
template <int G>
void score_keys(const float* const* q, const float* keys, int64_t lo, int64_t hi, int64_t D,
                float scale, float* const* scores) {
  constexpr int KB = 3;
  const int64_t d8 = D & ~int64_t(7);
  int64_t j = lo;
  for (; j + KB <= hi + 1; j += KB) {
    __m256 acc[KB][G];
    for (int b = 0; b < KB; ++b)
      for (int g = 0; g < G; ++g) acc[b][g] = _mm256_setzero_ps();
    for (int64_t d = 0; d < d8; d += 8) {
      __m256 kv[KB];
      for (int b = 0; b < KB; ++b) kv[b] = _mm256_loadu_ps(keys + (j + b) * D + d);
      for (int g = 0; g < G; ++g) {
        const __m256 qv = _mm256_loadu_ps(q[g] + d);
        for (int b = 0; b < KB; ++b) acc[b][g] = _mm256_fmadd_ps(qv, kv[b], acc[b][g]);
      }
    }
    for (int b = 0; b < KB; ++b)
      for (int g = 0; g < G; ++g) {
        float s = hsum8(acc[b][g]);
        for (int64_t d = d8; d < D; ++d) s = std::fma(q[g][d], keys[(j + b) * D + d], s);
        scores[g][j + b - lo] = s * scale;
      }
  }
  for (; j <= hi; ++j) {  // the same per-score order as above, one key at a time
    const float* k = keys + j * D;
    __m256 acc[G];
    for (int g = 0; g < G; ++g) acc[g] = _mm256_setzero_ps();
    for (int64_t d = 0; d < d8; d += 8) {
      const __m256 kv = _mm256_loadu_ps(k + d);
      for (int g = 0; g < G; ++g) acc[g] = _mm256_fmadd_ps(_mm256_loadu_ps(q[g] + d), kv, acc[g]);
    }
    for (int g = 0; g < G; ++g) {
      float s = hsum8(acc[g]);
      for (int64_t d = d8; d < D; ++d) s = std::fma(q[g][d], k[d], s);
      scores[g][j - lo] = s * scale;
    }
  }
}

// softmax(scores) @ values for one head, written to out [D]; `scores` is overwritten.
void softmax_values(float* scores, int64_t len, const float* values, int64_t D, float* out) {
  float mx = -INFINITY;
  for (int64_t j = 0; j < len; ++j) mx = std::max(mx, scores[j]);
  const int64_t l8 = len & ~int64_t(7);
  const __m256 mv = _mm256_set1_ps(mx);
  for (int64_t j = 0; j < l8; j += 8)
    _mm256_storeu_ps(scores + j, exp256(_mm256_sub_ps(_mm256_loadu_ps(scores + j), mv)));
  for (int64_t j = l8; j < len; ++j) scores[j] = std::exp(scores[j] - mx);
  float total = 0.f;
  for (int64_t j = 0; j < len; ++j) total += scores[j];
  const float inv = 1.0f / total;
  // 64 output floats at a time stay in registers across all keys
  const int64_t d8 = D & ~int64_t(7);
  for (int64_t d0 = 0; d0 < d8; d0 += 64) {
    const int nv = int(std::min<int64_t>(64, d8 - d0) / 8);
    __m256 acc[8];
    for (int c = 0; c < 8; ++c) acc[c] = _mm256_setzero_ps();
    for (int64_t j = 0; j < len; ++j) {
      const __m256 e = _mm256_set1_ps(scores[j]);
      const float* v = values + j * D + d0;
      for (int c = 0; c < nv; ++c) acc[c] = _mm256_fmadd_ps(e, _mm256_loadu_ps(v + 8 * c), acc[c]);
    }
    const __m256 iv = _mm256_set1_ps(inv);
    for (int c = 0; c < nv; ++c) _mm256_storeu_ps(out + d0 + 8 * c, _mm256_mul_ps(acc[c], iv));
  }
  for (int64_t d = d8; d < D; ++d) {
    float a = 0.f;
    for (int64_t j = 0; j < len; ++j) a = std::fma(scores[j], values[j * D + d], a);
    out[d] = a * inv;
  }
}

}  // namespace

// q [N, H, D]; k, v [N, Hkv, D] (this forward's keys/values, written into the caches first);
// caches [S, Hkv, M, D]; slots, positions [N] (int64); window <= 0: none.
// Row n attends to keys (slots[n], j) for j in (positions[n] - window, positions[n]].
torch::Tensor cached_attention(const torch::Tensor& q, const torch::Tensor& k,
                               const torch::Tensor& v, torch::Tensor k_cache,
                               torch::Tensor v_cache, const torch::Tensor& slots,
                               const torch::Tensor& positions, int64_t window) {
  TORCH_CHECK(q.dtype() == torch::kFloat32 && k_cache.dtype() == torch::kFloat32 &&
              v_cache.dtype() == torch::kFloat32, "cached_attention: float32 expected");
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(),
              "cached_attention: q [N, H, D] and caches [S, Hkv, M, D] expected");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "cached_attention: contiguous caches expected");
  const int64_t N = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t S = k_cache.size(0), Hkv = k_cache.size(1), M = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == D && H % Hkv == 0, "cached_attention: head shapes disagree");
  auto sl = slots.to(torch::kLong).contiguous();
  auto ps = positions.to(torch::kLong).contiguous();
  TORCH_CHECK(sl.numel() == N && ps.numel() == N, "cached_attention: one slot and position per row");
  const int64_t* slp = sl.data_ptr<int64_t>();
  const int64_t* pp = ps.data_ptr<int64_t>();
  for (int64_t n = 0; n < N; ++n)
    TORCH_CHECK(pp[n] >= 0 && pp[n] < M && slp[n] >= 0 && slp[n] < S,
                "cached_attention: slot ", slp[n], " position ", pp[n], " outside the cache");
  {  // write this forward's keys and values at (slot, head, position)
    auto kc = k.reshape({N, Hkv, D}).contiguous(), vc = v.reshape({N, Hkv, D}).contiguous();
    const float* ks = kc.data_ptr<float>();
    const float* vs = vc.data_ptr<float>();
    float* kd = k_cache.data_ptr<float>();
    float* vd = v_cache.data_ptr<float>();
    for (int64_t n = 0; n < N; ++n)
      for (int64_t h = 0; h < Hkv; ++h) {
        const int64_t dst = ((slp[n] * Hkv + h) * M + pp[n]) * D, src = (n * Hkv + h) * D;
        std::memcpy(kd + dst, ks + src, D * sizeof(float));
        std::memcpy(vd + dst, vs + src, D * sizeof(float));
      }
  }

  auto qc = q.contiguous();
  auto out = torch::empty({N, H, D}, qc.options());
  const float* qp = qc.data_ptr<float>();
  const float* kp = k_cache.data_ptr<float>();
  const float* vp = v_cache.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float scale = 1.0f / std::sqrt(float(D));
  const int64_t group = H / Hkv;
  at::parallel_for(0, N * Hkv, 1, [&](int64_t a, int64_t b) {
    std::vector<float> buf;
    for (int64_t nk = a; nk < b; ++nk) {
      const int64_t n = nk / Hkv, kvh = nk % Hkv, pos = pp[n];
      const int64_t lo = window > 0 ? std::max<int64_t>(0, pos - window + 1) : 0;
      const int64_t len = pos - lo + 1;
      const int64_t base = (slp[n] * Hkv + kvh) * M * D;
      buf.resize(group * len);
      for (int64_t g0 = 0; g0 < group; g0 += 4) {
        const int gs = int(std::min<int64_t>(4, group - g0));
        const float* qs[4];
        float* sc[4];
        for (int g = 0; g < gs; ++g) {
          qs[g] = qp + (n * H + kvh * group + g0 + g) * D;
          sc[g] = buf.data() + (g0 + g) * len;
        }
        switch (gs) {
          case 4: score_keys<4>(qs, kp + base, lo, pos, D, scale, sc); break;
          case 3: score_keys<3>(qs, kp + base, lo, pos, D, scale, sc); break;
          case 2: score_keys<2>(qs, kp + base, lo, pos, D, scale, sc); break;
          default: score_keys<1>(qs, kp + base, lo, pos, D, scale, sc);
        }
      }
      for (int64_t g = 0; g < group; ++g)
        softmax_values(buf.data() + g * len, len, vp + base + lo * D, D,
                       op + (n * H + kvh * group + g) * D);
    }
  });
  return out;
}

TORCH_LIBRARY_FRAGMENT(angelspec, m) {
  m.def("cached_attention(Tensor q, Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, "
        "Tensor slots, Tensor positions, int window) -> Tensor");
}
TORCH_LIBRARY_IMPL(angelspec, CPU, m) {
  m.impl("cached_attention", &cached_attention);
}
