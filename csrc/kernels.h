// Shared types of the CPU kernels: weight and activation views, per-ISA entry points.
//
// Weights use a split layout made at load time from GGUF blocks: all quants of a
// row contiguous (32 int8 per q8_0 block, 16 nibble bytes per q4_0 block in GGUF's
// order), and the fp16 block scales in a separate [M, K/32] array. Byte count equals GGUF's.
#pragma once
#include <cstddef>
#include <cstdint>

namespace offload {

constexpr int64_t QK = 32;  // elements per quant block

enum WFmt : int { W_Q8_0 = 0, W_Q4_0 = 1, W_BF16 = 2, W_F16 = 3 };
enum XType : int { X_F32 = 0, X_BF16 = 1 };
enum Path : int { P_SCALAR = 0, P_AVX2 = 1, P_AVX512 = 2 };

// A weight matrix [M, K].
struct WView {
  const uint8_t* qs;   // q8_0: int8 [M, K]; q4_0: uint8 [M, K/2]; bf16/f16: uint16 [M, K]
  const uint16_t* d;   // fp16 block scales [M, K/32]; null for bf16/f16
  int64_t M, K;
};

// Activations quantized per block of 32, natural element order: int8 (q8_0 style) against q4_0
// weights, int16 against q8_0 weights (whose 8-bit error would otherwise double: see quantize_x16_ref).
struct XQ {
  const int8_t* qs;  // [N, K] int8, or int16 for q8_0 weights (then d is amax / 32767)
  const float* d;    // [N, K/32] scale of each block
  const float* s;    // [N, K/32] d * sum(q) of each block (for q4_0's -8 offset)
  int64_t N, K;
};

// Row-range kernels: y[n, r] for r in [r0, r1), all n < N; y is [N, M] fp32, bias [M] or null.
using QGemmFn = void (*)(const WView& w, const XQ& x, float* y, const float* bias, int64_t r0, int64_t r1);
using FGemmFn = void (*)(const WView& w, const float* x, int64_t N, float* y, const float* bias,
                         int64_t r0, int64_t r1);
// Quantize one row of K activations (fp32 or bf16) into qs [K], d [K/32], s [K/32].
using QuantXFn = void (*)(const void* x, int xtype, int64_t K, int8_t* qs, float* d, float* s);
// Quantize one row of K activations into int16 qs [K] and scales d [K/32].
using QuantX16Fn = void (*)(const void* x, int xtype, int64_t K, int16_t* qs, float* d);

float fp16_to_f32(uint16_t h);
uint16_t f32_to_fp16(float f);  // round to nearest even, like numpy's astype(float16)
float bf16_to_f32(uint16_t h);

// Scalar references (ref.cpp).
void quantize_x_ref(const void* x, int xtype, int64_t K, int8_t* qs, float* d, float* s);
void quantize_x16_ref(const void* x, int xtype, int64_t K, int16_t* qs, float* d);
void gemm_q8_0_ref(const WView& w, const XQ& x, float* y, const float* bias, int64_t r0, int64_t r1);
void gemm_q4_0_ref(const WView& w, const XQ& x, float* y, const float* bias, int64_t r0, int64_t r1);
void gemm_bf16_ref(const WView& w, const float* x, int64_t N, float* y, const float* bias, int64_t r0, int64_t r1);
void gemm_f16_ref(const WView& w, const float* x, int64_t N, float* y, const float* bias, int64_t r0, int64_t r1);
// Weight quantizers, bit-exact with gguf-py / ggml-quants.c reference rounding.
void quantize_w_q8_0_rows(const float* src, int64_t r0, int64_t r1, int64_t K, uint8_t* qs, uint16_t* d);
void quantize_w_q4_0_rows(const float* src, int64_t r0, int64_t r1, int64_t K, uint8_t* qs, uint16_t* d);

// AVX2 + FMA + F16C (qgemm_avx2.cpp, fgemm_avx2.cpp).
void quantize_x_avx2(const void* x, int xtype, int64_t K, int8_t* qs, float* d, float* s);
void quantize_x16_avx2(const void* x, int xtype, int64_t K, int16_t* qs, float* d);
void gemm_q8_0_avx2(const WView& w, const XQ& x, float* y, const float* bias, int64_t r0, int64_t r1);
void gemm_q4_0_avx2(const WView& w, const XQ& x, float* y, const float* bias, int64_t r0, int64_t r1);
void gemm_bf16_avx2(const WView& w, const float* x, int64_t N, float* y, const float* bias, int64_t r0, int64_t r1);
void gemm_f16_avx2(const WView& w, const float* x, int64_t N, float* y, const float* bias, int64_t r0, int64_t r1);
uint64_t read_bytes_avx2(const uint8_t* p, int64_t n);  // bandwidth probe: touches every byte

// AVX-512 VL + VNNI (qgemm_avx512.cpp): the AVX2 tiles with dpbusd dot products.
void gemm_q8_0_avx512(const WView& w, const XQ& x, float* y, const float* bias, int64_t r0, int64_t r1);
void gemm_q4_0_avx512(const WView& w, const XQ& x, float* y, const float* bias, int64_t r0, int64_t r1);

}  // namespace offload
