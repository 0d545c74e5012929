// Python binding of the fused decoder layer (layer.cpp): raw pointers, validated by offload/kernels/layer.py.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <array>
#include <chrono>
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

// (n_heads, n_kv_heads, head_dim, intermediate, eps, scale, softcap, window, rotary_dim): softcap and window 0 for
// none, rotary_dim head_dim for rope over whole heads.
using ShapeTuple = std::tuple<int64_t, int64_t, int64_t, int64_t, float, float, float, int64_t, int64_t>;

LayerShape to_shape(const ShapeTuple& t) {
  const auto [n_heads, n_kv_heads, head_dim, intermediate, eps, scale, softcap, window, rotary_dim] = t;
  if (n_heads < 1 || n_kv_heads < 1 || n_heads % n_kv_heads != 0 || head_dim < 2 || head_dim % 2 != 0)
    throw std::invalid_argument("offload fused layer: n_heads must be a multiple of n_kv_heads, head_dim even");
  if (!(scale > 0.f) || softcap < 0.f || window < 0)
    throw std::invalid_argument("offload fused layer: the score scale must be > 0, softcap and window >= 0");
  if (rotary_dim < 2 || rotary_dim > head_dim || rotary_dim % 2 != 0)
    throw std::invalid_argument("offload fused layer: rotary_dim must be even, from 2 to head_dim");
  return {n_heads, n_kv_heads, head_dim, intermediate, eps, scale, softcap, window, rotary_dim};
}

// The weights of one layer, built once per layer by the Python face.
struct FusedWeights {
  LayerShape shape;
  const float *attn_norm, *mlp_norm;
  LinearArg qkv, o, gate_up, down;
  const float *q_norm, *k_norm, *shared_gate;
  int moe;
  const float *post_attn_norm, *post_mlp_norm;
  int act, qk_norm_all;
  const float* sinks;
};

// (q_norm, k_norm, shared_gate, moe, post_attn_norm, post_mlp_norm, act, qk_norm_all, sinks): the extras of Qwen3,
// MoE, Gemma, OLMo 2 and gpt-oss layers (null pointers: none; act a GateAct of a dense MLP, kSilu or kGeluTanh;
// qk_norm_all 1: q/k norms over all heads; sinks [n_heads] fp32).
using ExtrasTuple = std::tuple<uintptr_t, uintptr_t, uintptr_t, int, uintptr_t, uintptr_t, int, int, uintptr_t>;

FusedWeights make_weights(const ShapeTuple& shape, uintptr_t attn_norm, uintptr_t mlp_norm,
                          const std::array<std::vector<LinearTuple>, 4>& linears, const ExtrasTuple& extras) {
  const auto [q_norm, k_norm, shared_gate, moe, post_attn_norm, post_mlp_norm, act, qk_norm_all, sinks] = extras;
  if (act != kSilu && act != kGeluTanh)
    throw std::invalid_argument("offload fused layer: a dense MLP's activation must be silu (0) or gelu_tanh (1)");
  // a MoE layer without a shared expert has no MLP of its own: gate_up and down stay empty (M = 0)
  const bool no_mlp = moe && linears[2].empty() && linears[3].empty();
  const LinearArg none{-1, WView{nullptr, nullptr, 0, 0, false}, nullptr, {}};
  FusedWeights w{to_shape(shape), ptr<float>(attn_norm), ptr<float>(mlp_norm), to_stacked(linears[0]),
                 to_stacked(linears[1]), no_mlp ? none : to_stacked(linears[2]), no_mlp ? none : to_stacked(linears[3]),
                 ptr<float>(q_norm), ptr<float>(k_norm), ptr<float>(shared_gate), moe, ptr<float>(post_attn_norm),
                 ptr<float>(post_mlp_norm), act, qk_norm_all, ptr<float>(sinks)};
  const LayerShape& s = w.shape;
  const int64_t D = w.qkv.w.K, q_size = s.n_heads * s.head_dim, kv_size = s.n_kv_heads * s.head_dim;
  const bool mlp_ok = no_mlp || (w.gate_up.w.K == D && w.gate_up.w.M == 2 * s.intermediate &&
                                 w.down.w.K == s.intermediate && w.down.w.M == D);
  if (w.qkv.w.M != q_size + 2 * kv_size || w.o.w.M != D || w.o.w.K != q_size || !mlp_ok)
    throw std::invalid_argument("offload fused layer: linear shapes do not match the layer shape");
  if ((w.q_norm == nullptr) != (w.k_norm == nullptr) || (moe && !no_mlp && w.shared_gate == nullptr))
    throw std::invalid_argument("offload fused layer: q_norm and k_norm go together; a shared expert needs its gate");
  return w;
}

