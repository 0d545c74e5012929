// Shared types of the CPU kernels: weight and activation views, per-ISA entry points.
//
// Weights use a split layout made at load time from GGUF blocks: quants (32 int8 per q8_0 block,
// 16 nibble bytes per q4_0 block in GGUF's order) in one array, fp16 block scales in another
// [M, K/32]. Byte count equals GGUF's. Two orders of the blocks:
//  - row order: all blocks of a row contiguous, rows one after another (as GGUF);
//  - tiled order (what the CPU kernels are fastest on): rows in tiles of 4 (the last M % 4 rows stay
//    in row order); within a tile, block pairs (b, b+1) one after another, each pair holding the 4 rows'
//    two blocks side by side (row 0's b and b+1, then row 1's...), then an odd last block of the 4 rows.
//    The scales follow the same order. A matrix-vector product then reads one sequential stream.
// GGUF block formats (q4_1, q5_0, q5_1, iq4_nl, mxfp4, and the super-blocks q2_k, q3_k, q4_k, q5_k, q6_k, iq4_xs) are
// kept as GGUF's own block bytes in row order, in qs alone (d is null): see kquant.h for their layouts.
#pragma once
#include <cstddef>
#include <cstdint>
#include <new>
#include <vector>

namespace offload {

// An allocator whose blocks start on a cache line: rows of [N, D] scratch buffers (activations, a layer's hidden
// states) then take no load or store split across two lines. malloc's 16-byte alignment split every other 256-bit
// access and every 512-bit one: the attention's output rows, whose stores then failed to forward to the next
// block's loads, took 11% of a 256-token prefill with it, 7% without (0.8B Llama, IQ4_XS, Zen 5).
template <class T>
struct LineAligned {
  using value_type = T;
  LineAligned() = default;
  template <class U>
  LineAligned(const LineAligned<U>&) {}
  T* allocate(size_t n) { return static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t(64))); }
  void deallocate(T* p, size_t) { ::operator delete(p, std::align_val_t(64)); }
  template <class U>
  bool operator==(const LineAligned<U>&) const { return true; }
  template <class U>
  bool operator!=(const LineAligned<U>&) const { return false; }
};
template <class T>
using LineVector = std::vector<T, LineAligned<T>>;
using Floats = LineVector<float>;

constexpr int64_t QK = 32;  // elements per quant block

// The GGUF block formats with fused kernels, one line each: X(name, NAME, id, weights per block, bytes per block,
// decoder, scalar reference's row function). The id is offload/formats GGUF_TYPES' cpu_kernel; the decoder is a
// struct of kquant_tiles.inc, the row function one of kquant_ref.cpp. Each line declares and defines the format's
// enum value, sizes and entry points (gemm_<name>_ref, _avx2, _avx512) and fills the dispatch tables.
#define OFFLOAD_GGUF_FORMATS(X)                                                                               \
  X(q4_1, Q4_1, 8, 32, 20, Q41, row_q4_1) X(q4_k, Q4_K, 9, 256, 144, Q4K, row_qk<false>)                      \
  X(q5_k, Q5_K, 10, 256, 176, Q5K, row_qk<true>) X(q6_k, Q6_K, 11, 256, 210, Q6K, row_q6_k)                   \
  X(q5_0, Q5_0, 12, 32, 22, Q50, row_b32<W_Q5_0>) X(q5_1, Q5_1, 13, 32, 24, Q51, row_b32<W_Q5_1>)             \
  X(q3_k, Q3_K, 14, 256, 110, Q3K, row_q23_k<true>) X(q2_k, Q2_K, 15, 256, 84, Q2K, row_q23_k<false>)         \
  X(iq4_nl, IQ4_NL, 16, 32, 18, IQ4NL, row_b32<W_IQ4_NL>) X(iq4_xs, IQ4_XS, 17, 256, 136, IQ4XS, row_iq4_xs)    \
  X(mxfp4, MXFP4, 18, 32, 17, MXFP4, row_b32<W_MXFP4>)

