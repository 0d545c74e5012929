// AVX-512 (VL + VNNI) quantized kernels: the same tiles as the AVX2 path (qgemm_tiles.inc, kquant_tiles.inc), with
// each u8 x s8 dot product done by one vpdpbusd. Compiled with per-function target attributes
// and called only when the CPU reports avx512f, avx512bw, avx512vl and avx512vnni.
#include <immintrin.h>

// GCC 12's AVX-512 headers build some intrinsics on _mm512_undefined_*(), which -Wmaybe-uninitialized flags.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

#include <algorithm>
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

constexpr bool kExactUS = true;  // vpdpbusd sums u8 x s8 products in int32, no int16 step
#define GEMM_TOKENS 4  // 32 vector registers: 16 accumulators of a 4 x 4 tile
#include "qgemm_tiles.inc"
#include "kquant_tiles.inc"
#include "token_sums.inc"

// q4_0 and q8_0 matrix-matrix products in 16-row tiles. A tile's quants are unpacked once into a scratch where one
// zmm holds 4 consecutive quants of each of the 16 rows (q8_0: 2, widened to int16), so a vpdpbusd (vpdpwssd)
// against a token's 4 (2) activations broadcast makes 16 rows x 4 (2) products, and a block's scales are applied
// once per token for all 16 rows: 8 (16) dot products per 3 float operations, where the 4 x 4 tiles spend 3 per
// dot product. The q4_0 offset (-8 * sum of the activation block, c8) starts each block's integer sum. Rows left
// over (fewer than 16) and small token counts take the 4 x 4 tiles. The same integer sums as those, the float sums
// in another order: equal to the scalar reference within float rounding.
constexpr int WR = 16;           // weight rows per wide tile
constexpr int WT = 16;           // tokens per wide tile: 16 accumulators + 8 quant registers + scales
constexpr int64_t kWideMinTokens = 16;   // q4_0: from 16 tokens the unpacking pays: out of cache the 4 x 4 tiles
                                         // (prefetched) ran 1.2-1.6x faster at 8-12 tokens, as fast at 16, at
                                         // [49152, 576] and [14336, 4096] (Zen 5)
constexpr int64_t kWideMinTokens8 = 24;  // q8_0's unpacking (widening to int16) costs more: out of cache, at
                                         // [49152, 576] the 4 x 4 tiles (prefetched) ran 1.4-1.8x faster at 12-16
                                         // tokens, even at 24, 0.9x at 32 (Zen 5)
constexpr int kWideZmm = 9;      // scratch per block: 8 zmm of quants, 1 of fp32 scales
struct alignas(64) Zmm { uint8_t bytes[64]; };  // a std::vector of these is 64-byte aligned (__m512i's isn't)

// 16 bytes at rows[r] + at for 16 rows (4 dwords a row), as 4 zmm: dword j of every row, rows in lane order.
KFN void transpose16x4(const uint8_t* const (&rows)[WR], int64_t at, __m512i (&p)[4]) {
  const __m512i by_dword = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  __m512i z[4];
#pragma GCC unroll 4
  for (int k = 0; k < 4; ++k) {  // rows 4k..4k+3, then regrouped: [dword 0 of the 4 rows | dword 1 | 2 | 3]
    __m512i v = _mm512_zextsi128_si512(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rows[4 * k] + at)));
    v = _mm512_inserti32x4(v, _mm_loadu_si128(reinterpret_cast<const __m128i*>(rows[4 * k + 1] + at)), 1);
    v = _mm512_inserti32x4(v, _mm_loadu_si128(reinterpret_cast<const __m128i*>(rows[4 * k + 2] + at)), 2);
    v = _mm512_inserti32x4(v, _mm_loadu_si128(reinterpret_cast<const __m128i*>(rows[4 * k + 3] + at)), 3);
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

// The same for 16 bytes at byte `at` of block b of the 16 rows of 4 row tiles (q8_0 / q4_0 in either order).
KFN void gather_block16(const RowTile (&t)[4], int64_t b, int64_t at, __m512i (&p)[4]) {
  const uint8_t* rows[WR];
  for (int r = 0; r < WR; ++r) rows[r] = t[r / 4].qat(r % 4, b);
  transpose16x4(rows, at, p);
}

