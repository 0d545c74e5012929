// Fused decoder layer: the math of offload/model/llama.py::layer_forward in one call (Llama's, Gemma 2/3's norms
// after attention and the MLP, GELU-tanh, score scale, soft-cap and per-layer window, OLMo 2's q/k norms over all
// heads and no norms before attention and the MLP, rope over the first rotary_dim of each head, gpt-oss's sinks).
// The matmuls go through the dispatched packed kernels (packed_linear); norms and rope are plain loops, silu x up
// is vectorized, and attention is attention.cpp's.
#include "layer.h"
#include "tasks.h"

#include <immintrin.h>

// GCC 12's AVX-512 headers build some intrinsics on _mm512_undefined_*(), which -Wmaybe-uninitialized flags
// (attention's 512-bit shuffles and extracts), as in qgemm_avx512.cpp.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

#include <algorithm>
#include <climits>
#include <cmath>
#include <type_traits>
#include <vector>

namespace offload {
namespace {

namespace avx2 {
#define AFN __attribute__((target("avx2,fma"))) inline
#include "exp8.inc"
#undef AFN
}  // namespace avx2

#define ALWAYS_INLINE inline __attribute__((always_inline))

struct LayerScratch {  // per calling thread, grown on demand
  Floats h, qkv, att, tmp, gate_up, act, resid;
};
thread_local LayerScratch tls_layer;

// The sum of x's squares in double, in 8 running sums: one chain of dependent adds waits 4 cycles an element,
// about 1.1 us for a 1024-wide row.
double sum_squares(const float* x, int64_t n) {
  double s[8] = {};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int j = 0; j < 8; ++j) s[j] += double(x[i + j]) * double(x[i + j]);
  double t = ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7]));
  for (; i < n; ++i) t += double(x[i]) * double(x[i]);
  return t;
}

// y [N, D] = x * rsqrt(mean(x^2) + eps) * w, each row accumulated in double.
void rms_norm_rows(const float* x, const float* w, int64_t N, int64_t D, float eps, float* y, int nth) {
  auto row = [&](int64_t n) {
    const float* xn = x + n * D;
    const double ss = sum_squares(xn, D);
    const float r = 1.0f / std::sqrt(float(ss / double(D)) + eps);
    for (int64_t i = 0; i < D; ++i) y[n * D + i] = w[i] * (xn[i] * r);
  };
  run_tasks(nth, N > 8, N, row);
}

// In place on the first rot dimensions of n_heads heads of dh: x * cos + roll(x, rot / 2) * sin (sin's first half
// negated); the rest of each head passes (partial rotary).
void rope_heads(float* x, int64_t n_heads, int64_t dh, int64_t rot, const float* cos, const float* sin) {
  const int64_t half = rot / 2;
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
  run_tasks(a.nthreads, a.N > 8, a.N, [&](int64_t n) {
    float* row = qkv + n * width;
    const float *cos = a.cos + n * s.rotary_dim, *sin = a.sin + n * s.rotary_dim;
    rope_heads(row, s.n_heads, s.head_dim, s.rotary_dim, cos, sin);
    rope_heads(row + q_size, s.n_kv_heads, s.head_dim, s.rotary_dim, cos, sin);
    const int64_t slot = a.tokens[n * kTokenCols + kSlot];
    if (slot < 0) return;  // padding: the unfused path writes it to the trash slot, read by no one
    if (a.kv_bf16) {
      f32_rows_to_bf16(row + q_size, kv_size, static_cast<uint16_t*>(a.k_cache) + slot * kv_size);
      f32_rows_to_bf16(row + q_size + kv_size, kv_size, static_cast<uint16_t*>(a.v_cache) + slot * kv_size);
    } else {
      std::copy(row + q_size, row + q_size + kv_size, static_cast<float*>(a.k_cache) + slot * kv_size);
      std::copy(row + q_size + kv_size, row + width, static_cast<float*>(a.v_cache) + slot * kv_size);
    }
  });
}

// act [N, I] = silu(gate) * up, gelu_tanh(gate) * up or gpt-oss's clamped SwiGLU from gate_up [N, 2I] (rows:
// gate | up); rows split over the threads.
void gate_mul_ref(const float* g, const float* u, int64_t I, const Gate& k, float* act) {
  constexpr float kGeluK = 0.7978845608028654f;  // sqrt(2 / pi)
  for (int64_t i = 0; i < I; ++i) {
    if (k.act == kSwigluOai) {
      const float gi = std::min(g[i], k.limit), ui = std::min(std::max(u[i], -k.limit), k.limit);
      act[i] = gi / (1.f + std::exp(-k.alpha * gi)) * (ui + 1.f);
      continue;
    }
    act[i] = (k.act == kGeluTanh ? 0.5f * g[i] * (1.f + std::tanh(kGeluK * (g[i] + 0.044715f * g[i] * g[i] * g[i])))
                                 : g[i] / (1.f + std::exp(-g[i]))) * u[i];
  }
}

