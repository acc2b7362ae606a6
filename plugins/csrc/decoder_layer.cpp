// The decoder layers of a decoding or verification forward (up to SKINNY_MAX_ROWS rows) in one
// call (DecoderStack; a draft's layer is a stack of one), for the model's forward with the
// embedding lookup before them and the head after them: the same kernels, in the same order, as
// angelspec/model.py's layer loop calls them one by one (so the numbers are the same, bit for
// bit), without a trip through Python and the dispatcher for each of them, and on raw rows
// (layer_rows.h) in buffers kept from call to call: no tensor is made and no framework code runs
// between two kernels. The arguments are checked once a call, the attention's plan (each row's
// keys) built once for every layer.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <omp.h>
#include <immintrin.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstring>
#include <functional>
#include <thread>
#include <utility>
#include <vector>

#include "decoder_stack.h"

namespace {
// x + y, elementwise, into z (may be x or y): the float add of torch's `x + y`.
void add_rows(const float* x, const float* y, float* z, int64_t count) {
  for (int64_t i = 0; i < count; ++i) z[i] = x[i] + y[i];
}

// q, k, v apart, each [n, its heads, D], from qkv [n, nq + 2 nkv heads, D].
void split_qkv(const float* qkv, float* q, float* k, float* v, int64_t n, int64_t nq, int64_t nkv, int64_t D) {
  const int64_t heads = nq + 2 * nkv;
  for (int64_t r = 0; r < n; ++r) {
    const float* row = qkv + r * heads * D;
    std::memcpy(q + r * nq * D, row, nq * D * sizeof(float));
    std::memcpy(k + r * nkv * D, row + nq * D, nkv * D * sizeof(float));
    std::memcpy(v + r * nkv * D, row + (nq + nkv) * D, nkv * D * sizeof(float));
  }
}

// What a thread reads next (its share of the next matmul's weights, scales and minima, the
// first kAheadBytes of each), fetched into L2 a line at a time while it waits at a barrier: the
// time one thread waits for the other reads memory instead of idling. The one-row forward's
// layers read their weights about as long as they compute, one after the other rather than
// overlapped (bench's "layers" line); this overlaps what a wait allows
// (docs/results/design-measurements.md).
constexpr int64_t kAheadBytes = 256 * 1024;
struct Ahead {
  const void* of = nullptr;  // the matmul
  const char* p[3] = {};
  const char* end[3] = {};

  bool left() const { return p[0] < end[0] || p[1] < end[1] || p[2] < end[2]; }
  void fetch_one() {
    for (int i = 0; i < 3; ++i)
      if (p[i] < end[i]) {
        _mm_prefetch(p[i], _MM_HINT_T1);
        p[i] += 64;
        return;
      }
  }
};

// The threads of run_region meeting between its steps: the last to arrive moves the generation
// on, the others spin on it (a pause a turn; after kSpins turns they yield, should the machine
// have fewer cores free than threads). Every write before a thread's arrival is seen by every
// thread after it leaves (the arrivals' release and acquire, then the generation's). A forward
// meets at ~150 of them, each far cheaper than an OpenMP barrier
// (docs/results/design-measurements.md).
// A thread given an `ahead` fetches it while it waits.
class SpinBarrier {
 public:
  void wait(int64_t threads, Ahead* ahead = nullptr) {
    const int gen = generation_.load(std::memory_order_relaxed);
    if (arrived_.fetch_add(1, std::memory_order_acq_rel) == threads - 1) {
      arrived_.store(0, std::memory_order_relaxed);
      generation_.store(gen + 1, std::memory_order_release);
      return;
    }
    for (int turns = 0; generation_.load(std::memory_order_acquire) == gen; ++turns)
      if (ahead && ahead->left()) ahead->fetch_one();
      else if (turns < kSpins) _mm_pause(); else std::this_thread::yield();
  }

