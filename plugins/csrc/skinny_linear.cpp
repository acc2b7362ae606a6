// y[n, o] = sum_i x[n, i] * w[o, i] for few rows n (decode and verification forwards).
//
// Why our own kernel: on AVX2 CPUs the BLAS routine picked for 2-16 rows costs ~2x the 1-row one,
// although the weights (the real cost) are read once either way. Here every weight block is
// loaded once and reused for all rows, and each output's summation order is fixed (8 FMA lanes
// over the input, then a fixed horizontal sum), so a row's result does not depend on how many
// other rows share the call: a speculative verification forward rounds exactly like a
// one-token forward.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

namespace {
// AVX2 tile of 4 x-rows by 3 weight rows: 12 accumulators + 3 weight + 1 x register = all 16 ymm
// registers (among 2x4, 3x4, 2x6, 6x2 and 4x3 the most even across 1-16 rows here). CPUs with
// AVX-512 use skinny_avx512.cpp instead (twice the lanes and registers).
constexpr int kRows = 4;
constexpr int kCols = 3;

inline float hsum(__m256 v) {
  __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
  __m128 s = _mm_add_ps(lo, hi);                 // 4 lanes
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));        // 2 lanes
  s = _mm_add_ss(s, _mm_movehdup_ps(s));         // 1 lane
  return _mm_cvtss_f32(s);
}

// R rows of x against C rows of w; every (r, c) pair is one independent chain with the same order.
template <int R, int C>
inline void tile(const float* x, int64_t ldx, const float* w, int64_t ldw, int64_t in,
                 float* y, int64_t ldy, const float* prefetch) {
  __m256 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm256_setzero_ps();
  const int64_t in8 = in & ~int64_t(7);
  for (int64_t i = 0; i < in8; i += 8) {
    __m256 wv[C];
    if (prefetch && (i & 15) == 0)
      for (int c = 0; c < C; ++c) _mm_prefetch(reinterpret_cast<const char*>(prefetch + c * ldw + i), _MM_HINT_T0);
    for (int c = 0; c < C; ++c) wv[c] = _mm256_loadu_ps(w + c * ldw + i);
    for (int r = 0; r < R; ++r) {
      __m256 xv = _mm256_loadu_ps(x + r * ldx + i);
      for (int c = 0; c < C; ++c) acc[r][c] = _mm256_fmadd_ps(wv[c], xv, acc[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) {
      float s = hsum(acc[r][c]);
      for (int64_t i = in8; i < in; ++i) s = std::fma(w[c * ldw + i], x[r * ldx + i], s);
      y[r * ldy + c] = s;
    }
}

template <int C>
inline void column_block(const float* x, const float* w, float* y, int64_t n, int64_t in,
                         int64_t out) {
  // the first pass over this weight block also pulls the next block into L1
  const float* next = w + C * in;
  int64_t r = 0;
  for (; r + kRows <= n; r += kRows)
    tile<kRows, C>(x + r * in, in, w, in, in, y + r * out, out, r == 0 ? next : nullptr);
  for (; r + 2 <= n; r += 2)
    tile<2, C>(x + r * in, in, w, in, in, y + r * out, out, r == 0 ? next : nullptr);
  for (; r < n; ++r) tile<1, C>(x + r * in, in, w, in, in, y + r * out, out, r == 0 ? next : nullptr);
}

}  // namespace

void skinny_blocks_avx512(const float* x, const float* w, float* y, int64_t n, int64_t in,
                          int64_t out, int64_t b0, int64_t b1);
int64_t skinny_block_cols_avx512();

namespace {
void skinny_blocks_avx2(const float* x, const float* w, float* y, int64_t n, int64_t in,
                        int64_t out, int64_t b0, int64_t b1) {
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t o = b * kCols;
    if (o + kCols <= out) {
      column_block<kCols>(x, w + o * in, y + o, n, in, out);
    } else {
      for (int64_t oo = o; oo < out; ++oo) column_block<1>(x, w + oo * in, y + oo, n, in, out);
    }
  }
}

// One choice per process: a machine always rounds the same way, whatever the batch.
const bool kUseAvx512 = __builtin_cpu_supports("avx512f");
}  // namespace

torch::Tensor skinny_linear(const torch::Tensor& x, const torch::Tensor& w) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && w.dtype() == torch::kFloat32,
              "skinny_linear: float32 tensors expected");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1),
              "skinny_linear: x [n, in] and w [out, in] expected, got ", x.sizes(), " and ", w.sizes());
  auto xc = x.contiguous();
  auto wc = w.contiguous();
  const int64_t n = xc.size(0), in = xc.size(1), out = wc.size(0);
  auto y = torch::empty({n, out}, xc.options());
  const float* xp = xc.data_ptr<float>();
  const float* wp = wc.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t cols = kUseAvx512 ? skinny_block_cols_avx512() : kCols;
  auto* blocks_fn = kUseAvx512 ? &skinny_blocks_avx512 : &skinny_blocks_avx2;
  at::parallel_for(0, (out + cols - 1) / cols, 16, [&](int64_t b0, int64_t b1) {
    blocks_fn(xp, wp, yp, n, in, out, b0, b1);
  });
  return y;
}

TORCH_LIBRARY_FRAGMENT(angelspec, m) {
  m.def("skinny_linear(Tensor x, Tensor w) -> Tensor");
}
TORCH_LIBRARY_IMPL(angelspec, CPU, m) {
  m.impl("skinny_linear", &skinny_linear);
}
