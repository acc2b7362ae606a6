// The w8a8 / w4a8 integer dot kernel (dot_tile.h) on the AMX-INT8 tile unit, for calls of many
// rows (quant_dot.cpp's amx_rows): one tile product gives a block's integer sums I for 16 rows x
// 16 outputs at once (TDPBSUD: x signed times int4 weights 0-15 unsigned; TDPBSSD: both signed
// for int8), where vnni.cpp spends 8 instructions per row. The weights' layout is already the
// tile's (8 groups of 4 inputs x 16 outputs per block); int4's nibbles are spread into that
// layout ahead. The integers are exact, so they equal vnni.cpp's, and the float steps after them
// are the same elementwise chain per (row, output): the same numbers as every other kernel,
// row-exact. Like avx512.cpp, it includes no torch or standard C++ headers; it is only called
// after quant_dot.cpp has checked the CPU and asked Linux for tile state (amx_int8_available).
#pragma GCC target("amx-tile,amx-int8,avx512f,avx512bw,avx512vl,avx2,fma,f16c")
#include <immintrin.h>
#include <stdint.h>

#include "dot_tile.h"
#include "amx_tile.h"

namespace {
// Tiles 0-3: int32 sums of 16 rows x 16 outputs (two pairs of blocks); 4 and 5: x's 16 rows of a
// block (32 int8 each); 6 and 7: a block's weights (8 groups of 4 inputs, 16 outputs x 4 bytes
// each), alternating so that one block's loads overlap the product before.
void configure() {
  TileConfig c = {};
  c.palette = 1;
  for (int t = 0; t < 8; ++t) {
    c.rows[t] = t < 6 ? 16 : 8;
    c.colsb[t] = t == 4 || t == 5 ? 32 : 64;
  }
  _tile_loadconfig(&c);
}

// The sums of a block into tile I (0-3): x at a, weights at b (the tile intrinsics
// take tile numbers as literals).
#define BLOCK_SUMS(I, A, B, a, in, b)                   \
  do {                                                  \
    _tile_zero(I);                                      \
    _tile_loadd(A, a, in);                              \
    _tile_loadd(B, b, 64);                              \
    if constexpr (Bits == 4) _tile_dpbsud(I, A, B);     \
    else _tile_dpbssd(I, A, B);                         \
  } while (0)

// Weights of up to kChunk blocks of a tile in the tile's layout, unpacked ahead of the tile
// products (a tile load right after vector stores to the same lines waits for them).
constexpr int64_t kChunk = 32;

// Tile t, blocks [g0, g1) (unpacked at w) for the M (8 or 16) rows from r0 (x, d and ds hold
// zero rows up to a multiple of 16; only the m <= M real rows are stored). From the second chunk
// on, each chain goes on from the float32 value the first left in y: the same steps in order.
template <int Bits, int M>
inline void rows_amx(const int8_t* xq, const float* d, const float* ds, const uint8_t* w,
                     const uint16_t* scale, const uint16_t* offset, float* y, int64_t in,
                     int64_t out, int64_t t, int64_t g0, int64_t g1, int64_t r0, int64_t m,
                     int32_t* sums) {
  const int64_t blocks = in / kBlock, so = t * blocks * kTile;
  __m512 acc[M];
  for (int r = 0; r < M; ++r)
    acc[r] = g0 > 0 && r < m ? _mm512_loadu_ps(y + (r0 + r) * out + t * kTile) : _mm512_setzero_ps();
  // pairs of blocks, their products in tiles 0-1 or 2-3 by turns: pair j + 1's products run
  // while the float steps of pair j (stored from the other two tiles) do
  const int64_t pairs = (g1 - g0 + 1) / 2;
  auto issue = [&](int64_t j) {
    const int64_t g = g0 + 2 * j;
    const int8_t* a = xq + r0 * in + g * kBlock;
    const uint8_t* b = w + (g - g0) * 512;
    const bool two = g + 1 < g1;
    if (j % 2 == 0) {
      BLOCK_SUMS(0, 4, 6, a, in, b);
      if (two) BLOCK_SUMS(1, 5, 7, a + kBlock, in, b + 512);
    } else {
      BLOCK_SUMS(2, 4, 6, a, in, b);
      if (two) BLOCK_SUMS(3, 5, 7, a + kBlock, in, b + 512);
    }
  };
  auto store = [&](int64_t j) {
    int32_t* dst = sums + 512 * (j % 2);
    const bool two = g0 + 2 * j + 1 < g1;
    if (j % 2 == 0) {
      _tile_stored(0, dst, 64);
      if (two) _tile_stored(1, dst + 256, 64);
    } else {
      _tile_stored(2, dst, 64);
      if (two) _tile_stored(3, dst + 256, 64);
    }
  };
  issue(0);
  store(0);
  for (int64_t j = 0; j < pairs; ++j) {
    if (j + 1 < pairs) issue(j + 1);
    for (int64_t g = g0 + 2 * j; g < g0 + 2 * j + 2 && g < g1; ++g) {
      if constexpr (Bits == 8) fetch_ahead<8>(w + (g - g0) * 512, scale, offset, so + g * kTile);
      const int32_t* sg = sums + 512 * (j % 2) + 256 * (g - g0 - 2 * j);
      const __m512 sv = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(scale + so + g * kTile)));
      __m512 mv = _mm512_setzero_ps();
      if constexpr (Bits == 4)
        mv = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(offset + so + g * kTile)));
      for (int r = 0; r < M; ++r) {
        const __m512 s = _mm512_cvtepi32_ps(_mm512_load_si512(sg + 16 * r));
        acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(s, sv), _mm512_set1_ps(d[(r0 + r) * blocks + g]), acc[r]);
        if constexpr (Bits == 4) acc[r] = _mm512_fmadd_ps(mv, _mm512_set1_ps(ds[(r0 + r) * blocks + g]), acc[r]);
      }
    }
    if (j + 1 < pairs) store(j + 1);
  }
  for (int r = 0; r < M; ++r)
    if (r < m) _mm512_storeu_ps(y + (r0 + r) * out + t * kTile, acc[r]);
}

