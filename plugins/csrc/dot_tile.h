// Integer dot products for the w8a8 / w4a8 schemes (llama.cpp's Q8_0 / Q4_1 weights times its
// 8-bit activations). Each row of x is rounded to int8 in blocks of 32 (d = max |x| / 127,
// xq = round(x * (127 / max |x|)), and ds = d * sum(xq) for the int4 minima). For each block g
// the dot product I of a weight block with x's block is exact in integers; the float work is
// one chain per (row, output) over the blocks, in block order:
//     acc = fma(float(I) * scale_g, d_g, acc)      then, for int4,  acc = fma(min_g, ds_g, acc)
// Every kernel computes I its own way (the sum of integers does not depend on the order) and
// then these float steps elementwise, one output per vector lane: the result of a row never
// depends on how many rows share the call (a verification forward rounds exactly like one-token
// forwards), nor on the vector width or the integer instructions (AVX2, AVX512-VNNI: the same
// numbers on every CPU with AVX2).
//
// The weights lie in tiles of 16 outputs (linear.py's `tile_for_dot`): for tile t and block g,
// the 16 outputs' scales (float16), then their minima likewise, are contiguous ([out / 16,
// blocks, 16]), and the weights are groups of 64 bytes, each 4 consecutive inputs of the block for
// the 16 outputs (output c's 4 bytes at 4c): the layout of vpdpbusd's operand, so one
// instruction takes 4 inputs of x (broadcast) times 16 outputs. int8: 8 groups per block (inputs
// 4j to 4j + 3 in group j). int4: 4 groups of bytes per block, the low nibbles inputs 4j to 4j + 3
// and the high nibbles 16 + 4j to 19 + 4j.
#pragma once
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

namespace {

constexpr int kBlock = 32, kTile = 16;

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

// x float32 [n, in] -> xq int8 [n, in], d [n, in / 32] and ds [n, in / 32] = d * sum(xq).
inline void quantize_rows(const float* x, int64_t n, int64_t in, int8_t* xq, float* d, float* ds) {
  const int64_t blocks = in / kBlock;
  for (int64_t r = 0; r < n; ++r)
    for (int64_t g = 0; g < blocks; ++g) {
      int32_t sum;
      const __m256i a = quantize_block(x + r * in + g * kBlock, &d[r * blocks + g], &sum);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(xq + r * in + g * kBlock), a);
      ds[r * blocks + g] = d[r * blocks + g] * static_cast<float>(sum);
    }
}

// Bytes of one block of one tile.
constexpr int64_t tile_block_bytes(int bits) { return bits == 8 ? 512 : 256; }

// Blocks ahead of its use that a kernel asks for a tile's weights, scales and minima: a thread's
// tiles are one stream through memory (past a tile's end, the next tile's blocks), and without
// the hint a matmul of a few rows waits on memory, then computes. The weights kFarAhead blocks
// ahead go into L2 as well: more lines in flight (both measured:
// docs/results/design-measurements.md).
constexpr int64_t kAhead = 8, kFarAhead = 32;
// qg: the block's weights; i: its scales' index in scale (and offset: int4 only, else null).
template <int Bits>
inline void fetch_ahead(const uint8_t* qg, const uint16_t* scale, const uint16_t* offset, int64_t i) {
  const char* p = reinterpret_cast<const char*>(qg + kAhead * tile_block_bytes(Bits));
  const char* f = reinterpret_cast<const char*>(qg + kFarAhead * tile_block_bytes(Bits));
  for (int l = 0; l < tile_block_bytes(Bits); l += 64) {
    _mm_prefetch(p + l, _MM_HINT_T0);
    _mm_prefetch(f + l, _MM_HINT_T1);
  }
  _mm_prefetch(reinterpret_cast<const char*>(scale + i + kAhead * kTile), _MM_HINT_T0);
  if constexpr (Bits == 4) _mm_prefetch(reinterpret_cast<const char*>(offset + i + kAhead * kTile), _MM_HINT_T0);
}

// 4 bytes of x as one int32 (to broadcast).
inline int32_t x4(const int8_t* p) {
  int32_t v;
  memcpy(&v, p, 4);
  return v;
}

