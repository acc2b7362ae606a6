// The w8a8 / w4a8 integer dot kernel (dot_tile.h) for CPUs with AVX512-VNNI: a whole tile of 16
// outputs per 512-bit vector, vpdpbusd summing 4 inputs times 16 outputs in one instruction, up
// to 8 rows of x per pass over the tile's weights (one row: two tiles at a time). The integers
// are the same as the AVX2 kernel's, and so are the float steps after them (elementwise, one
// output per lane): the same numbers. Like avx512.cpp, it includes no torch or standard C++ headers (see there).
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")
#include <immintrin.h>
#include <stdint.h>

#include "dot_tile.h"

namespace {
// vpdpbusd multiplies unsigned by signed bytes. int4: the weights (0-15) are the unsigned side.
// int8: x + 128 is (x as unsigned bytes, the sign bit flipped), and I = sum((x + 128) * w) -
// sum(128 * w), the second sum once per tile and block for all rows.
// R rows of x times the T tiles ts, block by block, the tiles' blocks in turn (each tile its own
// chains, as with T = 1).
template <int Bits, int R, int T>
inline void dot_tile_vnni(const int8_t* xq, const float* d, const float* ds, const uint8_t* q,
                          const uint16_t* scale, const uint16_t* offset, float* y, int64_t in,
                          int64_t out, const int64_t* ts) {
  const int64_t blocks = in / kBlock;
  const __m512i low = _mm512_set1_epi8(15), flip = _mm512_set1_epi8(static_cast<char>(0x80));
  const uint8_t* qt[T];
  int64_t so[T];
  __m512 acc[T][R];
  for (int u = 0; u < T; ++u) {
    qt[u] = q + ts[u] * blocks * tile_block_bytes(Bits);
    so[u] = ts[u] * blocks * kTile;
    for (int r = 0; r < R; ++r) acc[u][r] = _mm512_setzero_ps();
  }
  for (int64_t g = 0; g < blocks; ++g)
    for (int u = 0; u < T; ++u) {
      const uint8_t* qg = qt[u] + g * tile_block_bytes(Bits);
      fetch_ahead<Bits>(qg, scale, offset, so[u] + g * kTile);
      __m512i dot[R];
      for (int r = 0; r < R; ++r) dot[r] = _mm512_setzero_si512();
      if constexpr (Bits == 4) {
        for (int j = 0; j < 4; ++j) {
          const __m512i v = _mm512_loadu_si512(qg + 64 * j);
          const __m512i lo = _mm512_and_si512(v, low), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
          for (int r = 0; r < R; ++r) {
            const int8_t* xg = xq + r * in + g * kBlock;
            dot[r] = _mm512_dpbusd_epi32(dot[r], lo, _mm512_set1_epi32(x4(xg + 4 * j)));
            dot[r] = _mm512_dpbusd_epi32(dot[r], hi, _mm512_set1_epi32(x4(xg + 16 + 4 * j)));
          }
        }
      } else {
        __m512i bias = _mm512_setzero_si512();
        for (int j = 0; j < 8; ++j) {
          const __m512i w = _mm512_loadu_si512(qg + 64 * j);
          bias = _mm512_dpbusd_epi32(bias, flip, w);
          for (int r = 0; r < R; ++r) {
            const __m512i xu = _mm512_xor_si512(_mm512_set1_epi32(x4(xq + r * in + g * kBlock + 4 * j)), flip);
            dot[r] = _mm512_dpbusd_epi32(dot[r], xu, w);
          }
        }
        for (int r = 0; r < R; ++r) dot[r] = _mm512_sub_epi32(dot[r], bias);
      }
      const __m512 sv =
          _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(scale + so[u] + g * kTile)));
      __m512 mv = _mm512_setzero_ps();
      if constexpr (Bits == 4)
        mv = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(offset + so[u] + g * kTile)));
      for (int r = 0; r < R; ++r) {
        acc[u][r] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(dot[r]), sv), _mm512_set1_ps(d[r * blocks + g]),
                                    acc[u][r]);
        if constexpr (Bits == 4) acc[u][r] = _mm512_fmadd_ps(mv, _mm512_set1_ps(ds[r * blocks + g]), acc[u][r]);
      }
    }
  for (int u = 0; u < T; ++u)
    for (int r = 0; r < R; ++r) _mm512_storeu_ps(y + r * out + ts[u] * kTile, acc[u][r]);
}

template <int Bits>
void dot_tiles_vnni(const int8_t* xq, const float* d, const float* ds, const uint8_t* q,
                    const uint16_t* scale, const uint16_t* offset, float* y, int64_t n, int64_t in,
                    int64_t out, int64_t t0, int64_t t1) {
  const int64_t blocks = in / kBlock;
  // one row: the two halves of the thread's tiles side by side, two streams from memory (a core
  // reads two streams faster than one; docs/results/design-measurements.md)
  if (n == 1 && t1 - t0 >= 2) {
    const int64_t half = (t1 - t0) / 2;
    for (int64_t i = 0; i < half; ++i) {
      const int64_t ts[2] = {t0 + i, t0 + half + i};
      dot_tile_vnni<Bits, 1, 2>(xq, d, ds, q, scale, offset, y, in, out, ts);
    }
    if ((t1 - t0) % 2) {
      const int64_t last = t1 - 1;
      dot_tile_vnni<Bits, 1, 1>(xq, d, ds, q, scale, offset, y, in, out, &last);
    }
    return;
  }
  for (int64_t t = t0; t < t1; ++t)
    for (int64_t r = 0; r < n;) {
      const int8_t* xr = xq + r * in;
      const float *dr = d + r * blocks, *sr = ds + r * blocks;
      float* yr = y + r * out;
      // every count of rows up to 8 in one pass over the tile (7 rows as 4 + 2 + 1 passes cost
      // nearly as much as 8: the int4 weights are unpacked and the scales read once a pass)
      const int64_t take = n - r < 8 ? n - r : 8;
      switch (take) {
        case 8: dot_tile_vnni<Bits, 8, 1>(xr, dr, sr, q, scale, offset, yr, in, out, &t); break;
        case 7: dot_tile_vnni<Bits, 7, 1>(xr, dr, sr, q, scale, offset, yr, in, out, &t); break;
        case 6: dot_tile_vnni<Bits, 6, 1>(xr, dr, sr, q, scale, offset, yr, in, out, &t); break;
        case 5: dot_tile_vnni<Bits, 5, 1>(xr, dr, sr, q, scale, offset, yr, in, out, &t); break;
        case 4: dot_tile_vnni<Bits, 4, 1>(xr, dr, sr, q, scale, offset, yr, in, out, &t); break;
        case 3: dot_tile_vnni<Bits, 3, 1>(xr, dr, sr, q, scale, offset, yr, in, out, &t); break;
        case 2: dot_tile_vnni<Bits, 2, 1>(xr, dr, sr, q, scale, offset, yr, in, out, &t); break;
        default: dot_tile_vnni<Bits, 1, 1>(xr, dr, sr, q, scale, offset, yr, in, out, &t);
      }
      r += take;
    }
}
}  // namespace

DotTiles dot_tiles_vnni_for(int64_t bits) { return bits == 8 ? &dot_tiles_vnni<8> : &dot_tiles_vnni<4>; }
