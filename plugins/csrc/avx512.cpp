// AVX-512 instances of the kernel templates (skinny_tile.h, attention_tile.h), chosen at run time
// on CPUs that have it. This file includes no torch or standard C++ headers on purpose: it is
// compiled for AVX-512, and an inline function shared with other files could otherwise be linked
// in its AVX-512 form and crash a CPU without it.
#pragma GCC target("avx512f,avx2,fma")
#include <immintrin.h>
#include <stdint.h>

namespace {
struct V512 {
  using reg = __m512;
  static constexpr int lanes = 16;
  static reg zero() { return _mm512_setzero_ps(); }
  static reg set1(float a) { return _mm512_set1_ps(a); }
  static reg load(const float* p) { return _mm512_loadu_ps(p); }
  static reg load(const uint16_t* p) {  // 16 bf16 -> float32, exactly
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
  static void load32(const uint16_t* p, reg* out) {  // a bf16 chunk (skinny_tile.h) in input order
    const __m512i w = _mm512_loadu_si512(p);
    out[0] = _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
    out[1] = _mm512_castsi512_ps(_mm512_and_si512(w, _mm512_set1_epi32(static_cast<int>(0xffff0000u))));
  }
  static void store(float* p, reg v) { _mm512_storeu_ps(p, v); }
  static reg mul(reg a, reg b) { return _mm512_mul_ps(a, b); }
  static reg fma(reg a, reg b, reg c) { return _mm512_fmadd_ps(a, b, c); }
  static float hsum(reg v) { return _mm512_reduce_add_ps(v); }
};
}  // namespace

#include "attention_tile.h"
#include "skinny_tile.h"
#include "quant_tile.h"

// 4 x-rows by 6 weight rows: 24 accumulators + 6 weight + 1 x = 31 of the 32 zmm registers. One
// row (a decoding step) takes 12 weight rows at a time: more streams in flight from memory, faster
// on out-of-cache matrices (docs/results/design-measurements.md).
constexpr int kCols512 = 6, kRowCols512 = 12;

void skinny_blocks_avx512(const float* x, const float* w, float* y, int64_t n, int64_t in,
                          int64_t out, int64_t b0, int64_t b1) {
  if (n == 1) return blocks<V512, 1, kRowCols512>(x, w, y, n, in, out, b0, b1);
  blocks<V512, 4, kCols512>(x, w, y, n, in, out, b0, b1);
}

void skinny_blocks_bf16_avx512(const float* x, const uint16_t* w, float* y, int64_t n, int64_t in,
                               int64_t out, int64_t b0, int64_t b1) {
  const auto* wc = reinterpret_cast<const Bf16Chunk*>(w);
  if (n == 1) return blocks<V512, 1, kRowCols512>(x, wc, y, n, in, out, b0, b1);
  blocks<V512, 4, kCols512>(x, wc, y, n, in, out, b0, b1);
}

int64_t skinny_block_cols_avx512(int64_t n) { return n == 1 ? kRowCols512 : kCols512; }
int64_t quant_block_cols_avx512() { return kCols512; }

void quant_blocks_avx512(const float* x, const uint8_t* q, const float* scale,
                         const float* offset, float* y, int64_t n, int64_t in, int64_t out,
                         int64_t group, int bits, int64_t b0, int64_t b1, float* buf) {
  quant_blocks<V512, 4, kCols512>(x, q, scale, offset, y, n, in, out, group, bits, b0, b1, buf);
}

void attend_items_avx512(const float* qp, const float* kp, const float* vp, float* op,
                         const int64_t* slots, const int64_t* pos, const int64_t* hi,
                         const int64_t* tbeg, const int64_t* tree, int64_t N, int64_t H,
                         int64_t Hkv, int64_t parts, int64_t M, int64_t D, int64_t window,
                         float scale, int64_t a, int64_t b, float* buf, const float** rows) {
  attend_items<V512>(qp, kp, vp, op, slots, pos, hi, tbeg, tree, N, H, Hkv, parts, M, D, window,
                     scale, a, b, buf, rows);
}

void attend_items_avx512(const float* qp, const uint16_t* kp, const uint16_t* vp, float* op,
                         const int64_t* slots, const int64_t* pos, const int64_t* hi,
                         const int64_t* tbeg, const int64_t* tree, int64_t N, int64_t H,
                         int64_t Hkv, int64_t parts, int64_t M, int64_t D, int64_t window,
                         float scale, int64_t a, int64_t b, float* buf, const uint16_t** rows) {
  attend_items<V512>(qp, kp, vp, op, slots, pos, hi, tbeg, tree, N, H, Hkv, parts, M, D, window,
                     scale, a, b, buf, rows);
}