#define OFFLOAD_ENUM(name_, NAME_, id_, weights_, bytes_, Dec_, Row_) W_##NAME_ = id_,
// W_F32: dense fp32 weights (a torch tensor's memory), run by the fp32-activation kernels of the half formats
enum WFmt : int { W_Q8_0 = 0, W_Q4_0 = 1, W_BF16 = 2, W_F16 = 3, W_F32 = 6, OFFLOAD_GGUF_FORMATS(OFFLOAD_ENUM) };
#undef OFFLOAD_ENUM
constexpr int W_TILED = 4;  // format id + W_TILED: the same format in tiled order (q8_0 / q4_0 only)
constexpr int kFormatIds = 32;  // format ids are below this

// Weights and bytes per GGUF block (0: not a GGUF block format with kernels).
constexpr int64_t gguf_block_weights(int fmt) {
#define OFFLOAD_WEIGHTS(name_, NAME_, id_, weights_, bytes_, Dec_, Row_) if (fmt == id_) return weights_;
  OFFLOAD_GGUF_FORMATS(OFFLOAD_WEIGHTS)
#undef OFFLOAD_WEIGHTS
  return 0;
}
constexpr int64_t gguf_block_bytes(int fmt) {
#define OFFLOAD_BYTES(name_, NAME_, id_, weights_, bytes_, Dec_, Row_) if (fmt == id_) return bytes_;
  OFFLOAD_GGUF_FORMATS(OFFLOAD_BYTES)
#undef OFFLOAD_BYTES
  return 0;
}
constexpr bool is_gguf(int fmt) { return gguf_block_weights(fmt) > 0; }
// A format id as the Python face sends it -> (format, tiled order); false for an unknown id.
inline bool parse_fmt_id(int id, int& fmt, bool& tiled) {
  tiled = id == W_TILED + W_Q8_0 || id == W_TILED + W_Q4_0;
  fmt = tiled ? id - W_TILED : id;
  return (fmt >= W_Q8_0 && fmt <= W_F16) || fmt == W_F32 || is_gguf(fmt);
}
// Whether fmt holds float weights, one element each (no blocks).
constexpr bool is_float(int fmt) { return fmt == W_BF16 || fmt == W_F16 || fmt == W_F32; }
// Whether K suits the format: quantized formats need whole blocks in every row.
inline bool k_fits(int fmt, int64_t K) {
  if (is_gguf(fmt)) return K % gguf_block_weights(fmt) == 0;
  return is_float(fmt) || K % 32 == 0;
}
// Whether fmt's kernels take int16 activations (quantize_x16) rather than int8.
constexpr bool takes_x16(int fmt) { return fmt == W_Q8_0 || fmt == W_Q4_1; }
enum XType : int { X_F32 = 0, X_BF16 = 1 };
enum Path : int { P_SCALAR = 0, P_AVX2 = 1, P_AVX512 = 2 };

// A weight matrix [M, K].
struct WView {
  const uint8_t* qs;   // q8_0: int8 [M, K]; q4_0: uint8 [M, K/2]; bf16/f16: uint16 [M, K]; f32: float [M, K]
  const uint16_t* d;   // fp16 block scales [M, K/32]; null for bf16/f16/f32
  int64_t M, K;
  bool tiled = false;  // tiled block order (see above)
};

// Where the quants and scale of (row r, block b) are, for rows r0.. of one row tile, in either order.
// Within a pair (b even, b + 1 < nb) a row's two blocks are adjacent in both orders.
struct RowTile {
  const uint8_t* q;
  const uint16_t* d;
  int64_t bb, pairs;             // bytes per block (16 for q4_0, 32 for q8_0); whole pairs per row
  int64_t q_row, q_pair, q_odd;  // byte strides: row, pair, row within the odd last block
  int64_t d_row, d_pair, d_odd;  // the same for scales, in elements