// 16 lanes of 4 int8 (or uint8: sign false) -> two zmm of int16 pairs: a holds each lane's bytes 0 and 1, b its
// bytes 2 and 3 (the layout a vpdpwssd against broadcast int16 activation pairs takes).
template <bool Signed>
KFN void widen_pairs(__m512i v, __m512i& a, __m512i& b) {
  const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
  const __m256i l = _mm512_castsi512_si256(v), h = _mm512_extracti64x4_epi64(v, 1);
  const __m512i lo = Signed ? _mm512_cvtepi8_epi16(l) : _mm512_cvtepu8_epi16(l);  // lanes 0-7: (b0 b1), (b2 b3)
  const __m512i hi = Signed ? _mm512_cvtepi8_epi16(h) : _mm512_cvtepu8_epi16(h);  // lanes 8-15
  a = _mm512_permutex2var_epi32(lo, even, hi);
  b = _mm512_permutex2var_epi32(lo, odd, hi);
}

// A 16-row tile's row streams are read side by side, a block or group at a time: each is prefetched kWideAhead
// bytes ahead (here every 64 bytes of quants, every 32 scales; the GGUF formats' unpackers likewise). The
// hardware's prefetchers alone left the unpacking waiting on memory; with these, out of cache on a Zen 5, 12-16
// tokens of q8_0 at [49152, 576] ran 1.05-1.1x faster, and iq4_nl at 8 tokens took 2.2x its 1-token time, not 2.4x.
constexpr int64_t kWideAhead = 1024;
KFN void prefetch_tile16(const RowTile (&t)[4], int64_t b) {
  if (b * t[0].bb % 64 == 0)
    for (int r = 0; r < WR; ++r)
      _mm_prefetch(reinterpret_cast<const char*>(t[r / 4].qat(r % 4, b)) + kWideAhead, _MM_HINT_T0);
  if (b % 32 == 0)
    for (int r = 0; r < WR; ++r)
      _mm_prefetch(reinterpret_cast<const char*>(t[r / 4].dat(r % 4, b)) + kWideAhead / 16, _MM_HINT_T0);
}

