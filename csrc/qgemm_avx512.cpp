// AVX-512 (VL + VNNI) quantized kernels: the same tiles as the AVX2 path (qgemm_tiles.inc, kquant_tiles.inc), with
// each u8 x s8 dot product done by one vpdpbusd. Compiled with per-function target attributes
// and called only when the CPU reports avx512f, avx512bw, avx512vl and avx512vnni.
#include <immintrin.h>

// GCC 12's AVX-512 headers build some intrinsics on _mm512_undefined_*(), which -Wmaybe-uninitialized flags.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

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

// q4_0 and q8_0 matrix-matrix products in 16-row tiles. A tile's quants are unpacked once into a scratch where one
// zmm holds 4 consecutive quants of each of the 16 rows (q8_0: 2, widened to int16), so a vpdpbusd (vpdpwssd)
// against a token's 4 (2) activations broadcast makes 16 rows x 4 (2) products, and a block's scales are applied
// once per token for all 16 rows: 8 (16) dot products per 3 float operations, where the 4 x 4 tiles spend 3 per
// dot product. The q4_0 offset (-8 * sum of the activation block, c8) starts each block's integer sum. Rows left
// over (fewer than 16) and small token counts take the 4 x 4 tiles. The same integer sums as those, the float sums
// in another order: equal to the scalar reference within float rounding.
constexpr int WR = 16;           // weight rows per wide tile
constexpr int WT = 16;           // tokens per wide tile: 16 accumulators + 8 quant registers + scales
constexpr int64_t kWideMinTokens = 4;    // q4_0: from 4 tokens the unpacking pays (8 measured 1.0-1.8x the 4 x 4 tiles)
constexpr int64_t kWideMinTokens8 = 12;  // q8_0's unpacking (widening to int16) costs more: at 8 tokens 0.6-1.0x
constexpr int kWideZmm = 9;      // scratch per block: 8 zmm of quants, 1 of fp32 scales
struct alignas(64) Zmm { uint8_t bytes[64]; };  // a std::vector of these is 64-byte aligned (__m512i's isn't)

// 16 bytes at byte `at` of block b of rows r0..r0+15 (4 dwords a row), as 4 zmm: dword j of every row, rows in
// lane order.
KFN void gather_block16(const RowTile (&t)[4], int64_t b, int64_t at, __m512i (&p)[4]) {
  const __m512i by_dword = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  __m512i z[4];
#pragma GCC unroll 4
  for (int k = 0; k < 4; ++k) {  // rows 4k..4k+3, then regrouped: [dword 0 of the 4 rows | dword 1 | 2 | 3]
    __m512i v = _mm512_zextsi128_si512(_mm_loadu_si128(reinterpret_cast<const __m128i*>(t[k].qat(0, b) + at)));
    v = _mm512_inserti32x4(v, _mm_loadu_si128(reinterpret_cast<const __m128i*>(t[k].qat(1, b) + at)), 1);
    v = _mm512_inserti32x4(v, _mm_loadu_si128(reinterpret_cast<const __m128i*>(t[k].qat(2, b) + at)), 2);
    v = _mm512_inserti32x4(v, _mm_loadu_si128(reinterpret_cast<const __m128i*>(t[k].qat(3, b) + at)), 3);
    z[k] = _mm512_permutexvar_epi32(by_dword, v);
  }
  // 4 x 4 transpose of 128-bit lanes: p[j] = [lane j of z0, of z1, of z2, of z3]
  const __m512i t0 = _mm512_shuffle_i32x4(z[0], z[1], 0x44), t1 = _mm512_shuffle_i32x4(z[0], z[1], 0xEE);
  const __m512i t2 = _mm512_shuffle_i32x4(z[2], z[3], 0x44), t3 = _mm512_shuffle_i32x4(z[2], z[3], 0xEE);
  p[0] = _mm512_shuffle_i32x4(t0, t2, 0x88);
  p[1] = _mm512_shuffle_i32x4(t0, t2, 0xDD);
  p[2] = _mm512_shuffle_i32x4(t1, t3, 0x88);
  p[3] = _mm512_shuffle_i32x4(t1, t3, 0xDD);
}