  RowTile(const WView& w, int64_t r0, int64_t block_bytes) : bb(block_bytes), pairs(w.K / 64) {
    const int64_t nb = w.K / 32;
    q = w.qs + r0 * nb * bb;
    d = w.d + r0 * nb;
    if (w.tiled && r0 < (w.M & ~int64_t(3))) {
      q_row = 2 * bb, q_pair = 8 * bb, q_odd = bb, d_row = 2, d_pair = 8, d_odd = 1;
    } else {
      q_row = nb * bb, q_pair = 2 * bb, q_odd = nb * bb, d_row = nb, d_pair = 2, d_odd = nb;
    }
  }
  const uint8_t* qat(int64_t r, int64_t b) const {
    return b < 2 * pairs ? q + r * q_row + (b >> 1) * q_pair + (b & 1) * bb : q + pairs * q_pair + r * q_odd;
  }
  const uint16_t* dat(int64_t r, int64_t b) const {
    return b < 2 * pairs ? d + r * d_row + (b >> 1) * d_pair + (b & 1) : d + pairs * d_pair + r * d_odd;
  }
};

// Activations quantized per block of 32: int8 (q8_0 style) against q4_0 and the K-quants (as llama.cpp's
// q8_K), int16 against q8_0 weights (whose 8-bit error would otherwise double: see quantize_x16_ref) and q4_1
// (int8 activations flipped the default model's greedy answer: see kquant_ref.cpp). The order within a block
// is natural, except for the SIMD q4_0 path (see quantize_x_avx2).
struct XQ {
  const int8_t* qs;  // [N, K] int8, or int16 for takes_x16 formats (then d is amax / 32767)
  const float* d;    // [N, K/32] scale of each block
  const float* s;    // [N, K/32] d * sum(q) of each block (q4_0's -8 offset, the GGUF formats' minimums)
  int64_t N, K;
  const int16_t* s16 = nullptr;  // [N, K/16] sum(q) of each 16 (q6_k's -32 offset); GGUF formats only
  const int32_t* c8 = nullptr;   // [N, K/32] -8 * sum(q) of each block (q4_0's offset, exact); q4_0, N > 1
  int64_t ld = 0;                // elements from one row of qs to the next, if not K
  int64_t stride() const { return ld ? ld : K; }
};

// Row-range kernels: y[n, r] for r in [r0, r1), all n < N; y is [N, M] fp32, bias [M] or null.
using QGemmFn = void (*)(const WView& w, const XQ& x, float* y, const float* bias, int64_t r0, int64_t r1);
using FGemmFn = void (*)(const WView& w, const float* x, int64_t N, float* y, const float* bias,
                         int64_t r0, int64_t r1);
// Quantize one row of K activations (fp32 or bf16) into qs [K], d [K/32], s [K/32].
using QuantXFn = void (*)(const void* x, int xtype, int64_t K, int8_t* qs, float* d, float* s);
// Quantize one row of K activations into int16 qs [K], scales d [K/32] and d * sum(q) s [K/32].
using QuantX16Fn = void (*)(const void* x, int xtype, int64_t K, int16_t* qs, float* d, float* s);
// Quantize one row for the GGUF formats: quantize_x's values in natural order, and the sums s16 [K/16].
using QuantXKFn = void (*)(const void* x, int xtype, int64_t K, int8_t* qs, float* d, float* s, int16_t* s16);

float fp16_to_f32(uint16_t h);
uint16_t f32_to_fp16(float f);  // round to nearest even, like numpy's astype(float16)
float bf16_to_f32(uint16_t h);

// Tokens from which the float weights' fp32-activation kernels (bf16, fp32) run the cache-blocked (packed) form; below,
// dot products whose sums do not depend on the token count (fgemm_avx2.cpp, fgemm_avx512.cpp).
constexpr int64_t kPackMinTokens = 10;
// fp32 weights x fp32 activations with AVX-512F tiles below kPackMinTokens, the AVX2 packed form from there
void gemm_f32_avx512(const WView& w, const float* x, int64_t N, float* y, const float* bias, int64_t r0, int64_t r1);
// bf16 weights x bf16 activations [N, K] (row stride ldx) with AVX-512 BF16 (vdpbf16ps), K a multiple of 32; rows
// r0..r1 of y [N, M].
void gemm_bf16_bf16x_avx512(const WView& w, const uint16_t* x, int64_t ldx, int64_t N, float* y, const float* bias,
                            int64_t r0, int64_t r1);

