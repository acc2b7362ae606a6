// The w8a8 / w4a8 integer dot kernel (dot_tile.h) for CPUs with AVX512-VNNI: vpdpbusd sums four
// byte products per 32-bit lane in one instruction where AVX2 takes vpmaddubsw and vpmaddwd. The
// integers are the same, and so are the float instructions after them: the same numbers as the
// AVX2 instance. Like avx512.cpp, it includes no torch or standard C++ headers (see there).
#pragma GCC target("avx512f,avx512vl,avx512vnni,avx2,fma,f16c")
#include <immintrin.h>
#include <stdint.h>

namespace {
struct Vnni {
  static __m256i dot(__m256i u, __m256i s) { return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s); }
  static __m256i dot2(__m256i u, __m256i s, __m256i u2, __m256i s2) {
    return _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s), u2, s2);
  }
};
}  // namespace

#include "dot_tile.h"

// With 32 vector registers, wider tiles than AVX2's: 8 weight rows for one x row, 4 for more.
int64_t dot_block_cols_vnni(int64_t n) { return n == 1 ? 8 : 4; }

void dot_blocks_vnni(int bits, const int8_t* xq, const float* d, const float* ds, const uint8_t* q,
                     const uint16_t* scale, const uint16_t* offset, float* y, int64_t n, int64_t in,
                     int64_t out, int64_t b0, int64_t b1) {
  auto* fn = n == 1 ? (bits == 8 ? &dot_blocks<Vnni, 8, 8> : &dot_blocks<Vnni, 4, 8>)
                    : (bits == 8 ? &dot_blocks<Vnni, 8, 4> : &dot_blocks<Vnni, 4, 4>);
  fn(xq, d, ds, q, scale, offset, y, n, in, out, b0, b1);
}
