// AVX2 + FMA + F16C quantized kernels: activation quantizers, q8_0 / q4_0 and GGUF block format matmuls.
// Compiled with per-function target attributes; only called after a runtime CPU check.
#include <immintrin.h>

#include <cstring>
#include <vector>

#include "kernels.h"
#include "kquant.h"

#define KFN __attribute__((target("avx2,fma,f16c"))) inline

namespace offload {
namespace {

// 8 int32 lanes, each the sum of 4 adjacent u8 x s8 products (|products| stay below int16 limits).
KFN __m256i dot_us(__m256i u, __m256i s) {
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
}

// Two dot products summed in int16 first: operands are nibbles (<= 15), so 4 * 15 * 128 fits.
KFN __m256i dot_us2(__m256i u1, __m256i s1, __m256i u2, __m256i s2) {
  const __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(u1, s1), _mm256_maddubs_epi16(u2, s2));
  return _mm256_madd_epi16(p, _mm256_set1_epi16(1));
}

// q8_0 x int16 activations: 16 products of each half, summed pairwise into 8 int32 lanes (exact).
KFN __m256i dot_q8x16(__m256i w1, __m256i x1, __m256i w2, __m256i x2) {
  return _mm256_add_epi32(_mm256_madd_epi16(w1, x1), _mm256_madd_epi16(w2, x2));
}

KFN __m256 load8(const void* x, int xtype, int64_t i) {
  if (xtype == X_BF16) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(x) + i));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
  return _mm256_loadu_ps(static_cast<const float*>(x) + i);
}

constexpr bool kExactUS = false;  // vpmaddubsw saturates int16 pairs: the iq4 levels stay signed
#include "qgemm_tiles.inc"
#include "kquant_tiles.inc"
#include "token_sums.inc"

// Loads one block of 32 activations into v[4] and returns its largest magnitude.
KFN float load_block_amax(const void* x, int xtype, int64_t i, __m256 (&v)[4]) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  for (int j = 0; j < 4; ++j) v[j] = load8(x, xtype, i + j * 8);
  __m256 m = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v[0]), _mm256_andnot_ps(sign, v[1])),
                           _mm256_max_ps(_mm256_andnot_ps(sign, v[2]), _mm256_andnot_ps(sign, v[3])));
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
  return _mm_cvtss_f32(m4);
}

