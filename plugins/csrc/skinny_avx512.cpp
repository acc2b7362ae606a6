// AVX-512 variant of skinny_linear's inner kernel (see skinny_linear.cpp), chosen at run time on
// CPUs that have it. This file includes no torch or standard C++ headers on purpose: it is
// compiled for AVX-512, and an inline function shared with other files could otherwise be linked
// in its AVX-512 form and crash a CPU without it.
#pragma GCC target("avx512f,avx2,fma")
#include <immintrin.h>
#include <stdint.h>

namespace {

// 4 x-rows by 6 weight rows: 24 accumulators + 6 weight + 1 x = 31 of the 32 zmm registers.
constexpr int kRows = 4;
constexpr int kCols = 6;

template <int R, int C>
inline void tile(const float* x, int64_t ldx, const float* w, int64_t ldw, int64_t in, float* y,
                 int64_t ldy, const float* prefetch) {
  __m512 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
  const int64_t in16 = in & ~int64_t(15);
  for (int64_t i = 0; i < in16; i += 16) {
    __m512 wv[C];
    if (prefetch)
      for (int c = 0; c < C; ++c) _mm_prefetch(reinterpret_cast<const char*>(prefetch + c * ldw + i), _MM_HINT_T0);
    for (int c = 0; c < C; ++c) wv[c] = _mm512_loadu_ps(w + c * ldw + i);
    for (int r = 0; r < R; ++r) {
      const __m512 xv = _mm512_loadu_ps(x + r * ldx + i);
      for (int c = 0; c < C; ++c) acc[r][c] = _mm512_fmadd_ps(wv[c], xv, acc[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) {
      float s = _mm512_reduce_add_ps(acc[r][c]);
      for (int64_t i = in16; i < in; ++i) s = __builtin_fmaf(w[c * ldw + i], x[r * ldx + i], s);
      y[r * ldy + c] = s;
    }
}

template <int C>
inline void column_block(const float* x, const float* w, float* y, int64_t n, int64_t in,
                         int64_t out) {
  const float* next = w + C * in;  // the first pass also pulls the next weight block into L1
  int64_t r = 0;
  for (; r + kRows <= n; r += kRows)
    tile<kRows, C>(x + r * in, in, w, in, in, y + r * out, out, r == 0 ? next : nullptr);
  for (; r + 2 <= n; r += 2)
    tile<2, C>(x + r * in, in, w, in, in, y + r * out, out, r == 0 ? next : nullptr);
  for (; r < n; ++r) tile<1, C>(x + r * in, in, w, in, in, y + r * out, out, r == 0 ? next : nullptr);
}

}  // namespace

// Weight-row blocks [b0, b1) of y = x @ w.T; called from skinny_linear's parallel loop.
void skinny_blocks_avx512(const float* x, const float* w, float* y, int64_t n, int64_t in,
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

int64_t skinny_block_cols_avx512() { return kCols; }
