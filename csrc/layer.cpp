// Fused decoder layer: the math of offload/model/llama.py::layer_forward in one call (Llama's, Gemma 2/3's norms
// after attention and the MLP, GELU-tanh, score scale, soft-cap and per-layer window, OLMo 2's q/k norms over all
// heads and no norms before attention and the MLP, rope over the first rotary_dim of each head, gpt-oss's sinks).
// The matmuls go through the dispatched packed kernels (packed_linear); norms and rope are plain loops, silu x up
// is vectorized, and attention runs blocked with an online softmax on the SIMD paths (attention_tiles.inc), one
// query at a time on the scalar path (the reference).
#include "layer.h"

#include <immintrin.h>
#include <omp.h>

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

#define ALWAYS_INLINE inline __attribute__((always_inline))

struct LayerScratch {  // per calling thread, grown on demand
  Floats h, qkv, att, tmp, gate_up, act, resid;
};
thread_local LayerScratch tls_layer;

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
#pragma omp parallel for num_threads(a.nthreads) if (a.nthreads > 1 && a.N > 8)
  for (int64_t n = 0; n < a.N; ++n) {
    float* row = qkv + n * width;
    const float *cos = a.cos + n * s.rotary_dim, *sin = a.sin + n * s.rotary_dim;
    rope_heads(row, s.n_heads, s.head_dim, s.rotary_dim, cos, sin);
    rope_heads(row + q_size, s.n_kv_heads, s.head_dim, s.rotary_dim, cos, sin);
    const int64_t slot = a.tokens[n * kTokenCols + kSlot];
    if (slot < 0) continue;  // padding: the unfused path writes it to the trash slot, read by no one
    if (a.kv_bf16) {
      f32_rows_to_bf16(row + q_size, kv_size, static_cast<uint16_t*>(a.k_cache) + slot * kv_size);
      f32_rows_to_bf16(row + q_size + kv_size, kv_size, static_cast<uint16_t*>(a.v_cache) + slot * kv_size);
    } else {
      std::copy(row + q_size, row + q_size + kv_size, static_cast<float*>(a.k_cache) + slot * kv_size);
      std::copy(row + q_size + kv_size, row + width, static_cast<float*>(a.v_cache) + slot * kv_size);
    }
  }
}

ALWAYS_INLINE float kv_at(const float* p, int64_t i) { return p[i]; }
ALWAYS_INLINE float kv_at(const uint16_t* p, int64_t i) { return bf16_bits_to_f32(p[i]); }

// What turns a query's sum of p_j * v_j into its output, p_j = e^(s_j - m) (m its scores' max, l their sum): 1 / (l +
// e^(sink - m)). A sink (gpt-oss; none: -inf) is one more logit in the softmax's denominator, with no value; where it
// is the larger, everything is taken relative to it instead (no e^(sink - m) to overflow).
ALWAYS_INLINE float softmax_norm(float m, float l, float sink) {
  if (!(sink > m)) return 1.f / (l + std::exp(sink - m));
  const float c = std::exp(m - sink);
  return c / (l * c + 1.f);
}

// out [dh] = softmax(q . k_j * scale | sink) @ v_j over n_keys keys spaced stride elements apart (KV: float or bf16
// bits), the scores soft-capped to cap * tanh(s / cap) where cap > 0; sink: -inf for none.
template <typename KV>
ALWAYS_INLINE void attend_body(const float* q, const KV* k, const KV* v, int64_t stride, int64_t n_keys,
                               int64_t dh, float scale, float cap, float sink, float* scores, float* out) {
  float top = -INFINITY;
  for (int64_t j = 0; j < n_keys; ++j) {
    const KV* kj = k + j * stride;
    float dot = 0.f;
#pragma omp simd reduction(+ : dot)
    for (int64_t i = 0; i < dh; ++i) dot += q[i] * kv_at(kj, i);
    scores[j] = cap > 0.f ? cap * std::tanh(dot * scale / cap) : dot * scale;
    top = std::max(top, scores[j]);
  }
  float sum = 0.f;
  for (int64_t j = 0; j < n_keys; ++j) sum += (scores[j] = std::exp(scores[j] - top));
  std::fill(out, out + dh, 0.f);
  for (int64_t j = 0; j < n_keys; ++j) {
    const float p = scores[j];
    const KV* vj = v + j * stride;
#pragma omp simd
    for (int64_t i = 0; i < dh; ++i) out[i] += p * kv_at(vj, i);
  }
  const float inv = softmax_norm(top, sum, sink);
  for (int64_t i = 0; i < dh; ++i) out[i] *= inv;
}

