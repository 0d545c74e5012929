// The routed experts of a MoE layer (experts_forward, layer.h): each expert's matmuls through the fused layer's
// packed linears (their biases added where the family has them, gpt-oss), the router's choice made here where the
// caller gives none.
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "layer.h"
#include "tasks.h"

namespace offload {
namespace {

struct ExpertScratch {  // per calling thread (an OpenMP worker has its own), grown on demand
  Floats h, gate_up, act;
};
thread_local ExpertScratch tls_expert;

// y [c, D] = down(act(gate(h)) * up(h)) of one expert for its c tokens' rows h gathered from x's second half.
void run_expert(const ExpertsArgs& e, int64_t x, const int64_t* pairs, int64_t c, int nthreads, float* y) {
  const int64_t D = e.D, F = e.F;
  ExpertScratch& b = tls_expert;
  float* h = grow(b.h, c * D);
  for (int64_t r = 0; r < c; ++r) {
    const float* src = e.x + (pairs[r] / e.top_k) * 2 * D + D;
    std::copy(src, src + D, h + r * D);
  }
  float* gate_up = grow(b.gate_up, c * 2 * F);
  float* act = grow(b.act, c * F);
  LayerArgs a{};
  a.path = e.path;
  a.nthreads = nthreads;
  a.N = c;
  run_linear(a, (*e.gate_up)[size_t(x)], h, gate_up);
  gate_mul(gate_up, c, F, e.gate, act, e.path, nthreads);
  run_linear(a, (*e.down)[size_t(x)], act, y);
}

constexpr int64_t kFewTokens = 4;  // experts with at most this many tokens each run side by side, one per thread

float dot_ref(const float* a, const float* b, int64_t n) {
  float s = 0.f;
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

__attribute__((target("avx2,fma"))) float dot_avx2(const float* a, const float* b, int64_t n) {
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
    acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), acc1);
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, _mm256_add_ps(acc0, acc1));
  float s = ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) + ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
  return s + dot_ref(a + i, b + i, n - i);
}

// The router's choice for each token: its top_k experts by h . router^T + router_bias (ties: the lower index) and
// their softmax weights, over all experts or, with norm_topk, over the top_k alone (the same numbers: p_j / sum of
// the top p). The logits are shared out by (token, eight experts), so a decode step's one token reads the router's
// rows on every thread.
void route_tokens(const ExpertsArgs& e, int64_t* ids, float* weights) {
  const int64_t E = e.n_experts, K = e.top_k, D = e.D;
  std::vector<float> logits(static_cast<size_t>(e.N * E));
  constexpr int64_t kRowsPerTask = 8;  // router rows of one task
  const int64_t per_token = (E + kRowsPerTask - 1) / kRowsPerTask;
  run_tasks(e.nthreads, e.N * E * D >= (int64_t(1) << 15), e.N * per_token, [&](int64_t t) {
    const int64_t n = t / per_token, x0 = t % per_token * kRowsPerTask;
    const float* h = e.x + n * 2 * D + D;
    for (int64_t x = x0; x < std::min(E, x0 + kRowsPerTask); ++x) {
      float& l = logits[size_t(n * E + x)];
      l = e.path == P_SCALAR ? dot_ref(h, e.router + x * D, D) : dot_avx2(h, e.router + x * D, D);
      if (e.router_bias != nullptr) l += e.router_bias[x];
    }
  });
  run_tasks(e.nthreads, e.N * E >= (int64_t(1) << 12), e.N, [&](int64_t n) {
    const float* l = logits.data() + n * E;
    const float top = *std::max_element(l, l + E);
    double total = 0.0;
    for (int64_t x = 0; x < E; ++x) total += std::exp(double(l[x] - top));
    std::vector<int64_t> order(static_cast<size_t>(E));
    for (int64_t x = 0; x < E; ++x) order[size_t(x)] = x;
    std::partial_sort(order.begin(), order.begin() + K, order.end(),
                      [&](int64_t a, int64_t b) { return l[a] > l[b] || (l[a] == l[b] && a < b); });
    double kept = 0.0;
    for (int64_t j = 0; j < K; ++j) kept += std::exp(double(l[order[size_t(j)]] - top));
    for (int64_t j = 0; j < K; ++j) {
      ids[n * K + j] = order[size_t(j)];
      weights[n * K + j] = float(std::exp(double(l[order[size_t(j)]] - top)) / (e.norm_topk ? kept : total));
    }
  });
}

}  // namespace

void experts_forward(const ExpertsArgs& args) {
  ExpertsArgs e = args;
  std::vector<int64_t> routed_ids;
  std::vector<float> routed_weights;
  if (e.ids == nullptr) {
    routed_ids.resize(size_t(e.N * e.top_k));
    routed_weights.resize(size_t(e.N * e.top_k));
    route_tokens(e, routed_ids.data(), routed_weights.data());
    e.ids = routed_ids.data();
    e.weights = routed_weights.data();
  }
  const int64_t N = e.N, D = e.D, K = e.top_k;
  // counting sort of the (token, slot) pairs by expert: expert x's pairs are order[start[x] .. start[x + 1])
  std::vector<int64_t> start(size_t(e.n_experts + 1), 0), order(size_t(N * K));
  for (int64_t j = 0; j < N * K; ++j) ++start[size_t(e.ids[j] + 1)];
  for (int64_t x = 0; x < e.n_experts; ++x) start[size_t(x + 1)] += start[size_t(x)];
  std::vector<int64_t> fill(start.begin(), start.end() - 1);
  for (int64_t j = 0; j < N * K; ++j) order[size_t(fill[size_t(e.ids[j])]++)] = j;
  std::vector<int64_t> active;
  int64_t most = 0;
  for (int64_t x = 0; x < e.n_experts; ++x) {
    const int64_t c = start[size_t(x + 1)] - start[size_t(x)];
    if (c > 0) active.push_back(x);
    most = std::max(most, c);
  }
  // y rows of every active expert, in order; a decode step's few small products run one expert per thread (each
  // matmul alone is too short to split well), a prefill's large ones each over all threads
  std::vector<float> ys(size_t(N * K * D));
  auto run = [&](size_t j, int nthreads) {
    const int64_t x = active[j];
    run_expert(e, x, order.data() + start[size_t(x)], start[size_t(x + 1)] - start[size_t(x)], nthreads,
               ys.data() + start[size_t(x)] * D);
  };
  const bool side_by_side = most <= kFewTokens && active.size() > 1;
  run_tasks(e.nthreads, side_by_side, int64_t(active.size()),
            [&](int64_t j) { run(size_t(j), side_by_side ? 1 : e.nthreads); });
  for (int64_t n = 0; n < N; ++n) std::copy(e.x + n * 2 * D, e.x + n * 2 * D + D, e.out + n * D);
  for (int64_t j = 0; j < N * K; ++j) {  // in expert order, as the reference adds them
    const int64_t pair = order[size_t(j)];
    const float w = e.weights[pair];
    const float* y = ys.data() + j * D;
    float* o = e.out + (pair / K) * D;
    for (int64_t i = 0; i < D; ++i) o[i] += w * y[i];
  }
}

}  // namespace offload