// The AVX2 kernel: each tile as two halves of 8 outputs (a 256-bit vector: 8 outputs x 4
// inputs), R rows of x at a time. int4: vpmaddubsw (weights 0-15 unsigned times x signed: at
// most 2 * 15 * 127 per 16-bit lane, 8 of them summed before vpmaddwd widens them: no
// saturation); int8: |w| times x with w's sign (at most 2 * 127 * 127), widened each group.
template <int Bits, int R>
inline void dot_half_avx2(const int8_t* xq, const float* d, const float* ds, const uint8_t* q,
                          const uint16_t* scale, const uint16_t* offset, float* y, int64_t in,
                          int64_t out, int64_t t, int h) {
  const int64_t blocks = in / kBlock;
  const __m256i ones = _mm256_set1_epi16(1), low = _mm256_set1_epi8(15);
  const uint8_t* qt = q + t * blocks * tile_block_bytes(Bits) + 32 * h;
  const int64_t so = t * blocks * kTile + 8 * h;  // this half's scales (and minima)
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t g = 0; g < blocks; ++g) {
    const uint8_t* qg = qt + g * tile_block_bytes(Bits);
    if (h == 0) fetch_ahead<Bits>(qg, scale, offset, so + g * kTile);
    __m256i dot[R];
    if constexpr (Bits == 4) {
      __m256i s16[R];
      for (int r = 0; r < R; ++r) s16[r] = _mm256_setzero_si256();
      for (int j = 0; j < 4; ++j) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qg + 64 * j));
        const __m256i lo = _mm256_and_si256(v, low), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
        for (int r = 0; r < R; ++r) {
          const int8_t* xg = xq + r * in + g * kBlock;
          s16[r] = _mm256_add_epi16(s16[r], _mm256_maddubs_epi16(lo, _mm256_set1_epi32(x4(xg + 4 * j))));
          s16[r] = _mm256_add_epi16(s16[r], _mm256_maddubs_epi16(hi, _mm256_set1_epi32(x4(xg + 16 + 4 * j))));
        }
      }
      for (int r = 0; r < R; ++r) dot[r] = _mm256_madd_epi16(s16[r], ones);
    } else {
      for (int r = 0; r < R; ++r) dot[r] = _mm256_setzero_si256();
      for (int j = 0; j < 8; ++j) {
        const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qg + 64 * j));
        const __m256i aw = _mm256_sign_epi8(w, w);
        for (int r = 0; r < R; ++r) {
          const __m256i xv = _mm256_set1_epi32(x4(xq + r * in + g * kBlock + 4 * j));
          dot[r] = _mm256_add_epi32(dot[r], _mm256_madd_epi16(_mm256_maddubs_epi16(aw, _mm256_sign_epi8(xv, w)), ones));
        }
      }
    }
    const __m256 sv = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(scale + so + g * kTile)));
    __m256 mv = _mm256_setzero_ps();
    if constexpr (Bits == 4)
      mv = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(offset + so + g * kTile)));
    for (int r = 0; r < R; ++r) {
      acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(dot[r]), sv), _mm256_set1_ps(d[r * blocks + g]), acc[r]);
      if constexpr (Bits == 4) acc[r] = _mm256_fmadd_ps(mv, _mm256_set1_ps(ds[r * blocks + g]), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm256_storeu_ps(y + r * out + t * kTile + 8 * h, acc[r]);
}

// The signature of the kernels' entry points: tiles [t0, t1), all n rows.
using DotTiles = void (*)(const int8_t*, const float*, const float*, const uint8_t*, const uint16_t*,
                          const uint16_t*, float*, int64_t, int64_t, int64_t, int64_t, int64_t);

template <int Bits>
inline void dot_tiles_avx2(const int8_t* xq, const float* d, const float* ds, const uint8_t* q,
                           const uint16_t* scale, const uint16_t* offset, float* y, int64_t n, int64_t in,
                           int64_t out, int64_t t0, int64_t t1) {
  const int64_t blocks = in / kBlock;
  for (int64_t t = t0; t < t1; ++t)
    for (int h = 0; h < 2; ++h)
      for (int64_t r = 0; r < n;) {
        const int8_t* xr = xq + r * in;
        const float *dr = d + r * blocks, *sr = ds + r * blocks;
        float* yr = y + r * out;
        if (n - r >= 2) {
          dot_half_avx2<Bits, 2>(xr, dr, sr, q, scale, offset, yr, in, out, t, h);
          r += 2;
        } else {
          dot_half_avx2<Bits, 1>(xr, dr, sr, q, scale, offset, yr, in, out, t, h);
          r += 1;
        }
      }
}

}  // namespace
