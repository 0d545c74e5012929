// AVX2 + FMA + F16C matmuls with bf16, fp16 or fp32 weights and fp32 activations.
//
// Few tokens (decode): dot products of 4 weight rows x 2 tokens over all of K, reading the weights once (memory-bound).
// From kPackMinTokens on (prefill, batches): cache blocking as in BLIS/OpenBLAS sgemm. A panel of 16 weight rows x KC
// columns is widened to fp32 and transposed once into a thread-local p[k][16] (L1), then each tile of 6 tokens keeps
// 6 x 16 sums in 12 registers (per k: 2 panel loads, 6 broadcasts of x, 12 FMAs) and adds them into y per K chunk.
// Each y element is bias + the K chunks' sums in order, whatever the token tile or thread: results do not depend on
// the thread count.
#include <immintrin.h>

#include <algorithm>
#include <type_traits>

#include "kernels.h"

#define KFN __attribute__((target("avx2,fma,f16c"))) inline

namespace offload {
namespace {

constexpr int FR = 4;  // weight rows per tile (dot-product form)
constexpr int FC = 2;  // tokens per tile (dot-product form)

constexpr int PR = 16;                 // weight rows per packed panel (two ymm)
constexpr int PC = 6;                  // tokens per tile of the packed form (12 accumulators + 2 weights + 1 x)
constexpr int64_t KC = 256;            // K columns per panel: 16 KiB of fp32, half of L1
// Packing costs ~0.3 cycles per weight whatever the token count; on a 2-core EPYC (AVX2, one thread, 2048x2048 bf16)
// the dot form ran 58 GFLOP/s at 8 and 12 tokens, the packed form 54 at 8 and 63 at 12 (73 at 64).
// fp16's dot form widens in one op (vcvtph2ps) and ran 70 GFLOP/s: packed it ran 0.89-0.95x at 16 tokens, 1.05x at 64.
constexpr int64_t kPackMinTokensF16 = 64;  // fp16's (bf16's and fp32's: kernels.h kPackMinTokens)

enum Kind : int { kBF16, kF16, kF32 };  // the weights' element type
template <int KIND>
using Elem = std::conditional_t<KIND == kF32, float, uint16_t>;
template <int KIND>
constexpr int64_t kLine = 64 / sizeof(Elem<KIND>);  // elements per cache line

template <int KIND>
KFN __m256 cvt8(const Elem<KIND>* p) {
  if constexpr (KIND == kF32) {
    return _mm256_loadu_ps(p);
  } else {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    if (KIND == kBF16) return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    return _mm256_cvtph_ps(h);
  }
}

template <int KIND>
KFN float cvt1(Elem<KIND> h) {
  if constexpr (KIND == kF32) return h;
  else return KIND == kBF16 ? bf16_to_f32(h) : _cvtsh_ss(h);
}

KFN float hsum8f(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// R rows x C tokens over all of K; K % 8 leftovers in scalar code.
template <int KIND, int R, int C>
KFN void tile_half(const WView& w, const float* x, int64_t r0, int64_t n0, float* y, const float* bias) {
  const int64_t K = w.K, K8 = K & ~int64_t(7);
  const Elem<KIND>* wh = reinterpret_cast<const Elem<KIND>*>(w.qs) + r0 * K;
  const float* xs = x + n0 * K;
  __m256 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int n = 0; n < C; ++n) acc[r][n] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K8; k += 8) {
    __m256 xv[C];
    for (int n = 0; n < C; ++n) xv[n] = _mm256_loadu_ps(xs + n * K + k);
    for (int r = 0; r < R; ++r) {
      const __m256 wv = cvt8<KIND>(wh + r * K + k);
      if (k % kLine<KIND> == 0)  // the next tile's rows, a cache line ahead of their first read
        _mm_prefetch(reinterpret_cast<const char*>(wh + (R + r) * K + k), _MM_HINT_T0);
      for (int n = 0; n < C; ++n) acc[r][n] = _mm256_fmadd_ps(wv, xv[n], acc[r][n]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int n = 0; n < C; ++n) {
      float t = hsum8f(acc[r][n]);
      for (int64_t k = K8; k < K; ++k) t += cvt1<KIND>(wh[r * K + k]) * xs[n * K + k];
      y[(n0 + n) * w.M + r0 + r] = t + (bias ? bias[r0 + r] : 0.f);
    }
}

template <int KIND, int R>
KFN void rows_half(const WView& w, const float* x, int64_t N, float* y, const float* bias, int64_t r) {
  int64_t n = 0;
  for (; n + FC <= N; n += FC) tile_half<KIND, R, FC>(w, x, r, n, y, bias);
  for (; n < N; ++n) tile_half<KIND, R, 1>(w, x, r, n, y, bias);
}

template <int KIND>
KFN void gemm_dot(const WView& w, const float* x, int64_t N, float* y, const float* bias, int64_t r0, int64_t r1) {
  int64_t r = r0;
  for (; r + FR <= r1; r += FR) rows_half<KIND, FR>(w, x, N, y, bias, r);
  for (; r < r1; ++r) rows_half<KIND, 1>(w, x, N, y, bias, r);
}

// In place: rows v[0..7] of an 8x8 block become its columns.
KFN void transpose8(__m256 v[8]) {
  const __m256 a0 = _mm256_unpacklo_ps(v[0], v[1]), a1 = _mm256_unpackhi_ps(v[0], v[1]);
  const __m256 a2 = _mm256_unpacklo_ps(v[2], v[3]), a3 = _mm256_unpackhi_ps(v[2], v[3]);
  const __m256 a4 = _mm256_unpacklo_ps(v[4], v[5]), a5 = _mm256_unpackhi_ps(v[4], v[5]);
  const __m256 a6 = _mm256_unpacklo_ps(v[6], v[7]), a7 = _mm256_unpackhi_ps(v[6], v[7]);
  const __m256 b0 = _mm256_shuffle_ps(a0, a2, 0x44), b1 = _mm256_shuffle_ps(a0, a2, 0xEE);
  const __m256 b2 = _mm256_shuffle_ps(a1, a3, 0x44), b3 = _mm256_shuffle_ps(a1, a3, 0xEE);
  const __m256 b4 = _mm256_shuffle_ps(a4, a6, 0x44), b5 = _mm256_shuffle_ps(a4, a6, 0xEE);
  const __m256 b6 = _mm256_shuffle_ps(a5, a7, 0x44), b7 = _mm256_shuffle_ps(a5, a7, 0xEE);
  v[0] = _mm256_permute2f128_ps(b0, b4, 0x20), v[4] = _mm256_permute2f128_ps(b0, b4, 0x31);
  v[1] = _mm256_permute2f128_ps(b1, b5, 0x20), v[5] = _mm256_permute2f128_ps(b1, b5, 0x31);
  v[2] = _mm256_permute2f128_ps(b2, b6, 0x20), v[6] = _mm256_permute2f128_ps(b2, b6, 0x31);
  v[3] = _mm256_permute2f128_ps(b3, b7, 0x20), v[7] = _mm256_permute2f128_ps(b3, b7, 0x31);
}

// p[k][0..7] for k in [k, k + 16) of 8 whole bf16 rows: a zero 16-bit half below each bf16 is its fp32, so one unpack
// widens 8 weights (k..k+3 and k+8..k+11, or k+4..k+7 and k+12..k+15) where cvt8 takes two ops.
KFN void pack16_bf16(const uint16_t* wg, int64_t K, int64_t k, float* p) {
  for (int half = 0; half < 2; ++half) {
    __m256 v[8];
    for (int i = 0; i < 8; ++i) {
      const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wg + i * K + k));
      const __m256i z = _mm256_setzero_si256();
      v[i] = _mm256_castsi256_ps(half ? _mm256_unpackhi_epi16(z, h) : _mm256_unpacklo_epi16(z, h));
    }
    transpose8(v);
    for (int j = 0; j < 8; ++j) _mm256_store_ps(p + (k + 4 * half + j + (j & 4)) * PR, v[j]);
  }
}

// p [kc][PR] fp32 = weight rows r..r+rows-1 (rows <= PR; the others zero), columns k0..k0+kc-1, transposed.
template <int KIND>
KFN void pack_panel(const WView& w, int64_t r, int rows, int64_t k0, int64_t kc, float* p) {
  const int64_t K = w.K, kc8 = kc & ~int64_t(7);
  const Elem<KIND>* wh = reinterpret_cast<const Elem<KIND>*>(w.qs) + r * K + k0;
  for (int g = 0; g < PR; g += 8) {
    const Elem<KIND>* wg = wh + g * K;
    int64_t k = 0;
    if (g + 8 <= rows) {
      if constexpr (KIND == kBF16)
        for (; k + 16 <= kc8; k += 16) pack16_bf16(wg, K, k, p + g);
      for (; k < kc8; k += 8) {
        __m256 v[8];
        for (int i = 0; i < 8; ++i) v[i] = cvt8<KIND>(wg + i * K + k);
        transpose8(v);
        for (int j = 0; j < 8; ++j) _mm256_store_ps(p + (k + j) * PR + g, v[j]);
      }
    } else {
      for (; k < kc8; k += 8) {
        __m256 v[8];
        for (int i = 0; i < 8; ++i) v[i] = g + i < rows ? cvt8<KIND>(wg + i * K + k) : _mm256_setzero_ps();
        transpose8(v);
        for (int j = 0; j < 8; ++j) _mm256_store_ps(p + (k + j) * PR + g, v[j]);
      }
    }
  }
  for (int64_t k = kc8; k < kc; ++k)
    for (int i = 0; i < PR; ++i) p[k * PR + i] = i < rows ? cvt1<KIND>(wh[i * K + k]) : 0.f;
}

// y[r..r+rows-1] of one token (+)= lo, hi; the first K chunk adds the bias instead of y.
KFN void store_sums(float* y, __m256 lo, __m256 hi, int rows, const float* bias, bool first) {
  if (rows == PR) {
    const __m256 b0 = first ? (bias ? _mm256_loadu_ps(bias) : _mm256_setzero_ps()) : _mm256_loadu_ps(y);
    const __m256 b1 = first ? (bias ? _mm256_loadu_ps(bias + 8) : _mm256_setzero_ps()) : _mm256_loadu_ps(y + 8);
    _mm256_storeu_ps(y, _mm256_add_ps(b0, lo));
    _mm256_storeu_ps(y + 8, _mm256_add_ps(b1, hi));
    return;
  }
  alignas(32) float t[PR];
  _mm256_store_ps(t, lo);
  _mm256_store_ps(t + 8, hi);
  for (int i = 0; i < rows; ++i) y[i] = (first ? (bias ? bias[i] : 0.f) : y[i]) + t[i];
}

// y[n0.., r..r+rows-1] (+)= x[n0.., k0..k0+kc-1] . panel, C tokens.
template <int C>
KFN void tile_packed(const float* p, int64_t kc, const float* x, int64_t K, float* y, int64_t M, int rows,
                     const float* bias, bool first) {
  __m256 lo[C], hi[C];
#pragma GCC unroll 8
  for (int n = 0; n < C; ++n) lo[n] = hi[n] = _mm256_setzero_ps();
  for (int64_t k = 0; k < kc; ++k) {
    const __m256 w0 = _mm256_load_ps(p + k * PR), w1 = _mm256_load_ps(p + k * PR + 8);
#pragma GCC unroll 8
    for (int n = 0; n < C; ++n) {
      const __m256 xv = _mm256_broadcast_ss(x + n * K + k);
      lo[n] = _mm256_fmadd_ps(w0, xv, lo[n]);
      hi[n] = _mm256_fmadd_ps(w1, xv, hi[n]);
    }
  }
#pragma GCC unroll 8
  for (int n = 0; n < C; ++n) store_sums(y + n * M, lo[n], hi[n], rows, bias, first);
}

// One panel (16 rows x one K chunk) against all N tokens, in the fewest tiles of at most 6, sized evenly: a tile of
// C tokens has 2C independent FMA chains, and under ~8 chains the FMA latency, not the ports, bounds it (so 8
// tokens run as 4 + 4, not 6 + 2).
KFN void panel_times_x(const float* p, int64_t kc, const float* x, int64_t N, int64_t K, float* y, int64_t M,
                       int rows, const float* bias, bool first) {
  const int64_t tiles = (N + PC - 1) / PC;
  for (int64_t t = 0, n = 0; t < tiles; ++t) {
    const int64_t c = (N - n) / (tiles - t);  // the earlier tiles take the smaller share
    const float* xt = x + n * K;
    float* yt = y + n * M;
    switch (c) {
      case 6: tile_packed<6>(p, kc, xt, K, yt, M, rows, bias, first); break;
      case 5: tile_packed<5>(p, kc, xt, K, yt, M, rows, bias, first); break;
      case 4: tile_packed<4>(p, kc, xt, K, yt, M, rows, bias, first); break;
      case 3: tile_packed<3>(p, kc, xt, K, yt, M, rows, bias, first); break;
      case 2: tile_packed<2>(p, kc, xt, K, yt, M, rows, bias, first); break;
      default: tile_packed<1>(p, kc, xt, K, yt, M, rows, bias, first); break;
    }
    n += c;
  }
}

template <int KIND>
KFN void gemm_packed(const WView& w, const float* x, int64_t N, float* y, const float* bias, int64_t r0, int64_t r1) {
  alignas(64) static thread_local float panel[KC * PR];
  for (int64_t r = r0; r < r1; r += PR) {
    const int rows = int(std::min<int64_t>(PR, r1 - r));
    for (int64_t k0 = 0; k0 < w.K; k0 += KC) {
      const int64_t kc = std::min(KC, w.K - k0);
      pack_panel<KIND>(w, r, rows, k0, kc, panel);
      panel_times_x(panel, kc, x + k0, N, w.K, y + r, w.M, rows, bias ? bias + r : nullptr, k0 == 0);
    }
  }
}

template <int KIND>
KFN void gemm_half(const WView& w, const float* x, int64_t N, float* y, const float* bias, int64_t r0, int64_t r1) {
  if (N < (KIND == kF16 ? kPackMinTokensF16 : kPackMinTokens))
    gemm_dot<KIND>(w, x, N, y, bias, r0, r1);
  else
    gemm_packed<KIND>(w, x, N, y, bias, r0, r1);
}

}  // namespace

__attribute__((target("avx2,fma,f16c")))
void gemm_bf16_avx2(const WView& w, const float* x, int64_t N, float* y, const float* bias, int64_t r0, int64_t r1) {
  gemm_half<kBF16>(w, x, N, y, bias, r0, r1);
}

__attribute__((target("avx2,fma,f16c")))
void gemm_f16_avx2(const WView& w, const float* x, int64_t N, float* y, const float* bias, int64_t r0, int64_t r1) {
  gemm_half<kF16>(w, x, N, y, bias, r0, r1);
}

__attribute__((target("avx2,fma,f16c")))
void gemm_f32_avx2(const WView& w, const float* x, int64_t N, float* y, const float* bias, int64_t r0, int64_t r1) {
  gemm_half<kF32>(w, x, N, y, bias, r0, r1);
}

}  // namespace offload
