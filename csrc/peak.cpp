// Peak arithmetic rate of the instructions the matmul kernels are built from, measured on this machine: many
// independent accumulator chains of one instruction, nothing else (no loads), on `nthreads` threads. The
// kernel benchmark prints each kernel's GFLOP/s as a fraction of the peak of its own instruction mix.
#include <immintrin.h>
#include <omp.h>

#include <chrono>
#include <cstdint>
#include <stdexcept>
#include <string>

namespace offload {
namespace {

constexpr int kChains = 12;  // independent accumulators: enough to cover the latency x throughput of each

template <typename Body>
double rate(Body body, int64_t iterations, int nthreads, double flop_per_iteration) {
  const auto t0 = std::chrono::steady_clock::now();
  int sink = 0;
#pragma omp parallel num_threads(nthreads) reduction(+ : sink)
  sink += body(iterations);
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (sink == 42) throw std::runtime_error("unreachable");  // keeps the result live
  return flop_per_iteration * double(iterations) * nthreads / s;
}

// int8 (u8 x s8) multiply-adds with AVX-512 VNNI vpdpbusd on 256 bits: 32 per instruction.
__attribute__((target("avx2,avx512f,avx512vl,avx512vnni"))) int body_vnni_u8(int64_t n) {
  __m256i acc[kChains];
  const __m256i a = _mm256_set1_epi8(3), b = _mm256_set1_epi8(5);
  for (int i = 0; i < kChains; ++i) acc[i] = _mm256_set1_epi32(i);
  for (int64_t k = 0; k < n; ++k)
    for (int i = 0; i < kChains; ++i) acc[i] = _mm256_dpbusd_epi32(acc[i], a, b);
  int s = 0;
  for (int i = 0; i < kChains; ++i) s += _mm256_extract_epi32(acc[i], 0);
  return s;
}

// int16 multiply-adds with vpdpwssd on 256 bits: 16 per instruction (q8_0 x int16 activations).
__attribute__((target("avx2,avx512f,avx512vl,avx512vnni"))) int body_vnni_s16(int64_t n) {
  __m256i acc[kChains];
  const __m256i a = _mm256_set1_epi16(3), b = _mm256_set1_epi16(5);
  for (int i = 0; i < kChains; ++i) acc[i] = _mm256_set1_epi32(i);
  for (int64_t k = 0; k < n; ++k)
    for (int i = 0; i < kChains; ++i) acc[i] = _mm256_dpwssd_epi32(acc[i], a, b);
  int s = 0;
  for (int i = 0; i < kChains; ++i) s += _mm256_extract_epi32(acc[i], 0);
  return s;
}

// int8 multiply-adds the AVX2 way: vpmaddubsw, vpmaddwd, vpaddd for 32 (what dot_us does without VNNI).
__attribute__((target("avx2"))) int body_avx2_u8(int64_t n) {
  __m256i acc[kChains];
  const __m256i a = _mm256_set1_epi8(3), b = _mm256_set1_epi8(5), one = _mm256_set1_epi16(1);
  for (int i = 0; i < kChains; ++i) acc[i] = _mm256_set1_epi32(i);
  for (int64_t k = 0; k < n; ++k)
    for (int i = 0; i < kChains; ++i)
      acc[i] = _mm256_add_epi32(acc[i], _mm256_madd_epi16(_mm256_maddubs_epi16(a, b), one));
  int s = 0;
  for (int i = 0; i < kChains; ++i) s += _mm256_extract_epi32(acc[i], 0);
  return s;
}

// int16 multiply-adds the AVX2 way: vpmaddwd, vpaddd for 16 (q8_0 x int16 activations without VNNI).
__attribute__((target("avx2"))) int body_avx2_s16(int64_t n) {
  __m256i acc[kChains];
  const __m256i a = _mm256_set1_epi16(3), b = _mm256_set1_epi16(5);
  for (int i = 0; i < kChains; ++i) acc[i] = _mm256_set1_epi32(i);
  for (int64_t k = 0; k < n; ++k)
    for (int i = 0; i < kChains; ++i) acc[i] = _mm256_add_epi32(acc[i], _mm256_madd_epi16(a, b));
  int s = 0;
  for (int i = 0; i < kChains; ++i) s += _mm256_extract_epi32(acc[i], 0);
  return s;
}

// fp32 fused multiply-adds on 256 bits: 8 per instruction.
__attribute__((target("avx2,fma"))) int body_fma32(int64_t n) {
  __m256 acc[kChains];
  const __m256 a = _mm256_set1_ps(0.999f), b = _mm256_set1_ps(1e-7f);
  for (int i = 0; i < kChains; ++i) acc[i] = _mm256_set1_ps(float(i));
  for (int64_t k = 0; k < n; ++k)
    for (int i = 0; i < kChains; ++i) acc[i] = _mm256_fmadd_ps(acc[i], a, b);
  float s = 0.f;
  for (int i = 0; i < kChains; ++i) s += _mm256_cvtss_f32(acc[i]);
  return int(s);
}

// bf16 pair multiply-adds with AVX-512 BF16 vdpbf16ps on 512 bits: 32 per instruction (the bf16 tiles' own).
__attribute__((target("avx2,avx512f,avx512bw,avx512vl,avx512bf16"))) int body_bf16(int64_t n) {
  __m512 acc[kChains];
  const __m512bh a = (__m512bh)_mm512_set1_epi16(0x3F80), b = (__m512bh)_mm512_set1_epi16(0x3380);  // 1, ~6e-8
  for (int i = 0; i < kChains; ++i) acc[i] = _mm512_set1_ps(float(i));
  for (int64_t k = 0; k < n; ++k)
    for (int i = 0; i < kChains; ++i) acc[i] = _mm512_dpbf16_ps(acc[i], a, b);
  float s = 0.f;
  for (int i = 0; i < kChains; ++i) s += _mm512_reduce_add_ps(acc[i]);
  return int(s);
}

}  // namespace

// FLOP/s (2 per multiply-add) of one instruction kind: vnni_u8, vnni_s16, avx2_u8, avx2_s16, fma32 or bf16.
double peak_flops(const std::string& kind, int64_t iterations, int nthreads) {
  const int nth = nthreads < 1 ? 1 : nthreads;
  const bool vnni = __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vl");
  if ((kind == "vnni_u8" || kind == "vnni_s16") && !vnni)
    throw std::invalid_argument("peak_flops: this CPU has no AVX-512 VNNI; measure avx2_u8 instead");
  if (!__builtin_cpu_supports("avx2") || !__builtin_cpu_supports("fma"))
    throw std::invalid_argument("peak_flops: this CPU has no AVX2/FMA");
  if (kind == "vnni_u8") return rate(body_vnni_u8, iterations, nth, 2.0 * 32 * kChains);
  if (kind == "vnni_s16") return rate(body_vnni_s16, iterations, nth, 2.0 * 16 * kChains);
  if (kind == "avx2_u8") return rate(body_avx2_u8, iterations, nth, 2.0 * 32 * kChains);
  if (kind == "avx2_s16") return rate(body_avx2_s16, iterations, nth, 2.0 * 16 * kChains);
  if (kind == "fma32") return rate(body_fma32, iterations, nth, 2.0 * 8 * kChains);
  if (kind == "bf16") {
    if (!__builtin_cpu_supports("avx512bf16"))
      throw std::invalid_argument("peak_flops: this CPU has no AVX-512 BF16; measure fma32 instead");
    return rate(body_bf16, iterations, nth, 2.0 * 32 * kChains);
  }
  throw std::invalid_argument("peak_flops: kind must be vnni_u8, vnni_s16, avx2_u8, avx2_s16, fma32 or bf16");
}

}  // namespace offload
