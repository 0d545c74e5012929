// Scalar references of the GGUF block formats (kquant.h): plain loops over the stored blocks,
// the same integer dot products per activation block of 32 as the SIMD tiles (kquant_tiles.inc).
//
// Per activation block b of token n: y += dw_b * dx_b * dot_b - mw_b * xs_b, with dot_b the integer dot product
// of the block's unsigned weight quants and the activation quants, dw_b, mw_b the block's weight scale and minimum
// (fp32 products of the fp16 and 6-bit fields, as gguf-py dequantizes), dx_b, xs_b the activations' scale and
// scale * sum (the sum of the quants, an exact integer). q6_k's and q3_k's quants carry an offset (32, 4) and a
// scale per 16 instead, folded into dot_b exactly; q2_k's minimum per 16 comes from the token's sums per 16. The
// iq4 types' and mxfp4's quants are signed levels (no minimum).
//
// Activations: int16 against q4_1 (quantize_x16), int8 against the others (as llama.cpp's q8_K and q8_0). With int8
// activations (llama.cpp's q8_1) the default model's Q4_1 file answered "What is the capital of France?" with
// "L'Étoile, la Marseillaise" (so does llama.cpp), its logits 2.7e-2 of their range away from transformers'
// dequantized fp32 model; with int16 it answers Paris, 1.1e-4 away (tests/test_kernels_gguf.py).
#include "kernels.h"
#include "kquant.h"

