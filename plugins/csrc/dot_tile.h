// Integer dot products for the w8a8 / w4a8 schemes (llama.cpp's Q8_0 / Q4_1 weights times its
// 8-bit activations). Each row of x is rounded to int8 in blocks of 32 (d = max |x| / 127,
// xq = round(x * (127 / max |x|)), and d * sum(xq) for the int4 minima); every block's dot
// product with a weight block is exact in integers (vpmaddubsw, vpmaddwd), and the float work is
// one FMA chain per (row, output) over the blocks, then one horizontal sum and the minima's
// term: the order never depends on how many rows share the call, so a verification forward
// rounds exactly like one-token forwards. Integer steps are exact and the float steps are the
// same instructions on every CPU with AVX2: these schemes give the same numbers on AVX2 and
// AVX-512 machines. The integer step is a policy (Madd here; vnni.cpp has one instruction, the
// same integers, for CPUs with AVX512-VNNI).
//
// int4 blocks go two at a time: one 32-byte load holds blocks g and g + 1 (16 bytes each, weight
// j < 16 in byte j's low nibble, 16 + j in its high nibble: quant_tile.h's layout), so the low
// nibbles are weights 0-15 of both blocks and the high nibbles weights 16-31 of both. x is
// stored in that order ("paired"): for each pair, x[g][0:16] x[g+1][0:16], then x[g][16:32]
// x[g+1][16:32]; its scales as [d_g] * 4 + [d_g+1] * 4. An odd last block is stored plainly,
// its scale 8 times. The weights' scales and minima are float16 (F16C: every AVX2 CPU has it).
#pragma once
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

namespace {

constexpr int kBlock = 32;

// The int32 sums of four adjacent products of unsigned and signed bytes, in each 32-bit lane,
// over one pair (dot) or two pairs (dot2) of vectors: exact (no product sum exceeds int16 here).
struct Madd {
  static __m256i dot(__m256i u, __m256i s) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
  }
  static __m256i dot2(__m256i u, __m256i s, __m256i u2, __m256i s2) {
    return _mm256_madd_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(u, s), _mm256_maddubs_epi16(u2, s2)),
                             _mm256_set1_epi16(1));
  }
};

inline float hsum256(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// 32 floats -> their int8 levels in order, the scale d and the sum of the levels.
inline __m256i quantize_block(const float* p, float* d, int32_t* sum) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 v[4], m = _mm256_setzero_ps();
  for (int j = 0; j < 4; ++j) {
    v[j] = _mm256_loadu_ps(p + 8 * j);
    m = _mm256_max_ps(m, _mm256_andnot_ps(sign, v[j]));
  }
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  h = _mm_max_ss(h, _mm_movehdup_ps(h));
  const float amax = _mm_cvtss_f32(h);
  *d = amax / 127.0f;
  const __m256 id = _mm256_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
  __m256i i32[4];
  for (int j = 0; j < 4; ++j) i32[j] = _mm256_cvtps_epi32(_mm256_mul_ps(v[j], id));  // nearest even
  const __m256i s = _mm256_add_epi32(_mm256_add_epi32(i32[0], i32[1]), _mm256_add_epi32(i32[2], i32[3]));
  __m128i t = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
  t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4e));
  t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0xb1));
  *sum = _mm_cvtsi128_si32(t);
  // packs interleave 128-bit lanes; the permute puts the four groups of eight back in order
  const __m256i i16a = _mm256_packs_epi32(i32[0], i32[1]), i16b = _mm256_packs_epi32(i32[2], i32[3]);
  return _mm256_permutevar8x32_epi32(_mm256_packs_epi16(i16a, i16b), _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

// Floats of x's scales per row: bits 8, one per block; bits 4, eight per pair of blocks.
inline int64_t scale_stride(int bits, int64_t blocks) { return bits == 8 ? blocks : (blocks + 1) / 2 * 8; }

// x float32 [n, in] -> xq int8 [n, in] (bits 4: paired), d [n, scale_stride] and, for bits 4,
// ds [n, in / 32] = d * sum(xq) per block.
inline void quantize_rows(const float* x, int64_t n, int64_t in, int bits, int8_t* xq, float* d, float* ds) {
  const int64_t blocks = in / kBlock, stride = scale_stride(bits, blocks);
  for (int64_t r = 0; r < n; ++r) {
    const float* xr = x + r * in;
    int8_t* qr = xq + r * in;
    float* dr = d + r * stride;
    for (int64_t g = 0; g < blocks;) {
      float dg[2];
      int32_t sg[2];
      const __m256i a = quantize_block(xr + g * kBlock, &dg[0], &sg[0]);
      if (bits == 8) {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(qr + g * kBlock), a);
        dr[g] = dg[0];
        g += 1;
        continue;
      }
      ds[r * blocks + g] = dg[0] * static_cast<float>(sg[0]);
      if (g + 1 == blocks) {  // an odd last block: plain
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(qr + g * kBlock), a);
        _mm256_storeu_ps(dr + g / 2 * 8, _mm256_set1_ps(dg[0]));
        g += 1;
        continue;
      }
      const __m256i b = quantize_block(xr + (g + 1) * kBlock, &dg[1], &sg[1]);
      ds[r * blocks + g + 1] = dg[1] * static_cast<float>(sg[1]);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(qr + g * kBlock), _mm256_permute2x128_si256(a, b, 0x20));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(qr + g * kBlock + 32), _mm256_permute2x128_si256(a, b, 0x31));
      _mm256_storeu_ps(dr + g / 2 * 8, _mm256_set_m128(_mm_set1_ps(dg[1]), _mm_set1_ps(dg[0])));
      g += 2;
    }
  }
}

