// The decoder layers of a decoding or verification forward (up to SKINNY_MAX_ROWS rows) as one
// op: the same kernels, in the same order, as angelspec/model.py's layer loop calls them one by
// one (so the numbers are the same, bit for bit), without a trip through Python and the
// dispatcher for each of them, and on raw rows (layer_rows.h) in buffers kept from call to call:
// no tensor is made and no framework code runs between two kernels. The arguments are checked
// once a call, the attention's plan (each row's keys) built once for every layer.
#include <torch/extension.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "layer_rows.h"

void check_skinny_weight(const torch::Tensor& w, int64_t in);
void check_amx_weight(const torch::Tensor& w, int64_t in);
int64_t check_quant_weight(const torch::Tensor& q, const torch::Tensor& scale,
                           const std::optional<torch::Tensor>& offset, int64_t bits, int64_t in);
void check_dot_weight(const torch::Tensor& q, const torch::Tensor& scale, const std::optional<torch::Tensor>& offset,
                      int64_t bits, int64_t in);
AttentionPlan plan_attention(const torch::Tensor& slots, const torch::Tensor& positions,
                             const torch::Tensor& parents, int64_t N, int64_t S, int64_t M, int64_t window);
bool check_caches(const torch::Tensor& k_cache, const torch::Tensor& v_cache, int64_t H, int64_t D);

namespace {
// One matmul y = x @ w.T (+ b) as plugins/linear.py's `linear` computes it for few rows; w and
// kind as its `weight_args` gives them: 0 float32 or bf16 rows [w], 1 bf16 packed for the tile
// unit [w], 2 weight-only quantized [q, scale(, offset)], 3 the same with int8 activations.
struct Matmul {
  int64_t kind = 0, in = 0, out = 0, bits = 0, group = 0;
  const void* w = nullptr;
  const void* scale = nullptr;
  const void* offset = nullptr;
  const float* bias = nullptr;
  bool bf16 = false;

  Matmul(at::TensorList t, int64_t kind_, const std::optional<torch::Tensor>& b, int64_t in_) : kind(kind_), in(in_) {
    TORCH_CHECK(!t.empty() && t.size() <= 3, "decoder_layer: 1 to 3 weight tensors a matmul, got ", t.size());
    for (const auto& w : t)
      TORCH_CHECK(w.is_contiguous(), "decoder_layer: weights must be contiguous (plugins.decoder_layer.prepare)");
    out = t[0].size(0);
    if (kind == 0) {
      TORCH_CHECK(t.size() == 1, "decoder_layer: kind 0 takes one weight tensor");
      check_skinny_weight(t[0], in);
      bf16 = t[0].scalar_type() == torch::kBFloat16;
    } else if (kind == 1) {
      TORCH_CHECK(t.size() == 1, "decoder_layer: kind 1 takes one weight tensor");
      check_amx_weight(t[0], in);
    } else {
      TORCH_CHECK(kind == 2 || kind == 3, "decoder_layer: unknown weight kind ", kind);
      bits = t[0].scalar_type() == torch::kInt8 ? 8 : 4;
      const std::optional<torch::Tensor> off = t.size() == 3 ? std::optional<torch::Tensor>(t[2]) : std::nullopt;
      TORCH_CHECK(t.size() >= 2, "decoder_layer: a quantized weight comes as [q, scale(, offset)]");
      if (kind == 2) group = check_quant_weight(t[0], t[1], off, bits, in);
      else check_dot_weight(t[0], t[1], off, bits, in);
      scale = t[1].data_ptr();
      offset = off ? off->data_ptr() : nullptr;
    }
    w = t[0].data_ptr();
    if (b) {
      TORCH_CHECK(b->is_contiguous() && b->scalar_type() == torch::kFloat32 && b->numel() == out,
                  "decoder_layer: a bias is float32 [", out, "], got ", b->scalar_type(), " ", b->sizes());
      bias = b->data_ptr<float>();
    }
  }