// Unpacks rows r0..r0+15 into the scratch: per block, zmm j < 4 holds quants 4j..4j+3 of each row (low nibbles
// of packed dword j), zmm 4 + j quants 16 + 4j.. (high nibbles), then the 16 rows' fp32 scales.
KFN void unpack_q4_wide(const WView& w, int64_t r0, __m512i* scratch) {
  const RowTile t[4] = {RowTile(w, r0, QK / 2), RowTile(w, r0 + 4, QK / 2), RowTile(w, r0 + 8, QK / 2),
                        RowTile(w, r0 + 12, QK / 2)};
  const __m512i m4 = _mm512_set1_epi8(0x0F);
  alignas(64) uint16_t d16[WR];
  for (int64_t b = 0; b < w.K / QK; ++b) {
    prefetch_tile16(t, b);
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

// acc + u (u8) . the 4 int8 at p broadcast, in one vpdpbusd with an embedded broadcast (GCC 12 loads the broadcast
// apart, one more instruction for each dot product: the 16-row GGUF tiles ran 0.9x of this)
KFN __m512i dpbusd_at(__m512i acc, __m512i u, const int8_t* p) {
  asm("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(u), "m"(*reinterpret_cast<const int32_t*>(p)));
  return acc;
}

// q8_0 likewise: per block 16 zmm, zmm i holding quants 2i and 2i + 1 of each row widened to int16 (the int16
// activations' pairs: one vpdpwssd makes 16 rows x 2 products), then the scales.
constexpr int kWideZmm8 = 17;

KFN void unpack_q8_wide(const WView& w, int64_t r0, __m512i* scratch) {
  const RowTile t[4] = {RowTile(w, r0, QK), RowTile(w, r0 + 4, QK), RowTile(w, r0 + 8, QK), RowTile(w, r0 + 12, QK)};
  alignas(64) uint16_t d16[WR];
  for (int64_t b = 0; b < w.K / QK; ++b) {
    prefetch_tile16(t, b);
    __m512i* o = scratch + b * kWideZmm8;
    for (int h = 0; h < 2; ++h) {
      __m512i p[4];  // p[j]: quants 16h + 4j .. 16h + 4j + 3 of each row
      gather_block16(t, b, 16 * h, p);
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) {
        __m512i a, c;
        widen_pairs<true>(p[j], a, c);
        _mm512_store_si512(o + 8 * h + 2 * j, a);
        _mm512_store_si512(o + 8 * h + 2 * j + 1, c);
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

// GGUF block formats in 16-row tiles. A K-quant's own group decoder (kquant_tiles.inc) runs once per row and group
// of a tile, and its quants are regrouped so that one zmm holds 4 consecutive quants of each of the 16 rows, with
// per block the 16 rows' scales and negated minimums (kScale16: d times its two scales per 16 weights, and q2_k's
// dmin times its two minimums). q4_1 is unpacked a block at a time, its nibbles widened
// to int16 pairs for its int16 activations. Per token and block: 8 vpdpbusd (q4_1: 16 vpdpwssd), then the scale
// and the minimum's term once for all 16 rows; q6_k's and q3_k's offsets start their two integer sums per 16
// (-32 or -4 x the token's sums per 16). The formats in blocks of 32 decode a row's last, partial group in part.
template <class F>
constexpr int gguf_wide_zmm() { return (F::kX16 ? 16 : 8) + tile_scale_vectors<F>(); }
constexpr int64_t kWideMinTokensGguf = 8;  // the decoding, once per tile, pays from here (1.0-1.2x at 8)

template <class F>
KFN void unpack_kquant_wide(const WView& w, int64_t r0, __m512i* scratch) {
  constexpr int Z = gguf_wide_zmm<F>();
  const int64_t row_bytes = w.K / F::kWeights * F::kBytes, nb = w.K / QK;
  alignas(64) uint8_t q[WR][8][32];         // one group: row, block, quants in natural order
  alignas(64) float v[4][8][WR];            // block, row: tile_scales'
  for (int64_t g = 0; 8 * g < nb; ++g) {
    const int n = int(std::min<int64_t>(8, nb - 8 * g));  // blocks in this group
    for (int r = 0; r < WR; ++r) {
      Group G;
      const uint8_t* p = w.qs + (r0 + r) * row_bytes + g * F::kGroupBytes;
      for (int l = 0; l < (F::kGroupBytes + 63) / 64; ++l)
        _mm_prefetch(reinterpret_cast<const char*>(p) + kWideAhead + 64 * l, _MM_HINT_T0);
      if constexpr (F::kTail) F::decode(p, G, n);
      else F::decode(p, G);
      for (int i = 0; i < 8; ++i) _mm256_store_si256(reinterpret_cast<__m256i*>(q[r][i]), G.q[i]);
      tile_scales<F, WR>(G, r, v);
    }
    for (int i = 0; i < n; ++i) {
      __m512i* o = scratch + (8 * g + i) * Z;
      const uint8_t* rows[WR];
      for (int r = 0; r < WR; ++r) rows[r] = q[r][i];
      __m512i p[4];
      for (int h = 0; h < 2; ++h) {
        transpose16x4(rows, 16 * h, p);
        for (int j = 0; j < 4; ++j) _mm512_store_si512(o + 4 * h + j, p[j]);
      }
      for (int k = 0; k < Z - 8; ++k) _mm512_store_ps(o + 8 + k, _mm512_load_ps(v[k][i]));
    }
  }
}

KFN void unpack_q4_1_wide(const WView& w, int64_t r0, __m512i* scratch) {
  constexpr int Z = gguf_wide_zmm<Q41>();
  const int64_t nb = w.K / QK;
  const __m512i m4 = _mm512_set1_epi8(0x0F);
  alignas(64) uint16_t d16[WR], m16[WR];
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* rows[WR];
    for (int r = 0; r < WR; ++r) {
      const uint8_t* blk = w.qs + ((r0 + r) * nb + b) * kQ41Bytes;  // fp16 d, fp16 m, 16 nibble bytes
      d16[r] = load_u16(blk), m16[r] = load_u16(blk + 2), rows[r] = blk + 4;
      if (b % 4 == 0)
        for (int l = 0; l < 2; ++l)
          _mm_prefetch(reinterpret_cast<const char*>(blk) + kWideAhead + 64 * l, _MM_HINT_T0);
    }
    __m512i p[4];
    transpose16x4(rows, 0, p);
    __m512i* o = scratch + b * Z;
    for (int j = 0; j < 4; ++j) {  // low nibbles: quants 4j.., high nibbles: 16 + 4j..
      __m512i a, c;
      widen_pairs<false>(_mm512_and_si512(p[j], m4), a, c);
      _mm512_store_si512(o + 2 * j, a);
      _mm512_store_si512(o + 2 * j + 1, c);
      widen_pairs<false>(_mm512_and_si512(_mm512_srli_epi16(p[j], 4), m4), a, c);
      _mm512_store_si512(o + 8 + 2 * j, a);
      _mm512_store_si512(o + 9 + 2 * j, c);
    }
    _mm512_store_ps(o + 16, _mm512_cvtph_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(d16))));
    _mm512_store_ps(o + 17, _mm512_cvtph_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(m16))));
  }
}

// T tokens from n0 against one unpacked 16-row tile of format F (s16w: sums16's for kScale16, block_offsets' for
// kMinOff).
template <class F, int T>
KFN void wide_gguf(const __m512i* scratch, const XQ& x, int64_t n0, float* y, int64_t M, int64_t r0,
                   const float* bias, const uint32_t* s16w) {
  constexpr int Z = gguf_wide_zmm<F>(), NQ = F::kX16 ? 16 : 8;
  const int64_t K = x.K, nb = K / QK, ld = x.stride();
  __m512 acc[T];
#pragma GCC unroll 16
  for (int t = 0; t < T; ++t) acc[t] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const __m512i* o = scratch + b * Z;
    __m512i q[NQ];
#pragma GCC unroll 16
    for (int j = 0; j < NQ; ++j) q[j] = _mm512_load_si512(o + j);
    const __m512 v1 = _mm512_load_ps(o + NQ), v2 = F::kMinOff ? v1 : _mm512_load_ps(o + NQ + 1);
#pragma GCC unroll 16
    for (int t = 0; t < T; ++t) {
      const int64_t xb = (n0 + t) * nb + b;
      const __m512 dx = _mm512_set1_ps(x.d[xb]);
      if constexpr (F::kX16) {  // int16 activations: pairs
        const int16_t* x16 = reinterpret_cast<const int16_t*>(x.qs) + (n0 + t) * ld + b * QK;
        const int8_t* xr = reinterpret_cast<const int8_t*>(x16);
        __m512i s = _mm512_setzero_si512();
#pragma GCC unroll 16
        for (int j = 0; j < 16; ++j) s = _mm512_dpwssd_epi32(s, q[j], bcast4(xr + 4 * j));
        acc[t] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(s), dx), v1, acc[t]);
        acc[t] = _mm512_fmadd_ps(v2, _mm512_set1_ps(x.s[xb]), acc[t]);
      } else if constexpr (F::kScale16) {  // two sums per 16 weights, each from -offset x the token's sum of its 16
        const int8_t* xr = x.qs + (n0 + t) * ld + b * QK;
        const uint32_t* s16 = s16w + (n0 + t) * (K / 16) + 2 * b;
        __m512i lo = _mm512_setzero_si512(), hi = lo;
        if constexpr (F::kOff != 0) lo = _mm512_set1_epi32(int(s16[0])), hi = _mm512_set1_epi32(int(s16[1]));
#pragma GCC unroll 4
        for (int j = 0; j < 4; ++j) {
          lo = dpbusd_at(lo, q[j], xr + 4 * j);
          hi = dpbusd_at(hi, q[4 + j], xr + 16 + 4 * j);
        }
        __m512 f = _mm512_fmadd_ps(_mm512_cvtepi32_ps(hi), v2, _mm512_mul_ps(_mm512_cvtepi32_ps(lo), v1));
        if constexpr (F::kMin16) {  // q2_k: less dmin x m x the token's sum of each 16
          const float* sf = reinterpret_cast<const float*>(s16);
          f = _mm512_fnmadd_ps(_mm512_load_ps(o + NQ + 2), _mm512_set1_ps(sf[0]), f);
          f = _mm512_fnmadd_ps(_mm512_load_ps(o + NQ + 3), _mm512_set1_ps(sf[1]), f);
        }
        acc[t] = _mm512_fmadd_ps(f, dx, acc[t]);
      } else {
        const int8_t* xr = x.qs + (n0 + t) * ld + b * QK;
        __m512i s = _mm512_setzero_si512(), s2 = s;  // two chains of 4 (their latency, not throughput, bound one)
        if constexpr (F::kMinOff != 0) s = _mm512_set1_epi32(int32_t(s16w[xb]));
#pragma GCC unroll 4
        for (int j = 0; j < 4; ++j) {
          s = dpbusd_at(s, q[j], xr + 4 * j);
          s2 = dpbusd_at(s2, q[4 + j], xr + 16 + 4 * j);
        }
        s = _mm512_add_epi32(s, s2);
        acc[t] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(s), dx), v1, acc[t]);
        if constexpr (F::kMinOff == 0) acc[t] = _mm512_fmadd_ps(v2, _mm512_set1_ps(x.s[xb]), acc[t]);
      }
    }
  }
  const __m512 bv = bias ? _mm512_loadu_ps(bias + r0) : _mm512_setzero_ps();
