// Attention of packed query rows against the static KV cache (which it first writes).
//
// Every query row is computed alone with a fixed summation order (keys in order, 8 FMA lanes over
// head_dim, a fixed horizontal sum), so its result does not depend on how many rows share the
// call - a k-token verification forward reproduces k one-token forwards bit for bit (torch's SDPA
// picks blockings by shape and does not). A token tree verifies the same way: each node attends
// to the committed keys, then its ancestors', then its own, in that order, which are exactly the
// keys (and the summation order) of the one-token forward at its depth once its path is
// committed. The query heads of one KV group are scored together so each key is loaded once per
// group. The kernels are in attention_tile.h (AVX2 here, AVX-512 in
// avx512.cpp).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>
#include <xmmintrin.h>

#include "layer_rows.h"
#include "vec.h"
#include "attention_tile.h"

void attend_items_avx512(const float* qp, const float* kp, const float* vp, float* op,
                         const int64_t* slots, const int64_t* pos, const int64_t* hi,
                         const int64_t* tbeg, const int64_t* tree, int64_t N, int64_t H,
                         int64_t Hkv, int64_t parts, int64_t M, int64_t D, int64_t window,
                         float scale, int64_t a, int64_t b, float* buf, const float** rows);
void attend_items_avx512(const float* qp, const uint16_t* kp, const uint16_t* vp, float* op,
                         const int64_t* slots, const int64_t* pos, const int64_t* hi,
                         const int64_t* tbeg, const int64_t* tree, int64_t N, int64_t H,
                         int64_t Hkv, int64_t parts, int64_t M, int64_t D, int64_t window,
                         float scale, int64_t a, int64_t b, float* buf, const uint16_t** rows);

namespace {
// float32 -> the cache's element: itself, or bf16 rounded to nearest even (NaN kept a NaN)
inline void narrow(float x, float* to) { *to = x; }
inline void narrow(float x, uint16_t* to) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) {
    *to = static_cast<uint16_t>((u >> 16) | 0x40);
    return;
  }
  u += 0x7fffu + ((u >> 16) & 1u);
  *to = static_cast<uint16_t>(u >> 16);
}

// Writes this forward's keys and values into the caches (element type T).
template <class T>
void write_kv(const float* ks, const float* vs, T* kd, T* vd, const int64_t* slp, const int64_t* wp, int64_t N,
              int64_t Hkv, int64_t M, int64_t D) {
  for (int64_t n = 0; n < N; ++n)
    for (int64_t h = 0; h < Hkv; ++h) {
      const int64_t head = (slp[n] * Hkv + h) * M * D, src = (n * Hkv + h) * D;
      T* kcol = kd + head + key_at(wp[n], D);
      for (int64_t d = 0; d < D; ++d) narrow(ks[src + d], kcol + d * kKeyTile);
      for (int64_t d = 0; d < D; ++d) narrow(vs[src + d], vd + head + wp[n] * D + d);
    }
}

// Each query head of a kv head's group in how many parts: one row on a few threads (3 kv heads
// on 2) splits a kv head's query heads in two, so the threads share 5:4 query heads instead of
// 2:1 kv heads.
int64_t parts_for(int64_t N, int64_t H, int64_t Hkv, int64_t threads) {
  const int64_t items = N * Hkv;
  return items % threads && items < 4 * threads && H / Hkv > 1 ? 2 : 1;
}

// Work items [a, b) of N * Hkv * parts (attend_items'), on the calling thread.
template <class T>
void attend_range(const AttentionPlan& plan, const float* qp, const T* kd, const T* vd, float* op, int64_t H,
                  int64_t Hkv, int64_t M, int64_t D, int64_t window, int64_t parts, int64_t a, int64_t b) {
  const int64_t N = static_cast<int64_t>(plan.slots.size());
  const float scale = 1.0f / std::sqrt(float(D));
  auto* fn = use_avx512() ? static_cast<decltype(&attend_items<V256, T>)>(&attend_items_avx512)
                          : &attend_items<V256, T>;
  // denormals read and written as zero while this thread attends: where a row attends sharply
  // (a draft's block to itself), its first keys' weights times their values are below
  // float32's normal range, and summing those took the CPU's slow path at every step (a DFly
  // block's attention ran ~10x slower than with zeros). The same for every row, so row-exact.
  const unsigned int csr = _mm_getcsr();
  _mm_setcsr(csr | 0x8040u);  // FTZ | DAZ
  thread_local std::vector<float> buf;
  thread_local std::vector<const T*> rows;
  buf.resize((H / Hkv) * (plan.longest + 2 * kKeyTile));
  rows.resize(plan.widest);
  fn(qp, kd, vd, op, plan.slots.data(), plan.positions.data(), plan.is_tree ? plan.hi.data() : nullptr,
     plan.is_tree ? plan.tbeg.data() : nullptr, plan.tree.data(), N, H, Hkv, parts, M, D, window, scale, a, b,
     buf.data(), rows.data());
  _mm_setcsr(csr);
}

