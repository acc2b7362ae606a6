// One decoder layer of a decoding or verification forward (up to SKINNY_MAX_ROWS rows) as one
// op: the same kernels, in the same order, as angelspec/model.py's layer loop calls them one by
// one (so the numbers are the same, bit for bit), without a trip through Python and the
// dispatcher for each of them: at ~10 ms a step, those trips were a tenth of it.
#include <torch/extension.h>

#include <vector>

torch::Tensor skinny_linear(const torch::Tensor& x, const torch::Tensor& w);
torch::Tensor amx_linear(const torch::Tensor& x, const torch::Tensor& w);
torch::Tensor quant_linear(const torch::Tensor& x, const torch::Tensor& q, const torch::Tensor& scale,
                           const std::optional<torch::Tensor>& offset, int64_t bits);
torch::Tensor quant_dot_linear(const torch::Tensor& x, const torch::Tensor& q, const torch::Tensor& scale,
                               const std::optional<torch::Tensor>& offset, int64_t bits);
torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& w, double eps);
void rope_(torch::Tensor x, const torch::Tensor& cos, const torch::Tensor& sin,
           const torch::Tensor& positions, int64_t heads);
torch::Tensor silu_mul(const torch::Tensor& gate_up);
torch::Tensor cached_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                               torch::Tensor k_cache, torch::Tensor v_cache, const torch::Tensor& slots,
                               const torch::Tensor& positions, const torch::Tensor& parents, int64_t window);

namespace {
// y = x @ w.T (+ b) as plugins/linear.py's `linear` computes it for few rows; w and kind as its
// `weight_args` gives them: 0 float32 [w], 1 bf16 packed [w], 2 weight-only quantized [q, scale
// (, offset)], 3 the same with int8 activations.
torch::Tensor matmul(const torch::Tensor& x, at::TensorList w, int64_t kind,
                     const std::optional<torch::Tensor>& b) {
  torch::Tensor y;
  if (kind == 0) {
    y = skinny_linear(x, w[0]);
  } else if (kind == 1) {
    y = amx_linear(x, w[0]);
  } else {
    TORCH_CHECK((kind == 2 || kind == 3) && (w.size() == 2 || w.size() == 3),
                "decoder_layer: unknown weight kind ", kind, " with ", w.size(), " tensors");
    const int64_t bits = w[0].scalar_type() == torch::kInt8 ? 8 : 4;
    const std::optional<torch::Tensor> offset = w.size() == 3 ? std::optional<torch::Tensor>(w[2]) : std::nullopt;
    y = kind == 3 ? quant_dot_linear(x, w[0], w[1], offset, bits) : quant_linear(x, w[0], w[1], offset, bits);
  }
  return b ? y + *b : y;
}
}  // namespace

torch::Tensor decoder_layer(const torch::Tensor& x, const torch::Tensor& in_norm,
                            const torch::Tensor& post_norm, double eps, at::TensorList qkv,
                            at::TensorList o, at::TensorList gate_up, at::TensorList down,
                            at::IntArrayRef kinds, const std::optional<torch::Tensor>& qkv_b,
                            const std::optional<torch::Tensor>& o_b,
                            const std::optional<torch::Tensor>& gate_up_b,
                            const std::optional<torch::Tensor>& down_b, const torch::Tensor& cos,
                            const torch::Tensor& sin, const torch::Tensor& rope_positions, int64_t nq,
                            int64_t nkv, torch::Tensor k_cache, torch::Tensor v_cache,
                            const torch::Tensor& slots, const torch::Tensor& positions,
                            const torch::Tensor& parents, int64_t window) {
  TORCH_CHECK(kinds.size() == 4, "decoder_layer: one weight kind per matmul (qkv, o, gate_up, down)");
  TORCH_CHECK(x.dim() == 2, "decoder_layer: x [N, hidden] expected");
  auto h = matmul(rms_norm(x, in_norm, eps), qkv, kinds[0], qkv_b);
  h = h.view({h.size(0), nq + 2 * nkv, -1});
  rope_(h, cos, sin, rope_positions, nq + nkv);
  auto parts = h.split_with_sizes({nq, nkv, nkv}, 1);
  auto attn = cached_attention(parts[0], parts[1], parts[2], k_cache, v_cache, slots, positions, parents, window);
  auto mid = x + matmul(attn.view({attn.size(0), -1}), o, kinds[1], o_b);
  auto up = matmul(rms_norm(mid, post_norm, eps), gate_up, kinds[2], gate_up_b);
  return mid + matmul(silu_mul(up), down, kinds[3], down_b);
}

