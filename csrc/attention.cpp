// Attention over the KV cache for the fused layer (layer.cpp): each new token's heads over its keys [lo, hi], read
// through its sequence's block table. The SIMD paths run blocked tiles with an online softmax (attention_tiles.inc):
// a decode step or a verify pass (a few tokens per sequence) token by token, in splits of its keys that read whole K
// and V rows in order, merged after (flash-decoding's split-K); other steps by tiles of tokens and a KV head's query
// group. The scalar path, and head
// sizes the tiles do not take, run one query at a time (the reference).
#include "layer.h"
#include "tasks.h"

#include <immintrin.h>
#include <omp.h>

// GCC 12's AVX-512 headers build some intrinsics on _mm512_undefined_*(), which -Wmaybe-uninitialized flags
// (attention's 512-bit shuffles and extracts), as in qgemm_avx512.cpp.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

namespace offload {
namespace {

#define ALWAYS_INLINE inline __attribute__((always_inline))

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

// Queries of an AVX2 prefill task (attention_panels.inc): 8 panels of 8 lanes. Each task reads its keys' K and V
// once for all of its queries: 16, 32, 64 and 128 ran Qwen3's 2,000-token prefill attention at 77, 98, 118 and 91
// GFLOP/s (the bf16 cache, before the outputs had rows of their own; 128's queries and outputs outgrow L1).
constexpr int kPanelQueries = 64;
static_assert(kTileTokens * kMaxGroup <= kPanelQueries, "a tile's queries fit a panel task's buffers");

struct PanelTask {  // attention_panels.inc's task: its queries, transposed into panels
  int nq;
  int64_t dh;
  float* qt;  // [kPanelQueries / 8][dh][8]: query 8 p + i's scaled values in lane i of panel p
  alignas(32) float lo[kPanelQueries], hi[kPanelQueries];  // the keys each query sees (lanes past nq: none)
  int64_t max_lo[kPanelQueries / 8], min_hi[kPanelQueries / 8];  // over each panel's queries
  alignas(32) float m[kPanelQueries], l[kPanelQueries];  // running max and sum of the online softmax
  float sink[kPanelQueries], cap;  // as TileQuery's
  float* out[kPanelQueries];  // each query's output row [dh]
  float* acc;  // [kPanelQueries][dh]: the outputs as they accumulate
};

// Head h's sink, or -inf where the layer has none.
ALWAYS_INLINE float sink_of(const LayerArgs& a, int64_t h) { return a.sinks != nullptr ? a.sinks[h] : -INFINITY; }

// The first key a token sees: its table's, or later where the layer's own window cuts it (padding: key 0).
ALWAYS_INLINE int64_t first_key(const LayerArgs& a, const int64_t* tok) {
  return a.shape.window > 0 ? std::max(tok[kLo], tok[kHi] - a.shape.window + 1) : tok[kLo];
}

// A tree of proposals' token (a key map, tok[kMap] >= 0): the first of its keys the map names (keys before it are
// where their positions say); else past its last key.
ALWAYS_INLINE int64_t map_start(const LayerArgs& a, const int64_t* tok) {
  return tok[kMap] < 0 ? tok[kHi] + 1 : tok[kHi] - a.blocks[tok[kMap]] + 1;
}

// Key j of a token as its sequence's block table holds it: j itself, or where its key map puts it.
ALWAYS_INLINE int64_t real_key(const LayerArgs& a, const int64_t* tok, int64_t j) {
  const int64_t ms = map_start(a, tok);
  return j < ms ? j : a.blocks[tok[kMap] + 1 + (j - ms)];
}

// Whether any token of the step is a tree's with a key map.
bool has_maps(const LayerArgs& a) {
  for (int64_t n = 0; n < a.N; ++n)
    if (a.tokens[n * kTokenCols + kMap] >= 0) return true;
  return false;
}

namespace avx2 {
#define AFN __attribute__((target("avx2,fma"))) inline
#define ATTN_PAIR_SCORES 0
#include "attention_tiles.inc"
#include "attention_panels.inc"
#include "attention_rows_bf16.inc"
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

// Tiles of attention_blocked: runs of up to per consecutive tokens of the same cache row; the last entry is N.
std::vector<int64_t> tile_starts(const LayerArgs& a, int64_t per) {
  std::vector<int64_t> start;
  for (int64_t n = 0; n < a.N; ++n) {
    const int64_t* tok = a.tokens + n * kTokenCols;
    if (start.empty() || n - start.back() >= per || a.tokens[start.back() * kTokenCols + kRowBase] != tok[kRowBase])
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

// One tile (tokens [n0, n1)) and KV head g in query panels (AVX2): the queries scaled and transposed into qt, the
// outputs accumulated in acc [kPanelQueries][dh].
void attend_panel_task(const LayerArgs& a, const float* qkv, float* att, int64_t n0, int64_t n1, int64_t g, float* qt,
                       float* acc) {
  const LayerShape& s = a.shape;
  const int64_t dh = s.head_dim, q_size = s.n_heads * dh, stride = s.n_kv_heads * dh;
  const int64_t width = q_size + 2 * stride, group = s.n_heads / s.n_kv_heads;
  PanelTask t;
  t.nq = 0, t.dh = dh, t.qt = qt, t.cap = s.softcap, t.acc = acc;
  std::fill(qt, qt + kPanelQueries * dh, 0.f);
  std::fill(t.lo, t.lo + kPanelQueries, 1e30f);  // lanes past nq see no key
  std::fill(t.hi, t.hi + kPanelQueries, -1.f);
  int64_t k_lo = INT64_MAX, k_hi = -1;
  for (int64_t n = n0; n < n1; ++n) {
    const int64_t *tok = a.tokens + n * kTokenCols, lo = first_key(a, tok);
    k_lo = std::min(k_lo, lo);
    k_hi = std::max(k_hi, tok[kHi]);
    for (int64_t h = g * group; h < (g + 1) * group; ++h) {
      const int i = t.nq++;
      float* lane = qt + (i / 8) * dh * 8 + i % 8;
      for (int64_t d = 0; d < dh; ++d) lane[d * 8] = qkv[n * width + h * dh + d] * s.scale;
      t.lo[i] = float(lo), t.hi[i] = float(tok[kHi]), t.sink[i] = sink_of(a, h), t.out[i] = att + n * q_size + h * dh;
    }
  }
  for (int p = 0; p < kPanelQueries / 8; ++p) {
    t.max_lo[p] = 0, t.min_hi[p] = INT64_MAX;
    for (int i = 8 * p; i < std::min(t.nq, 8 * p + 8); ++i)
      t.max_lo[p] = std::max(t.max_lo[p], int64_t(t.lo[i])), t.min_hi[p] = std::min(t.min_hi[p], int64_t(t.hi[i]));
  }
  const int64_t row_base = a.tokens[n0 * kTokenCols + kRowBase];
  const int64_t* blk = a.blocks != nullptr ? a.blocks + row_base : nullptr;
  const int64_t first = (blk ? 0 : row_base) * stride + g * dh;
  if (a.kv_bf16)
    avx2::attend_panels(t, static_cast<const uint16_t*>(a.k_cache) + first,
                        static_cast<const uint16_t*>(a.v_cache) + first, stride, k_lo, k_hi, blk);
  else
    avx2::attend_panels(t, static_cast<const float*>(a.k_cache) + first, static_cast<const float*>(a.v_cache) + first,
                        stride, k_lo, k_hi, blk);
}

// Keys x heads x head size of a step's attention: small ones run on the calling thread (a parallel region costs
// a barrier, and a barrier costs a whole time slice when another process has taken one of the cores). From 2^14
// (16 keys of 16 heads of 64) two threads pay: a random Qwen3-MoE's decode attention over 17-80 keys took 13-14.5
// us a layer on two threads of a Zen 4, 19-20 us on one.
bool attention_in_parallel(const LayerArgs& a, int64_t tasks) {
  int64_t work = 0;
  for (int64_t n = 0; n < a.N; ++n)
    work += (a.tokens[n * kTokenCols + kHi] - first_key(a, a.tokens + n * kTokenCols) + 1) * a.shape.n_heads *
            a.shape.head_dim;
  return a.nthreads > 1 && tasks > 1 && work >= (int64_t(1) << 14);
}

// att [N, n_heads * dh] by tiles of tokens x a KV head's query group (SIMD paths, dh a multiple of 8).
// On AVX2, tiles of kPanelQueries queries run in query panels where they hold 8 or more (shorter runs of tokens, as
// a verify step's, keep the tiles); AVX-512 keeps its tiles, whose two queries share each K load.
void attention_blocked(const LayerArgs& a, const float* qkv, float* att) {
  const LayerShape& s = a.shape;
  const int64_t group = s.n_heads / s.n_kv_heads;
  const bool panels = a.path == P_AVX2 && s.head_dim <= kMaxBufferedDh;
  const int64_t per = panels ? std::max<int64_t>(1, kPanelQueries / group) : kTileTokens;
  const std::vector<int64_t> start = tile_starts(a, per);
  const int64_t tasks = int64_t(start.size() - 1) * s.n_kv_heads;
  struct Buffers {
    Floats qbuf, acc;  // a task's queries (at most kPanelQueries either way) and a panel task's outputs
    std::vector<TileQuery> qs;
  };
  run_tasks(
      a.nthreads, attention_in_parallel(a, tasks), tasks,
      [&] {
        const size_t n = size_t(kPanelQueries * s.head_dim);
        return Buffers{Floats(n), Floats(panels ? n : 0), std::vector<TileQuery>(size_t(kPanelQueries))};
      },
      [&](Buffers& b, int64_t t) {
        const size_t tile = size_t(t / s.n_kv_heads);
        const int64_t n0 = start[tile], n1 = start[tile + 1], g = t % s.n_kv_heads;
        if (panels && (n1 - n0) * group >= 8) attend_panel_task(a, qkv, att, n0, n1, g, b.qbuf.data(), b.acc.data());
        else attend_task(a, qkv, att, n0, n1, g, b.qbuf.data(), b.qs.data());
      });
}

// attend_rows compiled for the head size and the ISA.
template <typename KV>
void attend_rows_for(bool wide, TileQuery* qs, int per_head, int64_t n_kv, const KV* kc, const KV* vc, int64_t stride,
                     int64_t j_lo, int64_t j_hi, int64_t dh, const int64_t* blk) {
  auto run = [&](auto fn) { fn(qs, per_head, n_kv, kc, vc, stride, j_lo, j_hi, dh, blk); };
  if (dh == 64) wide ? run(avx512::attend_rows<64, KV>) : run(avx2::attend_rows<64, KV>);
  else if (dh == 128) wide ? run(avx512::attend_rows<128, KV>) : run(avx2::attend_rows<128, KV>);
  else wide ? run(avx512::attend_rows<0, KV>) : run(avx2::attend_rows<0, KV>);
}

// A token's keys split into one task per kSplitKeys (at most kMaxSplits): by its own keys alone, not the step's
// tokens or threads, so that a token's attention sums in the same order whether it decodes alone or in a verify
// pass of proposals (speculative greedy answers are plain decoding's, bf16 included).
constexpr int64_t kSplitKeys = 128, kMaxSplits = 16;
constexpr int64_t kByTokensMax = 16;  // tokens of one row up to which a step attends token by token

int64_t splits_of(const LayerArgs& a, int64_t n) {
  const int64_t* tok = a.tokens + n * kTokenCols;
  return std::clamp<int64_t>((tok[kHi] - first_key(a, tok) + 1) / kSplitKeys, 1, kMaxSplits);
}

// Whether no row of the step has more than kByTokensMax tokens (decode steps, verify passes of proposals).
bool few_tokens_per_row(const LayerArgs& a) {
  for (int64_t n = 0, run = 1; n < a.N; ++n) {
    run = n > 0 && a.tokens[n * kTokenCols + kRowBase] == a.tokens[(n - 1) * kTokenCols + kRowBase] ? run + 1 : 1;
    if (run > kByTokensMax) return false;
  }
  return true;
}

// The parts a step's (token, split) tasks are cut into by KV head, where they are fewer than the threads (a decode
// step of one sequence over fewer than 256 keys on two threads): each head's sums keep their order, so a token's
// attention is the same alone or in a verify pass.
int64_t head_parts(const LayerArgs& a, int64_t tasks) {
  return tasks >= a.nthreads ? 1 : std::min<int64_t>(a.shape.n_kv_heads, (a.nthreads + tasks - 1) / tasks);
}

// Keys c .. hi of a tree's token (its map's chunks): their K and V rows (every head's) copied in key order from where
// the map puts them, then attended as one run from key 0, the queries' key ranges moved down by c to match.
template <typename Attend>
void gather_mapped(const LayerArgs& a, const int64_t* tok, const int64_t* blk, int64_t c, int64_t hi, int64_t stride,
                   TileQuery* qs, int nq, Attend& attend_keys) {
  const int64_t n = hi - c + 1, size = a.kv_bf16 ? 2 : 4, row_bytes = stride * size;
  std::vector<char> k(size_t(n * row_bytes)), v(size_t(n * row_bytes));
  for (int64_t j = 0; j < n; ++j) {
    const int64_t r = real_key(a, tok, c + j), slot = blk[r / kKvBlock] + r % kKvBlock;
    std::memcpy(k.data() + j * row_bytes, static_cast<const char*>(a.k_cache) + slot * row_bytes, size_t(row_bytes));
    std::memcpy(v.data() + j * row_bytes, static_cast<const char*>(a.v_cache) + slot * row_bytes, size_t(row_bytes));
  }
  for (int i = 0; i < nq; ++i) qs[i].lo -= c, qs[i].hi -= c;
  attend_keys(k.data(), v.data(), nullptr, 0, n - 1);
  for (int i = 0; i < nq; ++i) qs[i].lo += c, qs[i].hi += c;
}

// Task t = (token n, split sp) of attention_by_rows, or its part of KV heads g0 .. g1 - 1 (head_parts): those KV
// heads' query heads of token n over its split of the keys (chunks of 8 from the first chunk's start, shared out in
// order); the unnormalized (m, l) of each of them into ml, out into part.
void attend_split(const LayerArgs& a, const float* qkv, int64_t n, int64_t sp, int64_t splits, int64_t g0, int64_t g1,
                  float* part, float* ml, float* qbuf, TileQuery* qs) {
  const LayerShape& s = a.shape;
  const int64_t dh = s.head_dim, q_size = s.n_heads * dh, stride = s.n_kv_heads * dh, width = q_size + 2 * stride;
  const int64_t *tok = a.tokens + n * kTokenCols, lo = first_key(a, tok), hi = tok[kHi];
  const int64_t start = a.blocks != nullptr ? (lo & ~int64_t(7)) : lo, per = ((hi - start) / 8 + splits) / splits;
  const int64_t j_lo = start + sp * per * 8, j_hi = std::min(hi, j_lo + per * 8 - 1);
  const bool rows_bf16 = a.kv_bf16 && a.path == P_AVX2 && dh % 16 == 0;  // attention_rows_bf16.inc's widened order
  const int per_head = int(s.n_heads / s.n_kv_heads);
  const int64_t h0 = g0 * per_head, h1 = g1 * per_head;
  for (int64_t h = h0; h < h1; ++h) {
    float* qv = qbuf + h * dh;
    for (int64_t d = 0; d < dh; ++d) qv[d] = qkv[n * width + h * dh + d] * s.scale;
    if (rows_bf16) avx2::permute16(qv, dh);
    std::fill(part + h * dh, part + (h + 1) * dh, 0.f);
    qs[h] = TileQuery{qv, lo, hi, -INFINITY, 0.f, part + h * dh, s.softcap, sink_of(a, h)};
  }
  const int64_t row_base = tok[kRowBase];
  const int64_t* blk = a.blocks != nullptr ? a.blocks + row_base : nullptr;
  const int64_t first = (blk ? 0 : row_base) * stride + g0 * dh, n_kv = g1 - g0;
  TileQuery* group = qs + h0;
  // keys [lo_, hi_] of K and V rows kc, vc (through blk, or one run where blk is null), in chunks of 8 from lo_
  auto attend_keys = [&](const void* kc, const void* vc, const int64_t* blk_, int64_t lo_, int64_t hi_) {
    if (lo_ > hi_) return;
    if (rows_bf16)
      avx2::attend_rows_bf16(group, per_head, n_kv, static_cast<const uint16_t*>(kc) + first,
                             static_cast<const uint16_t*>(vc) + first, stride, lo_, hi_, dh, blk_);
    else if (a.kv_bf16)
      attend_rows_for(a.path == P_AVX512, group, per_head, n_kv, static_cast<const uint16_t*>(kc) + first,
                      static_cast<const uint16_t*>(vc) + first, stride, lo_, hi_, dh, blk_);
    else
      attend_rows_for(a.path == P_AVX512, group, per_head, n_kv, static_cast<const float*>(kc) + first,
                      static_cast<const float*>(vc) + first, stride, lo_, hi_, dh, blk_);
  };
  const int64_t ms = map_start(a, tok);
  if (ms > j_hi || blk == nullptr) {
    attend_keys(a.k_cache, a.v_cache, blk, j_lo, j_hi);
  } else {  // a tree's token: the chunks from the one its map starts in read rows gathered through the map, in the
            // same chunks of 8 (its sums are what the same keys at consecutive slots would give)
    const int64_t c = std::max(j_lo, ms & ~int64_t(7));
    attend_keys(a.k_cache, a.v_cache, blk, j_lo, c - 1);
    gather_mapped(a, tok, blk, c, j_hi, stride, group, int(h1 - h0), attend_keys);
  }
  for (int64_t h = h0; h < h1; ++h) {
    ml[2 * h] = qs[h].m, ml[2 * h + 1] = qs[h].l;
    if (rows_bf16) avx2::permute16(part + h * dh, dh);
  }
}

// att [N, n_heads * dh] of a decode step or a verify pass (few_tokens_per_row): a task is one token's every head
// over a split of its keys (flash-decoding's split-K, splits_of), reading whole K and V rows in order (attend_rows);
// the splits' partial softmaxes are merged after, in order, with the sink.
void attention_by_rows(const LayerArgs& a, const float* qkv, float* att) {
  const LayerShape& s = a.shape;
  const int64_t dh = s.head_dim, heads = s.n_heads;
  std::vector<int64_t> first(static_cast<size_t>(a.N + 1), 0);  // token n's tasks: first[n] .. first[n + 1] - 1
  for (int64_t n = 0; n < a.N; ++n) first[size_t(n + 1)] = first[size_t(n)] + splits_of(a, n);
  const int64_t tasks = first[size_t(a.N)], parts = head_parts(a, tasks), n_kv = s.n_kv_heads;
  std::vector<int64_t> owner(static_cast<size_t>(tasks));
  for (int64_t n = 0; n < a.N; ++n)
    std::fill(owner.begin() + first[size_t(n)], owner.begin() + first[size_t(n + 1)], n);
  Floats part(size_t(tasks * heads * dh));
  std::vector<float> ml(static_cast<size_t>(tasks * heads * 2));
  struct Buffers {
    Floats qbuf;
    std::vector<TileQuery> qs;
  };
  run_tasks(
      a.nthreads, attention_in_parallel(a, tasks * parts), tasks * parts,
      [&] { return Buffers{Floats(size_t(heads * dh)), std::vector<TileQuery>(size_t(heads))}; },
      [&](Buffers& b, int64_t tp) {
        const int64_t t = tp / parts, p = tp % parts;
        const int64_t n = owner[size_t(t)], splits = first[size_t(n + 1)] - first[size_t(n)];
        attend_split(a, qkv, n, t - first[size_t(n)], splits, n_kv * p / parts, n_kv * (p + 1) / parts,
                     part.data() + t * heads * dh, ml.data() + t * heads * 2, b.qbuf.data(), b.qs.data());
      });
  for (int64_t n = 0; n < a.N; ++n)
    for (int64_t h = 0; h < heads; ++h) {
      float m = -INFINITY, l = 0.f;
      for (int64_t t = first[size_t(n)]; t < first[size_t(n + 1)]; ++t) m = std::max(m, ml[(t * heads + h) * 2]);
      float* out = att + n * heads * dh + h * dh;
      std::fill(out, out + dh, 0.f);
      for (int64_t t = first[size_t(n)]; t < first[size_t(n + 1)]; ++t) {
        const int64_t at = t * heads + h;
        if (ml[2 * at] == -INFINITY) continue;  // a split this head's keys do not reach
        const float w = std::exp(ml[2 * at] - m);
        l += ml[2 * at + 1] * w;
        const float* p = part.data() + at * dh;
        for (int64_t d = 0; d < dh; ++d) out[d] += w * p[d];
      }
      const float inv = softmax_norm(m, l, sink_of(a, h));
      for (int64_t d = 0; d < dh; ++d) out[d] *= inv;
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
  struct Buffers {
    std::vector<float> scores;
    std::vector<KV> keys, values;  // a block table's keys of one query, gathered into one run
  };
  const size_t gathered = a.blocks != nullptr ? size_t(max_keys * dh) : 0;
  run_tasks(
      a.nthreads, attention_in_parallel(a, tasks), tasks,
      [&] {
        return Buffers{std::vector<float>(size_t(max_keys)), std::vector<KV>(gathered), std::vector<KV>(gathered)};
      },
      [&](Buffers& b, int64_t t) {
        const int64_t n = t / s.n_heads, h = t % s.n_heads, *tok = a.tokens + n * kTokenCols;
        const int64_t lo = first_key(a, tok), n_keys = tok[kHi] - lo + 1, head = (h / group) * dh;
        const KV *kr = k_cache + (tok[kRowBase] + lo) * stride + head;
        const KV *vr = v_cache + (tok[kRowBase] + lo) * stride + head;
        int64_t row_stride = stride;
        if (a.blocks != nullptr) {
          const int64_t* blk = a.blocks + tok[kRowBase];
          for (int64_t j = 0; j < n_keys; ++j) {
            const int64_t r = real_key(a, tok, lo + j), at = (blk[r / kKvBlock] + r % kKvBlock) * stride + head;
            std::copy(k_cache + at, k_cache + at + dh, b.keys.data() + j * dh);
            std::copy(v_cache + at, v_cache + at + dh, b.values.data() + j * dh);
          }
          kr = b.keys.data(), vr = b.values.data(), row_stride = dh;
        }
        fn(qkv + n * width + h * dh, kr, vr, row_stride, n_keys, dh, s.scale, s.softcap, sink_of(a, h),
           b.scores.data(), att + n * q_size + h * dh);
      });
}

}  // namespace

// att [N, n_heads * dh]: each token's heads over keys [lo, hi] of its cache row (GQA: head h reads kv head
// h / (n_heads / n_kv_heads)). The SIMD paths run blocked tiles; the scalar path, and head sizes the tiles do not
// take, one query at a time (the reference).
void attention(const LayerArgs& a, const float* qkv, float* att) {
  const LayerShape& s = a.shape;
  const int64_t dh = s.head_dim, group = s.n_heads / s.n_kv_heads;
  if (a.path != P_SCALAR && dh % 8 == 0 && group <= kMaxGroup && (!a.kv_bf16 || dh <= kMaxBufferedDh))
    return few_tokens_per_row(a) || has_maps(a) ? attention_by_rows(a, qkv, att) : attention_blocked(a, qkv, att);
  if (a.kv_bf16) return attention_per_query(a, qkv, att, static_cast<const uint16_t*>(a.k_cache),
                                            static_cast<const uint16_t*>(a.v_cache));
  attention_per_query(a, qkv, att, static_cast<const float*>(a.k_cache), static_cast<const float*>(a.v_cache));
}

}  // namespace offload
