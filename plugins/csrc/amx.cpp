// AMX-BF16 instance of the linear kernel: y[n, o] = sum_i x[n, i] * w[o, i] with bf16 weights
// (packed once, amx_linear.cpp) and bf16-rounded activations, summed in fp32 by the tile unit.
// Like avx512.cpp this file includes no torch or standard C++ headers: it is compiled for AMX,
// and is only called after amx_linear.cpp has checked the CPU and asked Linux for tile state.
//
// Row-exact like skinny_tile.h: every output is one chain of TDPBF16PS over the input in
// 32-element blocks, always in the same order, and a tile's rows never mix, so a row's result
// does not depend on how many rows share the call (rows past n are zeros, never stored).
#pragma GCC target("amx-tile,amx-bf16,avx512f,avx512bf16,avx512bw,avx512vl")
#include <immintrin.h>
#include <stdint.h>

#include "amx_tile.h"

namespace {
// Tiles for up to 16 rows: 0-3 fp32 accumulators (16 rows x 16 outputs each), 4 activations
// (16 rows x 32 bf16), 5 and 6 weights (16 pairs of inputs x 16 outputs, VNNI layout: 1 KB per
// block). For 32 rows: 0-3 accumulators of a 2 x 2 block (rows r, outputs c at 2r + c), 4 and 5
// the two row blocks' activations, 6 and 7 the two output blocks' weights: every tile loaded
// feeds two products.
void configure() {
  TileConfig c = {};
  c.palette = 1;
  for (int t = 0; t < 8; ++t) {
    c.rows[t] = 16;
    c.colsb[t] = 64;
  }
  _tile_loadconfig(&c);
}

// Store accumulator tile t (m valid rows of 16 outputs) at dst with row stride out: straight
// into y for a full tile, else through tmp (rows past n are never stored).
inline void store(int t, float* dst, int64_t m, int64_t out, float* tmp) {
  if (m == 16) {
    switch (t) {
      case 0: _tile_stored(0, dst, out * 4); break;
      case 1: _tile_stored(1, dst, out * 4); break;
      case 2: _tile_stored(2, dst, out * 4); break;
      default: _tile_stored(3, dst, out * 4); break;
    }
    return;
  }
  switch (t) {
    case 0: _tile_stored(0, tmp, 64); break;
    case 1: _tile_stored(1, tmp, 64); break;
    case 2: _tile_stored(2, tmp, 64); break;
    default: _tile_stored(3, tmp, 64); break;
  }
  for (int64_t r = 0; r < m; ++r)
    for (int64_t c = 0; c < 16; ++c) dst[r * out + c] = tmp[r * 16 + c];
}

// G (1-4) blocks of 16 outputs starting at block `cb`, for the 16 rows from r0.
template <int G>
void rows16(const uint16_t* x, int64_t n, int64_t in, const uint16_t* w, float* y, int64_t out,
            int64_t cb, int64_t r0, float* tmp) {
  const int64_t kb_n = in / 32;
  const uint16_t* b = w + cb * kb_n * 512;
  _tile_zero(0);
  if constexpr (G > 1) _tile_zero(1);
  if constexpr (G > 2) _tile_zero(2);
  if constexpr (G > 3) _tile_zero(3);
  const uint16_t* a = x + r0 * in;
  for (int64_t kb = 0; kb < kb_n; ++kb) {
    _tile_loadd(4, a + kb * 32, in * 2);
    _tile_loadd(5, b + kb * 512, 64);
    _tile_dpbf16ps(0, 4, 5);
    if constexpr (G > 1) {
      _tile_loadd(6, b + (kb_n + kb) * 512, 64);
      _tile_dpbf16ps(1, 4, 6);
    }
    if constexpr (G > 2) {
      _tile_loadd(5, b + (2 * kb_n + kb) * 512, 64);
      _tile_dpbf16ps(2, 4, 5);
    }
    if constexpr (G > 3) {
      _tile_loadd(6, b + (3 * kb_n + kb) * 512, 64);
      _tile_dpbf16ps(3, 4, 6);
    }
  }
  const int64_t m = n - r0 < 16 ? n - r0 : 16;
  float* dst = y + r0 * out + cb * 16;
  for (int t = 0; t < G; ++t) store(t, dst + 16 * t, m, out, tmp);
}

// 2 blocks of 16 outputs from block `cb`, for the 32 rows from r0 (n - r0 > 16; the activation
// buffer holds zero rows up to a whole 16, so the second row block can always be loaded).
void rows32(const uint16_t* x, int64_t n, int64_t in, const uint16_t* w, float* y, int64_t out,
            int64_t cb, int64_t r0, float* tmp) {
  const int64_t kb_n = in / 32;
  const uint16_t* b = w + cb * kb_n * 512;
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  const uint16_t* a = x + r0 * in;
  for (int64_t kb = 0; kb < kb_n; ++kb) {
    _tile_loadd(4, a + kb * 32, in * 2);
    _tile_loadd(6, b + kb * 512, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_loadd(7, b + (kb_n + kb) * 512, 64);
    _tile_dpbf16ps(1, 4, 7);
    _tile_loadd(5, a + 16 * in + kb * 32, in * 2);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
  const int64_t m = n - r0 - 16 < 16 ? n - r0 - 16 : 16;
  float* dst = y + r0 * out + cb * 16;
  store(0, dst, 16, out, tmp);
  store(1, dst + 16, 16, out, tmp);
  store(2, dst + 16 * out, m, out, tmp);
  store(3, dst + 16 * out + 16, m, out, tmp);
}

// Blocks of 16 outputs from `cb` (G of them) for every row: up to 16 rows one block of G
// outputs wide; more rows in pairs of row blocks two output blocks wide, the weights of those
// outputs (2 x in bf16 values) reused by every pair from cache.
template <int G>
void group(const uint16_t* x, int64_t n, int64_t in, const uint16_t* w, float* y, int64_t out,
           int64_t cb, float* tmp) {
  if (n <= 16) {
    rows16<G>(x, n, in, w, y, out, cb, 0, tmp);
    return;
  }
  for (int64_t c = 0; c < G; c += 2) {
    const int64_t blocks = G - c < 2 ? 1 : 2;
    for (int64_t r0 = 0; r0 < n; r0 += 32) {
      if (blocks == 2 && n - r0 > 16) rows32(x, n, in, w, y, out, cb + c, r0, tmp);
      else if (blocks == 2) rows16<2>(x, n, in, w, y, out, cb + c, r0, tmp);
      else {
        rows16<1>(x, n, in, w, y, out, cb + c, r0, tmp);
        if (n - r0 > 16) rows16<1>(x, n, in, w, y, out, cb + c, r0 + 16, tmp);
      }
    }
  }
}
}  // namespace

// x [count] float -> bf16, round to nearest even (denormals to zero), 16 at a time.
void amx_to_bf16(const float* x, uint16_t* xb, int64_t count) {
  int64_t i = 0;
  for (; i + 16 <= count; i += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(xb + i),
                        (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(x + i)));
  if (i < count) {
    const __mmask16 m = (__mmask16)((1u << (count - i)) - 1);
    _mm256_mask_storeu_epi16(xb + i, m, (__m256i)_mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(m, x + i)));
  }
}

// x [n_pad, in] bf16 (n_pad a multiple of 16, rows >= n zero), w packed by amx_pack, y [n, out]:
// output blocks [b0, b1) of 64 outputs (the last may be narrower).
void amx_blocks(const uint16_t* x, int64_t n, int64_t in, const uint16_t* w, float* y,
                int64_t out, int64_t b0, int64_t b1) {
  alignas(64) float tmp[16 * 16];
  configure();
  const int64_t blocks16 = out / 16;
  for (int64_t g = b0; g < b1; ++g) {
    const int64_t cb = g * 4, left = blocks16 - cb;
    if (left >= 4) group<4>(x, n, in, w, y, out, cb, tmp);
    else if (left == 3) group<3>(x, n, in, w, y, out, cb, tmp);
    else if (left == 2) group<2>(x, n, in, w, y, out, cb, tmp);
    else group<1>(x, n, in, w, y, out, cb, tmp);
  }
  _tile_release();
}
