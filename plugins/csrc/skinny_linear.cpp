// y = x @ w.T for few rows (decode and verification forwards): the torch op and its AVX2 kernel.
// w is float32, or bf16 in chunked rows (skinny_tile.h; CPUs without AMX tiles serve bf16 weights
// so: half the bytes, and bit for bit the float32 kernel's result on the same weight values).
//
// Why our own kernel: on these CPUs the BLAS routine picked for 2-16 rows costs ~2x the 1-row one,
// although the weights (the real cost) are read once either way. Here every weight block is
// loaded once and reused for all rows, and each output's summation order is fixed
// (skinny_tile.h), so a row's result does not depend on how many other rows share the call.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include "layer_rows.h"
#include "vec.h"
#include "skinny_tile.h"

void skinny_blocks_avx512(const float* x, const float* w, float* y, int64_t n, int64_t in,
                          int64_t out, int64_t b0, int64_t b1);
void skinny_blocks_bf16_avx512(const float* x, const uint16_t* w, float* y, int64_t n, int64_t in,
                               int64_t out, int64_t b0, int64_t b1);
int64_t skinny_block_cols_avx512(int64_t n);

namespace {
// 4 x-rows by 3 weight rows: 12 accumulators + 3 weight + 1 x = all 16 ymm registers (among
// 2x4, 3x4, 2x6, 6x2 and 4x3 the most even across 1-16 rows in our measurements).
constexpr int kCols256 = 3;

void skinny_blocks_avx2(const float* x, const float* w, float* y, int64_t n, int64_t in,
                        int64_t out, int64_t b0, int64_t b1) {
  blocks<V256, 4, kCols256>(x, w, y, n, in, out, b0, b1);
}

void skinny_blocks_bf16_avx2(const float* x, const uint16_t* w, float* y, int64_t n, int64_t in,
                             int64_t out, int64_t b0, int64_t b1) {
  blocks<V256, 4, kCols256>(x, reinterpret_cast<const Bf16Chunk*>(w), y, n, in, out, b0, b1);
}

template <class W>
void run(const float* x, const W* w, float* y, int64_t n, int64_t in, int64_t out,
         void (*avx2)(const float*, const W*, float*, int64_t, int64_t, int64_t, int64_t, int64_t),
         void (*avx512)(const float*, const W*, float*, int64_t, int64_t, int64_t, int64_t, int64_t)) {
  const int64_t cols = use_avx512() ? skinny_block_cols_avx512(n) : kCols256;
  auto* fn = use_avx512() ? avx512 : avx2;
  at::parallel_for(0, (out + cols - 1) / cols, 16, [&](int64_t b0, int64_t b1) {
    fn(x, w, y, n, in, out, b0, b1);
  });
}

}  // namespace

void skinny_linear_rows(const float* x, const void* w, bool bf16, float* y, int64_t n, int64_t in, int64_t out) {
  if (bf16)
    run(x, static_cast<const uint16_t*>(w), y, n, in, out, &skinny_blocks_bf16_avx2, &skinny_blocks_bf16_avx512);
  else
    run(x, static_cast<const float*>(w), y, n, in, out, &skinny_blocks_avx2, &skinny_blocks_avx512);
}

// w as skinny_linear takes it, for x of `in` columns.
void check_skinny_weight(const torch::Tensor& w, int64_t in) {
  TORCH_CHECK(w.dtype() == torch::kFloat32 || w.dtype() == torch::kBFloat16,
              "skinny_linear: float32 or bfloat16 w expected, got ", w.dtype());
  TORCH_CHECK(w.dim() == 2 && w.size(1) == in, "skinny_linear: w [out, in] expected for x of ", in,
              " columns, got ", w.sizes());
}

torch::Tensor skinny_linear(const torch::Tensor& x, const torch::Tensor& w) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && x.dim() == 2, "skinny_linear: float32 x [n, in] expected, got ",
              x.dtype(), " ", x.sizes());
  check_skinny_weight(w, x.size(1));
  auto xc = x.contiguous();
  auto wc = w.contiguous();
  const int64_t n = xc.size(0), in = xc.size(1), out = wc.size(0);
  auto y = torch::empty({n, out}, xc.options());
  skinny_linear_rows(xc.data_ptr<float>(), wc.data_ptr(), wc.dtype() == torch::kBFloat16, y.data_ptr<float>(), n,
                     in, out);
  return y;
}

TORCH_LIBRARY_FRAGMENT(angelspec, m) {
  m.def("skinny_linear(Tensor x, Tensor w) -> Tensor");
}
TORCH_LIBRARY_IMPL(angelspec, CPU, m) {
  m.impl("skinny_linear", &skinny_linear);
}