// The routed experts of one MoE layer, built once per layer by the Python face.
struct FusedExperts {
  int64_t n_experts, top_k, D, F;
  std::vector<LinearArg> gate_up, down;
  const float* router;       // [n_experts, D] fp32; null: the caller routes
  const float* router_bias;  // [n_experts] fp32; null: none
  int norm_topk;
  Gate gate;
};

// (act, alpha, limit): the experts' activation, a GateAct (alpha and limit: kSwigluOai's, gpt-oss).
using GateTuple = std::tuple<int, float, float>;

Gate to_gate(const GateTuple& t) {
  const auto [act, alpha, limit] = t;
  if (act != kSilu && act != kGeluTanh && act != kSwigluOai)
    throw std::invalid_argument("offload fused experts: unknown activation id");
  if (act == kSwigluOai && !(alpha > 0.f && limit > 0.f))
    throw std::invalid_argument("offload fused experts: the clamped SwiGLU's alpha and limit must be > 0");
  return {act, alpha, limit};
}

FusedExperts make_experts(int64_t top_k, const std::vector<std::vector<LinearTuple>>& gate_up,
                          const std::vector<std::vector<LinearTuple>>& down, uintptr_t router, uintptr_t router_bias,
                          int norm_topk, const GateTuple& gate) {
  if (gate_up.empty() || gate_up.size() != down.size() || top_k < 1 || top_k > int64_t(gate_up.size()))
    throw std::invalid_argument("offload fused experts: one gate_up and one down per expert, 1 <= top_k <= experts");
  FusedExperts e{int64_t(gate_up.size()), top_k, 0, 0, {}, {}, ptr<float>(router), ptr<float>(router_bias),
                 norm_topk, to_gate(gate)};
  for (size_t x = 0; x < gate_up.size(); ++x) {
    e.gate_up.push_back(to_stacked(gate_up[x]));
    e.down.push_back(to_stacked(down[x]));
    const WView &gu = e.gate_up.back().w, &dn = e.down.back().w;
    if (x == 0) e.D = gu.K, e.F = dn.K;
    if (gu.K != e.D || gu.M != 2 * e.F || dn.K != e.F || dn.M != e.D)
      throw std::invalid_argument("offload fused experts: every expert needs gate_up [2F, D] and down [D, F]");
  }
  return e;
}

// Activations given as bf16 (act_bf16: a GPU plan's compute format) are widened into fp32 rows here and the result
// narrowed back (rounded to nearest even), once per call: the layer in between computes in fp32.
struct Bf16Rows {
  std::vector<float> in, out;
};
thread_local Bf16Rows tls_bf16;

const float* widened(int act_bf16, uintptr_t x, int64_t n, std::vector<float>& buf) {
  if (!act_bf16) return ptr<float>(x);
  buf.resize(size_t(n));
  bf16_rows_to_f32(ptr<uint16_t>(x), n, buf.data());
  return buf.data();
}