#pragma GCC unroll 16
  for (int t = 0; t < T; ++t) _mm512_storeu_ps(y + (n0 + t) * M + r0, _mm512_add_ps(acc[t], bv));
}

// Rows r0..r1 of a GGUF format: whole 16-row tiles wide where there are enough tokens, the rest as before.
template <class F>
KFN void gguf_rows(const WView& w, const XQ& x, float* y, const float* bias, int64_t r0, int64_t r1) {
  if (x.N < kWideMinTokensGguf || r1 - r0 < WR) return gemm_gguf_rows<F>(w, x, y, bias, r0, r1);
  constexpr int Z = gguf_wide_zmm<F>(), TW = F::kX16 ? 8 : 16;  // q4_1: 16 quant registers, 8 tokens
  thread_local std::vector<Zmm> buffer;
  buffer.resize(size_t(w.K / QK * Z));
  __m512i* scratch = reinterpret_cast<__m512i*>(buffer.data());
  const uint32_t* s16w = F::kScale16 ? sums16<F>(x) : F::kMinOff ? block_offsets<F>(x) : nullptr;
  int64_t r = r0;
  for (; r + WR <= r1; r += WR) {
    if constexpr (F::kX16) unpack_q4_1_wide(w, r, scratch);
    else unpack_kquant_wide<F>(w, r, scratch);
    int64_t n = 0;
    for (; n + TW <= x.N; n += TW) wide_gguf<F, TW>(scratch, x, n, y, w.M, r, bias, s16w);
    if (TW > 8 && n + 8 <= x.N) wide_gguf<F, 8>(scratch, x, n, y, w.M, r, bias, s16w), n += 8;
    if (n + 4 <= x.N) wide_gguf<F, 4>(scratch, x, n, y, w.M, r, bias, s16w), n += 4;
    if (n + 2 <= x.N) wide_gguf<F, 2>(scratch, x, n, y, w.M, r, bias, s16w), n += 2;
    if (n < x.N) wide_gguf<F, 1>(scratch, x, n, y, w.M, r, bias, s16w);
  }
  if (r < r1) gemm_gguf_rows<F>(w, x, y, bias, r, r1);
}