// silu(g) = g / (1 + e^-g); gelu_tanh(g) = g / (1 + e^-2z), z = sqrt(2 / pi) (g + 0.044715 g^3): the same form, as
// (1 + tanh z) / 2 = 1 / (1 + e^-2z); gpt-oss's g / (1 + e^(-alpha g)) too, g and u clamped first (bounds of +-inf
// for the others, NaN passing as the scalar path's) and u + 1.
__attribute__((target("avx2,fma"))) void gate_mul_avx2(const float* g, const float* u, int64_t I, const Gate& k,
                                                       float* act) {
  const bool oai = k.act == kSwigluOai;
  const __m256 c1 = _mm256_set1_ps(k.act == kGeluTanh ? -2.f * 0.7978845608028654f : oai ? -k.alpha : -1.f);
  const __m256 c3 = _mm256_set1_ps(k.act == kGeluTanh ? -2.f * 0.7978845608028654f * 0.044715f : 0.f);
  const __m256 hi = _mm256_set1_ps(oai ? k.limit : INFINITY), lo = _mm256_set1_ps(oai ? -k.limit : -INFINITY);
  const __m256 up_add = _mm256_set1_ps(oai ? 1.f : 0.f);
  int64_t i = 0;
  for (; i + 8 <= I; i += 8) {
    const __m256 gv = _mm256_min_ps(hi, _mm256_loadu_ps(g + i));  // a NaN lane stays NaN (min's second operand)
    const __m256 uv = _mm256_add_ps(_mm256_min_ps(hi, _mm256_max_ps(lo, _mm256_loadu_ps(u + i))), up_add);
    const __m256 arg = _mm256_fmadd_ps(_mm256_mul_ps(c3, gv), _mm256_mul_ps(gv, gv), _mm256_mul_ps(c1, gv));
    const __m256 den = _mm256_add_ps(_mm256_set1_ps(1.f), avx2::exp8(arg));
    _mm256_storeu_ps(act + i, _mm256_mul_ps(_mm256_div_ps(gv, den), uv));
  }
  gate_mul_ref(g + i, u + i, I - i, k, act + i);
}

void add_rows(float* y, const float* x, const float* r, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] = x[i] + r[i];
}

// Qwen3: each head of q and of k RMS-normed over head_dim, in place, before rope; OLMo 2 (qk_norm_all): the whole
// of q and the whole of k, all heads as one row.
void qk_norm(const LayerArgs& a, float* qkv) {
  const LayerShape& s = a.shape;
  const int64_t q_size = s.n_heads * s.head_dim, kv_size = s.n_kv_heads * s.head_dim;
  const int64_t width = q_size + 2 * kv_size;
  const int64_t q_rows = a.qk_norm_all ? 1 : s.n_heads, k_rows = a.qk_norm_all ? 1 : s.n_kv_heads;
  for (int64_t n = 0; n < a.N; ++n) {
    float *q = qkv + n * width, *k = q + q_size;
    rms_norm_rows(q, a.q_norm, q_rows, q_size / q_rows, s.eps, q, 1);
    rms_norm_rows(k, a.k_norm, k_rows, kv_size / k_rows, s.eps, k, 1);
  }
}

// The input of attention or of the MLP: x RMS-normed by w into h, or x itself where the layer has no such norm.
const float* normed(const LayerArgs& a, const float* x, const float* w, float* h) {
  if (w == nullptr) return x;
  rms_norm_rows(x, w, a.N, a.qkv.w.K, a.shape.eps, h, a.nthreads);
  return h;
}

// The MoE hand-over: out [N, 2D] = residual + (shared expert of h, scaled by its sigmoid gate) | h.
void moe_handover(const LayerArgs& a, const float* resid, const float* h, const float* shared, float* out) {
  const int64_t N = a.N, D = a.qkv.w.K;
  for (int64_t n = 0; n < N; ++n) {
    const float *r = resid + n * D, *hn = h + n * D;
    float* o = out + n * 2 * D;
    float g = 0.f;
    if (shared != nullptr) {
      double dot = 0.0;
      for (int64_t i = 0; i < D; ++i) dot += double(hn[i]) * double(a.shared_gate[i]);
      g = 1.f / (1.f + std::exp(-float(dot)));
    }
    for (int64_t i = 0; i < D; ++i) o[i] = shared != nullptr ? r[i] + g * shared[n * D + i] : r[i];
    std::copy(hn, hn + D, o + D);
  }
}

}  // namespace