 private:
  static constexpr int kSpins = 1 << 14;
  alignas(64) std::atomic<int> arrived_{0};
  alignas(64) std::atomic<int> generation_{0};
};

// Forwards of up to this many rows with int8 dot products run in one parallel region (run_region).
constexpr int64_t kRegionRows = 16;

// Buffers of `sizes` floats one after the other in `buf` (grown as needed, kept from call to call).
template <size_t K>
std::array<float*, K> carve(std::vector<float>& buf, const int64_t (&sizes)[K]) {
  int64_t total = 0;
  for (int64_t size : sizes) total += size;
  if (static_cast<int64_t>(buf.size()) < total) buf.resize(total);
  std::array<float*, K> at;
  for (size_t i = 0, o = 0; i < K; o += sizes[i++]) at[i] = buf.data() + o;
  return at;
}

// How through_layers runs on the calling thread alone: each matmul (any weight kind) and the
// attention parallel inside, as their torch ops run them; nothing to meet at, every step its own.
struct Serial {
  int64_t n;
  void matmul(const Matmul& m, const float* in, float* y) const { m(in, y, n); }
  // the attention's work items [0, total), as attend_rows shares them
  template <class F>
  void share(int64_t total, const F& f) const { at::parallel_for(0, total, 1, f); }
  void wait(const Matmul*) const {}
  template <class F>
  void once(const F& f) const { f(); }
};

// How through_layers runs on each thread of run_region's parallel region: a thread takes its
// share of each matmul's tiles (int8 dot products: x rounded by every thread, its tiles with
// their bias) and of the attention's items, meets the others at `meet` after each, and fetches
// its share of the next matmul while it waits there (Ahead).
class Region {
 public:
  Region(SpinBarrier& meet, int64_t n) : meet_(meet), n_(n), t_(omp_get_thread_num()), T_(omp_get_num_threads()) {}

  // y = m(in): this thread rounds `in` (its own scratch) and computes its share of the tiles
  // (with their bias); the others' shares are in y after the next meeting
  void matmul(const Matmul& m, const float* in, float* y) const {
    const DotInput xq = quant_dot_input(in, n_, m.in, m.bits);
    share(m.out / 16, [&](int64_t a, int64_t b) {
      m.tiles(xq, y, n_, a, b);
      m.add_bias(y, n_, 16 * a, 16 * b);
    });
  }
  template <class F>
  void share(int64_t total, const F& f) const {
    const auto [a, b] = part(total);
    if (a < b) f(a, b);
  }
  // `next`: the matmul after the meeting (none: nothing to fetch)
  void wait(const Matmul* next) { meet_.wait(T_, next ? ahead_for(*next) : nullptr); }
  template <class F>
  void once(const F& f) const {
    if (t_ == 0) f();
  }

 private:
  SpinBarrier& meet_;
  const int64_t n_, t_, T_;
  Ahead ahead_;

  // this thread's share [a, b) of `total` items, in contiguous runs as at::parallel_for's
  std::pair<int64_t, int64_t> part(int64_t total) const {
    const int64_t per = (total + T_ - 1) / T_, a = std::min(total, t_ * per);
    return {a, std::min(total, a + per)};
  }
  // `ahead` for the meetings before matmul m: this thread's part of m's tiles; set at the first
  // of them, later ones go on where it stopped
  Ahead* ahead_for(const Matmul& m) {
    if (ahead_.of != &m) {
      const auto [a, b] = part(m.out / 16);
      const int64_t bytes[3] = {m.in * 16 * m.bits / 8, m.in, m.offset ? m.in : 0};  // a tile's
      const void* base[3] = {m.w, m.scale, m.offset};
      ahead_.of = &m;
      for (int i = 0; i < 3; ++i) {
        ahead_.p[i] = static_cast<const char*>(base[i]) + a * bytes[i];
        ahead_.end[i] = ahead_.p[i] + std::min((b - a) * bytes[i], kAheadBytes);
      }
    }
    return &ahead_;
  }
};
}  // namespace

// A forward's arguments, checked (run), as the layer loop reads them.
struct DecoderStack::Pass {
  int64_t n;
  const float *cos, *sin;
  const int64_t* rope;  // each row's RoPE position
  void* const* kc;      // each layer's caches
  void* const* vc;
  bool bf16;
  int64_t M, window;
  const AttentionPlan& plan;
  int64_t threads, items;  // attention_items(plan, nq, nkv, threads)
  at::IntArrayRef capture;
  float* const* caps;  // capture's outputs, in its order
  float* logits;       // the head's output where the loop runs the head, else null
};

