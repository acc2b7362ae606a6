// The decoder layers of a forward with their weights checked and taken apart once
// (decoder_layer.cpp defines them), and the matmul of every weight kind on raw rows: shared by
// DecoderStack and the MTP draft (mtp_draft.cpp).
#pragma once
#include <torch/extension.h>

#include <functional>
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
    add_bias(y, n);
  }

  // Kind 3 in steps (decoder_layer.cpp's one parallel region a forward): the tiles of 16
  // outputs [t0, t1) of y for x as quant_dot_input rounded it, on the calling thread; then the
  // bias, once.
  void tiles(const DotInput& x, float* y, int64_t n, int64_t t0, int64_t t1) const {
    x.kernel(x.xq, x.d, x.ds, static_cast<const uint8_t*>(w), static_cast<const uint16_t*>(scale),
             static_cast<const uint16_t*>(offset), y, n, in, out, t0, t1);
  }

  void add_bias(float* y, int64_t n) const { add_bias(y, n, 0, out); }

  // The bias of outputs [c0, c1) only.
  void add_bias(float* y, int64_t n, int64_t c0, int64_t c1) const {
    if (bias)
      for (int64_t r = 0; r < n; ++r)
        for (int64_t i = c0; i < c1; ++i) y[r * out + i] += bias[i];
  }
};

struct Layer {
  const float* in_norm;
  const float* post_norm;
  std::vector<Matmul> mm;  // qkv, o, gate_up, down
};

inline const float* norm_weight(const torch::Tensor& w, int64_t hidden) {
  TORCH_CHECK(w.scalar_type() == torch::kFloat32 && w.is_contiguous() && w.numel() == hidden,
              "decoder_layer: norm weights are float32 [", hidden, "], got ", w.scalar_type(), " ", w.sizes());
  return w.data_ptr<float>();
}

// Decoder layers whose weights are checked and taken apart once (plugins/decoder_layer.py's
// prepare_stack makes one per model and one per MTP draft layer): `forward` runs a decoding or
// verification forward through all of them. Holds the tensors its pointers point into.
struct DecoderStack : torch::CustomClassHolder {
  std::vector<torch::Tensor> keep;
  std::vector<Layer> layers;
  // The token embeddings (set_embed: forward's x may be token ids), the final norm and the
  // logits' matmul (set_head: forward's `logits`).
  torch::Tensor embed;
  const float* head_norm = nullptr;
  std::vector<Matmul> head;  // none or one
  double eps;
  int64_t hidden = 0, nq, nkv, D, inter = 0;

  // The layers' arguments flattened, layer after layer: norms (in, post), weights (`counts[j]`
  // tensors for matmul j), kinds and biases (qkv, o, gate_up, down); nq query heads and nkv kv
  // heads of head_dim.
  DecoderStack(std::vector<torch::Tensor> norms, double eps_, std::vector<torch::Tensor> weights,
               std::vector<int64_t> counts, std::vector<int64_t> kinds,
               std::vector<std::optional<torch::Tensor>> biases, int64_t nq_, int64_t nkv_, int64_t head_dim);

  // The model's token embeddings (float32 [vocab, hidden]), for forward's token ids.
  void set_embed(const torch::Tensor& table);

  // The model's final norm (float32 [hidden]) and logits' matmul (`weights` of `kind`, as for a
  // layer's), for forward's `logits`.
  void set_head(const torch::Tensor& norm, std::vector<torch::Tensor> weights, int64_t kind);

  // x [N, hidden] (or integer token ids [N], with set_embed's table) through every layer,
  // writing this forward's keys and values into each layer's caches (cached_attention's
  // arguments) -> the last layer's output, then the output of layer i
  // (counted from 1) for each i in `capture`, in its order; with `logits`, then every row's
  // logits (the head of set_head: rms_norm and the matmul, the kernels Llama.head calls).
  std::vector<torch::Tensor> forward(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin,
                                     const torch::Tensor& rope_positions, at::TensorList k_caches,
                                     at::TensorList v_caches, const torch::Tensor& slots,
                                     const torch::Tensor& positions, const torch::Tensor& parents, int64_t window,
                                     at::IntArrayRef capture, bool logits) const;

  // Blocks drafted in one parallel pass (DFly): x [N, hidden] at (slots, positions), whose keys
  // and values are written there first; each row then attends to its slot's keys up to its
  // `ends` entry (its block's last position: the context and its whole block, bidirectionally).
  // RoPE at the rows' own positions -> the last layer's output.
  torch::Tensor forward_blocks(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin,
                               at::TensorList k_caches, at::TensorList v_caches, const torch::Tensor& slots,
                               const torch::Tensor& positions, const torch::Tensor& ends) const;

 private:
  // Every matmul int8 dot products (kind 3) and at most kRegionRows rows: run_region's path.
  bool dot_only = false;
  // A forward's arguments, checked, and the buffers its layers compute in (decoder_layer.cpp).
  struct Pass;
  struct Rows;
  // The layer loop (with the head where the pass has one), written once for both ways of running
  // it: `ex` (decoder_layer.cpp's Serial or Region) runs the matmuls and the attention (whole, or
  // this thread's share of them in run_region's parallel region), the meetings between them and
  // the steps one thread does for all.
  template <class Exec>
  void through_layers(Exec& ex, const Pass& p, const Rows& b) const;
  // The layer loop in one parallel region, the threads sharing the buffers of `shared` that hold
  // the matmuls' and the attention's outputs; shared.x: x in, the last layer's output out.
  void run_region(const Pass& p, const Rows& shared) const;
  // Both forwards (forward_blocks without logits): the attention's plan from plan_for(rows,
  // cache slots, cache positions).
  std::vector<torch::Tensor> run(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin,
                                 const torch::Tensor& rope_positions, at::TensorList k_caches,
                                 at::TensorList v_caches, int64_t window, at::IntArrayRef capture, bool logits,
                                 const std::function<AttentionPlan(int64_t, int64_t, int64_t)>& plan_for) const;
};