const int64_t* writes(const AttentionPlan& plan) {
  return plan.writes.empty() ? plan.positions.data() : plan.writes.data();
}
}  // namespace

void write_rows_kv(const AttentionPlan& plan, const float* k, const float* v, void* k_cache, void* v_cache,
                   bool bf16, int64_t Hkv, int64_t M, int64_t D) {
  const int64_t N = static_cast<int64_t>(plan.slots.size());
  if (bf16)
    write_kv(k, v, static_cast<uint16_t*>(k_cache), static_cast<uint16_t*>(v_cache), plan.slots.data(),
             writes(plan), N, Hkv, M, D);
  else
    write_kv(k, v, static_cast<float*>(k_cache), static_cast<float*>(v_cache), plan.slots.data(), writes(plan), N,
             Hkv, M, D);
}

int64_t attention_items(const AttentionPlan& plan, int64_t H, int64_t Hkv, int64_t threads) {
  const int64_t N = static_cast<int64_t>(plan.slots.size());
  return N * Hkv * parts_for(N, H, Hkv, threads);
}

void attend_rows_range(const AttentionPlan& plan, const float* q, const void* k_cache, const void* v_cache,
                       bool bf16, float* out, int64_t H, int64_t Hkv, int64_t M, int64_t D, int64_t window,
                       int64_t threads, int64_t a, int64_t b) {
  const int64_t parts = parts_for(static_cast<int64_t>(plan.slots.size()), H, Hkv, threads);
  if (bf16)
    attend_range(plan, q, static_cast<const uint16_t*>(k_cache), static_cast<const uint16_t*>(v_cache), out, H,
                 Hkv, M, D, window, parts, a, b);
  else
    attend_range(plan, q, static_cast<const float*>(k_cache), static_cast<const float*>(v_cache), out, H, Hkv, M,
                 D, window, parts, a, b);
}

void attend_rows(const AttentionPlan& plan, const float* q, const float* k, const float* v, void* k_cache,
                 void* v_cache, bool bf16, float* out, int64_t H, int64_t Hkv, int64_t M, int64_t D,
                 int64_t window) {
  write_rows_kv(plan, k, v, k_cache, v_cache, bf16, Hkv, M, D);
  const int64_t threads = at::get_num_threads();
  at::parallel_for(0, attention_items(plan, H, Hkv, threads), 1, [&](int64_t a, int64_t b) {
    attend_rows_range(plan, q, k_cache, v_cache, bf16, out, H, Hkv, M, D, window, threads, a, b);
  });
}

// The keys each of N rows attends to in caches of S slots of M positions; slots, positions [N]:
// where each row's own key and value are written. parents empty: row n
// attends to keys (slots[n], j) for j in (positions[n] - window, positions[n]]. parents [N] (a
// token tree): parents[n] < n is the row of n's parent in this call, or -1 for a root, which
// attends to keys 0..positions[n]; any other row attends to its parent's keys, then its own (no
// window: trees need full attention).
AttentionPlan plan_attention(const torch::Tensor& slots, const torch::Tensor& positions,
                             const torch::Tensor& parents, int64_t N, int64_t S, int64_t M, int64_t window) {
  AttentionPlan plan;
  auto sl = slots.to(torch::kLong).contiguous();
  auto ps = positions.to(torch::kLong).contiguous();
  TORCH_CHECK(sl.numel() == N && ps.numel() == N, "cached_attention: one slot and position per row");
  const int64_t* slp = sl.data_ptr<int64_t>();
  const int64_t* pp = ps.data_ptr<int64_t>();
  for (int64_t n = 0; n < N; ++n)
    TORCH_CHECK(pp[n] >= 0 && pp[n] < M && slp[n] >= 0 && slp[n] < S,
                "cached_attention: slot ", slp[n], " position ", pp[n], " outside the cache");
  plan.slots.assign(slp, slp + N);
  plan.positions.assign(pp, pp + N);
  // a tree's rows: the contiguous run of keys from 0 (the committed ones, the root, and ancestors
  // stored right after them), then the positions of the rest of their ancestors, root first
  for (int64_t n = 0; n < N; ++n) plan.longest = std::max(plan.longest, pp[n] + 1);
  plan.is_tree = parents.numel() > 0;
  if (plan.is_tree) {
    TORCH_CHECK(window <= 0, "cached_attention: token trees need full attention (no sliding window)");
    auto pa = parents.to(torch::kLong).contiguous();
    TORCH_CHECK(pa.numel() == N, "cached_attention: one parent per row");
    const int64_t* par = pa.data_ptr<int64_t>();
    plan.hi.resize(N);
    plan.tbeg.resize(N + 1);
    std::vector<int64_t> path;
    for (int64_t n = 0; n < N; ++n) {
      TORCH_CHECK(par[n] >= -1 && par[n] < n && (par[n] < 0 || slp[par[n]] == slp[n]),
                  "cached_attention: row ", n, " has parent ", par[n],
                  " (an earlier row of its own slot, or -1)");
      path.clear();
      for (int64_t m = n; m >= 0; m = par[m]) path.push_back(pp[m]);
      std::reverse(path.begin(), path.end());
      size_t i = 1;
      while (i < path.size() && path[i] == path[i - 1] + 1) ++i;
      plan.hi[n] = path[i - 1];
      plan.tbeg[n] = int64_t(plan.tree.size());
      plan.tree.insert(plan.tree.end(), path.begin() + i, path.end());
      plan.longest = std::max(plan.longest, plan.hi[n] + 1 + int64_t(path.size() - i));
      plan.widest = std::max(plan.widest, int64_t(path.size() - i));
    }
    plan.tbeg[N] = int64_t(plan.tree.size());
  }
  return plan;
}