void experts(const FusedExperts& w, int path, int nthreads, int64_t N, uintptr_t x, uintptr_t ids, uintptr_t weights,
             uintptr_t out, int act_bf16) {
  if (path < P_SCALAR || path > P_AVX512 || N < 1)
    throw std::invalid_argument("offload fused experts: bad kernel path id or token count");
  const int64_t* id = ptr<int64_t>(ids);
  if (id == nullptr && w.router == nullptr)
    throw std::invalid_argument("offload fused experts: no router and no expert ids; pass the router's choice");
  for (int64_t j = 0; id != nullptr && j < N * w.top_k; ++j)
    if (id[j] < 0 || id[j] >= w.n_experts) throw std::invalid_argument("offload fused experts: expert id out of range");
  Bf16Rows& b = tls_bf16;
  const float* xf = widened(act_bf16, x, N * 2 * w.D, b.in);
  if (act_bf16) b.out.resize(size_t(N * w.D));
  float* of = act_bf16 ? b.out.data() : reinterpret_cast<float*>(out);
  ExpertsArgs a{};
  a.path = path, a.nthreads = nthreads < 1 ? 1 : nthreads;
  a.n_experts = w.n_experts, a.top_k = w.top_k, a.D = w.D, a.F = w.F;
  a.gate_up = &w.gate_up, a.down = &w.down, a.router = w.router, a.router_bias = w.router_bias;
  a.norm_topk = w.norm_topk, a.gate = w.gate;
  a.N = N, a.x = xf, a.ids = id, a.weights = ptr<float>(weights), a.out = of;
  experts_forward(a);
  if (act_bf16) f32_rows_to_bf16(of, N * w.D, reinterpret_cast<uint16_t*>(out));
}

void forward(const FusedWeights& w, int path, int nthreads, int64_t N, uintptr_t x, uintptr_t out, uintptr_t cos,
             uintptr_t sin, uintptr_t tokens, uintptr_t blocks, uintptr_t k_cache, uintptr_t v_cache, int act_bf16,
             int kv_bf16) {
  if (path < P_SCALAR || path > P_AVX512 || N < 1)
    throw std::invalid_argument("offload fused layer: bad kernel path id or token count");
  const int64_t D = w.qkv.w.K, out_width = w.moe ? 2 * D : D;
  Bf16Rows& b = tls_bf16;
  const float* xf = widened(act_bf16, x, N * D, b.in);
  if (act_bf16) b.out.resize(size_t(N * out_width));
  float* of = act_bf16 ? b.out.data() : reinterpret_cast<float*>(out);
  LayerArgs a{};
  a.path = path;
  a.nthreads = nthreads < 1 ? 1 : nthreads;
  a.shape = w.shape;
  a.attn_norm = w.attn_norm, a.mlp_norm = w.mlp_norm;
  a.qkv = w.qkv, a.o = w.o, a.gate_up = w.gate_up, a.down = w.down;
  a.q_norm = w.q_norm, a.k_norm = w.k_norm, a.qk_norm_all = w.qk_norm_all, a.shared_gate = w.shared_gate;
  a.moe = w.moe;
  a.post_attn_norm = w.post_attn_norm, a.post_mlp_norm = w.post_mlp_norm, a.act = w.act, a.sinks = w.sinks;
  a.N = N, a.x = xf, a.out = of;
  a.cos = ptr<float>(cos), a.sin = ptr<float>(sin), a.tokens = ptr<int64_t>(tokens), a.blocks = ptr<int64_t>(blocks);
  a.k_cache = reinterpret_cast<void*>(k_cache), a.v_cache = reinterpret_cast<void*>(v_cache), a.kv_bf16 = kv_bf16;
  a.act_bf16 = act_bf16;
  layer_forward(a);
  if (act_bf16) f32_rows_to_bf16(of, N * out_width, reinterpret_cast<uint16_t*>(out));
}

// A run of fused units called back to back (offload/kernels/layer.py FusedRun): built once, run every step, so a
// decode step crosses from Python once for all its units, not once per unit.
struct UnitRun {
  struct Unit {
    const FusedWeights* layer;    // a layer (attention part of a MoE layer included), or null
    const FusedExperts* experts;  // else a MoE layer's routed experts (or a split-off MLP)
    const float* norm;            // else the model's final norm's [D] weights (fp32 activations only)
    float eps;
    int64_t D;
    int64_t table;                // which of the step's tables it reads
    int local;                    // 1: it turns by the sliding layers' rope
    int wide;                     // 1: it hands over [N, 2D] to the experts after it
    uintptr_t k, v;
    int kv_bf16;
  };
  std::vector<Unit> units;
  int64_t n_tables = 0;
  std::vector<py::object> keep;  // the units' weights, alive while the run is
};