template <typename KV>
using AttendFn = void (*)(const float*, const KV*, const KV*, int64_t, int64_t, int64_t, float, float, float,
                          float*, float*);

template <typename KV>
void attend_ref(const float* q, const KV* k, const KV* v, int64_t stride, int64_t n_keys, int64_t dh,
                float scale, float cap, float sink, float* scores, float* out) {
  attend_body(q, k, v, stride, n_keys, dh, scale, cap, sink, scores, out);
}

template <typename KV>
__attribute__((target("avx2,fma"))) void attend_avx2(const float* q, const KV* k, const KV* v, int64_t stride,
                                                      int64_t n_keys, int64_t dh, float scale, float cap, float sink,
                                                      float* scores, float* out) {
  attend_body(q, k, v, stride, n_keys, dh, scale, cap, sink, scores, out);
}

// ---- Blocked attention: a task is a tile of up to kTileTokens consecutive tokens of one sequence and one KV head,
// with that head's whole GQA group of query heads: each key and value row is loaded once for all of the tile's
// queries (attention_tiles.inc, compiled for AVX2 and for AVX-512).

constexpr int kTileTokens = 4;
constexpr int kMaxGroup = 16;  // query heads per KV head the blocked path takes (more: the per-query loop)
constexpr int64_t kMaxBufferedDh = 256;  // head sizes a bf16 cache's tiles widen into buffers (more: per query)

struct TileQuery {
  const float* q;  // [dh], already scaled
  int64_t lo, hi;  // keys seen, inclusive, as offsets from the row's key 0
  float m, l;      // running max and sum of the online softmax
  float* out;      // [dh] running sum of p * v
  float cap;       // > 0: scores soft-capped to cap * tanh(s / cap)
  float sink;      // one more logit in the denominator, with no value (gpt-oss); -inf: none
};

// Head h's sink, or -inf where the layer has none.
ALWAYS_INLINE float sink_of(const LayerArgs& a, int64_t h) { return a.sinks != nullptr ? a.sinks[h] : -INFINITY; }

// The first key a token sees: its table's, or later where the layer's own window cuts it (padding: key 0).
ALWAYS_INLINE int64_t first_key(const LayerArgs& a, const int64_t* tok) {
  return a.shape.window > 0 ? std::max(tok[kLo], tok[kHi] - a.shape.window + 1) : tok[kLo];
}

namespace avx2 {
#define AFN __attribute__((target("avx2,fma"))) inline
#define ATTN_PAIR_SCORES 0
#include "attention_tiles.inc"
#undef ATTN_PAIR_SCORES
#undef AFN
}  // namespace avx2

namespace avx512 {
#define AFN __attribute__((target("avx2,fma,avx512f,avx512vl"))) inline
#define ATTN_PAIR_SCORES 1
#include "attention_tiles.inc"
#undef ATTN_PAIR_SCORES
#undef AFN
}  // namespace avx512

// Tiles of attention_blocked: runs of up to kTileTokens consecutive tokens of the same cache row; the last entry
// is N.
std::vector<int64_t> tile_starts(const LayerArgs& a) {
  std::vector<int64_t> start;
  for (int64_t n = 0; n < a.N; ++n) {
    const int64_t* tok = a.tokens + n * kTokenCols;
    if (start.empty() || n - start.back() >= kTileTokens || a.tokens[start.back() * kTokenCols + kRowBase] != tok[kRowBase])
      start.push_back(n);
  }
  start.push_back(a.N);
  return start;
}