// The buffers of a forward's layers, each [n, its width]: x the residual stream, the steps
// between matmuls in h, q, k, v, mid, act; the matmuls' and the attention's outputs in qkv, attn,
// proj (o's and down's: o's is read before down's is written) and up. In run_region each thread
// has its own of the first, and the threads share the second.
struct DecoderStack::Rows {
  float *x, *h, *q, *k, *v, *mid, *act;
  float *qkv, *attn, *proj, *up;
};

DecoderStack::DecoderStack(std::vector<torch::Tensor> norms, double eps_, std::vector<torch::Tensor> weights,
                           std::vector<int64_t> counts, std::vector<int64_t> kinds,
                           std::vector<std::optional<torch::Tensor>> biases, int64_t nq_, int64_t nkv_,
                           int64_t head_dim)
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
  dot_only = true;
  for (const Layer& L : layers)
    for (const Matmul& m : L.mm) dot_only = dot_only && m.kind == 3;
}

void DecoderStack::set_embed(const torch::Tensor& table) {
  TORCH_CHECK(table.scalar_type() == torch::kFloat32 && table.dim() == 2 && table.size(1) == hidden &&
                  table.is_contiguous(),
              "decoder_stack: embeddings float32 [vocab, ", hidden, "] expected, got ", table.scalar_type(), " ",
              table.sizes());
  embed = table;
}

void DecoderStack::set_head(const torch::Tensor& norm, std::vector<torch::Tensor> weights, int64_t kind) {
  head_norm = norm_weight(norm, hidden);
  head.clear();
  head.emplace_back(at::TensorList(weights), kind, std::nullopt, hidden);
  keep.push_back(norm);
  keep.insert(keep.end(), weights.begin(), weights.end());
}

std::vector<torch::Tensor> DecoderStack::forward(const torch::Tensor& x, const torch::Tensor& cos,
                                                 const torch::Tensor& sin, const torch::Tensor& rope_positions,
                                                 at::TensorList k_caches, at::TensorList v_caches,
                                                 const torch::Tensor& slots, const torch::Tensor& positions,
                                                 const torch::Tensor& parents, int64_t window,
                                                 at::IntArrayRef capture, bool logits) const {
  return run(x, cos, sin, rope_positions, k_caches, v_caches, window, capture, logits,
             [&](int64_t n, int64_t S, int64_t M) {
    return plan_attention(slots, positions, parents, n, S, M, window);
  });
}

torch::Tensor DecoderStack::forward_blocks(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin,
                                           at::TensorList k_caches, at::TensorList v_caches,
                                           const torch::Tensor& slots, const torch::Tensor& positions,
                                           const torch::Tensor& ends) const {
  return run(x, cos, sin, positions, k_caches, v_caches, 0, {}, false, [&](int64_t n, int64_t S, int64_t M) {
    const torch::Tensor chain = torch::zeros({0}, torch::kLong);  // no tree: chains
    AttentionPlan plan = plan_attention(slots, ends, chain, n, S, M, 0);
    const auto ps = positions.to(torch::kLong).contiguous();
    const int64_t* pp = ps.data_ptr<int64_t>();
    for (int64_t r = 0; r < n; ++r)
      TORCH_CHECK(pp[r] >= 0 && pp[r] <= plan.positions[r], "decoder_stack: row ", r, " at position ", pp[r],
                  " attends up to ", plan.positions[r], ", not past its own position");
    plan.writes.assign(pp, pp + n);
    return plan;
  })[0];
}

