// Python binding of the fused decoder layer (layer.cpp): raw pointers, validated by offload/kernels/layer.py.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <array>
#include <stdexcept>

#include "layer.h"

namespace py = pybind11;

namespace offload {
namespace {

// (fmt, quants, scales, bias, M, K): one packed linear as the Python face describes it.
using LinearTuple = std::tuple<int, uintptr_t, uintptr_t, uintptr_t, int64_t, int64_t>;

template <typename T>
const T* ptr(uintptr_t p) { return reinterpret_cast<const T*>(p); }

LinearArg to_linear(const LinearTuple& t) {
  const auto [fmt_id, qs, d, bias, M, K] = t;
  int fmt;
  bool tiled;
  if (!parse_fmt_id(fmt_id, fmt, tiled) || M < 1 || K < 1 || !k_fits(fmt, K))
    throw std::invalid_argument("offload fused layer: bad linear format or shape (quantized formats need K a "
                                "multiple of their block)");
  return {fmt, WView{ptr<uint8_t>(qs), ptr<uint16_t>(d), M, K, tiled}, ptr<float>(bias), {}};
}

// One linear: a single part, or the row blocks of a stacked linear (parts of one K, rows adding up).
LinearArg to_stacked(const std::vector<LinearTuple>& parts) {
  if (parts.empty()) throw std::invalid_argument("offload fused layer: a linear needs at least one part");
  if (parts.size() == 1) return to_linear(parts[0]);
  LinearArg l{-1, WView{nullptr, nullptr, 0, 0, false}, nullptr, {}};
  for (const LinearTuple& t : parts) {
    l.parts.push_back(to_linear(t));
    const WView& w = l.parts.back().w;
    if (l.w.K != 0 && w.K != l.w.K) throw std::invalid_argument("offload fused layer: stacked parts differ in K");
    l.w.K = w.K;
    l.w.M += w.M;
  }
  return l;
}

LayerShape to_shape(const std::tuple<int64_t, int64_t, int64_t, int64_t, float>& t) {
  const auto [n_heads, n_kv_heads, head_dim, intermediate, eps] = t;
  if (n_heads < 1 || n_kv_heads < 1 || n_heads % n_kv_heads != 0 || head_dim < 2 || head_dim % 2 != 0)
    throw std::invalid_argument("offload fused layer: n_heads must be a multiple of n_kv_heads, head_dim even");
  return {n_heads, n_kv_heads, head_dim, intermediate, eps};
}

// The weights of one layer, built once per layer by the Python face.
struct FusedWeights {
  LayerShape shape;
  const float *attn_norm, *mlp_norm;
  LinearArg qkv, o, gate_up, down;
};

FusedWeights make_weights(const std::tuple<int64_t, int64_t, int64_t, int64_t, float>& shape, uintptr_t attn_norm,
                          uintptr_t mlp_norm, const std::array<std::vector<LinearTuple>, 4>& linears) {
  FusedWeights w{to_shape(shape), ptr<float>(attn_norm), ptr<float>(mlp_norm),
                 to_stacked(linears[0]), to_stacked(linears[1]), to_stacked(linears[2]), to_stacked(linears[3])};
  const LayerShape& s = w.shape;
  const int64_t D = w.qkv.w.K, q_size = s.n_heads * s.head_dim, kv_size = s.n_kv_heads * s.head_dim;
  if (w.qkv.w.M != q_size + 2 * kv_size || w.o.w.M != D || w.o.w.K != q_size || w.gate_up.w.K != D ||
      w.gate_up.w.M != 2 * s.intermediate || w.down.w.K != s.intermediate || w.down.w.M != D)
    throw std::invalid_argument("offload fused layer: linear shapes do not match the layer shape");
  return w;
}

void forward(const FusedWeights& w, int path, int nthreads, int64_t N, uintptr_t x, uintptr_t out, uintptr_t cos,
             uintptr_t sin, uintptr_t tokens, uintptr_t k_cache, uintptr_t v_cache) {
  if (path < P_SCALAR || path > P_AVX512 || N < 1)
    throw std::invalid_argument("offload fused layer: bad kernel path id or token count");
  LayerArgs a{path, nthreads < 1 ? 1 : nthreads, w.shape, w.attn_norm, w.mlp_norm, w.qkv, w.o, w.gate_up, w.down,
              N, ptr<float>(x), reinterpret_cast<float*>(out), ptr<float>(cos), ptr<float>(sin),
              ptr<int64_t>(tokens), reinterpret_cast<float*>(k_cache), reinterpret_cast<float*>(v_cache)};
  layer_forward(a);
}

void cached_attention(const std::tuple<int64_t, int64_t, int64_t, int64_t, float>& shape, int path, int nthreads,
                      int64_t N, uintptr_t qkv, uintptr_t att, uintptr_t cos, uintptr_t sin, uintptr_t tokens,
                      uintptr_t k_cache, uintptr_t v_cache) {
  if (path < P_SCALAR || path > P_AVX512 || N < 1)
    throw std::invalid_argument("offload cached attention: bad kernel path id or token count");
  LayerArgs a{};
  a.path = path;
  a.nthreads = nthreads < 1 ? 1 : nthreads;
  a.shape = to_shape(shape);
  a.N = N;
  a.cos = ptr<float>(cos);
  a.sin = ptr<float>(sin);
  a.tokens = ptr<int64_t>(tokens);
  a.k_cache = reinterpret_cast<float*>(k_cache);
  a.v_cache = reinterpret_cast<float*>(v_cache);
  attention_forward(a, reinterpret_cast<float*>(qkv), reinterpret_cast<float*>(att));
}

}  // namespace

void bind_layer(py::module_& m) {
  py::class_<FusedWeights>(m, "FusedWeights", "one decoder layer's packed weights, as raw pointers");
  m.def("fused_weights", &make_weights,
        "fused_weights((n_heads, n_kv_heads, head_dim, intermediate, eps), attn_norm, mlp_norm, "
        "[[(fmt, qs, d, bias, M, K), ...]] * 4 for qkv, o, gate_up, down: each linear one part, or the row "
        "blocks of a stacked linear)");
  m.def("layer_forward", &forward, py::call_guard<py::gil_scoped_release>(),
        "layer_forward(weights, path, nthreads, N, x, out, cos, sin, tokens, k_cache, v_cache): raw pointers, "
        "see offload/kernels/layer.py");
  m.def("cached_attention", &cached_attention, py::call_guard<py::gil_scoped_release>(),
        "cached_attention((n_heads, n_kv_heads, head_dim, intermediate, eps), path, nthreads, N, qkv, att, cos, sin, "
        "tokens, k_cache, v_cache): rope, KV store and attention of one layer; raw pointers, see "
        "offload/kernels/layer.py");
}

}  // namespace offload
