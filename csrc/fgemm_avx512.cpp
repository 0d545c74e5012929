// AVX-512 matmul of dense fp32 weights with fp32 activations at few tokens (a decode step, a speculative verify
// pass): tiles of 4 weight rows x up to 6 tokens over all of K, 24 accumulators in zmm registers, so each weight
// row is read from memory once for the whole tile. The AVX2 dot form keeps 4 x 2 (16 ymm registers) and reads a
// row again from L1 for every 2 tokens; on a Zen 4 the SmolLM2-135M shapes at 4 tokens ran 1.4x its 1-token time.
// From kPackMinTokens on, the AVX2 packed (cache-blocked) form runs. Each y element sums its K in the same order
// whatever the token count or thread: a token's outputs do not depend on the tokens beside it.
#include <immintrin.h>

#include <algorithm>

#include "kernels.h"

#define KFN __attribute__((target("avx2,fma,avx512f"))) inline

namespace offload {
namespace {

constexpr int TR = 4;  // weight rows per tile
constexpr int TC = 6;  // tokens per tile at most: 24 accumulators + 6 x + 1 weight register of 32

// acc[r][n] += w row r . x token n over the 16 columns from k (the lanes m keeps; the others read nothing).
template <int R, int C>
KFN void step_f32(const float* wr, const float* xs, int64_t K, int64_t k, __mmask16 m, __m512 (&acc)[R][C]) {
  __m512 xv[C];
  for (int n = 0; n < C; ++n) xv[n] = _mm512_maskz_loadu_ps(m, xs + n * K + k);
  for (int r = 0; r < R; ++r) {
    const __m512 wv = _mm512_maskz_loadu_ps(m, wr + r * K + k);
    _mm_prefetch(reinterpret_cast<const char*>(wr + (R + r) * K + k), _MM_HINT_T0);  // the next tile's rows
    for (int n = 0; n < C; ++n) acc[r][n] = _mm512_fmadd_ps(wv, xv[n], acc[r][n]);
  }
}

// y[n0..n0+C-1, r0..r0+R-1] = x . w rows + bias, over all of K (K % 16 leftovers through masked loads).
template <int R, int C>
KFN void tile_f32(const WView& w, const float* x, int64_t r0, int64_t n0, float* y, const float* bias) {
  const int64_t K = w.K, K16 = K & ~int64_t(15);
  const float* wr = reinterpret_cast<const float*>(w.qs) + r0 * K;
  const float* xs = x + n0 * K;
  __m512 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int n = 0; n < C; ++n) acc[r][n] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K16; k += 16) step_f32<R, C>(wr, xs, K, k, 0xFFFF, acc);
  if (K16 < K) step_f32<R, C>(wr, xs, K, K16, __mmask16((1u << (K - K16)) - 1), acc);
  for (int r = 0; r < R; ++r)
    for (int n = 0; n < C; ++n)
      y[(n0 + n) * w.M + r0 + r] = _mm512_reduce_add_ps(acc[r][n]) + (bias ? bias[r0 + r] : 0.f);
}

template <int R>
KFN void rows_f32(const WView& w, const float* x, int64_t N, float* y, const float* bias, int64_t r) {
  const int64_t tiles = (N + TC - 1) / TC;
  for (int64_t t = 0, n = 0; t < tiles; ++t) {  // the fewest tiles, sized evenly (8 tokens: 4 + 4)
    const int64_t c = (N - n) / (tiles - t);
    switch (c) {
      case 6: tile_f32<R, 6>(w, x, r, n, y, bias); break;
      case 5: tile_f32<R, 5>(w, x, r, n, y, bias); break;
      case 4: tile_f32<R, 4>(w, x, r, n, y, bias); break;
      case 3: tile_f32<R, 3>(w, x, r, n, y, bias); break;
      case 2: tile_f32<R, 2>(w, x, r, n, y, bias); break;
      default: tile_f32<R, 1>(w, x, r, n, y, bias); break;
    }
    n += c;
  }
}

}  // namespace

__attribute__((target("avx2,fma,avx512f")))
void gemm_f32_avx512(const WView& w, const float* x, int64_t N, float* y, const float* bias, int64_t r0, int64_t r1) {
  if (N >= kPackMinTokens) {
    gemm_f32_avx2(w, x, N, y, bias, r0, r1);
    return;
  }
  int64_t r = r0;
  for (; r + TR <= r1; r += TR) rows_f32<TR>(w, x, N, y, bias, r);
  for (; r < r1; ++r) rows_f32<1>(w, x, N, y, bias, r);
}

}  // namespace offload