// Scalar references (ref.cpp).
void quantize_x_ref(const void* x, int xtype, int64_t K, int8_t* qs, float* d, float* s);
void quantize_x16_ref(const void* x, int xtype, int64_t K, int16_t* qs, float* d, float* s);
void gemm_q8_0_ref(const WView& w, const XQ& x, float* y, const float* bias, int64_t r0, int64_t r1);
void gemm_q4_0_ref(const WView& w, const XQ& x, float* y, const float* bias, int64_t r0, int64_t r1);
void gemm_bf16_ref(const WView& w, const float* x, int64_t N, float* y, const float* bias, int64_t r0, int64_t r1);
void gemm_f16_ref(const WView& w, const float* x, int64_t N, float* y, const float* bias, int64_t r0, int64_t r1);
void gemm_f32_ref(const WView& w, const float* x, int64_t N, float* y, const float* bias, int64_t r0, int64_t r1);
// Weight quantizers, bit-exact with gguf-py / ggml-quants.c reference rounding.
void quantize_w_q8_0_rows(const float* src, int64_t r0, int64_t r1, int64_t K, uint8_t* qs, uint16_t* d);
void quantize_w_q4_0_rows(const float* src, int64_t r0, int64_t r1, int64_t K, uint8_t* qs, uint16_t* d);

// Scalar references of the GGUF block formats (kquant_ref.cpp).
void quantize_xk_ref(const void* x, int xtype, int64_t K, int8_t* qs, float* d, float* s, int16_t* s16);

// AVX2 + FMA + F16C (qgemm_avx2.cpp, fgemm_avx2.cpp).
void quantize_x_avx2(const void* x, int xtype, int64_t K, int8_t* qs, float* d, float* s);
void quantize_x16_avx2(const void* x, int xtype, int64_t K, int16_t* qs, float* d, float* s);
void gemm_q8_0_avx2(const WView& w, const XQ& x, float* y, const float* bias, int64_t r0, int64_t r1);
void gemm_q4_0_avx2(const WView& w, const XQ& x, float* y, const float* bias, int64_t r0, int64_t r1);
void gemm_bf16_avx2(const WView& w, const float* x, int64_t N, float* y, const float* bias, int64_t r0, int64_t r1);
void gemm_f16_avx2(const WView& w, const float* x, int64_t N, float* y, const float* bias, int64_t r0, int64_t r1);
void gemm_f32_avx2(const WView& w, const float* x, int64_t N, float* y, const float* bias, int64_t r0, int64_t r1);
uint64_t read_bytes_avx2(const uint8_t* p, int64_t n);  // bandwidth probe: touches every byte
void quantize_xk_avx2(const void* x, int xtype, int64_t K, int8_t* qs, float* d, float* s, int16_t* s16);

// AVX-512 VL + VNNI (qgemm_avx512.cpp): the AVX2 tiles with dpbusd dot products.
void gemm_q8_0_avx512(const WView& w, const XQ& x, float* y, const float* bias, int64_t r0, int64_t r1);
void gemm_q4_0_avx512(const WView& w, const XQ& x, float* y, const float* bias, int64_t r0, int64_t r1);

// Each GGUF block format's entry points: the scalar reference (kquant_ref.cpp), AVX2 (qgemm_avx2.cpp) and AVX-512
// (qgemm_avx512.cpp).
#define OFFLOAD_DECLARE(name_, NAME_, id_, weights_, bytes_, Dec_, Row_) \
  void gemm_##name_##_ref(const WView& w, const XQ& x, float* y, const float* bias, int64_t r0, int64_t r1);     \
  void gemm_##name_##_avx2(const WView& w, const XQ& x, float* y, const float* bias, int64_t r0, int64_t r1);    \
  void gemm_##name_##_avx512(const WView& w, const XQ& x, float* y, const float* bias, int64_t r0, int64_t r1);
OFFLOAD_GGUF_FORMATS(OFFLOAD_DECLARE)
#undef OFFLOAD_DECLARE

}  // namespace offload