  void operator()(const float* x, float* y, int64_t n) const {
    if (kind == 0) {
      skinny_linear_rows(x, w, bf16, y, n, in, out);
    } else if (kind == 1) {
      amx_linear_rows(x, static_cast<const uint16_t*>(w), y, n, in, out);
    } else if (kind == 2) {
      quant_linear_rows(x, static_cast<const uint8_t*>(w), static_cast<const float*>(scale),
                        static_cast<const float*>(offset), y, n, in, out, group, bits);
    } else {
      quant_dot_linear_rows(x, static_cast<const uint8_t*>(w), static_cast<const uint16_t*>(scale),
                            static_cast<const uint16_t*>(offset), y, n, in, out, bits);
    }
    if (bias)
      for (int64_t r = 0; r < n; ++r)
        for (int64_t i = 0; i < out; ++i) y[r * out + i] += bias[i];
  }
};

struct Layer {
  const float* in_norm;
  const float* post_norm;
  std::vector<Matmul> mm;  // qkv, o, gate_up, down
};

const float* norm_weight(const torch::Tensor& w, int64_t hidden) {
  TORCH_CHECK(w.scalar_type() == torch::kFloat32 && w.is_contiguous() && w.numel() == hidden,
              "decoder_layer: norm weights are float32 [", hidden, "], got ", w.scalar_type(), " ", w.sizes());
  return w.data_ptr<float>();
}

// x + y, elementwise, into z (may be x or y): the float add of torch's `x + y`.
void add_rows(const float* x, const float* y, float* z, int64_t count) {
  for (int64_t i = 0; i < count; ++i) z[i] = x[i] + y[i];
}
}  // namespace

// Decoder layers whose weights are checked and taken apart once (plugins/decoder_layer.py's
// prepare_stack makes one per model, `decoder_layer` one per call): `forward` runs a decoding or
// verification forward through all of them. Holds the tensors its pointers point into.
struct DecoderStack : torch::CustomClassHolder {
  std::vector<torch::Tensor> keep;
  std::vector<Layer> layers;
  double eps;
  int64_t hidden = 0, nq, nkv, D, inter = 0;

  // The layers' arguments flattened, layer after layer: norms (in, post), weights (`counts[j]`
  // tensors for matmul j), kinds and biases (qkv, o, gate_up, down); nq query heads and nkv kv
  // heads of head_dim.
  DecoderStack(std::vector<torch::Tensor> norms, double eps_, std::vector<torch::Tensor> weights,
               std::vector<int64_t> counts, std::vector<int64_t> kinds,
               std::vector<std::optional<torch::Tensor>> biases, int64_t nq_, int64_t nkv_, int64_t head_dim)
      : eps(eps_), nq(nq_), nkv(nkv_), D(head_dim) {
    const int64_t n = static_cast<int64_t>(norms.size()) / 2;
    int64_t total = 0;
    for (int64_t c : counts) total += c;
    TORCH_CHECK(n > 0 && static_cast<int64_t>(norms.size()) == 2 * n && static_cast<int64_t>(counts.size()) == 4 * n &&
                    static_cast<int64_t>(kinds.size()) == 4 * n && static_cast<int64_t>(biases.size()) == 4 * n &&
                    total == static_cast<int64_t>(weights.size()),
                "decoder_stack: expected 2 norms, 4 counts, 4 kinds and 4 biases a layer and counts summing to "
                "the weights; got ", norms.size(), " norms, ", counts.size(), " counts, ", kinds.size(), " kinds, ",
                biases.size(), " biases, ", weights.size(), " weights for counts summing to ", total);
    TORCH_CHECK(nq > 0 && nkv > 0 && nq % nkv == 0 && D > 0, "decoder_layer: ", nq, " query heads for ", nkv,
                " kv heads of ", D);
    hidden = norms[0].numel();
    keep = norms;
    keep.insert(keep.end(), weights.begin(), weights.end());
    const at::TensorList w(weights);
    for (int64_t l = 0, at = 0; l < n; ++l) {
      Layer L;
      L.in_norm = norm_weight(norms[2 * l], hidden);
      L.post_norm = norm_weight(norms[2 * l + 1], hidden);
      for (int j = 0; j < 4; ++j) {
        const int64_t in = j == 0 || j == 2 ? hidden : j == 1 ? nq * D : L.mm[2].out / 2;
        L.mm.emplace_back(w.slice(at, counts[4 * l + j]), kinds[4 * l + j], biases[4 * l + j], in);
        if (biases[4 * l + j]) keep.push_back(*biases[4 * l + j]);
        at += counts[4 * l + j];
      }
      TORCH_CHECK(L.mm[0].out == (nq + 2 * nkv) * D && L.mm[1].out == hidden && L.mm[2].out % 2 == 0 &&
                      L.mm[3].out == hidden && (l == 0 || L.mm[2].out == layers[0].mm[2].out),
                  "decoder_layer: layer ", l + 1, "'s matmuls give ", L.mm[0].out, ", ", L.mm[1].out, ", ",
                  L.mm[2].out, ", ", L.mm[3].out, " outputs for ", nq, " + 2 x ", nkv, " heads of ", D,
                  " and hidden size ", hidden);
      layers.push_back(std::move(L));
    }
    inter = layers[0].mm[2].out / 2;
  }

