// Weight-only quantized y = x @ w.T, written once for any vector width (like skinny_tile.h, whose
// float32 tiles it reuses): each block of C weight rows is expanded to float32 in an L1-sized
// buffer, w[o, i] = q[o, i] * scale[o, i / group] (one float multiply, so every weight has one
// exact float32 value), and then multiplied exactly as the float32 kernel does. The result is
// the float32 engine on those dequantized weights, row-exact like it: a verification forward
// rounds as one-token forwards do. The weights cross the memory bus as 8 or 4 bits.
#pragma once
#include <immintrin.h>
#include <stdint.h>

namespace {

// Rows [o0, o0 + c) of the quantized matrix, as float32 into buf [c, in] (AVX2 integer
// conversions, available to every file that includes this: all are compiled for AVX2 or more).
// bits 8: q int8 [out, in], symmetric; bits 4: q uint8 [out, in / 2], each 32 weights in 16
// bytes: weight j (j < 16) in byte j's low nibble, weight 16 + j in its high nibble, levels 0-15
// above the group's offset (llama.cpp's Q4_1).
inline void dequant_rows(const uint8_t* q, const float* scale, const float* offset, float* buf,
                         int64_t o0, int64_t c, int64_t in, int64_t group, int bits) {
  const int64_t groups = in / group;
  const __m128i low = _mm_set1_epi8(15);
  for (int64_t r = 0; r < c; ++r) {
    const float* s = scale + (o0 + r) * groups;
    float* b = buf + r * in;
    if (bits == 8) {
      const int8_t* row = reinterpret_cast<const int8_t*>(q) + (o0 + r) * in;
      for (int64_t g = 0; g < groups; ++g) {
        const float sg = s[g];
        const __m256 sv = _mm256_set1_ps(sg);
        int64_t i = g * group;
        for (; i + 8 <= (g + 1) * group; i += 8) {
          const __m128i v = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + i));
          _mm256_storeu_ps(b + i, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v)), sv));
        }
        for (; i < (g + 1) * group; ++i) b[i] = static_cast<float>(row[i]) * sg;
      }
    } else {
      const uint8_t* row = q + (o0 + r) * (in / 2);
      const float* m = offset + (o0 + r) * groups;
      for (int64_t k = 0; k < in / 32; ++k) {
        const __m256 sv = _mm256_set1_ps(s[k * 32 / group]);
        const __m256 mv = _mm256_set1_ps(m[k * 32 / group]);
        const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + k * 16));
        const __m128i halves[2] = {_mm_and_si128(v, low), _mm_and_si128(_mm_srli_epi16(v, 4), low)};
        for (int h = 0; h < 2; ++h)
          for (int e = 0; e < 2; ++e) {
            const __m256i w = _mm256_cvtepu8_epi32(e ? _mm_srli_si128(halves[h], 8) : halves[h]);
            __m256 p = _mm256_mul_ps(_mm256_cvtepi32_ps(w), sv);
            asm("" : "+x"(p));  // no fused multiply-add: two roundings, as plugins/linear.py's
            _mm256_storeu_ps(b + k * 32 + h * 16 + e * 8, _mm256_add_ps(p, mv));
          }
      }
    }
  }
}

// Weight-row blocks [b0, b1) of C rows each; buf holds C * in floats (one per thread).
template <class V, int R, int C>
inline void quant_blocks(const float* x, const uint8_t* q, const float* scale, const float* offset,
                         float* y, int64_t n, int64_t in, int64_t out, int64_t group, int bits,
                         int64_t b0, int64_t b1, float* buf) {
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t o = b * C;
    const int64_t c = o + C <= out ? C : out - o;
    dequant_rows(q, scale, offset, buf, o, c, in, group, bits);
    if (c == C) {
      column_block<V, R, C>(x, buf, y + o, n, in, out);
    } else {
      for (int64_t oo = 0; oo < c; ++oo) column_block<V, R, 1>(x, buf + oo * in, y + o + oo, n, in, out);
    }
  }
}

}  // namespace