// One block of 32 activations -> 32 int8 (natural order); writes its scale d and d * sum(q).
KFN __m256i quantize_block(const void* x, int xtype, int64_t i, float* d, float* s) {
  __m256 v[4];
  const float amax = load_block_amax(x, xtype, i, v);
  const __m256 id = _mm256_set1_ps(amax != 0.f ? 127.f / amax : 0.f);
  __m256i q[4];  // cvtps rounds to nearest even (the default MXCSR mode), like nearbyint in the reference
  for (int j = 0; j < 4; ++j) q[j] = _mm256_cvtps_epi32(_mm256_mul_ps(v[j], id));
  const __m256i sum = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
  const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
  *d = amax / 127.f;
  *s = *d * hsum8(_mm256_cvtepi32_ps(sum));  // small integers: exact in fp32 in any order
  return _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

// q4_0 matrix-matrix products in 8-row tiles (the AVX2 form of qgemm_avx512.cpp's 16-row tiles): a tile's quants
// are unpacked once so that one ymm holds 4 consecutive quants of each of 8 rows; per token and block, 8 vpmaddubsw
// against the token's 4 activations broadcast are summed in int16 (nibbles x int8: 8 x 2 x 15 x 127 < 2^15), one
// vpmaddwd makes the 8 rows' block sums, and the scales are applied once for all 8 rows.
constexpr int AR = 8;                 // weight rows per wide tile
constexpr int AT = 8;                 // tokens per wide tile
constexpr int64_t kWideMinTokens = 4;
constexpr int kWideYmm = 9;           // scratch per block: 8 ymm of quants, 1 of fp32 scales
struct alignas(32) Ymm { uint8_t bytes[32]; };

KFN void unpack_q4_wide(const WView& w, int64_t r0, __m256i* scratch) {
  const RowTile t[2] = {RowTile(w, r0, QK / 2), RowTile(w, r0 + 4, QK / 2)};
  const __m256i m4 = _mm256_set1_epi8(0x0F);
  alignas(32) uint16_t d16[AR];
  for (int64_t b = 0; b < w.K / QK; ++b) {
    __m128i c[2][4];  // c[h][j]: packed dword j of rows 4h..4h+3 (a 4 x 4 dword transpose)
    for (int h = 0; h < 2; ++h) {
      __m128i a[4];
      for (int r = 0; r < 4; ++r) a[r] = _mm_loadu_si128(reinterpret_cast<const __m128i*>(t[h].qat(r, b)));
      const __m128i u0 = _mm_unpacklo_epi32(a[0], a[1]), u1 = _mm_unpackhi_epi32(a[0], a[1]);
      const __m128i u2 = _mm_unpacklo_epi32(a[2], a[3]), u3 = _mm_unpackhi_epi32(a[2], a[3]);
      c[h][0] = _mm_unpacklo_epi64(u0, u2);
      c[h][1] = _mm_unpackhi_epi64(u0, u2);
      c[h][2] = _mm_unpacklo_epi64(u1, u3);
      c[h][3] = _mm_unpackhi_epi64(u1, u3);
    }
    __m256i* o = scratch + b * kWideYmm;
    for (int j = 0; j < 4; ++j) {
      const __m256i p = _mm256_set_m128i(c[1][j], c[0][j]);
      _mm256_store_si256(o + j, _mm256_and_si256(p, m4));
      _mm256_store_si256(o + 4 + j, _mm256_and_si256(_mm256_srli_epi16(p, 4), m4));
    }
    for (int r = 0; r < AR; ++r) d16[r] = *t[r / 4].dat(r % 4, b);
    _mm256_store_ps(reinterpret_cast<float*>(o + 8), _mm256_cvtph_ps(_mm_load_si128(reinterpret_cast<const __m128i*>(d16))));
  }
}

KFN __m256i bcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

template <int T>
KFN void wide_q4_0(const __m256i* scratch, const XQ& x, int64_t n0, float* y, int64_t M, int64_t r0,
                   const float* bias) {
  const int64_t K = x.K, nb = K / QK, paired = nb & ~int64_t(1), ld = x.stride();
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[T];
#pragma GCC unroll 8
  for (int t = 0; t < T; ++t) acc[t] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const __m256i* o = scratch + b * kWideYmm;
    const __m256 dw = _mm256_load_ps(reinterpret_cast<const float*>(o + 8));
    // the activations of block b: quants 0-15 at lo, 16-31 at hi (see wide_q4_0 in qgemm_avx512.cpp)
    const int64_t lo = b < paired ? (b & ~int64_t(1)) * QK + (b & 1) * 16 : b * QK;
    const int64_t hi = b < paired ? lo + QK : lo + 16;
#pragma GCC unroll 8
    for (int t = 0; t < T; ++t) {
      const int8_t* xr = x.qs + (n0 + t) * ld;
      __m256i s16 = _mm256_maddubs_epi16(_mm256_load_si256(o), bcast4(xr + lo));
#pragma GCC unroll 4
      for (int j = 1; j < 4; ++j)
        s16 = _mm256_add_epi16(s16, _mm256_maddubs_epi16(_mm256_load_si256(o + j), bcast4(xr + lo + 4 * j)));
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j)
        s16 = _mm256_add_epi16(s16, _mm256_maddubs_epi16(_mm256_load_si256(o + 4 + j), bcast4(xr + hi + 4 * j)));
      const __m256i s = _mm256_add_epi32(_mm256_madd_epi16(s16, ones), _mm256_set1_epi32(x.c8[(n0 + t) * nb + b]));
      const __m256 dx = _mm256_set1_ps(x.d[(n0 + t) * nb + b]);
      acc[t] = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(s), dx), dw, acc[t]);
    }
  }
  const __m256 bv = bias ? _mm256_loadu_ps(bias + r0) : _mm256_setzero_ps();
#pragma GCC unroll 8
  for (int t = 0; t < T; ++t) _mm256_storeu_ps(y + (n0 + t) * M + r0, _mm256_add_ps(acc[t], bv));
}

KFN void wide_q4_0_rows(const WView& w, const XQ& x, float* y, const float* bias, int64_t r0, int64_t r1) {
  thread_local std::vector<Ymm> buffer;
  buffer.resize(size_t(w.K / QK * kWideYmm));
  __m256i* scratch = reinterpret_cast<__m256i*>(buffer.data());
  for (int64_t r = r0; r + AR <= r1; r += AR) {
    unpack_q4_wide(w, r, scratch);
    int64_t n = 0;
    for (; n + AT <= x.N; n += AT) wide_q4_0<AT>(scratch, x, n, y, w.M, r, bias);
    if (n + 4 <= x.N) wide_q4_0<4>(scratch, x, n, y, w.M, r, bias), n += 4;
    if (n + 2 <= x.N) wide_q4_0<2>(scratch, x, n, y, w.M, r, bias), n += 2;
    if (n < x.N) wide_q4_0<1>(scratch, x, n, y, w.M, r, bias);
  }
}

#include "kquant_wide_avx2.inc"

}  // namespace

// int8 activations for q4_0 weights, stored the way the q4_0 tiles read them: each pair of blocks
// (b, b+1) as [b[0:16], b+1[0:16], b[16:32], b+1[16:32]] (the nibble order of two weight blocks); an
// odd last block stays in natural order.
__attribute__((target("avx2,fma,f16c")))
void quantize_x_avx2(const void* x, int xtype, int64_t K, int8_t* qs, float* d, float* s) {
  const int64_t nb = K / QK;
  int64_t b = 0;
  for (; b + 2 <= nb; b += 2) {
    const __m256i p0 = quantize_block(x, xtype, b * QK, d + b, s + b);
    const __m256i p1 = quantize_block(x, xtype, (b + 1) * QK, d + b + 1, s + b + 1);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(qs + b * QK), _mm256_permute2x128_si256(p0, p1, 0x20));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(qs + b * QK + QK), _mm256_permute2x128_si256(p0, p1, 0x31));
  }
  if (b < nb) _mm256_storeu_si256(reinterpret_cast<__m256i*>(qs + b * QK), quantize_block(x, xtype, b * QK, d + b, s + b));
}

