// Fused Llama decoder layer: the math of offload/model/llama.py::layer_forward in one call.
// The matmuls go through the dispatched packed kernels (packed_linear); the elementwise parts and
// attention are plain loops (tiny next to the matmuls at decode), attention parallel over tokens x heads.
#include "layer.h"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace offload {
namespace {

#define ALWAYS_INLINE inline __attribute__((always_inline))

struct LayerScratch {  // per calling thread, grown on demand
  std::vector<float> h, qkv, att, tmp, gate_up, act;
};
thread_local LayerScratch tls_layer;

float* grow(std::vector<float>& v, int64_t n) {
  if (v.size() < size_t(n)) v.resize(size_t(n));
  return v.data();
}

// y [N, D] = x * rsqrt(mean(x^2) + eps) * w, each row accumulated in double.
void rms_norm_rows(const float* x, const float* w, int64_t N, int64_t D, float eps, float* y, int nth) {
#pragma omp parallel for num_threads(nth) if (nth > 1 && N > 8)
  for (int64_t n = 0; n < N; ++n) {
    const float* xn = x + n * D;
    double ss = 0.0;
    for (int64_t i = 0; i < D; ++i) ss += double(xn[i]) * double(xn[i]);
    const float r = 1.0f / std::sqrt(float(ss / double(D)) + eps);
    for (int64_t i = 0; i < D; ++i) y[n * D + i] = w[i] * (xn[i] * r);
  }
}

// In place on n_heads heads of dh: x * cos + roll(x, dh / 2) * sin (sin's first half negated).
void rope_heads(float* x, int64_t n_heads, int64_t dh, const float* cos, const float* sin) {
  const int64_t half = dh / 2;
  for (int64_t h = 0; h < n_heads; ++h) {
    float* xh = x + h * dh;
    for (int64_t i = 0; i < half; ++i) {
      const float a = xh[i], b = xh[i + half];
      xh[i] = a * cos[i] + b * sin[i];
      xh[i + half] = b * cos[i + half] + a * sin[i + half];
    }
  }
}

// Rope on q and k of every token, then K and V of real tokens into their cache slots.
void rope_and_store(const LayerArgs& a, float* qkv) {
  const LayerShape& s = a.shape;
  const int64_t q_size = s.n_heads * s.head_dim, kv_size = s.n_kv_heads * s.head_dim;
  const int64_t width = q_size + 2 * kv_size;
#pragma omp parallel for num_threads(a.nthreads) if (a.nthreads > 1 && a.N > 8)
  for (int64_t n = 0; n < a.N; ++n) {
    float* row = qkv + n * width;
    const float *cos = a.cos + n * s.head_dim, *sin = a.sin + n * s.head_dim;
    rope_heads(row, s.n_heads, s.head_dim, cos, sin);
    rope_heads(row + q_size, s.n_kv_heads, s.head_dim, cos, sin);
    const int64_t slot = a.tokens[n * kTokenCols + kSlot];
    if (slot < 0) continue;  // padding: the unfused path writes it to the trash slot, read by no one
    std::copy(row + q_size, row + q_size + kv_size, a.k_cache + slot * kv_size);
    std::copy(row + q_size + kv_size, row + width, a.v_cache + slot * kv_size);
  }
}

// out [dh] = softmax(q . k_j * scale) @ v_j over n_keys keys spaced stride floats apart.
ALWAYS_INLINE void attend_body(const float* q, const float* k, const float* v, int64_t stride, int64_t n_keys,
                               int64_t dh, float scale, float* scores, float* out) {
  float top = -INFINITY;
  for (int64_t j = 0; j < n_keys; ++j) {
    const float* kj = k + j * stride;
    float dot = 0.f;
#pragma omp simd reduction(+ : dot)
    for (int64_t i = 0; i < dh; ++i) dot += q[i] * kj[i];
    scores[j] = dot * scale;
    top = std::max(top, scores[j]);
  }
  float sum = 0.f;
  for (int64_t j = 0; j < n_keys; ++j) sum += (scores[j] = std::exp(scores[j] - top));
  std::fill(out, out + dh, 0.f);
  for (int64_t j = 0; j < n_keys; ++j) {
    const float p = scores[j], *vj = v + j * stride;
#pragma omp simd
    for (int64_t i = 0; i < dh; ++i) out[i] += p * vj[i];
  }
  const float inv = 1.f / sum;
  for (int64_t i = 0; i < dh; ++i) out[i] *= inv;
}

using AttendFn = void (*)(const float*, const float*, const float*, int64_t, int64_t, int64_t, float, float*, float*);

void attend_ref(const float* q, const float* k, const float* v, int64_t stride, int64_t n_keys, int64_t dh,
                float scale, float* scores, float* out) {
  attend_body(q, k, v, stride, n_keys, dh, scale, scores, out);
}

__attribute__((target("avx2,fma"))) void attend_avx2(const float* q, const float* k, const float* v, int64_t stride,
                                                      int64_t n_keys, int64_t dh, float scale, float* scores,
                                                      float* out) {
  attend_body(q, k, v, stride, n_keys, dh, scale, scores, out);
}

// att [N, n_heads * dh]: each token's heads over keys [lo, hi] of its cache row (GQA: head h reads kv head
// h / (n_heads / n_kv_heads)).
void attention(const LayerArgs& a, const float* qkv, float* att) {
  const LayerShape& s = a.shape;
  const int64_t dh = s.head_dim, q_size = s.n_heads * dh, stride = s.n_kv_heads * dh;
  const int64_t width = q_size + 2 * stride, group = s.n_heads / s.n_kv_heads, tasks = a.N * s.n_heads;
  int64_t max_keys = 1, work = 0;
  for (int64_t n = 0; n < a.N; ++n) {
    const int64_t keys = a.tokens[n * kTokenCols + kHi] - a.tokens[n * kTokenCols + kLo] + 1;
    max_keys = std::max(max_keys, keys);
    work += keys * s.n_heads * dh;
  }
  const AttendFn fn = a.path == P_SCALAR ? attend_ref : attend_avx2;
  const float scale = 1.f / std::sqrt(float(dh));
  // Short decode attention runs on the calling thread: a parallel region costs a barrier, and a barrier
  // costs a whole time slice when another process has taken one of the cores.
  const bool parallel = a.nthreads > 1 && tasks > 1 && work >= (int64_t(1) << 18);
#pragma omp parallel num_threads(a.nthreads) if (parallel)
  {
    std::vector<float> scores(static_cast<size_t>(max_keys));
#pragma omp for schedule(dynamic, 1)
    for (int64_t t = 0; t < tasks; ++t) {
      const int64_t n = t / s.n_heads, h = t % s.n_heads, *tok = a.tokens + n * kTokenCols;
      const int64_t first = (tok[kRowBase] + tok[kLo]) * stride + (h / group) * dh;
      fn(qkv + n * width + h * dh, a.k_cache + first, a.v_cache + first, stride, tok[kHi] - tok[kLo] + 1, dh, scale,
         scores.data(), att + n * q_size + h * dh);
    }
  }
}

// act [N, I] = silu(gate) * up from gate_up [N, 2I] (rows: gate | up).
void silu_mul(const float* gate_up, int64_t N, int64_t I, float* act) {
  for (int64_t n = 0; n < N; ++n) {
    const float *g = gate_up + n * 2 * I, *u = g + I;
    for (int64_t i = 0; i < I; ++i) act[n * I + i] = g[i] / (1.f + std::exp(-g[i])) * u[i];
  }
}

void add_rows(float* y, const float* x, const float* r, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] = x[i] + r[i];
}