template <int Bits>
void dot_tiles_amx(const int8_t* xq, const float* d, const float* ds, const uint8_t* q,
                   const uint16_t* scale, const uint16_t* offset, float* y, int64_t n, int64_t in,
                   int64_t out, int64_t t0, int64_t t1) {
  alignas(64) uint8_t wb[kChunk * 512];
  alignas(64) int32_t sums[4 * 16 * 16];
  const __m512i low = _mm512_set1_epi8(15);
  const int64_t blocks = in / kBlock;
  configure();
  for (int64_t t = t0; t < t1; ++t)
    for (int64_t g0 = 0, so = t * blocks * kTile; g0 < blocks; g0 += kChunk) {
      const int64_t g1 = g0 + kChunk < blocks ? g0 + kChunk : blocks;
      const uint8_t* w = q + (t * blocks + g0) * tile_block_bytes(Bits);
      if constexpr (Bits == 4) {  // low nibbles: inputs 4j..4j+3 of a block; high: 16+4j..19+4j
        for (int64_t g = 0; g < g1 - g0; ++g) {
          fetch_ahead<Bits>(w + g * 256, scale, offset, so + (g0 + g) * kTile);
          for (int j = 0; j < 4; ++j) {
            const __m512i v = _mm512_loadu_si512(w + g * 256 + 64 * j);
            _mm512_store_si512(wb + g * 512 + 64 * j, _mm512_and_si512(v, low));
            _mm512_store_si512(wb + g * 512 + 64 * (4 + j), _mm512_and_si512(_mm512_srli_epi16(v, 4), low));
          }
        }
        w = wb;
      }
      for (int64_t r0 = 0; r0 < n; r0 += 16) {
        const int64_t m = n - r0 < 16 ? n - r0 : 16;
        if (m > 8) rows_amx<Bits, 16>(xq, d, ds, w, scale, offset, y, in, out, t, g0, g1, r0, m, sums);
        else rows_amx<Bits, 8>(xq, d, ds, w, scale, offset, y, in, out, t, g0, g1, r0, m, sums);
      }
    }
  _tile_release();
}
}  // namespace

DotTiles dot_tiles_amx_for(int64_t bits) { return bits == 8 ? &dot_tiles_amx<8> : &dot_tiles_amx<4>; }