// units: (FusedWeights, table, local, wide, k_cache, v_cache, kv_bf16) for a layer, (FusedExperts,) for experts,
// (norm weights [D] fp32, eps, D) for the final norm.
UnitRun make_run(const py::list& units) {
  UnitRun r;
  for (const py::handle h : units) {
    const py::tuple t = h.cast<py::tuple>();
    r.keep.push_back(py::reinterpret_borrow<py::object>(t[0]));
    if (t.size() == 1) {
      r.units.push_back({nullptr, t[0].cast<const FusedExperts*>(), nullptr, 0.f, 0, 0, 0, 0, 0, 0, 0});
      continue;
    }
    if (t.size() == 3) {
      const int64_t D = t[2].cast<int64_t>();
      if (D < 1) throw std::invalid_argument("offload fused run: a norm's width must be >= 1");
      const float* w = ptr<float>(t[0].cast<uintptr_t>());
      r.units.push_back({nullptr, nullptr, w, t[1].cast<float>(), D, 0, 0, 0, 0, 0, 0});
      continue;
    }
    if (t.size() != 7)
      throw std::invalid_argument("offload fused run: a layer is (weights, table, local, wide, k, v, kv_bf16)");
    UnitRun::Unit u{t[0].cast<const FusedWeights*>(), nullptr, nullptr, 0.f, 0, t[1].cast<int64_t>(),
                    t[2].cast<int>(), t[3].cast<int>(), t[4].cast<uintptr_t>(), t[5].cast<uintptr_t>(),
                    t[6].cast<int>()};
    if (u.table < 0) throw std::invalid_argument("offload fused run: a table index must be >= 0");
    r.n_tables = std::max(r.n_tables, u.table + 1);
    r.units.push_back(u);
  }
  return r;
}

// Each unit in turn on x [N, D]: a layer writes narrow[j % 2] (or wide, where it hands over), the next reads it.
// tables: 6 pointers each (cos, sin, local cos, local sin, tokens, blocks); ends (0: none): each unit's end, in
// seconds after the call began.
void run_units(const UnitRun& r, int path, int nthreads, int64_t N, uintptr_t x, uintptr_t narrow0,
               uintptr_t narrow1, uintptr_t wide, const std::vector<uintptr_t>& tables, int act_bf16, uintptr_t ends) {
  if (int64_t(tables.size()) != 6 * r.n_tables)
    throw std::invalid_argument("offload fused run: pass 6 pointers for each of the run's step tables");
  double* end = reinterpret_cast<double*>(ends);
  const auto began = std::chrono::steady_clock::now();
  uintptr_t in = x;
  for (size_t j = 0; j < r.units.size(); ++j) {
    const UnitRun::Unit& u = r.units[j];
    const uintptr_t out = u.wide ? wide : (j % 2 ? narrow1 : narrow0);
    if (u.norm != nullptr) {
      if (act_bf16) throw std::invalid_argument("offload fused run: the final norm takes fp32 activations");
      rms_norm(ptr<float>(in), u.norm, N, u.D, u.eps, reinterpret_cast<float*>(out), nthreads < 1 ? 1 : nthreads);
    } else if (u.experts != nullptr) {
      experts(*u.experts, path, nthreads, N, in, 0, 0, out, act_bf16);
    } else {
      const uintptr_t* t = tables.data() + 6 * u.table;
      forward(*u.layer, path, nthreads, N, in, out, t[u.local ? 2 : 0], t[u.local ? 3 : 1], t[4], t[5], u.k, u.v,
              act_bf16, u.kv_bf16);
    }
    in = out;
    if (end != nullptr) end[j] = std::chrono::duration<double>(std::chrono::steady_clock::now() - began).count();
  }
}

void norm(uintptr_t x, uintptr_t w, int64_t N, int64_t D, float eps, uintptr_t y, int nthreads) {
  if (N < 1 || D < 1) throw std::invalid_argument("offload rms norm: the rows and their width must be >= 1");
  rms_norm(ptr<float>(x), ptr<float>(w), N, D, eps, reinterpret_cast<float*>(y), nthreads < 1 ? 1 : nthreads);
}

