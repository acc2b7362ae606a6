// The skinny GEMM algorithm, written once for any vector width. Each .cpp that includes this
// header supplies a vector type V (lanes, zero, load, fma, hsum) compiled for its own ISA; the
// templates live in an anonymous namespace, so every file gets its own private copy.
//
// y[n, o] = sum_i x[n, i] * w[o, i]. Every (row, output) pair is one FMA chain over the input
// in V::lanes-wide steps, then V::hsum, then a scalar tail: the order never depends on how many
// rows share the call, so a verification forward rounds exactly like one-token forwards.
//
// The weights W are float32, or bf16 (uint16_t: a float32's upper half) widened to float32 as they
// are loaded (exactly: a shift), so bf16 weights give bit for bit what the float32 weights of the
// same values give, at half the bytes read; x and every sum stay float32.
#pragma once
#include <stdint.h>

#include "widen.h"

namespace {

template <class V, int R, int C, class W>
inline void tile(const float* x, int64_t ldx, const W* w, int64_t ldw, int64_t in, float* y,
                 int64_t ldy, const W* prefetch) {
  typename V::reg acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = V::zero();
  const int64_t body = in - in % V::lanes;
  for (int64_t i = 0; i < body; i += V::lanes) {
    if (prefetch && (i * sizeof(W)) % 64 == 0)  // one cache line of each next-block row per 64 bytes
      for (int c = 0; c < C; ++c) _mm_prefetch(reinterpret_cast<const char*>(prefetch + c * ldw + i), _MM_HINT_T0);
    typename V::reg wv[C];
    for (int c = 0; c < C; ++c) wv[c] = V::load(w + c * ldw + i);
    for (int r = 0; r < R; ++r) {
      const typename V::reg xv = V::load(x + r * ldx + i);
      for (int c = 0; c < C; ++c) acc[r][c] = V::fma(wv[c], xv, acc[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) {
      float s = V::hsum(acc[r][c]);
      for (int64_t i = body; i < in; ++i) s = __builtin_fmaf(widen(w[c * ldw + i]), x[r * ldx + i], s);
      y[r * ldy + c] = s;
    }
}

// The last `left` (< K) rows in one tile of exactly that many rows: one pass over the block.
template <class V, int K, int C, class W>
inline void rest(const float* x, const W* w, float* y, int64_t left, int64_t in, int64_t out,
                 const W* prefetch) {
  if constexpr (K > 0) {
    if (left == K) return tile<V, K, C>(x, in, w, in, in, y, out, prefetch);
    rest<V, K - 1, C>(x, w, y, left, in, out, prefetch);
  }
}

// All rows of x against C weight rows, R at a time (the rest in one smaller tile); the first
// pass also pulls the next block into L1.
template <class V, int R, int C, class W>
inline void column_block(const float* x, const W* w, float* y, int64_t n, int64_t in,
                         int64_t out) {
  const W* next = w + C * in;
  int64_t r = 0;
  for (; r + R <= n; r += R) tile<V, R, C>(x + r * in, in, w, in, in, y + r * out, out, r == 0 ? next : nullptr);
  rest<V, R - 1, C>(x + r * in, w, y + r * out, n - r, in, out, r == 0 ? next : nullptr);
}

// Weight-row blocks [b0, b1) of C rows each (the last block may be partial).
template <class V, int R, int C, class W>
inline void blocks(const float* x, const W* w, float* y, int64_t n, int64_t in, int64_t out,
                   int64_t b0, int64_t b1) {
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t o = b * C;
    if (o + C <= out) {
      column_block<V, R, C>(x, w + o * in, y + o, n, in, out);
    } else {
      for (int64_t oo = o; oo < out; ++oo) column_block<V, R, 1>(x, w + oo * in, y + oo, n, in, out);
    }
  }
}

}  // namespace
