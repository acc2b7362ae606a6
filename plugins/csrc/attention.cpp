// Attention of packed query rows against the static KV cache, one (row, head) at a time.
//
// Every query row is computed alone with a fixed summation order (keys in order, 8 FMA lanes over
// head_dim, a fixed horizontal sum), so its result does not depend on how many rows share the
// call - a k-token verification forward reproduces k one-token forwards bit for bit (torch's SDPA
// picks blockings by shape and does not). Decoding and verification attend over a few rows, where
// this is as fast as SDPA.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <cmath>
#include <vector>

namespace {

inline float hsum8(__m256 v) {
  __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
  __m128 s = _mm_add_ps(lo, hi);
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline float dot(const float* a, const float* b, int64_t n) {
  __m256 acc = _mm256_setzero_ps();
  const int64_t n8 = n & ~int64_t(7);
  for (int64_t i = 0; i < n8; i += 8)
    acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
  float s = hsum8(acc);
  for (int64_t i = n8; i < n; ++i) s = std::fma(a[i], b[i], s);
  return s;
}

// out += w * v over n floats
inline void axpy(float* out, const float* v, float w, int64_t n) {
  const __m256 wv = _mm256_set1_ps(w);
  const int64_t n8 = n & ~int64_t(7);
  for (int64_t i = 0; i < n8; i += 8)
    _mm256_storeu_ps(out + i, _mm256_fmadd_ps(wv, _mm256_loadu_ps(v + i), _mm256_loadu_ps(out + i)));
  for (int64_t i = n8; i < n; ++i) out[i] = std::fma(w, v[i], out[i]);
}

}  // namespace

// q [N, H, D]; k_cache, v_cache [S, Hkv, M, D]; slots, positions [N] (int64); window <= 0: none.
// Row n attends to keys (slots[n], j) for j in (positions[n] - window, positions[n]].
torch::Tensor cached_attention(const torch::Tensor& q, const torch::Tensor& k_cache,
                               const torch::Tensor& v_cache, const torch::Tensor& slots,
                               const torch::Tensor& positions, int64_t window) {
  TORCH_CHECK(q.dtype() == torch::kFloat32 && k_cache.dtype() == torch::kFloat32 &&
              v_cache.dtype() == torch::kFloat32, "cached_attention: float32 expected");
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(),
              "cached_attention: q [N, H, D] and caches [S, Hkv, M, D] expected");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "cached_attention: contiguous caches expected");
  auto qc = q.contiguous();
  auto sl = slots.to(torch::kLong).contiguous();
  auto ps = positions.to(torch::kLong).contiguous();
  const int64_t N = qc.size(0), H = qc.size(1), D = qc.size(2);
  const int64_t Hkv = k_cache.size(1), M = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == D && H % Hkv == 0, "cached_attention: head shapes disagree");
  TORCH_CHECK(sl.numel() == N && ps.numel() == N, "cached_attention: one slot and position per row");
  auto out = torch::zeros({N, H, D}, qc.options());
  const float* qp = qc.data_ptr<float>();
  const float* kp = k_cache.data_ptr<float>();
  const float* vp = v_cache.data_ptr<float>();
  const int64_t* slp = sl.data_ptr<int64_t>();
  const int64_t* pp = ps.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  if (N > 0) {
    TORCH_CHECK(ps.min().item<int64_t>() >= 0 && ps.max().item<int64_t>() < M,
                "cached_attention: position outside the cache of ", M);
    TORCH_CHECK(sl.min().item<int64_t>() >= 0 && sl.max().item<int64_t>() < k_cache.size(0),
                "cached_attention: slot outside the cache");
  }
  const float scale = 1.0f / std::sqrt(float(D));
  const int64_t group = H / Hkv;
  at::parallel_for(0, N * H, 1, [&](int64_t a, int64_t b) {
    std::vector<float> score;
    for (int64_t nh = a; nh < b; ++nh) {
      const int64_t n = nh / H, h = nh % H, kvh = h / group;
      const int64_t pos = pp[n];
      const int64_t lo = window > 0 ? std::max<int64_t>(0, pos - window + 1) : 0;
      const float* qrow = qp + (n * H + h) * D;
      const int64_t base = (slp[n] * Hkv + kvh) * M;
      score.resize(pos - lo + 1);
      float mx = -INFINITY;
      for (int64_t j = lo; j <= pos; ++j) {
        const float s = dot(qrow, kp + (base + j) * D, D) * scale;
        score[j - lo] = s;
        mx = std::max(mx, s);
      }
      float total = 0.f;
      float* orow = op + (n * H + h) * D;
      for (int64_t j = lo; j <= pos; ++j) {
        const float e = std::exp(score[j - lo] - mx);
        total += e;
        axpy(orow, vp + (base + j) * D, e, D);
      }
      const float inv = 1.0f / total;
      for (int64_t d = 0; d < D; ++d) orow[d] *= inv;
    }
  });
  return out;
}

TORCH_LIBRARY_FRAGMENT(angelspec, m) {
  m.def("cached_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor slots, Tensor positions, int window) -> Tensor");
}
TORCH_LIBRARY_IMPL(angelspec, CPU, m) {
  m.impl("cached_attention", &cached_attention);
}