// The caches' shapes (k_cache [S, Hkv, M / 16, D, 16], tiles of 16 keys, transposed; v_cache
// [S, Hkv, M, D], both float32 or both bf16) for H query heads of D; returns whether bf16.
bool check_caches(const torch::Tensor& k_cache, const torch::Tensor& v_cache, int64_t H, int64_t D) {
  TORCH_CHECK(k_cache.dtype() == v_cache.dtype() &&
                  (k_cache.dtype() == torch::kFloat32 || k_cache.dtype() == torch::kBFloat16),
              "cached_attention: float32 or bfloat16 caches (both alike) expected, got ",
              k_cache.dtype(), " and ", v_cache.dtype());
  TORCH_CHECK(k_cache.dim() == 5 && v_cache.dim() == 4,
              "cached_attention: k_cache [S, Hkv, M / 16, D, 16], v_cache [S, Hkv, M, D] expected");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "cached_attention: contiguous caches expected");
  const int64_t S = v_cache.size(0), Hkv = v_cache.size(1), M = v_cache.size(2);
  TORCH_CHECK(v_cache.size(3) == D && H % Hkv == 0 && M % kKeyTile == 0 &&
              k_cache.sizes() == torch::IntArrayRef({S, Hkv, M / kKeyTile, D, kKeyTile}),
              "cached_attention: cache shapes disagree: k ", k_cache.sizes(), " v ", v_cache.sizes());
  return k_cache.dtype() == torch::kBFloat16;
}

// q [N, H, D]; k, v [N, Hkv, D] (this forward's keys/values, written into the caches first, at
// (slots[n], positions[n]), bf16 rounded to nearest even when the caches are); M a multiple of
// 16; window <= 0: none; parents: plan_attention's.
torch::Tensor cached_attention(const torch::Tensor& q, const torch::Tensor& k,
                               const torch::Tensor& v, torch::Tensor k_cache,
                               torch::Tensor v_cache, const torch::Tensor& slots,
                               const torch::Tensor& positions, const torch::Tensor& parents,
                               int64_t window) {
  TORCH_CHECK(q.dtype() == torch::kFloat32 && k.dtype() == torch::kFloat32 && v.dtype() == torch::kFloat32,
              "cached_attention: float32 q, k, v expected");
  TORCH_CHECK(q.dim() == 3, "cached_attention: q [N, H, D] expected");
  const int64_t N = q.size(0), H = q.size(1), D = q.size(2);
  const bool bf16 = check_caches(k_cache, v_cache, H, D);
  const int64_t S = v_cache.size(0), Hkv = v_cache.size(1), M = v_cache.size(2);
  const AttentionPlan plan = plan_attention(slots, positions, parents, N, S, M, window);
  auto kc = k.reshape({N, Hkv, D}).contiguous(), vc = v.reshape({N, Hkv, D}).contiguous();
  auto qc = q.contiguous();
  auto out = torch::empty({N, H, D}, qc.options());
  attend_rows(plan, qc.data_ptr<float>(), kc.data_ptr<float>(), vc.data_ptr<float>(), k_cache.data_ptr(),
              v_cache.data_ptr(), bf16, out.data_ptr<float>(), H, Hkv, M, D, window);
  return out;
}

TORCH_LIBRARY_FRAGMENT(angelspec, m) {
  m.def("cached_attention(Tensor q, Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, "
        "Tensor slots, Tensor positions, Tensor parents, int window) -> Tensor");
}
TORCH_LIBRARY_IMPL(angelspec, CPU, m) {
  m.impl("cached_attention", &cached_attention);
}