// Unpacks rows r0..r0+15 into the scratch: per block, zmm j < 4 holds quants 4j..4j+3 of each row (low nibbles
// of packed dword j), zmm 4 + j quants 16 + 4j.. (high nibbles), then the 16 rows' fp32 scales.
KFN void unpack_q4_wide(const WView& w, int64_t r0, __m512i* scratch) {
  const RowTile t[4] = {RowTile(w, r0, QK / 2), RowTile(w, r0 + 4, QK / 2), RowTile(w, r0 + 8, QK / 2),
                        RowTile(w, r0 + 12, QK / 2)};
  const __m512i m4 = _mm512_set1_epi8(0x0F);
  alignas(64) uint16_t d16[WR];
  for (int64_t b = 0; b < w.K / QK; ++b) {
    __m512i p[4];
    gather_block16(t, b, 0, p);
    __m512i* o = scratch + b * kWideZmm;
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {
      _mm512_store_si512(o + j, _mm512_and_si512(p[j], m4));
      _mm512_store_si512(o + 4 + j, _mm512_and_si512(_mm512_srli_epi16(p[j], 4), m4));
    }
    for (int r = 0; r < WR; ++r) d16[r] = *t[r / 4].dat(r % 4, b);
    _mm512_store_ps(o + 8, _mm512_cvtph_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(d16))));
  }
}

KFN __m512i bcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

// q8_0 likewise: per block 16 zmm, zmm i holding quants 2i and 2i + 1 of each row widened to int16 (the int16
// activations' pairs: one vpdpwssd makes 16 rows x 2 products), then the scales.
constexpr int kWideZmm8 = 17;

KFN void unpack_q8_wide(const WView& w, int64_t r0, __m512i* scratch) {
  const RowTile t[4] = {RowTile(w, r0, QK), RowTile(w, r0 + 4, QK), RowTile(w, r0 + 8, QK), RowTile(w, r0 + 12, QK)};
  const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
  alignas(64) uint16_t d16[WR];
  for (int64_t b = 0; b < w.K / QK; ++b) {
    __m512i* o = scratch + b * kWideZmm8;
    for (int h = 0; h < 2; ++h) {
      __m512i p[4];  // p[j]: quants 16h + 4j .. 16h + 4j + 3 of each row
      gather_block16(t, b, 16 * h, p);
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) {  // rows 0-7 and 8-15 widened: dwords alternate (q0 q1), (q2 q3) per row
        const __m512i lo = _mm512_cvtepi8_epi16(_mm512_castsi512_si256(p[j]));
        const __m512i hi = _mm512_cvtepi8_epi16(_mm512_extracti64x4_epi64(p[j], 1));
        _mm512_store_si512(o + 8 * h + 2 * j, _mm512_permutex2var_epi32(lo, even, hi));
        _mm512_store_si512(o + 8 * h + 2 * j + 1, _mm512_permutex2var_epi32(lo, odd, hi));
      }
    }
    for (int r = 0; r < WR; ++r) d16[r] = *t[r / 4].dat(r % 4, b);
    _mm512_store_ps(o + 16, _mm512_cvtph_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(d16))));
  }
}

// T tokens (int16 activations) from n0 against one unpacked 16-row q8_0 tile.
template <int T>
KFN void wide_q8_0(const __m512i* scratch, const XQ& x, int64_t n0, float* y, int64_t M, int64_t r0,
                   const float* bias) {
  const int64_t K = x.K, nb = K / QK;
  const int16_t* xq = reinterpret_cast<const int16_t*>(x.qs);
  __m512 acc[T];
#pragma GCC unroll 8
  for (int t = 0; t < T; ++t) acc[t] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const __m512i* o = scratch + b * kWideZmm8;
    __m512i q[16];
#pragma GCC unroll 16
    for (int i = 0; i < 16; ++i) q[i] = _mm512_load_si512(o + i);
    const __m512 dw = _mm512_load_ps(o + 16);
#pragma GCC unroll 8
    for (int t = 0; t < T; ++t) {
      const int8_t* xb = reinterpret_cast<const int8_t*>(xq + (n0 + t) * x.stride() + b * QK);
      __m512i s = _mm512_setzero_si512();
#pragma GCC unroll 16
      for (int i = 0; i < 16; ++i) s = _mm512_dpwssd_epi32(s, q[i], bcast4(xb + 4 * i));
      const __m512 dx = _mm512_set1_ps(x.d[(n0 + t) * nb + b]);
      acc[t] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(s), dx), dw, acc[t]);
    }
  }
  const __m512 bv = bias ? _mm512_loadu_ps(bias + r0) : _mm512_setzero_ps();
