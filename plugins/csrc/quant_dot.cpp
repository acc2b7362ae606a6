// y = x @ w.T for the w8a8 / w4a8 schemes: int8 or int4 weights in tiles of 16 outputs
// (dot_tile.h's layout, groups of 32 inputs) times x rounded to int8 in blocks of 32, with
// integer dot products. One AVX2 kernel for every CPU; CPUs with AVX512-VNNI run vnni.cpp's (a
// whole tile per vector, one instruction for the integer step), and calls of amx_rows rows or
// more on CPUs with AMX-INT8 amx_int8.cpp's (a block of 16 rows per tile product): the same
// numbers.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <vector>

#include "dot_tile.h"
#include "layer_rows.h"
#include "vec.h"

DotTiles dot_tiles_vnni_for(int64_t bits);
DotTiles dot_tiles_amx_for(int64_t bits);
bool amx_int8_available();

namespace {
// ANGELSPEC_NO_AVX512=1 turns it off with the other AVX-512 kernels.
bool use_vnni() {
  static const bool yes = use_avx512() && __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
  return yes;
}

// From this many rows the tile unit beats VNNI: int8 weights from 8, int4 (whose nibbles VNNI
// takes as they lie) from 16 (docs/results/design-measurements.md).
// ANGELSPEC_NO_AMX=1 turns it off with the bf16 tiles.
int64_t amx_rows(int64_t bits) { return bits == 8 ? 8 : 16; }
}  // namespace

DotInput quant_dot_input(const float* xp, int64_t n, int64_t in, int64_t bits) {
  // x's int8 levels and scales: scratch of the calling thread, reused from call to call; the
  // tile kernel reads whole blocks of 16 rows, so it gets zero rows up to a multiple of 16
  const bool tiles = n >= amx_rows(bits) && use_vnni() && amx_int8_available();
  const DotTiles fn = tiles ? dot_tiles_amx_for(bits) : use_vnni() ? dot_tiles_vnni_for(bits)
                      : bits == 8 ? &dot_tiles_avx2<8> : &dot_tiles_avx2<4>;
  const int64_t blocks = in / kBlock, rows = tiles ? (n + 15) / 16 * 16 : n;
  thread_local std::vector<int8_t> xq_buf;
  thread_local std::vector<float> d_buf;
  xq_buf.resize(rows * in);
  d_buf.resize(2 * rows * blocks);
  int8_t* xqp = xq_buf.data();
  float* dp = d_buf.data();
  float* dsp = dp + rows * blocks;
  std::fill(xqp + n * in, xqp + rows * in, 0);
  std::fill(dp + n * blocks, dp + rows * blocks, 0.0f);
  std::fill(dsp + n * blocks, dsp + rows * blocks, 0.0f);
  at::parallel_for(0, n, 64, [&](int64_t r0, int64_t r1) {
    quantize_rows(xp + r0 * in, r1 - r0, in, xqp + r0 * in, dp + r0 * blocks, dsp + r0 * blocks);
  });
  return {fn, xqp, dp, dsp};
}

void quant_dot_linear_rows(const float* xp, const uint8_t* qp, const uint16_t* sp, const uint16_t* op,
                           float* yp, int64_t n, int64_t in, int64_t out, int64_t bits) {
  const DotInput x = quant_dot_input(xp, n, in, bits);
  at::parallel_for(0, out / kTile, 4, [&](int64_t t0, int64_t t1) {
    x.kernel(x.xq, x.d, x.ds, qp, sp, op, yp, n, in, out, t0, t1);
  });
}

// q, scale, offset and bits as quant_dot_linear takes them, for x of `in` columns.
void check_dot_weight(const torch::Tensor& q, const torch::Tensor& scale, const std::optional<torch::Tensor>& offset,
                      int64_t bits, int64_t in) {
  TORCH_CHECK(bits == 8 || bits == 4, "quant_dot_linear: bits must be 8 or 4, got ", bits);
  TORCH_CHECK(q.dim() == 2 && q.dtype() == (bits == 8 ? torch::kInt8 : torch::kUInt8),
              "quant_dot_linear: q ", bits == 8 ? "int8 [out, in]" : "uint8 [out, in / 2]",
              " expected for ", bits, " bits");
  TORCH_CHECK((bits == 4) == offset.has_value(), "quant_dot_linear: an offset goes with 4 bits, and only");
  const int64_t out = q.size(0);
  TORCH_CHECK(q.size(1) * (bits == 8 ? 1 : 2) == in && in % kBlock == 0, "quant_dot_linear: q ",
              q.sizes(), " does not match x's ", in, " columns (rows of a multiple of 32 weights)");
  TORCH_CHECK(out % kTile == 0, "quant_dot_linear: weights come in tiles of 16 rows, got ", out, " rows");
  TORCH_CHECK(scale.dtype() == torch::kFloat16 && scale.dim() == 2 && scale.size(0) == out &&
                  scale.size(1) == in / kBlock,
              "quant_dot_linear: scale must be float16 [out, in / 32], got ", scale.dtype(), " ", scale.sizes());
  if (offset)
    TORCH_CHECK(offset->sizes() == scale.sizes() && offset->dtype() == torch::kFloat16,
                "quant_dot_linear: offset must be float16 like scale ", scale.sizes());
}

// x float32 [n, in]; q int8 [out, in] (bits 8) or uint8 [out, in / 2] (bits 4), tiled; scale
// float16 [out, in / 32], tiled; offset (bits 4 only, required) like scale. out a multiple of 16.
torch::Tensor quant_dot_linear(const torch::Tensor& x, const torch::Tensor& q, const torch::Tensor& scale,
                               const std::optional<torch::Tensor>& offset, int64_t bits) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && x.dim() == 2, "quant_dot_linear: x float32 [n, in] expected");
  check_dot_weight(q, scale, offset, bits, x.size(1));
  const int64_t n = x.size(0), in = x.size(1), out = q.size(0);
  torch::Tensor oc;
  if (offset) oc = offset->contiguous();
  auto xc = x.contiguous();
  auto qc = q.contiguous();
  auto sc = scale.contiguous();
  auto y = torch::empty({n, out}, xc.options());
  quant_dot_linear_rows(xc.data_ptr<float>(), static_cast<const uint8_t*>(qc.data_ptr()),
                        static_cast<const uint16_t*>(sc.data_ptr()),
                        offset ? static_cast<const uint16_t*>(oc.data_ptr()) : nullptr, y.data_ptr<float>(), n, in,
                        out, bits);
  return y;
}

TORCH_LIBRARY_FRAGMENT(angelspec, m) {
  m.def("quant_dot_linear(Tensor x, Tensor q, Tensor scale, Tensor? offset, int bits) -> Tensor");
}
TORCH_LIBRARY_IMPL(angelspec, CPU, m) {
  m.impl("quant_dot_linear", &quant_dot_linear);
}