  // x [N, hidden] through every layer, writing this forward's keys and values into each layer's
  // caches (cached_attention's arguments) -> the last layer's output, then the output of layer i
  // (counted from 1) for each i in `capture`, in its order.
  std::vector<torch::Tensor> forward(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin,
                                     const torch::Tensor& rope_positions, at::TensorList k_caches,
                                     at::TensorList v_caches, const torch::Tensor& slots,
                                     const torch::Tensor& positions, const torch::Tensor& parents, int64_t window,
                                     at::IntArrayRef capture) const {
    const int64_t count = static_cast<int64_t>(layers.size());
    TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.size(1) == hidden,
                "decoder_layer: x float32 [N, ", hidden, "] expected, got ", x.scalar_type(), " ", x.sizes());
    TORCH_CHECK(static_cast<int64_t>(k_caches.size()) == count && static_cast<int64_t>(v_caches.size()) == count,
                "decoder_stack: a key and a value cache for each of ", count, " layers, got ", k_caches.size(),
                " and ", v_caches.size());
    const int64_t n = x.size(0);
    const bool bf16 = check_caches(k_caches[0], v_caches[0], nq, D);
    const int64_t S = v_caches[0].size(0), M = v_caches[0].size(2);
    TORCH_CHECK(v_caches[0].size(1) == nkv, "decoder_layer: caches of ", v_caches[0].size(1), " kv heads for ", nkv);
    std::vector<void*> kc(count), vc(count);
    for (int64_t l = 0; l < count; ++l) {
      TORCH_CHECK(check_caches(k_caches[l], v_caches[l], nq, D) == bf16 && v_caches[l].sizes() == v_caches[0].sizes(),
                  "decoder_stack: every layer's caches alike ", v_caches[0].sizes(), ", layer ", l + 1, "'s are ",
                  v_caches[l].sizes());
      kc[l] = k_caches[l].data_ptr();
      vc[l] = v_caches[l].data_ptr();
    }
    TORCH_CHECK(cos.scalar_type() == torch::kFloat32 && sin.scalar_type() == torch::kFloat32 && cos.dim() == 2 &&
                    cos.sizes() == sin.sizes() && cos.size(1) == D && cos.is_contiguous() && sin.is_contiguous(),
                "decoder_layer: cos and sin tables float32 [max_len, ", D, "] expected, got ", cos.sizes());
    auto rp = rope_positions.to(torch::kLong).contiguous();
    TORCH_CHECK(rp.numel() == n, "decoder_layer: one RoPE position per row");
    const int64_t* rpp = rp.data_ptr<int64_t>();
    for (int64_t r = 0; r < n; ++r)
      TORCH_CHECK(rpp[r] >= 0 && rpp[r] < cos.size(0), "rope_: position ", rpp[r], " outside the table");
    for (int64_t c : capture)
      TORCH_CHECK(c >= 1 && c <= count, "decoder_stack: capture names layer ", c, ", not one of 1..", count);
    const AttentionPlan plan = plan_attention(slots, positions, parents, n, S, M, window);

