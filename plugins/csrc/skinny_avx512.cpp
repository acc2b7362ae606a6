// AVX-512 instance of the skinny GEMM (skinny_tile.h), chosen at run time on CPUs that have it.
// This file includes no torch or standard C++ headers on purpose: it is compiled for AVX-512, and
// an inline function shared with other files could otherwise be linked in its AVX-512 form and
// crash a CPU without it.
#pragma GCC target("avx512f,avx2,fma")
#include <immintrin.h>
#include <stdint.h>

#include "skinny_tile.h"

namespace {
struct V512 {
  using reg = __m512;
  static constexpr int lanes = 16;
  static reg zero() { return _mm512_setzero_ps(); }
  static reg load(const float* p) { return _mm512_loadu_ps(p); }
  static reg fma(reg a, reg b, reg c) { return _mm512_fmadd_ps(a, b, c); }
  static float hsum(reg v) { return _mm512_reduce_add_ps(v); }
};
}  // namespace

// 4 x-rows by 6 weight rows: 24 accumulators + 6 weight + 1 x = 31 of the 32 zmm registers.
constexpr int kCols512 = 6;

void skinny_blocks_avx512(const float* x, const float* w, float* y, int64_t n, int64_t in,
                          int64_t out, int64_t b0, int64_t b1) {
  blocks<V512, 4, kCols512>(x, w, y, n, in, out, b0, b1);
}

int64_t skinny_block_cols_avx512() { return kCols512; }
