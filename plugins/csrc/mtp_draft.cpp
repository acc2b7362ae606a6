// The MTP draft's proposal for greedy chains in one call (`angelspec::MTPDraft.draft`,
// angelspec/drafters/mtp.py): the catch-up forward over each request's newly committed
// positions, then the rollout, each step's inputs (embedding, the two norms, fuse), the draft's
// decoder layer, the target's final norm, the logits over the draft vocabulary and the best
// guesses with their softmax probability, on raw rows (layer_rows.h) with the engine's kernels
// and weights. The same computation as the drafter's op-by-op path, without ~15 trips through
// Python and the dispatcher a step (at batch 1 they cost more than the layer itself). The
// draft's numbers only decide what is proposed, never what is committed.
#include <torch/extension.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "draft_logits.h"

struct MTPDraft : torch::CustomClassHolder {
  DraftLogits target;
  c10::intrusive_ptr<DecoderStack> layer;
  const float *enorm, *hnorm;
  Matmul fuse;
  std::vector<torch::Tensor> keep;
  int64_t hidden, max_rows;

  // embed [V, h] float32 (the target's); enorm, hnorm, final_norm [h]; fuse [h, 2h] and head
  // [Vd, h] as plugins/decoder_layer.py's weight_args gives them (tensors and kind); layer: a
  // one-layer DecoderStack (prepare_stack); vocab_ids [Vd]: the target id of each head row;
  // max_rows: the most rows one forward of the layer takes (longer catch-ups go in pieces).
  MTPDraft(torch::Tensor embed, torch::Tensor enorm_, torch::Tensor hnorm_, std::vector<torch::Tensor> fuse_w,
           int64_t fuse_kind, c10::intrusive_ptr<DecoderStack> layer_, torch::Tensor final_norm,
           std::vector<torch::Tensor> head_w, int64_t head_kind, torch::Tensor vocab_ids, double eps,
           int64_t max_rows_)
      : target(embed, final_norm, head_w, head_kind, vocab_ids, eps),
        layer(std::move(layer_)),
        fuse(fuse_w, fuse_kind, std::nullopt, 2 * embed.size(1)),
        hidden(embed.size(1)),
        max_rows(max_rows_) {
    TORCH_CHECK(layer->layers.size() == 1 && layer->hidden == hidden, "mtp_draft: one decoder layer of hidden size ",
                hidden, " expected, got ", layer->layers.size(), " of ", layer->hidden);
    TORCH_CHECK(fuse.out == hidden, "mtp_draft: fuse gives ", fuse.out, " outputs for hidden size ", hidden);
    TORCH_CHECK(max_rows > 0, "mtp_draft: max_rows must be positive");
    enorm = norm_weight(enorm_, hidden);
    hnorm = norm_weight(hnorm_, hidden);
    keep = {enorm_, hnorm_};
    keep.insert(keep.end(), fuse_w.begin(), fuse_w.end());
  }

  // x [n, h] = fuse([enorm(embed[tokens]) ; hnorm(hidden)]), the draft's inputs.
  void inputs(const int64_t* tokens, const float* hid, float* x, int64_t n) const {
    std::vector<float> cat(n * 2 * hidden);
    for (int64_t r = 0; r < n; ++r) {
      target.embed_norm(tokens[r], enorm, cat.data() + r * 2 * hidden);
      rms_norm_rows(hid + r * hidden, hnorm, cat.data() + r * 2 * hidden + hidden, 1, hidden, target.eps);
    }
    fuse(cat.data(), x, n);
  }

  // The layer over rows x [n, h] at (slots, positions) in pieces of max_rows -> out [n, h].
  void forward(const torch::Tensor& x, const torch::Tensor& slots, const torch::Tensor& positions,
               const torch::Tensor& cos, const torch::Tensor& sin, const torch::Tensor& k_cache,
               const torch::Tensor& v_cache, float* out) const {
    const torch::Tensor chain = torch::zeros({0}, torch::kLong);  // no tree: chains
    for (int64_t a = 0, n = x.size(0); a < n; a += max_rows) {
      const int64_t b = std::min(n, a + max_rows);
      const auto pos = positions.slice(0, a, b);
      const auto y = layer->forward(x.slice(0, a, b), cos, sin, pos, {k_cache}, {v_cache}, slots.slice(0, a, b),
                                    pos, chain, 0, {}, false)[0];
      std::memcpy(out + a * hidden, y.data_ptr<float>(), (b - a) * hidden * sizeof(float));
    }
  }