void gate_mul(const float* gate_up, int64_t N, int64_t I, const Gate& gate, float* act, int path, int nth) {
  run_tasks(nth, N * I >= (int64_t(1) << 15), N, [&](int64_t n) {
    const float *g = gate_up + n * 2 * I, *u = g + I;
    if (path == P_SCALAR) gate_mul_ref(g, u, I, gate, act + n * I);
    else gate_mul_avx2(g, u, I, gate, act + n * I);
  });
}

// One matrix of a linear. In a bf16 plan, bf16 weights take x rounded to bf16: on AVX-512 BF16 the bf16 x bf16
// tiles then read them in one stream per row, at 1.3-2.0x the fp32-widening kernel's rate at 1 and 2 tokens and
// 1.6-2.5x at 5 (a Zen 4, SmolLM2-135M's and a 0.8B model's shapes), as fast as its unfused linears.
void linear_part(const LayerArgs& a, int fmt, const WView& w, const float* bias, const float* x, float* y) {
  if (!a.act_bf16 || fmt != W_BF16) {
    packed_linear(a.path, x, a.N, fmt, w, bias, y, a.nthreads);
    return;
  }
  thread_local std::vector<uint16_t> xh;
  xh.resize(static_cast<size_t>(a.N * w.K));
  f32_rows_to_bf16(x, a.N * w.K, xh.data());
  packed_linear_bf16(a.path, xh.data(), a.N, fmt, w, bias, y, a.nthreads);
}

void run_linear(const LayerArgs& a, const LinearArg& l, const float* x, float* y) {
  if (l.parts.empty()) {
    linear_part(a, l.fmt, l.w, l.bias, x, y);
    return;
  }
  // a stacked linear: each part into its own [N, Mp], then into its columns of y [N, M]
  std::vector<float> part_y;
  int64_t col = 0;
  for (const LinearArg& p : l.parts) {
    const int64_t mp = p.w.M;
    part_y.resize(static_cast<size_t>(a.N * mp));
    linear_part(a, p.fmt, p.w, p.bias, x, part_y.data());
    for (int64_t n = 0; n < a.N; ++n)
      std::copy(part_y.data() + n * mp, part_y.data() + (n + 1) * mp, y + n * l.w.M + col);
    col += mp;
  }
}

void attention_forward(const LayerArgs& a, float* qkv, float* att) {
  rope_and_store(a, qkv);
  attention(a, qkv, att);
}

void bf16_rows_to_f32(const uint16_t* src, int64_t n, float* dst) {
  for (int64_t i = 0; i < n; ++i) dst[i] = bf16_bits_to_f32(src[i]);
}

void f32_rows_to_bf16(const float* src, int64_t n, uint16_t* dst) {
  for (int64_t i = 0; i < n; ++i) dst[i] = f32_to_bf16_bits(src[i]);
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

  run_linear(a, a.qkv, normed(a, a.x, a.attn_norm, h), qkv);
  if (a.q_norm != nullptr) qk_norm(a, qkv);
  rope_and_store(a, qkv);
  attention(a, qkv, att);
  run_linear(a, a.o, att, tmp);
  if (a.post_attn_norm != nullptr) rms_norm_rows(tmp, a.post_attn_norm, N, D, s.eps, tmp, a.nthreads);
  if (a.moe) {
    float* resid = grow(b.resid, N * D);
    add_rows(resid, a.x, tmp, N * D);
    const float* hm = normed(a, resid, a.mlp_norm, h);
    const bool shared = a.gate_up.w.M > 0;
    if (shared) {
      run_linear(a, a.gate_up, hm, gate_up);
      gate_mul(gate_up, N, I, Gate{a.act, 0.f, 0.f}, act, a.path, a.nthreads);
      run_linear(a, a.down, act, tmp);
    }
    moe_handover(a, resid, hm, shared ? tmp : nullptr, a.out);
    return;
  }
  add_rows(a.out, a.x, tmp, N * D);

  run_linear(a, a.gate_up, normed(a, a.out, a.mlp_norm, h), gate_up);
  gate_mul(gate_up, N, I, Gate{a.act, 0.f, 0.f}, act, a.path, a.nthreads);
  run_linear(a, a.down, act, tmp);
  if (a.post_mlp_norm != nullptr) rms_norm_rows(tmp, a.post_mlp_norm, N, D, s.eps, tmp, a.nthreads);
  add_rows(a.out, a.out, tmp, N * D);
}

void rms_norm(const float* x, const float* w, int64_t N, int64_t D, float eps, float* y, int nth) {
  rms_norm_rows(x, w, N, D, eps, y, nth);
}

}  // namespace offload