namespace offload {

void quantize_xk_ref(const void* x, int xtype, int64_t K, int8_t* qs, float* d, float* s, int16_t* s16) {
  quantize_x_ref(x, xtype, K, qs, d, s);
  for (int64_t h = 0; h < K / 16; ++h) {
    int sum = 0;
    for (int64_t i = 0; i < 16; ++i) sum += qs[h * 16 + i];
    s16[h] = int16_t(sum);
  }
}

namespace {

// One token's quantized activations: q (int8) or q16 (int16, for takes_x16 formats), the other one null.
struct XRow {
  const int8_t* q;
  const int16_t* q16;
  const float *d, *s;
  const int16_t* s16;
};

template <class X>
int dot32(const uint8_t* wq, const X* xq) {
  int t = 0;
  for (int l = 0; l < 32; ++l) t += int(wq[l]) * int(xq[l]);
  return t;
}

// Adds one activation block's term to acc.
inline void add_block(float& acc, float dw, float mw, const XRow& x, int64_t b, int dot) {
  acc += dw * x.d[b] * float(dot) - mw * x.s[b];
}

float row_q4_1(const uint8_t* row, const XRow& x, int64_t K) {
  float acc = 0.f;
  for (int64_t b = 0; b < K / 32; ++b) {
    const uint8_t* blk = row + b * kQ41Bytes;
    uint8_t q[32];
    for (int j = 0; j < 16; ++j) q[j] = blk[4 + j] & 15, q[j + 16] = blk[4 + j] >> 4;
    add_block(acc, fp16_to_f32(load_u16(blk)), -fp16_to_f32(load_u16(blk + 2)), x, b, dot32(q, x.q16 + b * 32));
  }
  return acc;
}

// q4_k and q5_k: the 6-bit scales and minimums times the super-block's d and dmin, then sub-blocks of 32.
template <bool Q5>
float row_qk(const uint8_t* row, const XRow& x, int64_t K) {
  const int64_t bytes = Q5 ? kQ5KBytes : kQ4KBytes;
  float acc = 0.f;
  for (int64_t g = 0; g < K / QK_K; ++g) {
    const uint8_t* blk = row + g * bytes;
    const float d = fp16_to_f32(load_u16(blk)), dmin = fp16_to_f32(load_u16(blk + 2));
    uint32_t packed[4];
    unpack_k4_scales(blk + 4, packed);
    uint8_t sm[16];  // scales 0-7, minimums 0-7
    std::memcpy(sm, packed, 16);
    const uint8_t* qh = blk + 16;
    const uint8_t* qs = blk + (Q5 ? 48 : 16);
    for (int i = 0; i < 8; ++i) {
      uint8_t q[32];
      for (int l = 0; l < 32; ++l) {
        q[l] = (qs[32 * (i / 2) + l] >> (4 * (i % 2))) & 15;
        if (Q5) q[l] |= ((qh[l] >> i) & 1) << 4;
      }
      const int64_t b = g * 8 + i;
      add_block(acc, d * float(sm[i]), dmin * float(sm[8 + i]), x, b, dot32(q, x.q + b * 32));
    }
  }
  return acc;
}

float row_q6_k(const uint8_t* row, const XRow& x, int64_t K) {
  float acc = 0.f;
  for (int64_t g = 0; g < K / QK_K; ++g) {
    const uint8_t* blk = row + g * kQ6KBytes;
    const int8_t* sc = reinterpret_cast<const int8_t*>(blk + 192);
    const float d = fp16_to_f32(load_u16(blk + 208));
    for (int i = 0; i < 8; ++i) {
      const int h = i / 4, t = i % 4;
      const uint8_t *ql = blk + 64 * h + 32 * (t % 2), *qh = blk + 128 + 32 * h;
      const int64_t b = g * 8 + i;
      int dot = 0;
      for (int half = 0; half < 2; ++half) {  // scale per 16; the -32 offset through the activation sums
        int part = 0;
        for (int l = 16 * half; l < 16 * half + 16; ++l) {
          const int q = ((ql[l] >> (4 * (t / 2))) & 15) | (((qh[l] >> (2 * t)) & 3) << 4);
          part += q * int(x.q[b * 32 + l]);
        }
        dot += int(sc[2 * i + half]) * (part - 32 * int(x.s16[2 * b + half]));
      }
      add_block(acc, d, 0.f, x, b, dot);
    }
  }
  return acc;
}

int dot32s(const int8_t* wq, const int8_t* xq) {
  int t = 0;
  for (int l = 0; l < 32; ++l) t += int(wq[l]) * int(xq[l]);
  return t;
}

// The 32 quants of a q5_0 / q5_1 block (unsigned, 0-31).
void q5_quants(const uint8_t* qh4, const uint8_t* qs, uint8_t (&q)[32]) {
  uint32_t qh;
  std::memcpy(&qh, qh4, 4);
  for (int j = 0; j < 16; ++j) {
    q[j] = uint8_t((qs[j] & 15) | ((qh >> j) & 1) << 4);
    q[j + 16] = uint8_t((qs[j] >> 4) | ((qh >> (j + 16)) & 1) << 4);
  }
}

// The 32 levels of a nibble block (iq4_nl's, iq4_xs's or mxfp4's table).
void level_quants(const int8_t (&levels)[16], const uint8_t* qs, int8_t (&q)[32]) {
  for (int j = 0; j < 16; ++j) q[j] = levels[qs[j] & 15], q[j + 16] = levels[qs[j] >> 4];
}

// q5_0, q5_1, iq4_nl, mxfp4: blocks of 32 with one scale (and q5_1's minimum; q5_0's -16 offset as a minimum of
// 16 d). mxfp4's scale is its e8m0 byte halved, its levels e2m1's doubled: as llama.cpp's mxfp4 x q8_0 dot product.
template <int FMT>
float row_b32(const uint8_t* row, const XRow& x, int64_t K) {
  const int64_t bytes = gguf_block_bytes(FMT);
  float acc = 0.f;
  for (int64_t b = 0; b < K / 32; ++b) {
    const uint8_t* blk = row + b * bytes;
    if (FMT == W_MXFP4) {
      int8_t q[32];
      level_quants(kMXFP4Values, blk + 1, q);
      add_block(acc, e8m0_half_to_f32(blk[0]), 0.f, x, b, dot32s(q, x.q + b * 32));
      continue;
    }
    const float d = fp16_to_f32(load_u16(blk));
    if (FMT == W_IQ4_NL) {
      int8_t q[32];
      level_quants(kIQ4Values, blk + 2, q);
      add_block(acc, d, 0.f, x, b, dot32s(q, x.q + b * 32));
      continue;
    }
    uint8_t q[32];
    q5_quants(blk + (FMT == W_Q5_1 ? 4 : 2), blk + (FMT == W_Q5_1 ? 8 : 6), q);
    const float mw = FMT == W_Q5_1 ? -fp16_to_f32(load_u16(blk + 2)) : 16.f * d;
    add_block(acc, d, mw, x, b, dot32(q, x.q + b * 32));
  }
  return acc;
}

float row_iq4_xs(const uint8_t* row, const XRow& x, int64_t K) {
  float acc = 0.f;
  for (int64_t g = 0; g < K / QK_K; ++g) {
    const uint8_t* blk = row + g * kIQ4XSBytes;
    const float d = fp16_to_f32(load_u16(blk));
    const int sh = load_u16(blk + 2);
    for (int i = 0; i < 8; ++i) {
      const int ls = ((blk[4 + i / 2] >> (4 * (i % 2))) & 15) | ((sh >> (2 * i)) & 3) << 4;
      int8_t q[32];
      level_quants(kIQ4Values, blk + 8 + 16 * i, q);
      const int64_t b = g * 8 + i;
      add_block(acc, d * float(ls - 32), 0.f, x, b, dot32s(q, x.q + b * 32));
    }
  }
  return acc;
}

// q3_k and q2_k: 2-bit quants (q3_k with a third bit from hmask) in sub-blocks of 32, a scale per 16.
template <bool Q3>
float row_q23_k(const uint8_t* row, const XRow& x, int64_t K) {
  const int64_t bytes = Q3 ? kQ3KBytes : kQ2KBytes;
  float acc = 0.f;
  for (int64_t g = 0; g < K / QK_K; ++g) {
    const uint8_t* blk = row + g * bytes;
    const uint8_t* qs = blk + (Q3 ? 32 : 16);
    int sc[16], mn[16] = {};
    if (Q3) {
      uint32_t packed[4];
      unpack_q3_scales(blk + 96, packed);
      uint8_t u[16];
      std::memcpy(u, packed, 16);
      for (int k = 0; k < 16; ++k) sc[k] = int(u[k]) - 32;
    } else {
      for (int k = 0; k < 16; ++k) sc[k] = blk[k] & 15, mn[k] = blk[k] >> 4;
    }
    const float d = fp16_to_f32(load_u16(blk + (Q3 ? 108 : 80))), dmin = Q3 ? 0.f : fp16_to_f32(load_u16(blk + 82));
    for (int i = 0; i < 8; ++i) {
      const int h = i / 4, j = i % 4;
      const int64_t b = g * 8 + i;
      int dot = 0, low = 0;
      for (int half = 0; half < 2; ++half) {
        int part = 0;
        for (int l = 16 * half; l < 16 * half + 16; ++l) {
          int q = (qs[32 * h + l] >> (2 * j)) & 3;
          if (Q3) q |= ((blk[l] >> i) & 1) << 2;
          part += q * int(x.q[b * 32 + l]);
        }
        const int sum16 = x.s16[2 * b + half];
        dot += sc[2 * i + half] * (part - (Q3 ? 4 * sum16 : 0));
        low += mn[2 * i + half] * sum16;
      }
      acc += d * x.d[b] * float(dot) - dmin * x.d[b] * float(low);
    }
  }
  return acc;
}

template <float (*ROW)(const uint8_t*, const XRow&, int64_t)>
void gemm_gguf_ref(int fmt, const WView& w, const XQ& x, float* y, const float* bias, int64_t r0, int64_t r1) {
  const int64_t K = w.K, row_bytes = K / gguf_block_weights(fmt) * gguf_block_bytes(fmt);
  const bool x16 = takes_x16(fmt);
  for (int64_t r = r0; r < r1; ++r)
    for (int64_t n = 0; n < x.N; ++n) {
      const int64_t at = n * x.stride();
      const XRow xr{x16 ? nullptr : x.qs + at, x16 ? reinterpret_cast<const int16_t*>(x.qs) + at : nullptr,
                    x.d + n * (K / 32), x.s + n * (K / 32), x16 ? nullptr : x.s16 + n * (K / 16)};
      y[n * w.M + r] = ROW(w.qs + r * row_bytes, xr, K) + (bias ? bias[r] : 0.f);
    }
}

}  // namespace

#define OFFLOAD_REF(name_, NAME_, id_, weights_, bytes_, Dec_, Row_) \
  void gemm_##name_##_ref(const WView& w, const XQ& x, float* y, const float* bias, int64_t r0, int64_t r1) {     \
    gemm_gguf_ref<Row_>(W_##NAME_, w, x, y, bias, r0, r1);                                                           \
  }
OFFLOAD_GGUF_FORMATS(OFFLOAD_REF)
#undef OFFLOAD_REF

}  // namespace offload