  // hidden [N, h]: the target's features at N newly committed positions of R requests, in
  // position order per request, with next [N] the token after each, at (slots, positions) [N];
  // last [R]: each request's newest row. Catches the layer's cache up on the N rows, then rolls
  // each request's chain out from its newest row for `steps` tokens in all (its slot, positions
  // past its newest). Returns (tokens [R, steps, width] target ids, confidence [R, steps, width]):
  // at each step the best `width` guesses, best first; the chain goes on with the best.
  std::vector<torch::Tensor> draft(const torch::Tensor& hidden_, const torch::Tensor& next_,
                                   const torch::Tensor& slots_, const torch::Tensor& positions_,
                                   const torch::Tensor& last_, int64_t steps, int64_t width,
                                   const torch::Tensor& cos, const torch::Tensor& sin, const torch::Tensor& k_cache,
                                   const torch::Tensor& v_cache) const {
    TORCH_CHECK(hidden_.dim() == 2 && hidden_.size(1) == hidden, "mtp_draft: hidden [N, ", hidden,
                "] expected, got ", hidden_.sizes());
    const int64_t n = hidden_.size(0), R = last_.numel();
    const auto hid = hidden_.to(torch::kFloat32).contiguous();
    const auto next = next_.to(torch::kLong).contiguous(), slots = slots_.to(torch::kLong).contiguous(),
               positions = positions_.to(torch::kLong).contiguous(), last = last_.to(torch::kLong).contiguous();
    TORCH_CHECK(next.numel() == n && slots.numel() == n && positions.numel() == n,
                "mtp_draft: one next token, slot and position per hidden row");
    TORCH_CHECK(steps >= 1, "mtp_draft: steps >= 1 expected, got ", steps);
    const int64_t* lp = last.data_ptr<int64_t>();
    for (int64_t r = 0; r < R; ++r)
      TORCH_CHECK(lp[r] >= 0 && lp[r] < n, "mtp_draft: last row ", lp[r], " outside the ", n, " rows");
    auto tokens = torch::empty({R, steps, width}, torch::kLong);
    auto conf = torch::empty({R, steps, width}, torch::kFloat32);
    int64_t* tp = tokens.data_ptr<int64_t>();
    float* cp = conf.data_ptr<float>();

    auto x = torch::empty({n, hidden}, torch::kFloat32);
    std::vector<float> out(n * hidden), o(R * hidden);
    inputs(next.data_ptr<int64_t>(), hid.data_ptr<float>(), x.data_ptr<float>(), n);
    forward(x, slots, positions, cos, sin, k_cache, v_cache, out.data());
    auto rslots = torch::empty({R}, torch::kLong), rpos = torch::empty({R}, torch::kLong);
    std::vector<int64_t> prev(R), t(R * width);
    std::vector<float> c(R * width);
    for (int64_t r = 0; r < R; ++r) {
      std::memcpy(o.data() + r * hidden, out.data() + lp[r] * hidden, hidden * sizeof(float));
      rslots.data_ptr<int64_t>()[r] = slots.data_ptr<int64_t>()[lp[r]];
      rpos.data_ptr<int64_t>()[r] = positions.data_ptr<int64_t>()[lp[r]];
    }
    auto xr = torch::empty({R, hidden}, torch::kFloat32);
    for (int64_t step = 0; step < steps; ++step) {
      if (step > 0) {
        inputs(prev.data(), o.data(), xr.data_ptr<float>(), R);
        for (int64_t r = 0; r < R; ++r) rpos.data_ptr<int64_t>()[r] += 1;
        forward(xr, rslots, rpos, cos, sin, k_cache, v_cache, o.data());
      }
      target.guesses(o.data(), R, width, t.data(), c.data());
      for (int64_t r = 0; r < R; ++r) {
        prev[r] = t[r * width];
        for (int64_t w = 0; w < width; ++w) {
          tp[(r * steps + step) * width + w] = t[r * width + w];
          cp[(r * steps + step) * width + w] = c[r * width + w];
        }
      }
    }
    return {tokens, conf};
  }
};

TORCH_LIBRARY_FRAGMENT(angelspec, m) {
  m.class_<MTPDraft>("MTPDraft")
      .def(torch::init<torch::Tensor, torch::Tensor, torch::Tensor, std::vector<torch::Tensor>, int64_t,
                       c10::intrusive_ptr<DecoderStack>, torch::Tensor, std::vector<torch::Tensor>, int64_t,
                       torch::Tensor, double, int64_t>())
      .def("draft", &MTPDraft::draft);
}