void run_linear(const LayerArgs& a, const LinearArg& l, const float* x, float* y) {
  if (l.parts.empty()) {
    packed_linear(a.path, x, a.N, l.fmt, l.w, l.bias, y, a.nthreads);
    return;
  }
  // a stacked linear: each part into its own [N, Mp], then into its columns of y [N, M]
  std::vector<float> part_y;
  int64_t col = 0;
  for (const LinearArg& p : l.parts) {
    const int64_t mp = p.w.M;
    part_y.resize(static_cast<size_t>(a.N * mp));
    packed_linear(a.path, x, a.N, p.fmt, p.w, p.bias, part_y.data(), a.nthreads);
    for (int64_t n = 0; n < a.N; ++n)
      std::copy(part_y.data() + n * mp, part_y.data() + (n + 1) * mp, y + n * l.w.M + col);
    col += mp;
  }
}

}  // namespace

void attention_forward(const LayerArgs& a, float* qkv, float* att) {
  rope_and_store(a, qkv);
  attention(a, qkv, att);
}

void layer_forward(const LayerArgs& a) {
  const LayerShape& s = a.shape;
  const int64_t N = a.N, D = a.qkv.w.K, I = s.intermediate;
  LayerScratch& b = tls_layer;
  float* h = grow(b.h, N * D);
  float* qkv = grow(b.qkv, N * a.qkv.w.M);
  float* att = grow(b.att, N * s.n_heads * s.head_dim);
  float* tmp = grow(b.tmp, N * D);
  float* gate_up = grow(b.gate_up, N * 2 * I);
  float* act = grow(b.act, N * I);

  rms_norm_rows(a.x, a.attn_norm, N, D, s.eps, h, a.nthreads);
  run_linear(a, a.qkv, h, qkv);
  rope_and_store(a, qkv);
  attention(a, qkv, att);
  run_linear(a, a.o, att, tmp);
  add_rows(a.out, a.x, tmp, N * D);

  rms_norm_rows(a.out, a.mlp_norm, N, D, s.eps, h, a.nthreads);
  run_linear(a, a.gate_up, h, gate_up);
  silu_mul(gate_up, N, I, act);
  run_linear(a, a.down, act, tmp);
  add_rows(a.out, a.out, tmp, N * D);
}

}  // namespace offload
