// Fused decoder layer (layer.cpp): one C++ call per layer for CPU blocks with packed weights and fp32 activations, so
// a decode token pays no per-op Python/torch dispatch. Llama's block math, and where LayerArgs says so Gemma 2/3's,
// OLMo 2's (no norms before attention and the MLP, q/k norms over all heads), partial rotary (Phi-4-mini) and
// gpt-oss's attention sinks; gpt-oss's biased, clamped experts where ExpertsArgs says so.
#pragma once
#include <cstdint>
#include <vector>

#include "kernels.h"

namespace offload {

// y [N, M] fp32 = x [N, K] fp32 @ W[M, K]^T + bias through the dispatched matmul kernels (bindings.cpp).
void packed_linear(int path, const float* x, int64_t N, int fmt, const WView& w, const float* bias, float* y,
                   int nthreads);
// The same with bf16 activations x [N, K] (bf16 weights: the AVX-512 BF16 tiles where the CPU has them).
void packed_linear_bf16(int path, const uint16_t* x, int64_t N, int fmt, const WView& w, const float* bias, float* y,
                        int nthreads);

// One packed weight matrix [M, K] in format fmt (WFmt), with an optional fp32 bias [M]. A stacked linear (a GGUF
// layer whose q, k and v are stored in different formats) has parts instead: row blocks of its M rows, each a
// matrix of its own; w.M and w.K then give the whole shape and fmt / w's pointers are unused.
struct LinearArg {
  int fmt;
  WView w;
  const float* bias;
  std::vector<LinearArg> parts;
};

// Per new token n, the int64 row tokens[n * kTokenCols + ...]:
constexpr int kSlot = 0;     // flat KV slot row * (T + 1) + write_index; -1: padding (writes nothing)
constexpr int kRowBase = 1;  // flat slot of key 0 of the token's sequence: row * (T + 1) + its base; with a block
                             // table (LayerArgs::blocks), where its sequence's entries begin there
constexpr int64_t kKvBlock = 16;  // keys per block of a block table (offload.attention_sizes.KV_BLOCK)
constexpr int kLo = 2;       // first key the token sees (inclusive)
constexpr int kHi = 3;       // last key the token sees (inclusive)
constexpr int kMap = 4;      // -1; or a tree of proposals' token: where its key map begins in LayerArgs::blocks,
                             // [t, r_1 .. r_t]: its keys kHi - t + 1 .. kHi (its ancestors' positions and its own)
                             // are keys r_1 .. r_t of its sequence (where the tree's tokens wrote them)
constexpr int kTokenCols = 5;

struct LayerShape {
  int64_t n_heads, n_kv_heads, head_dim, intermediate;
  float eps;       // rms_norm epsilon
  float scale;     // of the attention scores (head_dim ** -0.5, or Gemma's query_pre_attn_scalar ** -0.5)
  float softcap;   // > 0: scores soft-capped to softcap * tanh(s / softcap) before the softmax (Gemma 2)
  int64_t window;  // > 0: each token sees only its last window keys (the layer's own sliding window, Gemma 2/3)
  int64_t rotary_dim;  // rope turns the first rotary_dim dimensions of each head (head_dim: all; Phi-4-mini: 3/4)
};

// The gated MLP's activation of gate: silu (Llama), GELU with the tanh approximation (Gemma), or gpt-oss's clamped
// SwiGLU (its experts): gate clamped above and up on both sides at limit, gate * sigmoid(alpha * gate) * (up + 1).
enum GateAct { kSilu = 0, kGeluTanh = 1, kSwigluOai = 2 };
struct Gate {
  int act;             // GateAct
  float alpha, limit;  // kSwigluOai's; unused by the others
};

struct LayerArgs {
  int path, nthreads;  // kernel path (Path) and thread count
  LayerShape shape;
  const float *attn_norm, *mlp_norm;  // [D]; null: none (OLMo 2 norms only the outputs)
  LinearArg qkv, o, gate_up, down;    // qkv rows: q | k | v; gate_up rows: gate | up (a MoE layer: none, M = 0,
                                      // or its shared expert's)
  const float *q_norm, *k_norm;       // [head_dim] per-head RMSNorm of q and k before rope (Qwen3); null: none
  int qk_norm_all;                    // 1: q_norm [n_heads * head_dim] and k_norm [n_kv_heads * head_dim] norm the
                                      // whole of q and of k, all heads together (OLMo 2)
  const float* shared_gate;           // [D] a MoE layer's shared-expert gate (sigmoid(h . g) scales it); null: none
  int moe;                            // 1: the attention part of a MoE layer: out is [N, 2D] = residual | normed h
  const float *post_attn_norm, *post_mlp_norm;  // [D] Gemma: attention's and the MLP's outputs RMS-normed before
                                                // their residual adds; null: none
  int act;                                      // GateAct of the MLP (kSilu or kGeluTanh)
  const float* sinks;                 // [n_heads] gpt-oss: one more logit per head in the softmax's denominator,
                                      // with no value; null: none
  int64_t N;                          // new tokens (batch x sequence, flattened)
  const float* x;                     // [N, D] hidden states in
  float* out;                         // [N, D] hidden states out (may not alias x)
  const float *cos, *sin;             // [N, rotary_dim]: cos and sin with the rotate-half sign folded in (and a
                                      // rope's attention_factor, YaRN's or LongRoPE's, multiplied in)
  const int64_t* tokens;              // [N, kTokenCols], see above
  const int64_t* blocks;              // null: each sequence's keys are one run from kRowBase; else key j of a
                                      // token's sequence is at flat slot blocks[tok[kRowBase] + j / 16] + j % 16
  void *k_cache, *v_cache;            // [slots, n_kv_heads, head_dim], token-major: fp32, or bf16 with kv_bf16
  int kv_bf16;                        // 1: the caches hold bf16 (this step's K, V rounded to nearest even)
  int act_bf16;                       // 1: a bf16 plan's layer: the linears of bf16 weights take their input
                                      // rounded to bf16, as its unfused ones (and llama.cpp's bf16 rows) do
};

// bf16 <-> fp32: widening is exact; narrowing rounds to nearest even (as torch's .to(torch.bfloat16)).
inline float bf16_bits_to_f32(uint16_t h) {
  const uint32_t u = uint32_t(h) << 16;
  float f;
  __builtin_memcpy(&f, &u, 4);
  return f;
}
inline uint16_t f32_to_bf16_bits(float f) {
  uint32_t u;
  __builtin_memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40);  // NaN stays NaN
  return uint16_t((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
void bf16_rows_to_f32(const uint16_t* src, int64_t n, float* dst);
void f32_rows_to_bf16(const float* src, int64_t n, uint16_t* dst);

// x -> x + attn(rms_norm(x)) -> + mlp(rms_norm(.)) (each output normed first where post_*_norm is set, an input
// unnormed where its norm is null); writes this step's K, V into the cache. With a.moe, the MLP is the shared
// expert's (if any) and out gets [residual | rms_norm(residual before it)] for the routed experts.
void layer_forward(const LayerArgs& a);

// y [N, D] = x * rsqrt(mean(x^2) + eps) * w, each row's squares summed in double: the layer's own norm, for a
// model's final one.
void rms_norm(const float* x, const float* w, int64_t N, int64_t D, float eps, float* y, int nth);

// Shared with experts.cpp: y [N, M] = x [N, K] @ l^T (+ bias) with a.path, a.nthreads and a.N (a stacked linear part
// by part); act [N, I] = gate's activation of gate times up from gate_up [N, 2I]; v grown to n floats.
void run_linear(const LayerArgs& a, const LinearArg& l, const float* x, float* y);
void gate_mul(const float* gate_up, int64_t N, int64_t I, const Gate& gate, float* act, int path, int nth);
inline float* grow(Floats& v, int64_t n) {
  if (v.size() < size_t(n)) v.resize(size_t(n));
  return v.data();
}

// The routed experts of a MoE layer: out [N, D] = x[:, :D] + sum over each token's top_k experts of
// weight * down(act(gate(h)) * up(h)), h = x[:, D:], for x [N, 2D] (each linear's bias added where it has one,
// gpt-oss). The router's choice is ids / weights [N, top_k] when given, else made here from the fp32 router
// [n_experts, D] (+ router_bias): softmax over h . router^T, the top_k (renormalised to sum 1 with norm_topk).
// Each expert runs once over the tokens routed to it.
struct ExpertsArgs {
  int path, nthreads;
  int64_t n_experts, top_k, D, F;
  const std::vector<LinearArg>* gate_up;  // per expert [2F, D], rows gate | up
  const std::vector<LinearArg>* down;     // per expert [D, F]
  const float* router;                    // [n_experts, D], used when ids is null
  const float* router_bias;               // [n_experts]; null: none
  int norm_topk;
  Gate gate;                              // the experts' activation
  int64_t N;
  const float* x;
  const int64_t* ids;
  const float* weights;
  float* out;
};
void experts_forward(const ExpertsArgs& a);

// The attention of layer_forward alone, for layers whose linears run elsewhere (fp32 weights through torch):
// rope on qkv [N, q | k | v] in place, this step's K, V into the cache, att [N, n_heads * head_dim] out. Reads
// a.path, a.nthreads, a.shape, a.N, a.cos, a.sin, a.tokens, a.sinks and the caches; nothing else.
void attention_forward(const LayerArgs& a, float* qkv, float* att);

// att [N, n_heads * head_dim]: each token's heads over its keys in the cache (attention.cpp); this step's K and V
// already stored.
void attention(const LayerArgs& a, const float* qkv, float* att);

}  // namespace offload
