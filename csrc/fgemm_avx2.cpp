// AVX2 + FMA + F16C matmuls with bf16 or fp16 weights and fp32 activations.
#include <immintrin.h>

#include "kernels.h"

#define KFN __attribute__((target("avx2,fma,f16c"))) inline

namespace offload {
namespace {

constexpr int FR = 4;  // weight rows per tile
constexpr int FC = 2;  // tokens per tile

template <bool BF16>
KFN __m256 cvt8(const uint16_t* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  if (BF16) return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  return _mm256_cvtph_ps(h);
}

template <bool BF16>
KFN float cvt1(uint16_t h) { return BF16 ? bf16_to_f32(h) : _cvtsh_ss(h); }

KFN float hsum8f(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// R rows x C tokens over all of K; K % 8 leftovers in scalar code.
template <bool BF16, int R, int C>
KFN void tile_half(const WView& w, const float* x, int64_t r0, int64_t n0, float* y, const float* bias) {
  const int64_t K = w.K, K8 = K & ~int64_t(7);
  const uint16_t* wh = reinterpret_cast<const uint16_t*>(w.qs) + r0 * K;
  const float* xs = x + n0 * K;
  __m256 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int n = 0; n < C; ++n) acc[r][n] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K8; k += 8) {
    __m256 xv[C];
    for (int n = 0; n < C; ++n) xv[n] = _mm256_loadu_ps(xs + n * K + k);
    for (int r = 0; r < R; ++r) {
      const __m256 wv = cvt8<BF16>(wh + r * K + k);
      for (int n = 0; n < C; ++n) acc[r][n] = _mm256_fmadd_ps(wv, xv[n], acc[r][n]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int n = 0; n < C; ++n) {
      float t = hsum8f(acc[r][n]);
      for (int64_t k = K8; k < K; ++k) t += cvt1<BF16>(wh[r * K + k]) * xs[n * K + k];
      y[(n0 + n) * w.M + r0 + r] = t + (bias ? bias[r0 + r] : 0.f);
    }
}

template <bool BF16, int R>
KFN void rows_half(const WView& w, const float* x, int64_t N, float* y, const float* bias, int64_t r) {
  int64_t n = 0;
  for (; n + FC <= N; n += FC) tile_half<BF16, R, FC>(w, x, r, n, y, bias);
  for (; n < N; ++n) tile_half<BF16, R, 1>(w, x, r, n, y, bias);
}

template <bool BF16>
KFN void gemm_half(const WView& w, const float* x, int64_t N, float* y, const float* bias, int64_t r0, int64_t r1) {
  int64_t r = r0;
  for (; r + FR <= r1; r += FR) rows_half<BF16, FR>(w, x, N, y, bias, r);
  for (; r < r1; ++r) rows_half<BF16, 1>(w, x, N, y, bias, r);
}

}  // namespace

__attribute__((target("avx2,fma,f16c")))
void gemm_bf16_avx2(const WView& w, const float* x, int64_t N, float* y, const float* bias, int64_t r0, int64_t r1) {
  gemm_half<true>(w, x, N, y, bias, r0, r1);
}

__attribute__((target("avx2,fma,f16c")))
void gemm_f16_avx2(const WView& w, const float* x, int64_t N, float* y, const float* bias, int64_t r0, int64_t r1) {
  gemm_half<false>(w, x, N, y, bias, r0, r1);
}

}  // namespace offload