void cached_attention(const ShapeTuple& shape, int path, int nthreads,
                      int64_t N, uintptr_t qkv, uintptr_t att, uintptr_t cos, uintptr_t sin, uintptr_t tokens,
                      uintptr_t blocks, uintptr_t k_cache, uintptr_t v_cache, int kv_bf16, uintptr_t sinks) {
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
  a.blocks = ptr<int64_t>(blocks);
  a.k_cache = reinterpret_cast<void*>(k_cache);
  a.v_cache = reinterpret_cast<void*>(v_cache);
  a.kv_bf16 = kv_bf16;
  a.sinks = ptr<float>(sinks);
  attention_forward(a, reinterpret_cast<float*>(qkv), reinterpret_cast<float*>(att));
}

}  // namespace

void bind_layer(py::module_& m) {
  py::class_<FusedWeights>(m, "FusedWeights", "one decoder layer's packed weights, as raw pointers");
  m.def("fused_weights", &make_weights,
        "fused_weights((n_heads, n_kv_heads, head_dim, intermediate, eps, scale, softcap, window, rotary_dim), "
        "attn_norm, mlp_norm (0: none), [[(fmt, qs, d, bias, M, K), ...]] * 4 for qkv, o, gate_up, down: each linear "
        "one part, or the row blocks of a stacked linear; (q_norm, k_norm, shared_gate, moe, post_attn_norm, "
        "post_mlp_norm, act, qk_norm_all, sinks))");
  py::class_<FusedExperts>(m, "FusedExperts", "one MoE layer's routed experts' packed weights, as raw pointers");
  m.def("fused_experts", &make_experts,
        "fused_experts(top_k, [[(fmt, qs, d, bias, M, K), ...] per expert] for gate_up, the same for down, router "
        "[n_experts, D] fp32 or 0, router_bias [n_experts] fp32 or 0, norm_topk, (act, alpha, limit))");
  m.def("experts_forward", &experts, py::call_guard<py::gil_scoped_release>(),
        "experts_forward(experts, path, nthreads, N, x [N, 2D], ids [N, k] int64, weights [N, k] fp32, out [N, D], "
        "act_bf16): raw pointers (x and out fp32, or bf16 with act_bf16) (ids and weights 0: routed by the experts' router), see offload/kernels/layer.py");
  m.def("layer_forward", &forward, py::call_guard<py::gil_scoped_release>(),
        "layer_forward(weights, path, nthreads, N, x, out, cos, sin, tokens, blocks (0: none), k_cache, v_cache, act_bf16, "
        "kv_bf16): "
        "raw pointers (x, out fp32 or bf16 with act_bf16; the caches fp32 or bf16 with kv_bf16), see offload/kernels/layer.py");
  py::class_<UnitRun>(m, "UnitRun", "a run of fused units, called back to back");
  m.def("unit_run", &make_run, "unit_run([(FusedWeights, table, local, wide, k, v, kv_bf16), (FusedExperts,) or "
        "(norm weights, eps, D)])");
  m.def("run_units", &run_units, py::call_guard<py::gil_scoped_release>(),
        "run_units(run, path, nthreads, N, x, narrow0, narrow1, wide, [cos, sin, local cos, local sin, tokens, "
        "blocks] * tables, act_bf16, ends (fp64 [units] or 0: seconds since the call began)): raw pointers, see "
        "offload/kernels/layer.py");
  m.def("rms_norm", &norm, py::call_guard<py::gil_scoped_release>(),
        "rms_norm(x, w, N, D, eps, y, nthreads): y [N, D] = x * rsqrt(mean(x^2) + eps) * w, fp32 raw pointers");
  m.def("cached_attention", &cached_attention, py::call_guard<py::gil_scoped_release>(),
        "cached_attention((n_heads, n_kv_heads, head_dim, intermediate, eps, scale, softcap, window, rotary_dim), "
        "path, nthreads, N, qkv, att, cos, sin, "
        "tokens, blocks (0: none), k_cache, v_cache, kv_bf16, sinks): rope, KV store and attention of one layer (sinks [n_heads] fp32 "
        "or 0); raw pointers, see "
        "offload/kernels/layer.py");
}

}  // namespace offload