// R rows of x (quantized) against C weight rows starting at o.
template <class Dot, int Bits, int R, int C>
inline void dot_tile(const int8_t* xq, const float* d, const float* ds, const uint8_t* q,
                     const uint16_t* scale, const uint16_t* offset, float* y, int64_t in, int64_t out,
                     int64_t o) {
  const int64_t blocks = in / kBlock, stride = scale_stride(Bits, blocks);
  __m256 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm256_setzero_ps();
  if constexpr (Bits == 8) {
    for (int64_t g = 0; g < blocks; ++g) {
      if ((g & 1) == 0)  // the next C rows' cache line at this column (the prefetcher lags)
        for (int c = 0; c < C; ++c) _mm_prefetch(reinterpret_cast<const char*>(q + (o + c + C) * in + g * kBlock), _MM_HINT_T0);
      for (int c = 0; c < C; ++c) {
        const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + (o + c) * in + g * kBlock));
        const __m256i aw = _mm256_sign_epi8(w, w);
        const __m256 sv = _mm256_set1_ps(_cvtsh_ss(scale[(o + c) * blocks + g]));
        for (int r = 0; r < R; ++r) {
          const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + r * in + g * kBlock));
          const __m256 p = _mm256_cvtepi32_ps(Dot::dot(aw, _mm256_sign_epi8(xv, w)));
          acc[r][c] = _mm256_fmadd_ps(_mm256_mul_ps(p, sv), _mm256_broadcast_ss(d + r * stride + g), acc[r][c]);
        }
      }
    }
  } else {
    const __m128i low128 = _mm_set1_epi8(15);
    const __m256i low = _mm256_set1_epi8(15);
    const __m256i spread = _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1);
    int64_t g = 0;
    for (; g + 2 <= blocks; g += 2) {
      if ((g & 3) == 0)  // the next C rows' cache line at this column (the prefetcher lags)
        for (int c = 0; c < C; ++c) _mm_prefetch(reinterpret_cast<const char*>(q + (o + c + C) * (in / 2) + g * 16), _MM_HINT_T0);
      for (int c = 0; c < C; ++c) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + (o + c) * (in / 2) + g * 16));
        const __m256i lo = _mm256_and_si256(v, low), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
        int32_t s2;
        memcpy(&s2, scale + (o + c) * blocks + g, 4);
        const __m256 sv = _mm256_permutevar8x32_ps(_mm256_castps128_ps256(_mm_cvtph_ps(_mm_cvtsi32_si128(s2))), spread);
        for (int r = 0; r < R; ++r) {
          const int8_t* xr = xq + r * in + g * kBlock;
          const __m256 p = _mm256_cvtepi32_ps(
              Dot::dot2(lo, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xr)),
                        hi, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xr + 32))));
          acc[r][c] = _mm256_fmadd_ps(_mm256_mul_ps(p, sv), _mm256_loadu_ps(d + r * stride + g / 2 * 8), acc[r][c]);
        }
      }
    }
    if (g < blocks) {  // an odd last block, plain
      for (int c = 0; c < C; ++c) {
        const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + (o + c) * (in / 2) + g * 16));
        const __m256i w = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), low128), _mm_and_si128(v, low128));
        const __m256 sv = _mm256_set1_ps(_cvtsh_ss(scale[(o + c) * blocks + g]));
        for (int r = 0; r < R; ++r) {
          const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + r * in + g * kBlock));
          const __m256 p = _mm256_cvtepi32_ps(Dot::dot(w, xv));
          acc[r][c] = _mm256_fmadd_ps(_mm256_mul_ps(p, sv), _mm256_loadu_ps(d + r * stride + g / 2 * 8), acc[r][c]);
        }
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) {
      float s = hsum256(acc[r][c]);
      if constexpr (Bits == 4) {  // the minima: sum over blocks of offset * d * sum(xq)
        const uint16_t* m = offset + (o + c) * blocks;
        const float* t = ds + r * blocks;
        __m256 a = _mm256_setzero_ps();
        int64_t k = 0;
        for (; k + 8 <= blocks; k += 8)
          a = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(m + k))),
                              _mm256_loadu_ps(t + k), a);
        float u = hsum256(a);
        for (; k < blocks; ++k) u = __builtin_fmaf(_cvtsh_ss(m[k]), t[k], u);
        s += u;
      }
      y[r * out + o + c] = s;
    }
}