// Every layer of a decoding or verification forward in one call: decoder_layer layer after layer,
// without a trip through Python and the dispatcher between them (~7 us a layer on a 2-core
// CPU, a few percent of a one-token step with 4-bit weights). The layers' arguments come
// flattened, layer after layer: norms (in, post), weights (`counts[j]` tensors for matmul j),
// kinds and biases (qkv, o, gate_up, down), one key and one value cache per layer. Returns the
// last layer's output, then the output of layer i (counted from 1) for each i in `capture`, in
// its order.
std::vector<torch::Tensor> decoder_stack(const torch::Tensor& x, at::TensorList norms, double eps,
                                         at::TensorList weights, at::IntArrayRef counts,
                                         at::IntArrayRef kinds,
                                         const c10::List<std::optional<torch::Tensor>>& biases,
                                         const torch::Tensor& cos, const torch::Tensor& sin,
                                         const torch::Tensor& rope_positions, int64_t nq, int64_t nkv,
                                         at::TensorList k_caches, at::TensorList v_caches,
                                         const torch::Tensor& slots, const torch::Tensor& positions,
                                         const torch::Tensor& parents, int64_t window,
                                         at::IntArrayRef capture) {
  const int64_t layers = static_cast<int64_t>(k_caches.size());
  int64_t total = 0;
  for (int64_t c : counts) total += c;
  TORCH_CHECK(static_cast<int64_t>(norms.size()) == 2 * layers && static_cast<int64_t>(v_caches.size()) == layers &&
                  static_cast<int64_t>(counts.size()) == 4 * layers && static_cast<int64_t>(kinds.size()) == 4 * layers &&
                  static_cast<int64_t>(biases.size()) == 4 * layers && total == static_cast<int64_t>(weights.size()),
              "decoder_stack: for ", layers, " layers (key caches) expected 2 norms, 4 counts, 4 kinds and 4 "
              "biases a layer, a value cache each and counts summing to the weights; got ", norms.size(),
              " norms, ", v_caches.size(), " value caches, ", counts.size(), " counts, ", kinds.size(),
              " kinds, ", biases.size(), " biases, ", weights.size(), " weights for counts summing to ", total);
  std::vector<torch::Tensor> out(1 + capture.size());
  std::vector<std::optional<torch::Tensor>> b(biases.begin(), biases.end());
  torch::Tensor h = x;
  for (int64_t l = 0, w = 0; l < layers; ++l) {
    at::TensorList mats[4];
    for (int j = 0; j < 4; ++j) {
      mats[j] = weights.slice(w, counts[4 * l + j]);
      w += counts[4 * l + j];
    }
    h = decoder_layer(h, norms[2 * l], norms[2 * l + 1], eps, mats[0], mats[1], mats[2], mats[3],
                      kinds.slice(4 * l, 4), b[4 * l], b[4 * l + 1], b[4 * l + 2], b[4 * l + 3], cos, sin,
                      rope_positions, nq, nkv, k_caches[l], v_caches[l], slots, positions, parents, window);
    for (size_t c = 0; c < capture.size(); ++c)
      if (capture[c] == l + 1) out[1 + c] = h;
  }
  for (size_t c = 0; c < capture.size(); ++c)
    TORCH_CHECK(out[1 + c].defined(), "decoder_stack: capture names layer ", capture[c], ", not one of 1..", layers);
  out[0] = h;
  return out;
}

TORCH_LIBRARY_FRAGMENT(angelspec, m) {
  m.def("decoder_layer(Tensor x, Tensor in_norm, Tensor post_norm, float eps, Tensor[] qkv, "
        "Tensor[] o, Tensor[] gate_up, Tensor[] down, int[] kinds, Tensor? qkv_b, Tensor? o_b, "
        "Tensor? gate_up_b, Tensor? down_b, Tensor cos, Tensor sin, Tensor rope_positions, int nq, "
        "int nkv, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slots, Tensor positions, "
        "Tensor parents, int window) -> Tensor");
  m.def("decoder_stack(Tensor x, Tensor[] norms, float eps, Tensor[] weights, int[] counts, int[] kinds, "
        "Tensor?[] biases, Tensor cos, Tensor sin, Tensor rope_positions, int nq, int nkv, "
        "Tensor(a!)[] k_caches, Tensor(b!)[] v_caches, Tensor slots, Tensor positions, Tensor parents, "
        "int window, int[] capture) -> Tensor[]");
}
TORCH_LIBRARY_IMPL(angelspec, CPU, m) {
  m.impl("decoder_layer", &decoder_layer);
  m.impl("decoder_stack", &decoder_stack);
}
