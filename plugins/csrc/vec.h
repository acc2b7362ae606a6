// Vector types for the kernel templates (skinny_tile.h, attention_tile.h): an AVX2 one here;
// avx512.cpp defines its AVX-512 twin. Static members, so each file keeps its own copy.
#pragma once
#include <immintrin.h>
#include <stdint.h>

#include <cstdlib>

namespace {
struct V256 {
  using reg = __m256;
  static constexpr int lanes = 8;
  static reg zero() { return _mm256_setzero_ps(); }
  static reg set1(float a) { return _mm256_set1_ps(a); }
  static reg load(const float* p) { return _mm256_loadu_ps(p); }
  static reg load(const uint16_t* p) {  // 8 bf16 -> float32, exactly
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
  static void load32(const uint16_t* p, reg* out) {  // a bf16 chunk (skinny_tile.h) in input order
    const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 16));
    const __m256i high = _mm256_set1_epi32(static_cast<int>(0xffff0000u));
    out[0] = _mm256_castsi256_ps(_mm256_slli_epi32(a, 16));
    out[1] = _mm256_castsi256_ps(_mm256_slli_epi32(b, 16));
    out[2] = _mm256_castsi256_ps(_mm256_and_si256(a, high));
    out[3] = _mm256_castsi256_ps(_mm256_and_si256(b, high));
  }
  static void store(float* p, reg v) { _mm256_storeu_ps(p, v); }
  static reg mul(reg a, reg b) { return _mm256_mul_ps(a, b); }
  static reg fma(reg a, reg b, reg c) { return _mm256_fmadd_ps(a, b, c); }
  static float hsum(reg v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }
};

// One choice per process, so a machine always rounds the same way whatever the batch.
// ANGELSPEC_NO_AVX512=1 forces the AVX2 kernels (tests use it to cover both paths on one CPU).
bool use_avx512() {
  static const bool yes = __builtin_cpu_supports("avx512f") && !std::getenv("ANGELSPEC_NO_AVX512");
  return yes;
}
}  // namespace
