// DFly's predecessor-conditioned AR head over every block's chain in one call
// (`angelspec::DFlyHead.chains`, angelspec/drafters/dfly.py), on raw rows with the engine's
// kernels and weights: link i of each chain
//     h'_i = h_i + down(silu(gate(x_i)) * up(x_i)),  x_i = [head_norm(h_i) ; prev_norm(embed[t_(i-1)])]
//     t_i  = the best guesses of lm_head . final_norm(h'_i) over the draft vocabulary, t_0 the anchor
// as plugins/dfly_head.py's draft_head computes it link by link in ~15 framework calls each. The
// draft's numbers only decide what is proposed, never what is committed.
#include <torch/extension.h>

#include <cstring>
#include <vector>

#include "draft_logits.h"

struct DFlyHead : torch::CustomClassHolder {
  DraftLogits target;
  const float *head_norm, *prev_norm;
  Matmul gate_up, down;
  std::vector<torch::Tensor> keep;
  int64_t hidden, inter;

  // embed [V, h] float32 (the target's); head_norm, prev_norm, final_norm [h]; gate_up [2m, 2h]
  // (gate's rows, then up's), down [h, m] and head [Vd, h] as plugins/decoder_layer.py's
  // weight_args gives them (tensors and kind); vocab_ids [Vd]: the target id of each head row.
  DFlyHead(torch::Tensor embed, torch::Tensor head_norm_, torch::Tensor prev_norm_, std::vector<torch::Tensor> gate_up_w,
           int64_t gate_up_kind, std::vector<torch::Tensor> down_w, int64_t down_kind, torch::Tensor final_norm,
           std::vector<torch::Tensor> head_w, int64_t head_kind, torch::Tensor vocab_ids, double eps)
      : target(embed, final_norm, head_w, head_kind, vocab_ids, eps),
        gate_up(gate_up_w, gate_up_kind, std::nullopt, 2 * embed.size(1)),
        down(down_w, down_kind, std::nullopt, gate_up.out / 2),
        hidden(embed.size(1)),
        inter(gate_up.out / 2) {
    TORCH_CHECK(gate_up.out % 2 == 0 && down.out == hidden, "dfly_head: gate_up gives ", gate_up.out,
                " outputs and down ", down.out, " for hidden size ", hidden);
    head_norm = norm_weight(head_norm_, hidden);
    prev_norm = norm_weight(prev_norm_, hidden);
    keep = {head_norm_, prev_norm_};
    keep.insert(keep.end(), gate_up_w.begin(), gate_up_w.end());
    keep.insert(keep.end(), down_w.begin(), down_w.end());
  }

  // hidden [R, k, h] (the backbone's output per draft position), anchor [R] -> (tokens [R, n, width]
  // target ids, confidence [R, n, width] = the draft's probability of each): at each link the best
  // `width` guesses, best first; the chain goes on with the best. n = k, or with stop_below > 0
  // the links up to the first at which every chain's path survival (the product of its chosen
  // tokens' probabilities) is below stop_below.
  std::vector<torch::Tensor> chains(const torch::Tensor& hidden_, const torch::Tensor& anchor_, int64_t width,
                                    double stop_below) const {
    TORCH_CHECK(hidden_.dim() == 3 && hidden_.size(2) == hidden, "dfly_head: hidden [R, k, ", hidden,
                "] expected, got ", hidden_.sizes());
    const int64_t R = hidden_.size(0), k = hidden_.size(1);
    const auto hid = hidden_.to(torch::kFloat32).contiguous();
    const auto anchor = anchor_.to(torch::kLong).contiguous();
    TORCH_CHECK(anchor.numel() == R, "dfly_head: one anchor per block");
    const float* hp = hid.data_ptr<float>();
    auto tokens = torch::empty({R, k, width}, torch::kLong);
    auto conf = torch::empty({R, k, width}, torch::kFloat32);
    int64_t* tp = tokens.data_ptr<int64_t>();
    float* cp = conf.data_ptr<float>();
    std::vector<float> hn(R * k * hidden), x(R * 2 * hidden), gu(R * 2 * inter), act(R * inter), y(R * hidden);
    std::vector<float> survival(R, 1.0f), c(R * width);
    std::vector<int64_t> prev(anchor.data_ptr<int64_t>(), anchor.data_ptr<int64_t>() + R), t(R * width);
    rms_norm_rows(hp, head_norm, hn.data(), R * k, hidden, target.eps);
    for (int64_t i = 0; i < k; ++i) {
      for (int64_t r = 0; r < R; ++r) {
        std::memcpy(x.data() + r * 2 * hidden, hn.data() + (r * k + i) * hidden, hidden * sizeof(float));
        target.embed_norm(prev[r], prev_norm, x.data() + r * 2 * hidden + hidden);
      }
      gate_up(x.data(), gu.data(), R);
      silu_mul_rows(gu.data(), act.data(), R, inter);
      down(act.data(), y.data(), R);
      for (int64_t r = 0; r < R; ++r)
        for (int64_t j = 0; j < hidden; ++j) y[r * hidden + j] += hp[(r * k + i) * hidden + j];
      target.guesses(y.data(), R, width, t.data(), c.data());
      bool all_below = stop_below > 0;
      for (int64_t r = 0; r < R; ++r) {
        std::memcpy(tp + (r * k + i) * width, t.data() + r * width, width * sizeof(int64_t));
        std::memcpy(cp + (r * k + i) * width, c.data() + r * width, width * sizeof(float));
        prev[r] = t[r * width];
        survival[r] *= c[r * width];
        all_below = all_below && survival[r] < stop_below;
      }
      if (all_below) return {tokens.slice(1, 0, i + 1), conf.slice(1, 0, i + 1)};
    }
    return {tokens, conf};
  }
};

TORCH_LIBRARY_FRAGMENT(angelspec, m) {
  m.class_<DFlyHead>("DFlyHead")
      .def(torch::init<torch::Tensor, torch::Tensor, torch::Tensor, std::vector<torch::Tensor>, int64_t,
                       std::vector<torch::Tensor>, int64_t, torch::Tensor, std::vector<torch::Tensor>, int64_t,
                       torch::Tensor, double>())
      .def("chains", &DFlyHead::chains);
}
