// y = x @ w.T with weight-only int8 or int4 weights (quant_tile.h): the torch op and its AVX2
// instance; avx512.cpp supplies the AVX-512 one, chosen as skinny_linear chooses.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <vector>

#include "layer_rows.h"
#include "vec.h"
#include "skinny_tile.h"
#include "quant_tile.h"

void quant_blocks_avx512(const float* x, const uint8_t* q, const float* scale,
                         const float* offset, float* y, int64_t n, int64_t in, int64_t out,
                         int64_t group, int bits, int64_t b0, int64_t b1, float* buf);
int64_t quant_block_cols_avx512();

namespace {
constexpr int kCols256 = 3;  // as skinny_linear.cpp

void quant_blocks_avx2(const float* x, const uint8_t* q, const float* scale,
                       const float* offset, float* y, int64_t n, int64_t in, int64_t out,
                       int64_t group, int bits, int64_t b0, int64_t b1, float* buf) {
  quant_blocks<V256, 4, kCols256>(x, q, scale, offset, y, n, in, out, group, bits, b0, b1, buf);
}
}  // namespace

void quant_linear_rows(const float* xp, const uint8_t* qp, const float* sp, const float* op, float* yp,
                       int64_t n, int64_t in, int64_t out, int64_t group, int64_t bits) {
  const int64_t cols = use_avx512() ? quant_block_cols_avx512() : kCols256;
  auto* fn = use_avx512() ? &quant_blocks_avx512 : &quant_blocks_avx2;
  at::parallel_for(0, (out + cols - 1) / cols, 16, [&](int64_t b0, int64_t b1) {
    std::vector<float> buf(cols * in);
    fn(xp, qp, sp, op, yp, n, in, out, group, static_cast<int>(bits), b0, b1, buf.data());
  });
}

// q, scale, offset and bits as quant_linear takes them, for x of `in` columns -> the group size.
int64_t check_quant_weight(const torch::Tensor& q, const torch::Tensor& scale,
                           const std::optional<torch::Tensor>& offset, int64_t bits, int64_t in) {
  TORCH_CHECK(bits == 8 || bits == 4, "quant_linear: bits must be 8 or 4, got ", bits);
  TORCH_CHECK(q.dim() == 2 && scale.dim() == 2 && scale.dtype() == torch::kFloat32,
              "quant_linear: q [out, in or in/2] and float32 scale [out, groups] expected");
  TORCH_CHECK(q.dtype() == (bits == 8 ? torch::kInt8 : torch::kUInt8),
              "quant_linear: ", bits == 8 ? "int8" : "uint8", " q expected for ", bits, " bits");
  TORCH_CHECK((bits == 4) == offset.has_value(), "quant_linear: an offset goes with 4 bits, and only");
  const int64_t out = q.size(0);
  TORCH_CHECK(q.size(1) * (bits == 8 ? 1 : 2) == in, "quant_linear: q ", q.sizes(),
              " does not match x's ", in, " columns");
  TORCH_CHECK(scale.size(0) == out && scale.size(1) > 0 && in % scale.size(1) == 0 &&
                  (bits == 8 || (in / scale.size(1)) % 32 == 0),
              "quant_linear: scale ", scale.sizes(), " must be [out, groups] (4 bits: groups of a ",
              "multiple of 32 weights)");
  if (offset)
    TORCH_CHECK(offset->sizes() == scale.sizes() && offset->dtype() == torch::kFloat32,
                "quant_linear: offset must be float32 like scale ", scale.sizes());
  return in / scale.size(1);
}

// x float32 [n, in]; q int8 [out, in] (bits 8) or uint8 [out, in / 2] (bits 4: quant_tile.h's
// layout); scale float32 [out, in / group]; offset (bits 4 only, required) like scale.
torch::Tensor quant_linear(const torch::Tensor& x, const torch::Tensor& q, const torch::Tensor& scale,
                           const std::optional<torch::Tensor>& offset, int64_t bits) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && x.dim() == 2, "quant_linear: x float32 [n, in] expected");
  const int64_t group = check_quant_weight(q, scale, offset, bits, x.size(1));
  const int64_t n = x.size(0), in = x.size(1), out = q.size(0);
  torch::Tensor oc;
  if (offset) oc = offset->contiguous();
  auto xc = x.contiguous();
  auto qc = q.contiguous();
  auto sc = scale.contiguous();
  auto y = torch::empty({n, out}, xc.options());
  quant_linear_rows(xc.data_ptr<float>(), static_cast<const uint8_t*>(qc.data_ptr()), sc.data_ptr<float>(),
                    offset ? oc.data_ptr<float>() : nullptr, y.data_ptr<float>(), n, in, out, group, bits);
  return y;
}

TORCH_LIBRARY_FRAGMENT(angelspec, m) {
  m.def("quant_linear(Tensor x, Tensor q, Tensor scale, Tensor? offset, int bits) -> Tensor");
}
TORCH_LIBRARY_IMPL(angelspec, CPU, m) {
  m.impl("quant_linear", &quant_linear);
}