// int8 activations for the GGUF formats: natural order, and the sum of each 16 quants.
__attribute__((target("avx2,fma,f16c")))
void quantize_xk_avx2(const void* x, int xtype, int64_t K, int8_t* qs, float* d, float* s, int16_t* s16) {
  for (int64_t b = 0; b < K / QK; ++b) {
    const __m256i q = quantize_block(x, xtype, b * QK, d + b, s + b);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(qs + b * QK), q);
    // pair sums, then 4-lane sums: [sum of weights 0-15 x4 | sum of 16-31 x4]
    __m256i t = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_set1_epi8(1), q), _mm256_set1_epi16(1));
    t = _mm256_hadd_epi32(t, t);
    t = _mm256_hadd_epi32(t, t);
    s16[2 * b] = int16_t(_mm256_extract_epi32(t, 0));
    s16[2 * b + 1] = int16_t(_mm256_extract_epi32(t, 4));
  }
}

__attribute__((target("avx2,fma,f16c")))
void quantize_x16_avx2(const void* x, int xtype, int64_t K, int16_t* qs, float* d, float* s) {
  for (int64_t b = 0; b < K / QK; ++b) {
    __m256 v[4];
    const float amax = load_block_amax(x, xtype, b * QK, v);
    const __m256 id = _mm256_set1_ps(amax != 0.f ? 32767.f / amax : 0.f);
    __m256i q[4];  // round to nearest even (default MXCSR), like nearbyint in the reference
    for (int i = 0; i < 4; ++i) q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], id));
    // packs works per 128-bit lane: [q0 0-3, q1 0-3 | q0 4-7, q1 4-7] -> reorder the 64-bit quarters
    const __m256i lo = _mm256_permute4x64_epi64(_mm256_packs_epi32(q[0], q[1]), 0xD8);
    const __m256i hi = _mm256_permute4x64_epi64(_mm256_packs_epi32(q[2], q[3]), 0xD8);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(qs + b * QK), lo);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(qs + b * QK + 16), hi);
    d[b] = amax / 32767.f;
    const __m256i sum = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
    s[b] = d[b] * hsum8(_mm256_cvtepi32_ps(sum));  // |sum| < 2^24: exact in fp32 in any order, as the reference
  }
}

__attribute__((target("avx2,fma,f16c")))
void gemm_q8_0_avx2(const WView& w, const XQ& x, float* y, const float* bias, int64_t r0, int64_t r1) {
  gemm_rows<false>(w, x, y, bias, r0, r1);
}

__attribute__((target("avx2,fma,f16c")))
void gemm_q4_0_avx2(const WView& w, const XQ& x, float* y, const float* bias, int64_t r0, int64_t r1) {
  if (x.c8 == nullptr || x.N < kWideMinTokens || r1 - r0 < AR) return gemm_rows<true>(w, x, y, bias, r0, r1);
  wide_q4_0_rows(w, x, y, bias, r0, r1);
  const int64_t done = r0 + (r1 - r0) / AR * AR;
  if (done < r1) gemm_rows<true>(w, x, y, bias, done, r1);
}

#define OFFLOAD_ENTRY(name_, NAME_, id_, weights_, bytes_, Dec_, Row_) \
  __attribute__((target("avx2,fma,f16c")))                          \
  void gemm_##name_##_avx2(const WView& w, const XQ& x, float* y, const float* bias, int64_t r0, int64_t r1) {  \
    gguf_rows<Dec_>(w, x, y, bias, r0, r1);                                                                          \
  }
OFFLOAD_GGUF_FORMATS(OFFLOAD_ENTRY)
#undef OFFLOAD_ENTRY

__attribute__((target("avx2,fma,f16c")))
uint64_t read_bytes_avx2(const uint8_t* p, int64_t n) {
  __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
  int64_t i = 0;
  for (; i + 128 <= n; i += 128) {
    a0 = _mm256_add_epi64(a0, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i)));
    a1 = _mm256_add_epi64(a1, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i + 32)));
    a2 = _mm256_add_epi64(a2, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i + 64)));
    a3 = _mm256_add_epi64(a3, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i + 96)));
  }
  a0 = _mm256_add_epi64(_mm256_add_epi64(a0, a1), _mm256_add_epi64(a2, a3));
  uint64_t t = uint64_t(_mm256_extract_epi64(a0, 0) + _mm256_extract_epi64(a0, 1) +
                        _mm256_extract_epi64(a0, 2) + _mm256_extract_epi64(a0, 3));
  for (; i < n; ++i) t += p[i];
  return t;
}

}  // namespace offload