std::vector<torch::Tensor> DecoderStack::run(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin,
                                             const torch::Tensor& rope_positions, at::TensorList k_caches,
                                             at::TensorList v_caches, int64_t window, at::IntArrayRef capture,
                                             bool logits, const std::function<AttentionPlan(int64_t, int64_t, int64_t)>& plan_for) const {
  const int64_t count = static_cast<int64_t>(layers.size());
  const bool ids = !x.is_floating_point();
  TORCH_CHECK(ids ? x.dim() == 1 && embed.defined()
                  : x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.size(1) == hidden,
              "decoder_layer: x float32 [N, ", hidden, "] (or integer token ids [N] with set_embed's table) expected, got ",
              x.scalar_type(), " ", x.sizes());
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
  TORCH_CHECK(!logits || !head.empty(), "decoder_stack: logits asked of a stack without a head (set_head)");
  const AttentionPlan plan = plan_for(n, S, M);

  std::vector<torch::Tensor> out(1 + capture.size() + logits);
  float* lp = nullptr;
  if (logits) {
    out.back() = torch::empty({n, head[0].out}, torch::kFloat32);
    lp = out.back().data_ptr<float>();
  }
  if (ids) {  // the embeddings' rows, as F.embedding gives them
    const auto tc = x.to(torch::kLong).contiguous();
    const int64_t* tp = tc.data_ptr<int64_t>();
    const int64_t vocab = embed.size(0);
    out[0] = torch::empty({n, hidden}, embed.options());
    const float* table = embed.data_ptr<float>();
    float* rows = out[0].data_ptr<float>();
    for (int64_t r = 0; r < n; ++r) {
      TORCH_CHECK(tp[r] >= 0 && tp[r] < vocab, "decoder_stack: token id ", tp[r], " outside the vocabulary (",
                  vocab, ")");
      std::memcpy(rows + r * hidden, table + tp[r] * hidden, hidden * sizeof(float));
    }
  } else {
    out[0] = x.contiguous().clone();
  }
  float* xp = out[0].data_ptr<float>();
  std::vector<float*> caps(capture.size());
  for (size_t c = 0; c < capture.size(); ++c) {
    out[1 + c] = torch::empty_like(out[0]);
    caps[c] = out[1 + c].data_ptr<float>();
  }
  // the calling thread's buffers, kept from call to call
  const int64_t heads = nq + 2 * nkv;
  thread_local std::vector<float> buf;
  const auto r = carve(buf, {n * hidden, n * nq * D, n * nkv * D, n * nkv * D, n * hidden, n * inter,
                             n * heads * D, n * nq * D, n * hidden, n * 2 * inter});
  const Rows b{xp, r[0], r[1], r[2], r[3], r[4], r[5], r[6], r[7], r[8], r[9]};
  // a head of int8 dot products runs in the region too, as its last matmul (no second region, no
  // trip through Python for the final norm and the logits: a faster step,
  // docs/results/design-measurements.md); any other head after it
  const int64_t threads = at::get_num_threads();
  const bool region = dot_only && n <= kRegionRows && threads > 1;
  const bool head_here = logits && (!region || head[0].kind == 3);
  const Pass p{n, cos.data_ptr<float>(), sin.data_ptr<float>(), rpp, kc.data(), vc.data(), bf16, M, window, plan,
               threads, attention_items(plan, nq, nkv, threads), capture, caps.data(), head_here ? lp : nullptr};
  if (region) {
    run_region(p, b);
  } else {
    Serial ex{n};
    through_layers(ex, p, b);
  }
  if (logits && !head_here) {
    rms_norm_rows(xp, head_norm, b.h, n, hidden, eps);
    head[0](b.h, lp, n);
  }
  return out;
}