// The signature of dot_blocks' instances: quant_dot.cpp picks one (vnni.cpp hands out its own).
using DotBlocks = void (*)(const int8_t*, const float*, const float*, const uint8_t*, const uint16_t*,
                           const uint16_t*, float*, int64_t, int64_t, int64_t, int64_t, int64_t);

// Weight-row blocks [b0, b1) of C rows each (the last block may be partial), all n rows: four at
// a time (each weight block is unpacked once for all of them), then the 3, 2 or 1 left together.
template <class Dot, int Bits, int C>
inline void dot_blocks(const int8_t* xq, const float* d, const float* ds, const uint8_t* q,
                       const uint16_t* scale, const uint16_t* offset, float* y, int64_t n, int64_t in,
                       int64_t out, int64_t b0, int64_t b1) {
  const int64_t blocks = in / kBlock, stride = scale_stride(Bits, blocks);
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t o = b * C;
    for (int64_t r = 0; r < n;) {
      const int8_t* xr = xq + r * in;
      const float* dr = d + r * stride;
      const float* sr = ds ? ds + r * blocks : nullptr;
      float* yr = y + r * out;
      if (o + C > out) {  // a partial last block: its weight rows one by one
        for (int64_t oo = o; oo < out; ++oo) dot_tile<Dot, Bits, 1, 1>(xr, dr, sr, q, scale, offset, yr, in, out, oo);
        r += 1;
        continue;
      }
      const int64_t rows = n - r < 4 ? n - r : 4;
      switch (rows) {
        case 4: dot_tile<Dot, Bits, 4, C>(xr, dr, sr, q, scale, offset, yr, in, out, o); break;
        case 3: dot_tile<Dot, Bits, 3, C>(xr, dr, sr, q, scale, offset, yr, in, out, o); break;
        case 2: dot_tile<Dot, Bits, 2, C>(xr, dr, sr, q, scale, offset, yr, in, out, o); break;
        default: dot_tile<Dot, Bits, 1, C>(xr, dr, sr, q, scale, offset, yr, in, out, o);
      }
      r += rows;
    }
  }
}

}  // namespace