// attend_tile compiled for the head size (64 and 128 known at compile time) and the ISA.
template <typename KV>
void attend_tile_for(bool wide, TileQuery* qs, int nq, const KV* kc, const KV* vc, int64_t stride, int64_t k_lo,
                     int64_t k_hi, int64_t dh, const int64_t* blk) {
  if (dh == 64) (wide ? avx512::attend_tile<64, KV> : avx2::attend_tile<64, KV>)(qs, nq, kc, vc, stride, k_lo, k_hi, dh, blk);
  else if (dh == 128) (wide ? avx512::attend_tile<128, KV> : avx2::attend_tile<128, KV>)(qs, nq, kc, vc, stride, k_lo, k_hi, dh, blk);
  else (wide ? avx512::attend_tile<0, KV> : avx2::attend_tile<0, KV>)(qs, nq, kc, vc, stride, k_lo, k_hi, dh, blk);
}

// One tile (tokens [n0, n1)) and KV head g: its queries scaled into qbuf, then attend_tile over their keys.
void attend_task(const LayerArgs& a, const float* qkv, float* att, int64_t n0, int64_t n1, int64_t g, float* qbuf,
                 TileQuery* qs) {
  const LayerShape& s = a.shape;
  const int64_t dh = s.head_dim, q_size = s.n_heads * dh, stride = s.n_kv_heads * dh;
  const int64_t width = q_size + 2 * stride, group = s.n_heads / s.n_kv_heads;
  const float scale = s.scale;
  int64_t k_lo = INT64_MAX, k_hi = -1;
  int nq = 0;
  for (int64_t n = n0; n < n1; ++n) {
    const int64_t* tok = a.tokens + n * kTokenCols;
    const int64_t lo = first_key(a, tok);
    k_lo = std::min(k_lo, lo);
    k_hi = std::max(k_hi, tok[kHi]);
    for (int64_t h = g * group; h < (g + 1) * group; ++h, ++nq) {
      float* qv = qbuf + nq * dh;
      const float* src = qkv + n * width + h * dh;
      for (int64_t d = 0; d < dh; ++d) qv[d] = src[d] * scale;
      qs[nq] = TileQuery{qv, lo, tok[kHi], 0.f, 0.f, att + n * q_size + h * dh, s.softcap, sink_of(a, h)};
    }
  }
  const int64_t row_base = a.tokens[n0 * kTokenCols + kRowBase];
  const int64_t* blk = a.blocks != nullptr ? a.blocks + row_base : nullptr;  // the tile's sequence's block table
  const int64_t first = (blk ? 0 : row_base) * stride + g * dh;
  if (a.kv_bf16) {
    const uint16_t *kc = static_cast<const uint16_t*>(a.k_cache) + first,
                   *vc = static_cast<const uint16_t*>(a.v_cache) + first;
    attend_tile_for(a.path == P_AVX512, qs, nq, kc, vc, stride, k_lo, k_hi, dh, blk);
  } else {
    const float *kc = static_cast<const float*>(a.k_cache) + first, *vc = static_cast<const float*>(a.v_cache) + first;
    attend_tile_for(a.path == P_AVX512, qs, nq, kc, vc, stride, k_lo, k_hi, dh, blk);
  }
}

// Keys x heads x head size of a step's attention: small ones run on the calling thread (a parallel region costs
// a barrier, and a barrier costs a whole time slice when another process has taken one of the cores).
bool attention_in_parallel(const LayerArgs& a, int64_t tasks) {
  int64_t work = 0;
  for (int64_t n = 0; n < a.N; ++n)
    work += (a.tokens[n * kTokenCols + kHi] - first_key(a, a.tokens + n * kTokenCols) + 1) * a.shape.n_heads *
            a.shape.head_dim;
  return a.nthreads > 1 && tasks > 1 && work >= (int64_t(1) << 18);
}

// att [N, n_heads * dh] by tiles of tokens x a KV head's query group (SIMD paths, dh a multiple of 8).
void attention_blocked(const LayerArgs& a, const float* qkv, float* att) {
  const LayerShape& s = a.shape;
  const std::vector<int64_t> start = tile_starts(a);
  const int64_t tasks = int64_t(start.size() - 1) * s.n_kv_heads, group = s.n_heads / s.n_kv_heads;
#pragma omp parallel num_threads(a.nthreads) if (attention_in_parallel(a, tasks))
  {
    Floats qbuf(size_t(kTileTokens * group * s.head_dim));
    TileQuery qs[kTileTokens * kMaxGroup];
#pragma omp for schedule(dynamic, 1)
    for (int64_t t = 0; t < tasks; ++t) {
      const size_t tile = size_t(t / s.n_kv_heads);
      attend_task(a, qkv, att, start[tile], start[tile + 1], t % s.n_kv_heads, qbuf.data(), qs);
    }
  }
}

