// The skinny GEMM algorithm, written once for any vector width. Each .cpp that includes this
// header supplies a vector type V (lanes, zero, load, fma, hsum) compiled for its own ISA; the
// templates live in an anonymous namespace, so every file gets its own private copy.
//
// y[n, o] = sum_i x[n, i] * w[o, i]. Every (row, output) pair is one FMA chain over the input
// in V::lanes-wide steps, then V::hsum, then a scalar tail: the order never depends on how many
// rows share the call, so a verification forward rounds exactly like one-token forwards.
//
// The weights W are float32, or bf16 (Bf16Chunk: a float32's upper half) widened to float32 as
// they are loaded (exactly: a shift or a mask), so bf16 weights give bit for bit what the float32
// weights of the same values give, at half the bytes read; x and every sum stay float32. A bf16
// row is stored in chunks of 32 inputs, each as 16 pairs (input j, input 16 + j) in one 32-bit
// word (plugins.linear.Bf16Weight): a 64-byte load then widens to inputs 0-15 (the words shifted
// left) and 16-31 (the words masked) in order, with no shuffle; the last in % 32 inputs are
// stored in order, and each output's FMA chain is exactly the float32 kernel's.
#pragma once
#include <stdint.h>

#include "widen.h"

namespace {

struct Bf16Chunk {  // one stored bf16 weight of a chunked row (above)
  uint16_t bits;
};

// One cache line of each of C rows at input i: into L1 from `prefetch` (the next block), into L2
// from `far` (kFar blocks ahead).
template <int C, class W>
inline void fetch_rows(const W* prefetch, const W* far, int64_t ldw, int64_t i) {
  for (int c = 0; c < C; ++c) {
    _mm_prefetch(reinterpret_cast<const char*>(prefetch + c * ldw + i), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(far + c * ldw + i), _MM_HINT_T1);
  }
}

// Lane-wide steps over the inputs [from, in - in % V::lanes) of weights stored in order, then
// each accumulator's horizontal sum and the scalar tail, into y. prefetch / far (or null): the
// same rows one block / kFar blocks ahead, pulled into L1 / L2 a cache line per 64 bytes.
template <class V, int R, int C, class W>
inline void steps(typename V::reg (&acc)[R][C], const float* x, int64_t ldx, const W* w, int64_t ldw,
                  int64_t from, int64_t in, float* y, int64_t ldy, const W* prefetch, const W* far) {
  const int64_t body = in - in % V::lanes;
  for (int64_t i = from; i < body; i += V::lanes) {
    if (prefetch && (i * sizeof(W)) % 64 == 0) fetch_rows<C>(prefetch, far, ldw, i);
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

template <class V, int R, int C, class W>
inline void tile(const float* x, int64_t ldx, const W* w, int64_t ldw, int64_t in, float* y,
                 int64_t ldy, const W* prefetch, const W* far) {
  typename V::reg acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = V::zero();
  steps<V>(acc, x, ldx, w, ldw, 0, in, y, ldy, prefetch, far);
}

// The same for chunked bf16 rows: per chunk and weight row, 32 / V::lanes registers in input
// order (V::load32), each multiplied into every row's accumulator in that order; the inputs
// after the last chunk (stored in order) as above.
template <class V, int R, int C>
inline void tile(const float* x, int64_t ldx, const Bf16Chunk* wc, int64_t ldw, int64_t in, float* y,
                 int64_t ldy, const Bf16Chunk* prefetch, const Bf16Chunk* far) {
  constexpr int S = 32 / V::lanes;
  const uint16_t* w = &wc->bits;
  typename V::reg acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = V::zero();
  const int64_t chunks = in - in % 32;
  for (int64_t i = 0; i < chunks; i += 32) {
    if (prefetch) fetch_rows<C>(prefetch, far, ldw, i);  // a chunk is one cache line of each row
    for (int c = 0; c < C; ++c) {
      typename V::reg wv[S];
      V::load32(w + c * ldw + i, wv);
      for (int r = 0; r < R; ++r)
        for (int s = 0; s < S; ++s) acc[r][c] = V::fma(wv[s], V::load(x + r * ldx + i + s * V::lanes), acc[r][c]);
    }
  }
  steps<V>(acc, x, ldx, w, ldw, chunks, in, y, ldy, static_cast<const uint16_t*>(nullptr),
           static_cast<const uint16_t*>(nullptr));
}

// The last `left` (< K) rows in one tile of exactly that many rows: one pass over the block.
template <class V, int K, int C, class W>
inline void rest(const float* x, const W* w, float* y, int64_t left, int64_t in, int64_t out,
                 const W* prefetch, const W* far) {
  if constexpr (K > 0) {
    if (left == K) return tile<V, K, C>(x, in, w, in, in, y, out, prefetch, far);
    rest<V, K - 1, C>(x, w, y, left, in, out, prefetch, far);
  }
}

// How far ahead the first pass over a block fetches weight rows: the next block into L1, and the
// block kFar ahead into L2 (more lines in flight than the hardware prefetcher keeps for short
// rows; docs/results/design-measurements.md). Fetching past the matrix's end is
// harmless: a prefetch never faults.
constexpr int64_t kFar = 4;

// All rows of x against C weight rows, R at a time (the rest in one smaller tile); the first
// pass also fetches the rows ahead.
template <class V, int R, int C, class W>
inline void column_block(const float* x, const W* w, float* y, int64_t n, int64_t in,
                         int64_t out) {
  const W* next = w + C * in;
  const W* far = w + kFar * C * in;
  int64_t r = 0;
  for (; r + R <= n; r += R)
    tile<V, R, C>(x + r * in, in, w, in, in, y + r * out, out, r == 0 ? next : nullptr, far);
  rest<V, R - 1, C>(x + r * in, w, y + r * out, n - r, in, out, r == 0 ? next : nullptr, far);
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
