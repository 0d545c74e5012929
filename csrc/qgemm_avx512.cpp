// AVX-512 (VL + VNNI) quantized kernels: the same tiles as the AVX2 path (qgemm_tiles.inc, kquant_tiles.inc), with
// each u8 x s8 dot product done by one vpdpbusd. Compiled with per-function target attributes
// and called only when the CPU reports avx512f, avx512bw, avx512vl and avx512vnni.
#include <immintrin.h>

#include <cstring>
#include <vector>

#include "kernels.h"
#include "kquant.h"

#define KFN __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni"))) inline

namespace offload {
namespace {

// 8 int32 lanes, each the sum of 4 adjacent u8 x s8 products (exact in int32, no int16 step).
KFN __m256i dot_us(__m256i u, __m256i s) { return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s); }

KFN __m256i dot_us2(__m256i u1, __m256i s1, __m256i u2, __m256i s2) {
  return _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(_mm256_setzero_si256(), u1, s1), u2, s2);
}

// q8_0 x int16 activations: two vpdpwssd (int16 pairs summed into int32, exact).
KFN __m256i dot_q8x16(__m256i w1, __m256i x1, __m256i w2, __m256i x2) {
  return _mm256_dpwssd_epi32(_mm256_dpwssd_epi32(_mm256_setzero_si256(), w1, x1), w2, x2);
}

#define GEMM_TOKENS 4  // 32 vector registers: 16 accumulators of a 4 x 4 tile
#include "qgemm_tiles.inc"
#include "kquant_tiles.inc"

}  // namespace

__attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")))
void gemm_q8_0_avx512(const WView& w, const XQ& x, float* y, const float* bias, int64_t r0, int64_t r1) {
  gemm_rows<false>(w, x, y, bias, r0, r1);
}

__attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")))
void gemm_q4_0_avx512(const WView& w, const XQ& x, float* y, const float* bias, int64_t r0, int64_t r1) {
  gemm_rows<true>(w, x, y, bias, r0, r1);
}

__attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")))
void gemm_q4_1_avx512(const WView& w, const XQ& x, float* y, const float* bias, int64_t r0, int64_t r1) {
  gemm_gguf_rows<Q41>(w, x, y, bias, r0, r1);
}

__attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")))
void gemm_q4_k_avx512(const WView& w, const XQ& x, float* y, const float* bias, int64_t r0, int64_t r1) {
  gemm_gguf_rows<Q4K>(w, x, y, bias, r0, r1);
}

__attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")))
void gemm_q5_k_avx512(const WView& w, const XQ& x, float* y, const float* bias, int64_t r0, int64_t r1) {
  gemm_gguf_rows<Q5K>(w, x, y, bias, r0, r1);
}

__attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")))
void gemm_q6_k_avx512(const WView& w, const XQ& x, float* y, const float* bias, int64_t r0, int64_t r1) {
  gemm_gguf_rows<Q6K>(w, x, y, bias, r0, r1);
}

}  // namespace offload
