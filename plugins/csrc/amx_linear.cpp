// y = x @ w.T with bf16 weights on the AMX tile unit: the ops amx_pack (once, at load) and
// amx_linear (every forward). Used for checkpoints whose weights are bf16 (SmolLM2's are): the
// weights are then exactly what the checkpoint holds, read at half the bytes of float32, and
// only the activations entering each matmul are rounded to bf16 (sums, norms, attention and
// the residual stream stay float32). Any row count, row-exact (amx.cpp).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>

#include "layer_rows.h"

void amx_blocks(const uint16_t* x, int64_t n, int64_t in, const uint16_t* w, float* y,
                int64_t out, int64_t b0, int64_t b1);
void amx_to_bf16(const float* x, uint16_t* xb, int64_t count);

namespace {
uint16_t to_bf16(float f) {  // round to nearest even (weights: once, at packing)
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);  // NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

void check_shapes(int64_t out, int64_t in, const char* op) {
  TORCH_CHECK(out % 16 == 0 && in % 32 == 0, op, ": needs out % 16 == 0 and in % 32 == 0, got [",
              out, ", ", in, "]");
}
}  // namespace

namespace {
// CPUID.(7, 0).EDX bits (24: AMX-TILE, 22: AMX-BF16, 25: AMX-INT8) all set, Linux granted this
// process the tile state (asked once), and ANGELSPEC_NO_AMX unset.
bool amx_with(unsigned bits) {
  static const unsigned features = [] {
    if (std::getenv("ANGELSPEC_NO_AMX")) return 0u;
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(d & (1u << 24))) return 0u;
    return syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) == 0 ? d : 0u;
  }();
  return (features & bits) == bits;
}
}  // namespace

// The CPU has AMX-BF16 and Linux granted this process the tile state.
// ANGELSPEC_NO_AMX=1 says no (tests and benchmarks use it to run the paths of CPUs without tiles).
bool amx_available() { return amx_with((1u << 24) | (1u << 22)); }

// Likewise for AMX-INT8 (the w8a8 / w4a8 kernels' tile path, quant_dot.cpp).
bool amx_int8_available() { return amx_with((1u << 24) | (1u << 25)); }

// w [out, in] float -> the same shape in bf16, laid out block by block: 16 outputs x 32 inputs
// per 1 KB block, (output block, input block) order, inputs paired per output (VNNI).
torch::Tensor amx_pack(const torch::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.dtype() == torch::kFloat32, "amx_pack: float32 [out, in] expected");
  const int64_t out = w.size(0), in = w.size(1);
  check_shapes(out, in, "amx_pack");
  auto wc = w.contiguous();
  auto packed = torch::empty({out, in}, w.options().dtype(torch::kBFloat16));
  const float* src = wc.data_ptr<float>();
  auto* dst = reinterpret_cast<uint16_t*>(packed.data_ptr());
  const int64_t kb_n = in / 32;
  at::parallel_for(0, out / 16, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t cb = c0; cb < c1; ++cb)
      for (int64_t kb = 0; kb < kb_n; ++kb)
        for (int64_t p = 0; p < 16; ++p)
          for (int64_t c = 0; c < 16; ++c)
            for (int64_t e = 0; e < 2; ++e)
              dst[((cb * kb_n + kb) * 16 + p) * 32 + c * 2 + e] =
                  to_bf16(src[(cb * 16 + c) * in + kb * 32 + 2 * p + e]);
  });
  return packed;
}

void amx_linear_rows(const float* x, const uint16_t* wp, float* yp, int64_t n, int64_t in, int64_t out) {
  if (n == 0) return;
  // the activations in bf16, padded with zero rows to whole 16-row tiles (a buffer per thread)
  const int64_t n_pad = (n + 15) / 16 * 16;
  static thread_local std::vector<uint16_t> xb;
  if (static_cast<int64_t>(xb.size()) < n_pad * in) xb.resize(n_pad * in);
  amx_to_bf16(x, xb.data(), n * in);
  std::fill(xb.begin() + n * in, xb.begin() + n_pad * in, uint16_t(0));
  const uint16_t* xbp = xb.data();
  at::parallel_for(0, (out / 16 + 3) / 4, 2, [&](int64_t b0, int64_t b1) {
    amx_blocks(xbp, n, in, wp, yp, out, b0, b1);
  });
}

// w as amx_linear takes it, for x of `in` columns.
void check_amx_weight(const torch::Tensor& w, int64_t in) {
  TORCH_CHECK(amx_available(), "amx_linear: this CPU (or kernel) offers no AMX-BF16 tiles");
  TORCH_CHECK(w.dim() == 2 && w.dtype() == torch::kBFloat16 && w.size(1) == in,
              "amx_linear: w packed by amx_pack [out, in] expected, got ", w.sizes(), " for x of ", in, " columns");
  check_shapes(w.size(0), in, "amx_linear");
}

torch::Tensor amx_linear(const torch::Tensor& x, const torch::Tensor& w) {
  TORCH_CHECK(x.dim() == 2 && x.dtype() == torch::kFloat32, "amx_linear: float32 x [n, in] expected");
  check_amx_weight(w, x.size(1));
  const int64_t n = x.size(0), in = x.size(1), out = w.size(0);
  auto y = torch::empty({n, out}, x.options());
  amx_linear_rows(x.contiguous().data_ptr<float>(), reinterpret_cast<const uint16_t*>(w.data_ptr()),
                  y.data_ptr<float>(), n, in, out);
  return y;
}

TORCH_LIBRARY_FRAGMENT(angelspec, m) {
  m.def("amx_pack(Tensor w) -> Tensor");
  m.def("amx_linear(Tensor x, Tensor w) -> Tensor");
  m.def("amx_available() -> bool", &amx_available);
}
TORCH_LIBRARY_IMPL(angelspec, CPU, m) {
  m.impl("amx_pack", &amx_pack);
  m.impl("amx_linear", &amx_linear);
}