// bf16 weights against bf16 activations with AVX-512 BF16, in the weights' own row order (nothing regrouped): a
// tile of R rows x T tokens keeps R x T accumulators of 16 lanes; per 32 elements of K it loads the R rows' and the
// T tokens' 32 values once each and makes R x T vdpbf16ps (16 pairs of products each), accumulated in fp32 as they
// come; each accumulator's 16 lanes are summed at the end. A tile that regrouped each 16-row strip per call (one
// weight register against 12 broadcast tokens) spent a fifth of its time on the regrouping at 64 tokens.
#define KFN_BF16 \
  __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,avx512bf16"))) inline
constexpr int BR = 4, BT = 6;  // rows and tokens per bf16 tile: 24 accumulators, 4 row registers, 1 token's

// The sums of the 16 lanes of a[0..3] as lanes 0-3.
KFN_BF16 __m128 sum4(const __m512 (&a)[4]) {
  __m256 h[4];
#pragma GCC unroll 4
  for (int i = 0; i < 4; ++i) h[i] = _mm256_add_ps(_mm512_castps512_ps256(a[i]), _mm512_extractf32x8_ps(a[i], 1));
  const __m256 s = _mm256_hadd_ps(_mm256_hadd_ps(h[0], h[1]), _mm256_hadd_ps(h[2], h[3]));  // [0 1 2 3 | 0 1 2 3]
  return _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
}

// Rows r0 .. r0 + R of w x tokens n0 .. n0 + T of x (rows ldx apart): y[n][r] = sum_k w[r][k] x[n][k] + bias[r].
// next: rows whose next 32 elements are fetched into L2 with each step (the next tile's rows), or nullptr.
template <int R, int T>
KFN_BF16 void dot_tile_bf16(const uint16_t* w, int64_t K, const uint16_t* x, int64_t ldx, float* y, int64_t M,
                            const float* bias, const uint16_t* next) {
  __m512 acc[R][T];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 6
    for (int t = 0; t < T; ++t) acc[r][t] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += QK) {
    __m512i wr[R];
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      wr[r] = _mm512_loadu_si512(w + r * K + k);
      if (next != nullptr) _mm_prefetch(reinterpret_cast<const char*>(next + r * K + k), _MM_HINT_T1);
    }
