// One float32 or bf16 value (uint16_t: a float32's upper half) as float32, exactly. No torch or
// standard C++ headers: avx512.cpp includes this file too.
#pragma once
#include <stdint.h>

namespace {
inline float widen(float w) { return w; }
inline float widen(uint16_t w) {
  const uint32_t u = static_cast<uint32_t>(w) << 16;
  float f;
  __builtin_memcpy(&f, &u, 4);
  return f;
}
}  // namespace