#pragma GCC unroll 8
  for (int t = 0; t < T; ++t) _mm512_storeu_ps(y + (n0 + t) * M + r0, _mm512_add_ps(acc[t], bv));
}

KFN void wide_q8_0_rows(const WView& w, const XQ& x, float* y, const float* bias, int64_t r0, int64_t r1) {
  thread_local std::vector<Zmm> buffer;
  buffer.resize(size_t(w.K / QK * kWideZmm8));
  __m512i* scratch = reinterpret_cast<__m512i*>(buffer.data());
  for (int64_t r = r0; r + WR <= r1; r += WR) {
    unpack_q8_wide(w, r, scratch);
    int64_t n = 0;
    for (; n + 8 <= x.N; n += 8) wide_q8_0<8>(scratch, x, n, y, w.M, r, bias);
    if (n + 4 <= x.N) wide_q8_0<4>(scratch, x, n, y, w.M, r, bias), n += 4;
    if (n + 2 <= x.N) wide_q8_0<2>(scratch, x, n, y, w.M, r, bias), n += 2;
    if (n < x.N) wide_q8_0<1>(scratch, x, n, y, w.M, r, bias);
  }
}

// T tokens from n0 against one unpacked 16-row tile; y rows r0..r0+15 of each token.
template <int T>
KFN void wide_q4_0(const __m512i* scratch, const XQ& x, int64_t n0, float* y, int64_t M, int64_t r0,
                   const float* bias) {
  const int64_t K = x.K, nb = K / QK, paired = nb & ~int64_t(1);
  __m512 acc[T];
#pragma GCC unroll 16
  for (int t = 0; t < T; ++t) acc[t] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const __m512i* o = scratch + b * kWideZmm;
    __m512i q[8];
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) q[j] = _mm512_load_si512(o + j);
    const __m512 dw = _mm512_load_ps(o + 8);
    // the activations of block b: quants 0-15 at lo, 16-31 at hi (a pair's blocks are stored interleaved by
    // halves, see quantize_x_avx2; an odd last block in natural order)
    const int64_t lo = b < paired ? (b & ~int64_t(1)) * QK + (b & 1) * 16 : b * QK;
    const int64_t hi = b < paired ? lo + QK : lo + 16;
#pragma GCC unroll 16
    for (int t = 0; t < T; ++t) {
      const int8_t* xr = x.qs + (n0 + t) * x.stride();
      __m512i s = _mm512_set1_epi32(x.c8[(n0 + t) * nb + b]);
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) {
        s = _mm512_dpbusd_epi32(s, q[j], bcast4(xr + lo + 4 * j));
        s = _mm512_dpbusd_epi32(s, q[4 + j], bcast4(xr + hi + 4 * j));
      }
      const __m512 dx = _mm512_set1_ps(x.d[(n0 + t) * nb + b]);
      acc[t] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(s), dx), dw, acc[t]);
    }
  }
  const __m512 bv = bias ? _mm512_loadu_ps(bias + r0) : _mm512_setzero_ps();
#pragma GCC unroll 16
  for (int t = 0; t < T; ++t) _mm512_storeu_ps(y + (n0 + t) * M + r0, _mm512_add_ps(acc[t], bv));
}

