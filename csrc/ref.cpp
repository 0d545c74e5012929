// Scalar references for every kernel, and the weight quantizers (plain C++, any CPU).
#include <algorithm>
#include <cmath>
#include <cstring>

#include "kernels.h"

namespace offload {

static inline uint32_t f2u(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }
static inline float u2f(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }

float fp16_to_f32(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000) << 16;
  const uint32_t exp = (h >> 10) & 0x1f, mant = h & 0x3ff;
  if (exp == 0) {  // zero or subnormal: mant * 2^-24, exact in fp32
    const float v = float(mant) * 5.9604644775390625e-8f;
    return sign ? -v : v;
  }
  if (exp == 31) return u2f(sign | 0x7f800000u | (mant << 13));
  return u2f(sign | ((exp + 112) << 23) | (mant << 13));
}

uint16_t f32_to_fp16(float f) {
  // Round-to-nearest-even through fp32 arithmetic (same algorithm as ggml's FP16 fallback).
  const float scale_to_inf = 0x1.0p+112f, scale_to_zero = 0x1.0p-110f;
  float base = (std::fabs(f) * scale_to_inf) * scale_to_zero;
  const uint32_t w = f2u(f), shl1_w = w + w, sign = w & 0x80000000u;
  uint32_t bias = shl1_w & 0xFF000000u;
  if (bias < 0x71000000u) bias = 0x71000000u;
  base = u2f((bias >> 1) + 0x07800000u) + base;
  const uint32_t bits = f2u(base);
  const uint32_t nonsign = ((bits >> 13) & 0x00007C00u) + (bits & 0x00000FFFu);
  return uint16_t((sign >> 16) | (shl1_w > 0xFF000000u ? 0x7E00u : nonsign));
}

float bf16_to_f32(uint16_t h) { return u2f(uint32_t(h) << 16); }

static inline float load_x(const void* x, int xtype, int64_t i) {
  return xtype == X_BF16 ? bf16_to_f32(static_cast<const uint16_t*>(x)[i]) : static_cast<const float*>(x)[i];
}

void quantize_x_ref(const void* x, int xtype, int64_t K, int8_t* qs, float* d, float* s) {
  for (int64_t b = 0; b < K / QK; ++b) {
    float amax = 0.f;
    for (int64_t i = 0; i < QK; ++i) amax = std::fmax(amax, std::fabs(load_x(x, xtype, b * QK + i)));
    const float id = amax != 0.f ? 127.f / amax : 0.f;
    int sum = 0;
    for (int64_t i = 0; i < QK; ++i) {
      const int q = int(std::nearbyint(load_x(x, xtype, b * QK + i) * id));  // ties to even, as AVX2
      qs[b * QK + i] = int8_t(q);
      sum += q;
    }
    d[b] = amax / 127.f;
    s[b] = d[b] * float(sum);
  }
}

// int16 activations for q8_0 weights: per-block error ~1/256 of int8's, so a q8_0 layer stays as
// close to its dequantized fp32 weights as the GPU path (greedy tokens match; int8 flipped some).
// The sum of a block's 32 quants is at most 32 * 32767 < 2^24: exact in fp32, so s = d * sum rounds once.
void quantize_x16_ref(const void* x, int xtype, int64_t K, int16_t* qs, float* d, float* s) {
  for (int64_t b = 0; b < K / QK; ++b) {
    float amax = 0.f;
    for (int64_t i = 0; i < QK; ++i) amax = std::fmax(amax, std::fabs(load_x(x, xtype, b * QK + i)));
    const float id = amax != 0.f ? 32767.f / amax : 0.f;
    int sum = 0;
    for (int64_t i = 0; i < QK; ++i) {
      qs[b * QK + i] = int16_t(std::nearbyint(load_x(x, xtype, b * QK + i) * id));
      sum += qs[b * QK + i];
    }
    d[b] = amax / 32767.f;
    s[b] = d[b] * float(sum);
  }
}

// The tile holding row r (its first row) in w's block order, and r's index in it.
static inline int64_t tile_start(const WView& w, int64_t r) { return w.tiled && r < (w.M & ~int64_t(3)) ? r & ~int64_t(3) : r; }

void gemm_q8_0_ref(const WView& w, const XQ& x, float* y, const float* bias, int64_t r0, int64_t r1) {
  const int64_t K = w.K, nb = K / QK;
  for (int64_t r = r0; r < r1; ++r) {
    const int64_t t0 = tile_start(w, r);
    const RowTile t(w, t0, QK);
    for (int64_t n = 0; n < x.N; ++n) {
      const int16_t* xq = reinterpret_cast<const int16_t*>(x.qs) + n * x.stride();
      float acc = 0.f;
      for (int64_t b = 0; b < nb; ++b) {
        int dot = 0;
        const int8_t* wq = reinterpret_cast<const int8_t*>(t.qat(r - t0, b));
        for (int64_t i = 0; i < QK; ++i) dot += int(wq[i]) * int(xq[b * QK + i]);
        acc += fp16_to_f32(*t.dat(r - t0, b)) * x.d[n * nb + b] * float(dot);
      }
      y[n * w.M + r] = acc + (bias ? bias[r] : 0.f);
    }
  }
}

