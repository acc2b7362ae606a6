// Small per-row ops of the decoder layer, fused so a one-token forward does not pay a dozen
// framework calls per layer (op overhead is otherwise a large part of a decode step).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>

#include "layer_rows.h"
#include "vec_exp.h"

// x [N, h], w [h] -> x / sqrt(mean(x^2) + eps) * w, row by row (double accumulation in 16
// lanes, lane l summing i = l mod 16 in order, then a fixed reduction and the tail in order: a
// row's result depends on h only; one scalar chain of dependent adds was slow).
void rms_norm_rows(const float* xp, const float* wp, float* yp, int64_t n, int64_t h, double eps) {
  at::parallel_for(0, n, 64, [&](int64_t a, int64_t b) {
    for (int64_t r = a; r < b; ++r) {
      const float* xr = xp + r * h;
      __m256d acc[4] = {_mm256_setzero_pd(), _mm256_setzero_pd(), _mm256_setzero_pd(),
                        _mm256_setzero_pd()};
      const int64_t h16 = h & ~int64_t(15);
      for (int64_t i = 0; i < h16; i += 16)
        for (int g = 0; g < 4; ++g) {
          const __m256d d = _mm256_cvtps_pd(_mm_loadu_ps(xr + i + 4 * g));
          acc[g] = _mm256_fmadd_pd(d, d, acc[g]);
        }
      const __m256d s4 = _mm256_add_pd(_mm256_add_pd(acc[0], acc[1]), _mm256_add_pd(acc[2], acc[3]));
      alignas(32) double lanes[4];
      _mm256_store_pd(lanes, s4);
      double ss = (lanes[0] + lanes[1]) + (lanes[2] + lanes[3]);
      for (int64_t i = h16; i < h; ++i) ss += double(xr[i]) * xr[i];
      const float inv = float(1.0 / std::sqrt(ss / h + eps));
      for (int64_t i = 0; i < h; ++i) yp[r * h + i] = xr[i] * inv * wp[i];
    }
  });
}

torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& w, double eps) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && w.dtype() == torch::kFloat32, "rms_norm: float32 expected");
  auto xc = x.contiguous();
  const int64_t h = xc.size(-1), n = xc.numel() / h;
  TORCH_CHECK(w.numel() == h, "rms_norm: weight size ", w.numel(), " != hidden size ", h);
  auto y = torch::empty_like(xc);
  rms_norm_rows(xc.data_ptr<float>(), w.contiguous().data_ptr<float>(), y.data_ptr<float>(), n, h, eps);
  return y;
}

// In place on the first `heads` heads of x [N, all_heads, D] (q and k of a fused qkv): rotate-half
// RoPE with cos/sin tables [max_len, D] at positions [N].
void rope_rows(float* xp, const float* cp, const float* sp, const int64_t* pp, int64_t n, int64_t all,
               int64_t d, int64_t heads) {
  const int64_t half = d / 2;
  for (int64_t r = 0; r < n; ++r) {
    const float* c = cp + pp[r] * d;
    const float* s = sp + pp[r] * d;
    for (int64_t hh = 0; hh < heads; ++hh) {
      float* v = xp + (r * all + hh) * d;
      for (int64_t i = 0; i < half; ++i) {
        const float a = v[i], b = v[i + half];
        v[i] = a * c[i] - b * s[i];
        v[i + half] = b * c[i + half] + a * s[i + half];
      }
    }
  }
}

void rope_(torch::Tensor x, const torch::Tensor& cos, const torch::Tensor& sin,
           const torch::Tensor& positions, int64_t heads) {
  TORCH_CHECK(x.is_contiguous() && x.dim() == 3, "rope_: contiguous [N, heads, D] expected");
  const int64_t n = x.size(0), all = x.size(1), d = x.size(2);
  TORCH_CHECK(heads <= all && cos.size(1) == d, "rope_: shapes disagree");
  auto pos = positions.to(torch::kLong).contiguous();
  const int64_t* pp = pos.data_ptr<int64_t>();
  for (int64_t r = 0; r < n; ++r)
    TORCH_CHECK(pp[r] >= 0 && pp[r] < cos.size(0), "rope_: position ", pp[r], " outside the table");
  rope_rows(x.data_ptr<float>(), cos.data_ptr<float>(), sin.data_ptr<float>(), pp, n, all, d, heads);
}

// gate_up [N, 2m] -> silu(gate) * up [N, m]
void silu_mul_rows(const float* gp, float* yp, int64_t n, int64_t m) {
  const int64_t m2 = 2 * m, m8 = m & ~int64_t(7);
  const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
  at::parallel_for(0, n * m8 / 8, 256, [&](int64_t a, int64_t b) {
    for (int64_t c = a; c < b; ++c) {
      const int64_t r = c * 8 / m8, i = c * 8 % m8;
      const __m256 x = _mm256_loadu_ps(gp + r * m2 + i);
      const __m256 s = _mm256_div_ps(x, _mm256_add_ps(one, exp256(_mm256_sub_ps(zero, x))));
      _mm256_storeu_ps(yp + r * m + i, _mm256_mul_ps(s, _mm256_loadu_ps(gp + r * m2 + m + i)));
    }
  });
  for (int64_t r = 0; r < n; ++r)
    for (int64_t i = m8; i < m; ++i) {
      const float x = gp[r * m2 + i];
      yp[r * m + i] = x / (1.0f + std::exp(-x)) * gp[r * m2 + m + i];
    }
}

torch::Tensor silu_mul(const torch::Tensor& gate_up) {
  auto g = gate_up.contiguous();
  const int64_t m2 = g.size(-1), m = m2 / 2, n = g.numel() / m2;
  auto sizes = g.sizes().vec();
  sizes.back() = m;
  auto y = torch::empty(sizes, g.options());
  silu_mul_rows(g.data_ptr<float>(), y.data_ptr<float>(), n, m);
  return y;
}

TORCH_LIBRARY_FRAGMENT(angelspec, m) {
  m.def("rms_norm(Tensor x, Tensor w, float eps) -> Tensor");
  m.def("rope_(Tensor(a!) x, Tensor cos, Tensor sin, Tensor positions, int heads) -> ()");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
}
TORCH_LIBRARY_IMPL(angelspec, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("rope_", &rope_);
  m.impl("silu_mul", &silu_mul);
}