KFN void wide_q4_0_rows(const WView& w, const XQ& x, float* y, const float* bias, int64_t r0, int64_t r1) {
  thread_local std::vector<Zmm> buffer;
  buffer.resize(size_t(w.K / QK * kWideZmm));
  __m512i* scratch = reinterpret_cast<__m512i*>(buffer.data());
  for (int64_t r = r0; r + WR <= r1; r += WR) {
    unpack_q4_wide(w, r, scratch);
    int64_t n = 0;
    for (; n + WT <= x.N; n += WT) wide_q4_0<WT>(scratch, x, n, y, w.M, r, bias);
    if (n + 8 <= x.N) wide_q4_0<8>(scratch, x, n, y, w.M, r, bias), n += 8;
    if (n + 4 <= x.N) wide_q4_0<4>(scratch, x, n, y, w.M, r, bias), n += 4;
    if (n + 2 <= x.N) wide_q4_0<2>(scratch, x, n, y, w.M, r, bias), n += 2;
    if (n < x.N) wide_q4_0<1>(scratch, x, n, y, w.M, r, bias);
  }
}

// bf16 weights against bf16 activations with AVX-512 BF16: per 16-row tile the weights are regrouped once so that
// zmm i holds elements 2i and 2i + 1 of each row (a 16 x 32 slice per 16 zmm), then one vdpbf16ps against a token's
// pair of activations broadcast makes 16 rows x 2 products, accumulated in fp32 as they come (no scales).
#define KFN_BF16 __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni,avx512bf16"))) inline
constexpr int BT = 12;  // tokens per bf16 tile: 12 accumulators + 16 weight registers

KFN_BF16 void unpack_bf16_wide(const WView& w, int64_t r0, int64_t b, __m512i (&q)[16]) {
  const uint8_t* base = w.qs + (r0 * w.K + b * QK) * 2;
  const __m512i by_dword = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
#pragma GCC unroll 4
  for (int c = 0; c < 4; ++c) {  // 16 bytes (8 elements) of each row at a time: the 16 x 4 dword transpose
    __m512i z[4];
#pragma GCC unroll 4
    for (int k = 0; k < 4; ++k) {
      const uint8_t* rk = base + (4 * k) * w.K * 2 + 16 * c;
      __m512i v = _mm512_zextsi128_si512(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rk)));
      v = _mm512_inserti32x4(v, _mm_loadu_si128(reinterpret_cast<const __m128i*>(rk + w.K * 2)), 1);
      v = _mm512_inserti32x4(v, _mm_loadu_si128(reinterpret_cast<const __m128i*>(rk + w.K * 4)), 2);
      v = _mm512_inserti32x4(v, _mm_loadu_si128(reinterpret_cast<const __m128i*>(rk + w.K * 6)), 3);
      z[k] = _mm512_permutexvar_epi32(by_dword, v);
    }
    const __m512i t0 = _mm512_shuffle_i32x4(z[0], z[1], 0x44), t1 = _mm512_shuffle_i32x4(z[0], z[1], 0xEE);
    const __m512i t2 = _mm512_shuffle_i32x4(z[2], z[3], 0x44), t3 = _mm512_shuffle_i32x4(z[2], z[3], 0xEE);
    q[4 * c] = _mm512_shuffle_i32x4(t0, t2, 0x88);
    q[4 * c + 1] = _mm512_shuffle_i32x4(t0, t2, 0xDD);
    q[4 * c + 2] = _mm512_shuffle_i32x4(t1, t3, 0x88);
    q[4 * c + 3] = _mm512_shuffle_i32x4(t1, t3, 0xDD);
  }
}

template <int T>
KFN_BF16 void wide_bf16(const __m512i* scratch, const uint16_t* x, int64_t K, int64_t ldx, int64_t n0, float* y,
                        int64_t M, int64_t r0, const float* bias) {
  __m512 acc[T];
#pragma GCC unroll 12
  for (int t = 0; t < T; ++t) acc[t] = _mm512_setzero_ps();
  for (int64_t b = 0; b < K / QK; ++b) {
    const __m512i* o = scratch + b * 16;
#pragma GCC unroll 16
    for (int i = 0; i < 16; ++i) {
      const __m512i q = _mm512_load_si512(o + i);
#pragma GCC unroll 12
      for (int t = 0; t < T; ++t) {
        int32_t pair;
        std::memcpy(&pair, x + (n0 + t) * ldx + b * QK + 2 * i, 4);
        acc[t] = _mm512_dpbf16_ps(acc[t], (__m512bh)q, (__m512bh)_mm512_set1_epi32(pair));
      }
    }
  }
  const __m512 bv = bias ? _mm512_loadu_ps(bias + r0) : _mm512_setzero_ps();
#pragma GCC unroll 12
  for (int t = 0; t < T; ++t) _mm512_storeu_ps(y + (n0 + t) * M + r0, _mm512_add_ps(acc[t], bv));
}