void gemm_q4_0_ref(const WView& w, const XQ& x, float* y, const float* bias, int64_t r0, int64_t r1) {
  const int64_t K = w.K, nb = K / QK;
  for (int64_t r = r0; r < r1; ++r) {
    const int64_t t0 = tile_start(w, r);
    const RowTile t(w, t0, QK / 2);
    for (int64_t n = 0; n < x.N; ++n) {
      const int8_t* xq = x.qs + n * x.stride();
      float acc = 0.f;
      for (int64_t b = 0; b < nb; ++b) {
        int dot = 0;
        const uint8_t* wq = t.qat(r - t0, b);
        for (int64_t j = 0; j < QK / 2; ++j) {  // low nibble: element j, high nibble: element j + 16
          const uint8_t v = wq[j];
          dot += (int(v & 15) - 8) * int(xq[b * QK + j]) + (int(v >> 4) - 8) * int(xq[b * QK + j + 16]);
        }
        acc += fp16_to_f32(*t.dat(r - t0, b)) * x.d[n * nb + b] * float(dot);
      }
      y[n * w.M + r] = acc + (bias ? bias[r] : 0.f);
    }
  }
}

template <typename E, float (*CVT)(E)>
static void gemm_half_ref(const WView& w, const float* x, int64_t N, float* y, const float* bias,
                          int64_t r0, int64_t r1) {
  const E* wh = reinterpret_cast<const E*>(w.qs);
  for (int64_t r = r0; r < r1; ++r)
    for (int64_t n = 0; n < N; ++n) {
      float acc = 0.f;
      for (int64_t k = 0; k < w.K; ++k) acc += CVT(wh[r * w.K + k]) * x[n * w.K + k];
      y[n * w.M + r] = acc + (bias ? bias[r] : 0.f);
    }
}

void gemm_bf16_ref(const WView& w, const float* x, int64_t N, float* y, const float* bias, int64_t r0, int64_t r1) {
  gemm_half_ref<uint16_t, bf16_to_f32>(w, x, N, y, bias, r0, r1);
}

void gemm_f16_ref(const WView& w, const float* x, int64_t N, float* y, const float* bias, int64_t r0, int64_t r1) {
  gemm_half_ref<uint16_t, fp16_to_f32>(w, x, N, y, bias, r0, r1);
}

static float as_f32(float v) { return v; }

void gemm_f32_ref(const WView& w, const float* x, int64_t N, float* y, const float* bias, int64_t r0, int64_t r1) {
  gemm_half_ref<float, as_f32>(w, x, N, y, bias, r0, r1);
}

void quantize_w_q8_0_rows(const float* src, int64_t r0, int64_t r1, int64_t K, uint8_t* qs, uint16_t* d) {
  const int64_t nb = K / QK;
  for (int64_t r = r0; r < r1; ++r)
    for (int64_t b = 0; b < nb; ++b) {
      const float* v = src + r * K + b * QK;
      float amax = 0.f;
      for (int64_t i = 0; i < QK; ++i) { const float a = std::fabs(v[i]); amax = a > amax ? a : amax; }
      const float dd = amax / 127.f, id = dd != 0.f ? 1.f / dd : 0.f;
      for (int64_t i = 0; i < QK; ++i) {  // roundf (half away from zero) in plain SSE2-vectorizable steps
        const float t = v[i] * id, a = std::fabs(t);
        const int q = int(a) + (a - float(int(a)) >= 0.5f ? 1 : 0);
        qs[r * K + b * QK + i] = uint8_t(int8_t(t < 0.f ? -q : q));
      }
      d[r * nb + b] = f32_to_fp16(dd);
    }
}

void quantize_w_q4_0_rows(const float* src, int64_t r0, int64_t r1, int64_t K, uint8_t* qs, uint16_t* d) {
  const int64_t nb = K / QK;
  for (int64_t r = r0; r < r1; ++r)
    for (int64_t b = 0; b < nb; ++b) {
      const float* v = src + r * K + b * QK;
      float amax = 0.f, vmax = 0.f;  // vmax: the signed value of largest magnitude (first one on ties)
      for (int64_t i = 0; i < QK; ++i)
        if (amax < std::fabs(v[i])) { amax = std::fabs(v[i]); vmax = v[i]; }
      const float dd = vmax / -8.f, id = dd != 0.f ? 1.f / dd : 0.f;
      uint8_t* out = qs + r * (K / 2) + b * (QK / 2);
      for (int64_t j = 0; j < QK / 2; ++j) {
        const float t0 = v[j] * id, t1 = v[j + 16] * id;  // separate statements: no FMA contraction
        const int q0 = std::min(15, int(std::trunc(t0 + 8.5f))), q1 = std::min(15, int(std::trunc(t1 + 8.5f)));
        out[j] = uint8_t(q0 | (q1 << 4));
      }
      d[r * nb + b] = f32_to_fp16(dd);
    }
}

}  // namespace offload