    std::vector<torch::Tensor> out(1 + capture.size());
    out[0] = x.contiguous().clone();
    float* xp = out[0].data_ptr<float>();
    const float *cp = cos.data_ptr<float>(), *sp = sin.data_ptr<float>();
    // the calling thread's buffers, kept from call to call
    const int64_t heads = nq + 2 * nkv;
    const int64_t sizes[] = {n * hidden, n * heads * D, n * nq * D, n * nkv * D, n * nkv * D, n * nq * D,
                             n * hidden, n * 2 * inter, n * inter};
    int64_t total = 0;
    for (int64_t size : sizes) total += size;
    thread_local std::vector<float> buf;
    if (static_cast<int64_t>(buf.size()) < total) buf.resize(total);
    float *h = buf.data(), *qkv = h + sizes[0], *q = qkv + sizes[1], *k = q + sizes[2], *v = k + sizes[3],
          *attn = v + sizes[4], *mid = attn + sizes[5], *up = mid + sizes[6], *act = up + sizes[7];
    for (int64_t l = 0; l < count; ++l) {
      const Layer& L = layers[l];
      rms_norm_rows(xp, L.in_norm, h, n, hidden, eps);
      L.mm[0](h, qkv, n);
      rope_rows(qkv, cp, sp, rpp, n, heads, D, nq + nkv);
      for (int64_t r = 0; r < n; ++r) {  // q, k, v apart, each [n, its heads, D]
        const float* row = qkv + r * heads * D;
        std::memcpy(q + r * nq * D, row, nq * D * sizeof(float));
        std::memcpy(k + r * nkv * D, row + nq * D, nkv * D * sizeof(float));
        std::memcpy(v + r * nkv * D, row + (nq + nkv) * D, nkv * D * sizeof(float));
      }
      attend_rows(plan, q, k, v, kc[l], vc[l], bf16, attn, nq, nkv, M, D, window);
      L.mm[1](attn, mid, n);
      add_rows(xp, mid, mid, n * hidden);
      rms_norm_rows(mid, L.post_norm, h, n, hidden, eps);
      L.mm[2](h, up, n);
      silu_mul_rows(up, act, n, inter);
      L.mm[3](act, xp, n);
      add_rows(mid, xp, xp, n * hidden);
      for (size_t c = 0; c < capture.size(); ++c)
        if (capture[c] == l + 1) out[1 + c] = out[0].clone();
    }
    return out;
  }
};

// One decoder layer (a draft's: plugins/decoder_layer.py's `prepare` gives its weights).
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
  std::vector<torch::Tensor> weights;
  std::vector<int64_t> counts;
  for (at::TensorList m : {qkv, o, gate_up, down}) {
    weights.insert(weights.end(), m.begin(), m.end());
    counts.push_back(static_cast<int64_t>(m.size()));
  }
  const int64_t D = v_cache.dim() == 4 ? v_cache.size(3) : -1;
  const DecoderStack layer({in_norm, post_norm}, eps, weights, counts, kinds.vec(), {qkv_b, o_b, gate_up_b, down_b},
                           nq, nkv, D);
  return layer.forward(x, cos, sin, rope_positions, {k_cache}, {v_cache}, slots, positions, parents, window, {})[0];
}

TORCH_LIBRARY_FRAGMENT(angelspec, m) {
  m.def("decoder_layer(Tensor x, Tensor in_norm, Tensor post_norm, float eps, Tensor[] qkv, "
        "Tensor[] o, Tensor[] gate_up, Tensor[] down, int[] kinds, Tensor? qkv_b, Tensor? o_b, "
        "Tensor? gate_up_b, Tensor? down_b, Tensor cos, Tensor sin, Tensor rope_positions, int nq, "
        "int nkv, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slots, Tensor positions, "
        "Tensor parents, int window) -> Tensor");
  m.class_<DecoderStack>("DecoderStack")
      .def(torch::init<std::vector<torch::Tensor>, double, std::vector<torch::Tensor>, std::vector<int64_t>,
                       std::vector<int64_t>, std::vector<std::optional<torch::Tensor>>, int64_t, int64_t, int64_t>())
      .def("forward", &DecoderStack::forward);
}
TORCH_LIBRARY_IMPL(angelspec, CPU, m) {
  m.impl("decoder_layer", &decoder_layer);
}