#pragma GCC unroll 6
    for (int t = 0; t < T; ++t) {
      const __m512bh xt = (__m512bh)_mm512_loadu_si512(x + t * ldx + k);
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) acc[r][t] = _mm512_dpbf16_ps(acc[r][t], (__m512bh)wr[r], xt);
    }
  }
#pragma GCC unroll 6
  for (int t = 0; t < T; ++t) {
    if constexpr (R == 4) {
      const __m512 a[4] = {acc[0][t], acc[1][t], acc[2][t], acc[3][t]};
      const __m128 b = bias ? _mm_loadu_ps(bias) : _mm_setzero_ps();
      _mm_storeu_ps(y + t * M, _mm_add_ps(sum4(a), b));
    } else {
      for (int r = 0; r < R; ++r) y[t * M + r] = _mm512_reduce_add_ps(acc[r][t]) + (bias ? bias[r] : 0.f);
    }
  }
}

// Rows r0 .. r1 (whole tiles of R) against T tokens: the T tokens' activations stay in L1 while the rows pass.
// fetch (the first tokens only): each tile fetches the next tile's rows into L2 as it runs.
template <int R, int T>
KFN_BF16 void dot_rows_bf16(const WView& w, int64_t r0, int64_t r1, const uint16_t* x, int64_t ldx, float* y,
                            const float* bias, bool fetch) {
  const uint16_t* wq = reinterpret_cast<const uint16_t*>(w.qs);
  for (int64_t r = r0; r + R <= r1; r += R) {
    const uint16_t* next = fetch && r + 2 * R <= r1 ? wq + (r + R) * w.K : nullptr;
    dot_tile_bf16<R, T>(wq + r * w.K, w.K, x, ldx, y + r, w.M, bias ? bias + r : nullptr, next);
  }
}

template <int R>
KFN_BF16 void dot_rows_bf16_n(const WView& w, int64_t r0, int64_t r1, const uint16_t* x, int64_t ldx, int64_t n,
                              float* y, const float* bias, bool fetch) {
  switch (n) {
    case 6: return dot_rows_bf16<R, 6>(w, r0, r1, x, ldx, y, bias, fetch);
    case 5: return dot_rows_bf16<R, 5>(w, r0, r1, x, ldx, y, bias, fetch);
    case 4: return dot_rows_bf16<R, 4>(w, r0, r1, x, ldx, y, bias, fetch);
    case 3: return dot_rows_bf16<R, 3>(w, r0, r1, x, ldx, y, bias, fetch);
    case 2: return dot_rows_bf16<R, 2>(w, r0, r1, x, ldx, y, bias, fetch);
    default: return dot_rows_bf16<R, 1>(w, r0, r1, x, ldx, y, bias, fetch);
  }
}

constexpr int64_t kBf16BlockRows = 64;  // rows whose weights stay in L2 while every token passes them

}  // namespace

__attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,avx512bf16")))
void gemm_bf16_bf16x_avx512(const WView& w, const uint16_t* x, int64_t ldx, int64_t N, float* y, const float* bias,
                            int64_t r0, int64_t r1) {
  static_assert(kBf16BlockRows % BR == 0, "blocks of whole tiles");
  for (int64_t rb = r0; rb < r1; rb += kBf16BlockRows) {
    const int64_t re = std::min(r1, rb + kBf16BlockRows), whole = rb + (re - rb) / BR * BR;
    for (int64_t n = 0; n < N; n += BT) {
      const int64_t t = std::min<int64_t>(BT, N - n);
      dot_rows_bf16_n<BR>(w, rb, whole, x + n * ldx, ldx, t, y + n * w.M, bias, n == 0);
      dot_rows_bf16_n<1>(w, whole, re, x + n * ldx, ldx, t, y + n * w.M, bias, false);
    }
  }
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

#define OFFLOAD_ENTRY(name_, NAME_, id_, weights_, bytes_, Dec_, Row_) \
  __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")))                          \
  void gemm_##name_##_avx512(const WView& w, const XQ& x, float* y, const float* bias, int64_t r0, int64_t r1) {  \
    gguf_rows<Dec_>(w, x, y, bias, r0, r1);                                                                     \
  }
OFFLOAD_GGUF_FORMATS(OFFLOAD_ENTRY)
#undef OFFLOAD_ENTRY

}  // namespace offload