// The per-query loop of attention (the scalar path's reference, and shapes the tiles do not take).
template <typename KV>
void attention_per_query(const LayerArgs& a, const float* qkv, float* att, const KV* k_cache, const KV* v_cache) {
  const LayerShape& s = a.shape;
  const int64_t dh = s.head_dim, q_size = s.n_heads * dh, stride = s.n_kv_heads * dh;
  const int64_t width = q_size + 2 * stride, group = s.n_heads / s.n_kv_heads;
  int64_t max_keys = 1;
  for (int64_t n = 0; n < a.N; ++n)
    max_keys = std::max(max_keys, a.tokens[n * kTokenCols + kHi] - first_key(a, a.tokens + n * kTokenCols) + 1);
  const int64_t tasks = a.N * s.n_heads;
  const AttendFn<KV> fn = a.path == P_SCALAR ? attend_ref<KV> : attend_avx2<KV>;
#pragma omp parallel num_threads(a.nthreads) if (attention_in_parallel(a, tasks))
  {
    std::vector<float> scores(static_cast<size_t>(max_keys));
    std::vector<KV> keys, values;  // a block table's keys of one query, gathered into one run
    if (a.blocks != nullptr) keys.resize(size_t(max_keys * dh)), values.resize(size_t(max_keys * dh));
#pragma omp for schedule(dynamic, 1)
    for (int64_t t = 0; t < tasks; ++t) {
      const int64_t n = t / s.n_heads, h = t % s.n_heads, *tok = a.tokens + n * kTokenCols;
      const int64_t lo = first_key(a, tok), n_keys = tok[kHi] - lo + 1, head = (h / group) * dh;
      const KV *kr = k_cache + (tok[kRowBase] + lo) * stride + head, *vr = v_cache + (tok[kRowBase] + lo) * stride + head;
      int64_t row_stride = stride;
      if (a.blocks != nullptr) {
        const int64_t* blk = a.blocks + tok[kRowBase];
        for (int64_t j = 0; j < n_keys; ++j) {
          const int64_t at = (blk[(lo + j) / kKvBlock] + (lo + j) % kKvBlock) * stride + head;
          std::copy(k_cache + at, k_cache + at + dh, keys.data() + j * dh);
          std::copy(v_cache + at, v_cache + at + dh, values.data() + j * dh);
        }
        kr = keys.data(), vr = values.data(), row_stride = dh;
      }
      fn(qkv + n * width + h * dh, kr, vr, row_stride, n_keys, dh, s.scale, s.softcap, sink_of(a, h), scores.data(),
         att + n * q_size + h * dh);
    }
  }
}

// att [N, n_heads * dh]: each token's heads over keys [lo, hi] of its cache row (GQA: head h reads kv head
// h / (n_heads / n_kv_heads)). The SIMD paths run blocked tiles; the scalar path, and head sizes the tiles do not
// take, one query at a time (the reference).
void attention(const LayerArgs& a, const float* qkv, float* att) {
  const LayerShape& s = a.shape;
  const int64_t dh = s.head_dim, group = s.n_heads / s.n_kv_heads;
  if (a.path != P_SCALAR && dh % 8 == 0 && group <= kMaxGroup && (!a.kv_bf16 || dh <= kMaxBufferedDh))
    return attention_blocked(a, qkv, att);
  if (a.kv_bf16) return attention_per_query(a, qkv, att, static_cast<const uint16_t*>(a.k_cache),
                                            static_cast<const uint16_t*>(a.v_cache));
  attention_per_query(a, qkv, att, static_cast<const float*>(a.k_cache), static_cast<const float*>(a.v_cache));
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
#pragma omp parallel for num_threads(nth) if (nth > 1 && N * I >= (int64_t(1) << 15))
  for (int64_t n = 0; n < N; ++n) {
    const float *g = gate_up + n * 2 * I, *u = g + I;
    if (path == P_SCALAR) gate_mul_ref(g, u, I, gate, act + n * I);
    else gate_mul_avx2(g, u, I, gate, act + n * I);
  }
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

}  // namespace offload