// The layers of a forward (and the head where p has one), the same steps whichever way `ex` runs
// them: the same kernels on the same numbers, each output computed whole by one thread, so the
// same results bit for bit, however the work is shared. In run_region every thread runs the steps
// between `ex`'s (norms, RoPE, the residual adds) on its own copy, and a meeting after each of
// `ex`'s makes its whole output everyone's input: six meetings a layer.
template <class Exec>
void DecoderStack::through_layers(Exec& ex, const Pass& p, const Rows& b) const {
  const int64_t count = static_cast<int64_t>(layers.size()), n = p.n;
  for (int64_t l = 0; l < count; ++l) {
    const Layer& L = layers[l];
    rms_norm_rows(b.x, L.in_norm, b.h, n, hidden, eps);
    ex.matmul(L.mm[0], b.h, b.qkv);
    ex.wait(&L.mm[1]);
    // q, k and v apart, RoPE on q and k (head by head, as on qkv); one thread writes the keys and
    // values into the caches, then each attends to its share of the items
    split_qkv(b.qkv, b.q, b.k, b.v, n, nq, nkv, D);
    rope_rows(b.q, p.cos, p.sin, p.rope, n, nq, D, nq);
    rope_rows(b.k, p.cos, p.sin, p.rope, n, nkv, D, nkv);
    ex.once([&] { write_rows_kv(p.plan, b.k, b.v, p.kc[l], p.vc[l], p.bf16, nkv, p.M, D); });
    ex.wait(&L.mm[1]);
    ex.share(p.items, [&](int64_t a, int64_t e) {
      attend_rows_range(p.plan, b.q, p.kc[l], p.vc[l], p.bf16, b.attn, nq, nkv, p.M, D, p.window, p.threads, a, e);
    });
    ex.wait(&L.mm[1]);
    ex.matmul(L.mm[1], b.attn, b.proj);
    ex.wait(&L.mm[2]);
    add_rows(b.x, b.proj, b.mid, n * hidden);
    rms_norm_rows(b.mid, L.post_norm, b.h, n, hidden, eps);
    ex.matmul(L.mm[2], b.h, b.up);
    ex.wait(&L.mm[3]);
    silu_mul_rows(b.up, b.act, n, inter);
    ex.matmul(L.mm[3], b.act, b.proj);
    ex.wait(l + 1 < count ? &layers[l + 1].mm[0] : p.logits ? &head[0] : nullptr);
    add_rows(b.mid, b.proj, b.x, n * hidden);
    ex.once([&] {
      for (size_t c = 0; c < p.capture.size(); ++c)
        if (p.capture[c] == l + 1) std::memcpy(p.caps[c], b.x, n * hidden * sizeof(float));
    });
  }
  if (p.logits) {  // the head as a layer's matmul (in the region: its tiles shared, the region's end joins them)
    rms_norm_rows(b.x, head_norm, b.h, n, hidden, eps);
    ex.matmul(head[0], b.h, p.logits);
  }
}

// The layer loop for few rows of int8 dot products: one parallel region for the whole forward
// instead of one per matmul and attention (~150 a forward of 30 layers, each some microseconds of
// threads starting late and joining). Every thread runs the steps between the shared ones on its
// own copy, where thread 0 running them alone while the others waited took ten meetings a layer
// and left the others idle. The meetings are SpinBarriers, cheaper than OpenMP's (both measured:
// docs/results/design-measurements.md).
void DecoderStack::run_region(const Pass& p, const Rows& shared) const {
  const int64_t n = p.n;
  SpinBarrier meet;
#pragma omp parallel num_threads(p.threads)
  {
    Region ex(meet, n);
    // this thread's own copy of the steps between the shared ones (the residual stream, norms,
    // RoPE, the int8 rounding of each matmul's input): the same code on the same numbers, so the
    // same results, and no thread waits while another does them
    thread_local std::vector<float> own;
    const auto r = carve(own, {n * hidden, n * hidden, n * nq * D, n * nkv * D, n * nkv * D, n * hidden, n * inter});
    const Rows b{r[0], r[1], r[2], r[3], r[4], r[5], r[6], shared.qkv, shared.attn, shared.proj, shared.up};
    std::memcpy(b.x, shared.x, n * hidden * sizeof(float));
    through_layers(ex, p, b);
    ex.once([&] { std::memcpy(shared.x, b.x, n * hidden * sizeof(float)); });
  }
}

TORCH_LIBRARY_FRAGMENT(angelspec, m) {
  m.class_<DecoderStack>("DecoderStack")
      .def(torch::init<std::vector<torch::Tensor>, double, std::vector<torch::Tensor>, std::vector<int64_t>,
                       std::vector<int64_t>, std::vector<std::optional<torch::Tensor>>, int64_t, int64_t, int64_t>())
      .def("set_embed", &DecoderStack::set_embed)
      .def("set_head", &DecoderStack::set_head)
      .def("forward", &DecoderStack::forward)
      .def("forward_blocks", &DecoderStack::forward_blocks);
}