// Rows left over from the 16-row tiles: one dot product of 32 elements per step per (row, token).
KFN_BF16 void rows_bf16(const WView& w, const uint16_t* x, int64_t ldx, int64_t N, float* y, const float* bias,
                        int64_t r0, int64_t r1) {
  const uint16_t* wq = reinterpret_cast<const uint16_t*>(w.qs);
  for (int64_t r = r0; r < r1; ++r)
    for (int64_t n = 0; n < N; ++n) {
      __m512 acc = _mm512_setzero_ps();
      for (int64_t k = 0; k < w.K; k += QK)
        acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(wq + r * w.K + k),
                               (__m512bh)_mm512_loadu_si512(x + n * ldx + k));
      y[n * w.M + r] = _mm512_reduce_add_ps(acc) + (bias ? bias[r] : 0.f);
    }
}

}  // namespace

__attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni,avx512bf16")))
void gemm_bf16_bf16x_avx512(const WView& w, const uint16_t* x, int64_t ldx, int64_t N, float* y, const float* bias,
                            int64_t r0, int64_t r1) {
  thread_local std::vector<Zmm> buffer;
  buffer.resize(size_t(w.K / QK * 16));
  __m512i* scratch = reinterpret_cast<__m512i*>(buffer.data());
  int64_t r = r0;
  for (; r + WR <= r1; r += WR) {
    for (int64_t b = 0; b < w.K / QK; ++b) {
      __m512i q[16];
      unpack_bf16_wide(w, r, b, q);
#pragma GCC unroll 16
      for (int i = 0; i < 16; ++i) _mm512_store_si512(scratch + b * 16 + i, q[i]);
    }
    int64_t n = 0;
    for (; n + BT <= N; n += BT) wide_bf16<BT>(scratch, x, w.K, ldx, n, y, w.M, r, bias);
    if (n + 8 <= N) wide_bf16<8>(scratch, x, w.K, ldx, n, y, w.M, r, bias), n += 8;
    if (n + 4 <= N) wide_bf16<4>(scratch, x, w.K, ldx, n, y, w.M, r, bias), n += 4;
    if (n + 2 <= N) wide_bf16<2>(scratch, x, w.K, ldx, n, y, w.M, r, bias), n += 2;
    if (n < N) wide_bf16<1>(scratch, x, w.K, ldx, n, y, w.M, r, bias);
  }
  if (r < r1) rows_bf16(w, x, ldx, N, y, bias, r, r1);
}

__attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")))
void gemm_q8_0_avx512(const WView& w, const XQ& x, float* y, const float* bias, int64_t r0, int64_t r1) {
  if (x.N < kWideMinTokens8 || r1 - r0 < WR) return gemm_rows<false>(w, x, y, bias, r0, r1);
  wide_q8_0_rows(w, x, y, bias, r0, r1);
  const int64_t done = r0 + (r1 - r0) / WR * WR;
  if (done < r1) gemm_rows<false>(w, x, y, bias, done, r1);
}

__attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")))
void gemm_q4_0_avx512(const WView& w, const XQ& x, float* y, const float* bias, int64_t r0, int64_t r1) {
  if (x.c8 == nullptr || x.N < kWideMinTokens || r1 - r0 < WR) return gemm_rows<true>(w, x, y, bias, r0, r1);
  wide_q4_0_rows(w, x, y, bias, r0, r1);
  const int64_t done = r0 + (r1 - r0) / WR * WR;
  if (done < r1) gemm_rows<true>(w, x, y, bias, done, r1);
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
