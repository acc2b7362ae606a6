// Verification of ragged drafts, chains or token trees (plugins/verify.py has the layout and the
// rules): the target's own token at every row, then the walk that keeps each request's deepest
// accepted path. Greedy verification is one call into here (`angelspec::verify_greedy`), and
// rejection sampling walks the same way (`angelspec::accept_paths`) over the target's own
// samples: once per step, where a Python walk and the dispatch of a Python op cost a batch-1
// step a real part of its time.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <tuple>
#include <vector>

// x [N, V] float32 -> [N] int64: each row's first maximum, as torch's max(-1).indices gives it
// (a NaN counts as the maximum: the first NaN). Two passes over a row (it stays in cache): the
// maximum in four independent accumulators of 8 lanes, then the first index holding it.
// Verification takes the target's greedy token of every row this way: torch's reduction was a
// real part of a many-request step.
torch::Tensor row_argmax(const torch::Tensor& x) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && x.dim() == 2 && x.size(1) > 0,
              "row_argmax: float32 [N, V] with V > 0 expected");
  auto xc = x.contiguous();
  const int64_t n = xc.size(0), v = xc.size(1);
  auto out = torch::empty({n}, torch::kLong);
  const float* xp = xc.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, n, 4, [&](int64_t a, int64_t b) {
    for (int64_t r = a; r < b; ++r) {
      const float* xr = xp + r * v;
      const int64_t v32 = v & ~int64_t(31);
      __m256 m[4], bad = _mm256_setzero_ps();
      for (auto& mk : m) mk = _mm256_set1_ps(-__builtin_inff());
      for (int64_t i = 0; i < v32; i += 32)
        for (int k = 0; k < 4; ++k) {
          const __m256 xv = _mm256_loadu_ps(xr + i + 8 * k);
          m[k] = _mm256_max_ps(m[k], xv);
          bad = _mm256_or_ps(bad, _mm256_cmp_ps(xv, xv, _CMP_UNORD_Q));
        }
      alignas(32) float lanes[8];
      _mm256_store_ps(lanes, _mm256_max_ps(_mm256_max_ps(m[0], m[1]), _mm256_max_ps(m[2], m[3])));
      float top = -__builtin_inff();
      for (float l : lanes) top = l > top ? l : top;
      bool nan = _mm256_movemask_ps(bad) != 0;
      for (int64_t i = v32; i < v && !nan; ++i) {
        nan = xr[i] != xr[i];
        top = xr[i] > top ? xr[i] : top;
      }
      int64_t best = 0;
      if (nan) {
        while (xr[best] == xr[best]) ++best;
      } else {
        const __m256 t = _mm256_set1_ps(top);
        const int64_t v8 = v & ~int64_t(7);
        int64_t i = 0;
        int hit = 0;
        for (; i < v8 && !(hit = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(xr + i), t, _CMP_EQ_OQ))); i += 8) {}
        if (hit) {
          best = i + __builtin_ctz(hit);
        } else {
          for (best = v8; xr[best] != top; ++best) {}
        }
      }
      op[r] = best;
    }
  });
  return out;
}

// own [N]: the target's own token at every row; draft, parents [sum(lengths)] (parents empty:
// every draft a chain, token i's parent i - 1, as cached_attention takes them); lengths [B] ->
// (accepted, last, leaf) [B] (int64). A draft token is accepted when its parent is (the anchor
// always is) and it equals the target's own token at its parent's row; each request keeps its
// deepest accepted token (the first of equal depth) and ends with the target's own token after it.
std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> accept_paths(
    const torch::Tensor& own, const torch::Tensor& draft, const torch::Tensor& lengths,
    const torch::Tensor& parents) {
  auto ow = own.to(torch::kLong).contiguous(), dr = draft.to(torch::kLong).contiguous();
  auto le = lengths.to(torch::kLong).contiguous(), pa = parents.to(torch::kLong).contiguous();
  const int64_t B = le.numel();
  const int64_t* lp = le.data_ptr<int64_t>();
  int64_t rows = 0, toks = 0;
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(lp[b] >= 0, "accept_paths: request ", b, " has ", lp[b], " draft tokens");
    rows += lp[b] + 1;
    toks += lp[b];
  }
  const bool chains = pa.numel() == 0;
  TORCH_CHECK(ow.numel() == rows && dr.numel() == toks && (chains || pa.numel() == toks),
              "accept_paths: ", B, " requests with ", toks, " draft tokens need ", rows,
              " rows and as many parents as tokens (or none: chains); got ", ow.numel(), " rows, ", dr.numel(),
              " tokens, ", pa.numel(), " parents");
  const int64_t *op = ow.data_ptr<int64_t>(), *dp = dr.data_ptr<int64_t>(), *pp = pa.data_ptr<int64_t>();
  auto accepted = torch::empty({B}, torch::kLong), last = torch::empty({B}, torch::kLong),
       leaf = torch::empty({B}, torch::kLong);
  int64_t *ap = accepted.data_ptr<int64_t>(), *lastp = last.data_ptr<int64_t>(), *leafp = leaf.data_ptr<int64_t>();
  std::vector<int64_t> depth;  // 0: not accepted, else the token's depth
  for (int64_t b = 0, row = 0, tok = 0; b < B; ++b) {
    const int64_t k = lp[b];
    depth.assign(k, 0);
    int64_t best = -1, best_depth = 0;
    for (int64_t i = 0; i < k; ++i) {
      const int64_t p = chains ? i - 1 : pp[tok + i];
      TORCH_CHECK(p >= -1 && p < i, "accept_paths: token ", i, " of request ", b, " has parent ", p,
                  " (an earlier token of its request, or -1)");
      const int64_t up = p < 0 ? 0 : depth[p];
      if ((p < 0 || up) && dp[tok + i] == op[row + 1 + p]) {
        depth[i] = up + 1;
        if (depth[i] > best_depth) best = i, best_depth = depth[i];
      }
    }
    ap[b] = best_depth;
    lastp[b] = op[row + 1 + best];
    leafp[b] = best;
    row += k + 1;
    tok += k;
  }
  return {accepted, last, leaf};
}

// logits [N, V] (N = sum(lengths + 1)), draft and parents [sum(lengths)], lengths [B]: keep draft
// tokens while each is the target's argmax at its parent's row.
std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> verify_greedy(
    const torch::Tensor& logits, const torch::Tensor& draft, const torch::Tensor& lengths,
    const torch::Tensor& parents) {
  return accept_paths(row_argmax(logits), draft, lengths, parents);
}

TORCH_LIBRARY_FRAGMENT(angelspec, m) {
  m.def("row_argmax(Tensor x) -> Tensor");
  m.def("accept_paths(Tensor own, Tensor draft, Tensor lengths, Tensor parents) -> (Tensor, Tensor, Tensor)");
  m.def("verify_greedy(Tensor logits, Tensor draft, Tensor lengths, Tensor parents) -> (Tensor, Tensor, Tensor)");
}
TORCH_LIBRARY_IMPL(angelspec, CPU, m) {
  m.impl("row_argmax", &row_argmax);
  m.impl("accept_paths", &accept_paths);
  m.impl("verify_greedy", &verify_greedy);
}
