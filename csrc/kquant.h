// GGUF block formats read as stored (ggml-common.h layouts), shared by the scalar reference (kquant_ref.cpp)
// and the SIMD tiles (kquant_tiles.inc). All values little-endian; fp16 fields are IEEE half.
//
//   q4_1 (32 weights, 20 bytes):  fp16 d, fp16 m, qs[16]; w[j] = d * (qs[j] & 15) + m, w[j + 16] = d * (qs[j] >> 4) + m
//   q4_k (256, 144):  fp16 d, fp16 dmin, scales[12], qs[128]. Sub-block i (32 weights) has the 6-bit scale sc[i]
//                     and minimum m[i] (unpack_k4_scales); its quants are the nibbles of qs[32 (i / 2) + l], low
//                     for even i: w = d * sc[i] * q - dmin * m[i]
//   q5_k (256, 176):  fp16 d, fp16 dmin, scales[12], qh[32], qs[128]; as q4_k with a fifth bit (qh[l] >> i) & 1
//   q6_k (256, 210):  ql[128], qh[64], int8 scales[16], fp16 d. Sub-block i = 4h + t (h < 2, t < 4, 32 weights):
//                     q = (nibble t / 2 of ql[64 h + 32 (t % 2) + l]) | ((qh[32 h + l] >> 2t) & 3) << 4, and
//                     w = d * scales[2i + l / 16] * (q - 32)
//   q5_0 (32, 22):    fp16 d, qh[4], qs[16]; q = nibble | (bit l of qh, as a little-endian uint32) << 4 for weight l
//                     (low nibbles weights 0-15, high 16-31): w = d * (q - 16)
//   q5_1 (32, 24):    fp16 d, fp16 m, qh[4], qs[16]; q as q5_0: w = d * q + m
//   iq4_nl (32, 18):  fp16 d, qs[16]; nibbles as q4_1's, each an index into kIQ4Values: w = d * kIQ4Values[nibble]
//   mxfp4 (32, 17):   e8m0 e, qs[16]; nibbles as q4_1's, each an index into kMXFP4Values (e2m1's levels doubled):
//                     w = 2^(e - 128) * kMXFP4Values[nibble] (e8m0_half_to_f32)
//   iq4_xs (256, 136): fp16 d, scales_h (uint16), scales_l[4], qs[128]. Sub-block i (32 weights): 6-bit scale
//                     ls = (nibble i of scales_l) | (bits 2i of scales_h) << 4, nibbles of qs[16 i + l] as iq4_nl:
//                     w = d * (ls - 32) * kIQ4Values[nibble]
//   q3_k (256, 110):  hmask[32], qs[64], scales[12], fp16 d. Sub-block i = 4h + j (32 weights): q = ((qs[32 h + l]
//                     >> 2j) & 3) | ((hmask[l] >> i) & 1) << 2, 16 6-bit scales (unpack_q3_scales) one per 16
//                     weights: w = d * (scales[2i + l / 16] - 32) * (q - 4)
//   q2_k (256, 84):   scales[16], qs[64], fp16 d, fp16 dmin. Sub-block i = 4h + j: q = (qs[32 h + l] >> 2j) & 3;
//                     per 16 weights a 4-bit scale (low nibble of scales[2i + l / 16]) and minimum (high nibble):
//                     w = d * sc * q - dmin * m
//
// Every sub-block of 32 lines up with one activation block of 32, so the kernels work in integers per block.
#pragma once
#include <cstdint>
#include <cstring>

#include "kernels.h"

namespace offload {

constexpr int64_t QK_K = 256;  // weights per super-block of the K-quants
constexpr int64_t kQ41Bytes = gguf_block_bytes(W_Q4_1), kQ4KBytes = gguf_block_bytes(W_Q4_K),
                  kQ5KBytes = gguf_block_bytes(W_Q5_K), kQ6KBytes = gguf_block_bytes(W_Q6_K),
                  kQ50Bytes = gguf_block_bytes(W_Q5_0), kQ51Bytes = gguf_block_bytes(W_Q5_1),
                  kIQ4NLBytes = gguf_block_bytes(W_IQ4_NL), kIQ4XSBytes = gguf_block_bytes(W_IQ4_XS),
                  kQ3KBytes = gguf_block_bytes(W_Q3_K), kQ2KBytes = gguf_block_bytes(W_Q2_K),
                  kMXFP4Bytes = gguf_block_bytes(W_MXFP4);

// The 16 non-uniform levels of iq4_nl and iq4_xs (ggml-common.h kvalues_iq4nl).
alignas(16) constexpr int8_t kIQ4Values[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                                1,    13,   25,  38,  53,  69,  89,  113};

// The 16 levels of mxfp4 (e2m1: 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives), doubled to integers (ggml-common.h
// kvalues_mxfp4); the block's scale is halved to match (e8m0_half_to_f32).
alignas(16) constexpr int8_t kMXFP4Values[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

// An e8m0 scale byte halved, 2^(e - 128), as fp32 bits: the exponent field e - 1, or for e < 2 the subnormals
// 2^-128 and 2^-127 (ggml's GGML_E8M0_TO_FP32_HALF, gguf-py's e8m0_to_fp32_half). Exact for every byte.
constexpr uint32_t e8m0_half_bits(uint8_t e) { return e < 2 ? 0x00200000u << e : uint32_t(e - 1) << 23; }
inline float e8m0_half_to_f32(uint8_t e) {
  const uint32_t bits = e8m0_half_bits(e);
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// The 16 6-bit scales of a q3_k super-block (before their -32) from its 12 packed bytes, one per byte of out:
// scale k has its low 4 bits in byte k % 8 (low nibble for k < 8, high for the rest) and its top 2 bits in bits
// 2 (k / 4) of byte 8 + k % 4 (ggml's dequantize_row_q3_K).
inline void unpack_q3_scales(const uint8_t* packed, uint32_t out[4]) {
  uint32_t a[3];
  std::memcpy(a, packed, 12);
  const uint32_t m4 = 0x0f0f0f0fu, m2 = 0x03030303u;
  out[0] = (a[0] & m4) | ((a[2] & m2) << 4);
  out[1] = (a[1] & m4) | (((a[2] >> 2) & m2) << 4);
  out[2] = ((a[0] >> 4) & m4) | (((a[2] >> 4) & m2) << 4);
  out[3] = ((a[1] >> 4) & m4) | (((a[2] >> 6) & m2) << 4);
}

// The 8 scales and 8 minimums of a q4_k / q5_k super-block, 6 bits each, from its 12 packed bytes:
// bytes 0-3 hold scales 0-3 (low 6 bits) and the top 2 bits of scales 4-7; bytes 4-7 the same for the
// minimums; bytes 8-11 the low 4 bits of scales 4-7 (low nibbles) and of minimums 4-7 (high nibbles).
// Out: out[0], out[1] = scales 0-3, 4-7 and out[2], out[3] = minimums 0-3, 4-7, one per byte.
inline void unpack_k4_scales(const uint8_t* packed, uint32_t out[4]) {
  uint32_t w[3];
  std::memcpy(w, packed, 12);
  out[0] = w[0] & 0x3f3f3f3fu;
  out[1] = (w[2] & 0x0f0f0f0fu) | ((w[0] >> 2) & 0x30303030u);
  out[2] = w[1] & 0x3f3f3f3fu;
  out[3] = ((w[2] >> 4) & 0x0f0f0f0fu) | ((w[1] >> 2) & 0x30303030u);
}

inline uint16_t load_u16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}

}  // namespace offload
