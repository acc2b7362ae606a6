// The decoder layer's kernels on raw rows, without torch tensors: each op's file defines its
// own (the torch op checks its arguments, makes them contiguous and calls it), and
// decoder_layer.cpp runs a whole forward through them on buffers it keeps, so a decoding step
// allocates no tensor and makes no framework call per op. The same code either way, so the same
// numbers, bit for bit.
#pragma once
#include <stdint.h>

#include <vector>

// x [n, h] -> x / sqrt(mean(x^2) + eps) * w (elementwise.cpp).
void rms_norm_rows(const float* x, const float* w, float* y, int64_t n, int64_t h, double eps);
// In place on the first `heads` of the `all` heads (d wide) of each of n rows, at positions pos
// of the cos/sin tables [*, d] (elementwise.cpp; positions checked by the caller).
void rope_rows(float* x, const float* cos, const float* sin, const int64_t* pos, int64_t n, int64_t all,
               int64_t d, int64_t heads);
// gate_up [n, 2m] -> silu(gate) * up [n, m] (elementwise.cpp).
void silu_mul_rows(const float* gate_up, float* y, int64_t n, int64_t m);

// y [n, out] = x [n, in] @ w.T for each weight kind (plugins/decoder_layer.py's weight_args):
// float32 or bf16 rows (skinny_linear.cpp), bf16 packed for the tile unit (amx_linear.cpp),
// weight-only int8/int4 (quant_linear.cpp), the same with int8 activations (quant_dot.cpp).
void skinny_linear_rows(const float* x, const void* w, bool bf16, float* y, int64_t n, int64_t in, int64_t out);
void amx_linear_rows(const float* x, const uint16_t* w, float* y, int64_t n, int64_t in, int64_t out);
void quant_linear_rows(const float* x, const uint8_t* q, const float* scale, const float* offset, float* y,
                       int64_t n, int64_t in, int64_t out, int64_t group, int64_t bits);
void quant_dot_linear_rows(const float* x, const uint8_t* q, const uint16_t* scale, const uint16_t* offset,
                           float* y, int64_t n, int64_t in, int64_t out, int64_t bits);
// The same in two steps, for a caller that keeps its threads (decoder_layer.cpp): x rounded to
// int8 once (the calling thread's scratch, valid until its next call), then any range of tiles
// of 16 outputs [t0, t1) on any thread.
using DotKernel = void (*)(const int8_t*, const float*, const float*, const uint8_t*, const uint16_t*,
                           const uint16_t*, float*, int64_t, int64_t, int64_t, int64_t, int64_t);
struct DotInput {
  DotKernel kernel;
  const int8_t* xq;
  const float* d;
  const float* ds;
};
DotInput quant_dot_input(const float* x, int64_t n, int64_t in, int64_t bits);

// Which keys each query row of a forward attends to (attention.cpp's plan_attention builds it
// once a forward from slots, positions and parents; every layer uses it).
struct AttentionPlan {
  std::vector<int64_t> slots, positions;  // per row: its slot, the last position it attends to
  std::vector<int64_t> writes;            // per row: where its key and value go (empty: positions)
  std::vector<int64_t> hi, tbeg, tree;    // a token tree's rows (empty for chains)
  int64_t longest = 0, widest = 0;
  bool is_tree = false;
};
// q [n, H, D], k and v [n, Hkv, D] (this forward's, written into the caches first: float32, or
// bf16 when bf16) -> out [n, H, D] (attention.cpp).
void attend_rows(const AttentionPlan& plan, const float* q, const float* k, const float* v, void* k_cache,
                 void* v_cache, bool bf16, float* out, int64_t H, int64_t Hkv, int64_t M, int64_t D,
                 int64_t window);
// The same in steps, for a caller that keeps its threads: the keys and values written, then the
// work items [a, b) of attention_items(plan, H, Hkv, threads) on any of `threads` threads.
void write_rows_kv(const AttentionPlan& plan, const float* k, const float* v, void* k_cache, void* v_cache,
                   bool bf16, int64_t Hkv, int64_t M, int64_t D);
int64_t attention_items(const AttentionPlan& plan, int64_t H, int64_t Hkv, int64_t threads);
void attend_rows_range(const AttentionPlan& plan, const float* q, const void* k_cache, const void* v_cache,
                       bool bf16, float* out, int64_t H, int64_t Hkv, int64_t M, int64_t D, int64_t window,
                       int64_t threads, int64_t a, int64_t b);
