// What the trained drafts borrow from the target, on raw rows: its token embedding, and its final
// norm with the lm_head rows of a draft vocabulary, whose logits give a draft's best guesses and
// their softmax probability (mtp_draft.cpp, dfly_head.cpp).
#pragma once
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "decoder_stack.h"
#include "vec_exp.h"

struct DraftLogits {
  std::vector<torch::Tensor> keep;
  const float *embed, *final_norm;
  const int64_t* vocab_ids;
  Matmul head;
  double eps;
  int64_t hidden, vocab;

  // embed [V, h] float32; final_norm [h]; head [Vd, h] as plugins/decoder_layer.py's weight_args
  // gives it (tensors and kind); vocab_ids [Vd]: the target id of each head row.
  DraftLogits(const torch::Tensor& embed_, const torch::Tensor& final_norm_, std::vector<torch::Tensor> head_w,
              int64_t head_kind, const torch::Tensor& vocab_ids_, double eps_)
      : head(head_w, head_kind, std::nullopt, embed_.size(1)), eps(eps_), hidden(embed_.size(1)),
        vocab(embed_.size(0)) {
    TORCH_CHECK(embed_.dim() == 2 && embed_.scalar_type() == torch::kFloat32 && embed_.is_contiguous(),
                "draft: embed float32 [V, h] expected, got ", embed_.scalar_type(), " ", embed_.sizes());
    TORCH_CHECK(vocab_ids_.scalar_type() == torch::kLong && vocab_ids_.is_contiguous() &&
                    vocab_ids_.numel() == head.out,
                "draft: one int64 target id per head row (", head.out, ") expected, got ", vocab_ids_.sizes());
    embed = embed_.data_ptr<float>();
    final_norm = norm_weight(final_norm_, hidden);
    vocab_ids = vocab_ids_.data_ptr<int64_t>();
    keep = {embed_, final_norm_, vocab_ids_};
    keep.insert(keep.end(), head_w.begin(), head_w.end());
  }

  // y [h] = norm(embed[token]) with the norm's weight w.
  void embed_norm(int64_t token, const float* w, float* y) const {
    TORCH_CHECK(token >= 0 && token < vocab, "draft: token ", token, " outside the vocabulary");
    rms_norm_rows(embed + token * hidden, w, y, 1, hidden, eps);
  }

  // The best `width` draft-vocabulary rows of final_norm(o) @ head.T for each of n rows [n, h],
  // best first (ties: the lower row first), as target ids, with their softmax probability.
  void guesses(const float* o, int64_t n, int64_t width, int64_t* tokens, float* conf) const {
    TORCH_CHECK(width >= 1 && width <= head.out, "draft: 1 to ", head.out, " guesses a position, not ", width);
    const int64_t V = head.out;
    std::vector<float> on(n * hidden), logits(n * V), best(width);
    std::vector<int64_t> at(width);
    rms_norm_rows(o, final_norm, on.data(), n, hidden, eps);
    head(on.data(), logits.data(), n);
    for (int64_t r = 0; r < n; ++r) {
      const float* l = logits.data() + r * V;
      std::fill(best.begin(), best.end(), -INFINITY);
      std::fill(at.begin(), at.end(), 0);
      for (int64_t i = 0; i < V; ++i) {
        if (!(l[i] > best[width - 1])) continue;
        int64_t j = width - 1;
        for (; j > 0 && l[i] > best[j - 1]; --j) {
          best[j] = best[j - 1];
          at[j] = at[j - 1];
        }
        best[j] = l[i];
        at[j] = i;
      }
      const __m256 top = _mm256_set1_ps(best[0]);
      __m256 acc = _mm256_setzero_ps();
      int64_t i = 0;
      for (; i + 8 <= V; i += 8) acc = _mm256_add_ps(acc, exp256(_mm256_sub_ps(_mm256_loadu_ps(l + i), top)));
      alignas(32) float lanes[8];
      _mm256_store_ps(lanes, acc);
      float sum = 0;
      for (float x : lanes) sum += x;
      for (; i < V; ++i) sum += std::exp(l[i] - best[0]);
      for (int64_t w = 0; w < width; ++w) {
        tokens[r * width + w] = vocab_ids[at[w]];
        conf[r * width + w] = std::exp(best[w] - best[0]) / sum;
      }
    }
  }
};
