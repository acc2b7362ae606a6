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

// The instance for `bits` and n x rows, and its weight rows per block (*cols): with 32 vector
// registers, wider tiles than AVX2's, 8 weight rows for one x row, 4 for more.
DotBlocks dot_blocks_vnni(int64_t bits, int64_t n, int64_t* cols) {
  *cols = n == 1 ? 8 : 4;
  return n == 1 ? (bits == 8 ? &dot_blocks<Vnni, 8, 8> : &dot_blocks<Vnni, 4, 8>)
                : (bits == 8 ? &dot_blocks<Vnni, 8, 4> : &dot_blocks<Vnni, 4, 4>);
}
