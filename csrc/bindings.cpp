// Python bindings of offload.kernels._C: dispatch by path, threading (OpenMP), GIL release.
// Arguments are raw data pointers: the Python face (offload/kernels) validates dtypes and shapes.
#include <omp.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "kernels.h"
#include "tasks.h"
#include "layer.h"

namespace py = pybind11;
using namespace offload;

namespace {

struct KernelTable {
  QuantXFn quantize_x;
  QuantX16Fn quantize_x16;
  QuantXKFn quantize_xk;
  QGemmFn q8_0, q4_0;
  FGemmFn bf16, f16, f32;
  QGemmFn gguf[kFormatIds];  // the GGUF block formats' (kernels.h OFFLOAD_GGUF_FORMATS), by format id
};

// The kernels of a path. The AVX-512 path reuses AVX2 code where 512-bit/VNNI brings nothing.
KernelTable table_of(int path) {
  KernelTable t{};
  if (path == P_SCALAR)
    t = {quantize_x_ref, quantize_x16_ref, quantize_xk_ref, gemm_q8_0_ref, gemm_q4_0_ref, gemm_bf16_ref, gemm_f16_ref,
         gemm_f32_ref, {}};
  else
    t = {quantize_x_avx2, quantize_x16_avx2, quantize_xk_avx2, path == P_AVX2 ? gemm_q8_0_avx2 : gemm_q8_0_avx512,
         path == P_AVX2 ? gemm_q4_0_avx2 : gemm_q4_0_avx512, gemm_bf16_avx2, gemm_f16_avx2,
         path == P_AVX2 ? gemm_f32_avx2 : gemm_f32_avx512, {}};
#define OFFLOAD_FILL(name_, NAME_, id_, weights_, bytes_, Dec_, Row_) \
  t.gguf[id_] = path == P_SCALAR ? gemm_##name_##_ref : path == P_AVX2 ? gemm_##name_##_avx2 : gemm_##name_##_avx512;
  OFFLOAD_GGUF_FORMATS(OFFLOAD_FILL)
#undef OFFLOAD_FILL
  return t;
}
// Indexed by Path.
const KernelTable kTables[3] = {table_of(P_SCALAR), table_of(P_AVX2), table_of(P_AVX512)};

QGemmFn qgemm_of(const KernelTable& t, int fmt) {
  if (fmt == W_Q8_0) return t.q8_0;
  if (fmt == W_Q4_0) return t.q4_0;
  return t.gguf[fmt];
}

std::vector<std::string> cpu_features() {
  __builtin_cpu_init();
  std::vector<std::string> out;
#define OFFLOAD_FEATURE(name) if (__builtin_cpu_supports(name)) out.emplace_back(name);
  OFFLOAD_FEATURE("sse4.2") OFFLOAD_FEATURE("avx") OFFLOAD_FEATURE("avx2") OFFLOAD_FEATURE("fma")
  OFFLOAD_FEATURE("f16c") OFFLOAD_FEATURE("avx512f") OFFLOAD_FEATURE("avx512bw") OFFLOAD_FEATURE("avx512vl")
  OFFLOAD_FEATURE("avx512vnni") OFFLOAD_FEATURE("avx512bf16")
#undef OFFLOAD_FEATURE
  return out;
}

// Rows are handed out in chunks of whole 4-row tiles, dynamically: a thread that the OS preempts
// (other work on the cores) does not hold the others back. Each row is still computed whole by one
// thread, so results do not depend on the thread count. A chunk is whole 16-row tiles (the AVX-512 q4_0 and q8_0
// matrix-matrix tiles), so which rows those tiles take does not depend on it either.
struct RowChunks {
  int64_t M, rows, n;
  RowChunks(int64_t m, int nth) : M(m) {
    const int64_t tiles = (m + 3) / 4;
    const int64_t per = std::max<int64_t>(4, (tiles / (int64_t(nth) * 8) + 2) / 4 * 4);  // a multiple of 4 tiles
    rows = per * 4;
    n = (m + rows - 1) / rows;
  }
  int64_t r0(int64_t c) const { return c * rows; }
  int64_t r1(int64_t c) const { return std::min(M, (c + 1) * rows); }
};

struct Scratch {  // per calling thread, grown on demand: quantized activations
  LineVector<int16_t> qs;  // int16 for takes_x16 formats, int8 (first half of the bytes) for the others
  Floats d, s, xf;
  LineVector<int16_t> s16;
  LineVector<int32_t> c8;
  LineVector<uint16_t> xh;
};
constexpr int64_t kPadBytes = 64;  // activation rows copied for the wide tiles start a cache line past a power of two
thread_local Scratch tls;

// One row of activations quantized as fmt's kernels read them (see XQ); for q4_0 also c8 (when not null).
void quantize_row(const KernelTable& t, int fmt, const void* x, int xtype, int64_t K, int16_t* q16, float* d,
                  float* s, int16_t* s16, int32_t* c8) {
  int8_t* qs = reinterpret_cast<int8_t*>(q16);
  if (takes_x16(fmt)) t.quantize_x16(x, xtype, K, q16, d, s);
  else if (is_gguf(fmt)) t.quantize_xk(x, xtype, K, qs, d, s, s16);
  else t.quantize_x(x, xtype, K, qs, d, s);
  if (c8)  // s = d * sum(q), |sum(q)| <= 32 * 127: the quotient rounds back to the integer sum
    for (int64_t b = 0; b < K / QK; ++b) c8[b] = d[b] > 0.f ? -8 * int32_t(std::nearbyint(s[b] / d[b])) : 0;
}

// Tokens per block of a matrix-matrix product: each block's activations stay in the caches while every row tile
// reads them (256 x K = 2048 int8 activations are 512 KiB).
constexpr int64_t kTokenBlock = 256;
int64_t token_blocks(int64_t N) { return (N + kTokenBlock - 1) / kTokenBlock; }

// Tokens n0 .. n0 + kTokenBlock (or to the end) of quantized activations.
XQ token_block(const XQ& x, bool x16, int64_t n0) {
  if (n0 == 0 && x.N <= kTokenBlock) return x;
  const int64_t nb = x.K / QK;
  XQ b = x;
  b.qs = x.qs + n0 * x.stride() * (x16 ? 2 : 1);
  b.d = x.d + n0 * nb, b.s = x.s + n0 * nb;
  if (x.s16) b.s16 = x.s16 + n0 * (x.K / 16);
  if (x.c8) b.c8 = x.c8 + n0 * nb;
  b.N = std::min(kTokenBlock, x.N - n0);
  return b;
}

void linear_q(const KernelTable& t, int fmt, const void* x, int xtype, int64_t N, const WView& w,
              const float* bias, float* y, int nth) {
  const int64_t K = w.K, nb = K / QK;
  // activation rows kPadBytes apart, past a power of two (the 16-row tiles read 8-16 rows at once)
  const bool padded = N > 1;
  const int64_t q_row = (takes_x16(fmt) ? K : K / 2) + (padded ? kPadBytes / 2 : 0);  // in int16 units
  tls.qs.resize(size_t(N * q_row));
  tls.d.resize(size_t(N * nb));
  tls.s.resize(size_t(N * nb));
  tls.s16.resize(size_t(N * (K / 16)));
  const bool with_c8 = fmt == W_Q4_0 && N > 1;  // the 16-row q4_0 tiles' offset sums
  tls.c8.resize(with_c8 ? size_t(N * nb) : 0);
  int16_t* q16 = tls.qs.data(); float* d = tls.d.data(); float* s = tls.s.data(); int16_t* s16 = tls.s16.data();
  int32_t* c8 = with_c8 ? tls.c8.data() : nullptr;
  const int64_t xbytes = xtype == X_BF16 ? 2 : 4;
  XQ xq{reinterpret_cast<int8_t*>(q16), d, s, N, K, s16};
  xq.c8 = c8;
  xq.ld = padded ? (takes_x16(fmt) ? q_row : 2 * q_row) : 0;
  const QGemmFn fn = qgemm_of(t, fmt);
  if (N == 1) quantize_row(t, fmt, x, xtype, K, q16, d, s, s16, nullptr);  // tiny: no barrier needed before the rows
  const RowChunks chunks(w.M, nth);
  auto quantize = [&](int64_t n) {
    quantize_row(t, fmt, static_cast<const char*>(x) + n * K * xbytes, xtype, K, q16 + n * q_row, d + n * nb,
                 s + n * nb, s16 + n * (K / 16), c8 ? c8 + n * nb : nullptr);
  };
  // work items: (block of tokens, chunk of rows), blocks first, so that the threads share one block's
  // activations (a 16-row tile reads all of its tokens' for every tile: 2048 tokens ran 0.4-0.9x of 512)
  const int64_t items = token_blocks(N) * chunks.n;
  auto item = [&](int64_t i) {
    const int64_t n0 = i / chunks.n * kTokenBlock, c = i % chunks.n;
    fn(w, token_block(xq, takes_x16(fmt), n0), y + n0 * w.M, bias, chunks.r0(c), chunks.r1(c));
  };
  if (nth == 1) {  // no OpenMP region at all (tasks.h): an expert's matmuls run on their own thread
    for (int64_t n = 0; N > 1 && n < N; ++n) quantize(n);
    for (int64_t i = 0; i < items; ++i) item(i);
    return;
  }
#pragma omp parallel num_threads(nth)
  {
    if (N > 1) {
#pragma omp for schedule(dynamic, 1)
      for (int64_t n = 0; n < N; ++n) quantize(n);
    }
#pragma omp for schedule(dynamic, 1) nowait
    for (int64_t i = 0; i < items; ++i) item(i);
  }
}

// Whether bf16 x bf16 products take the AVX-512 BF16 tiles: at any token count. They read the weights in their row
// order as one stream per row, so a matrix-vector product reaches the memory's rate (a 9216 x 2048 product at 1 and
// 2 tokens ran 1.3-1.8x the fp32-widening kernel on a Zen 4), where the tiles that regrouped 16 rows per call had
// been left to 4 tokens and more.
bool use_bf16_tiles(int path, int fmt, int xtype, int64_t K) {
  static const bool has_bf16 = __builtin_cpu_supports("avx512bf16");
  return path == P_AVX512 && has_bf16 && fmt == W_BF16 && xtype == X_BF16 && K % QK == 0;
}

void linear_half(const KernelTable& t, int fmt, const void* x, int xtype, int64_t N, const WView& w,
                 const float* bias, float* y, int nth, int path) {
  if (use_bf16_tiles(path, fmt, xtype, w.K)) {
    // copied with rows kPadBytes apart: rows a power of two apart would share L1 sets, and a tile reads 6 at once
    const int64_t ldx = w.K + kPadBytes / 2;
    tls.xh.resize(size_t(N * ldx));
    for (int64_t n = 0; n < N; ++n)
      std::memcpy(tls.xh.data() + n * ldx, static_cast<const uint16_t*>(x) + n * w.K, size_t(w.K) * 2);
    const uint16_t* xh = tls.xh.data();  // this thread's buffer: the others' tls is their own
    const RowChunks chunks(w.M, nth);
    run_tasks(nth, true, token_blocks(N) * chunks.n, [&](int64_t i) {  // as in linear_q
      const int64_t n0 = i / chunks.n * kTokenBlock, c = i % chunks.n;
      gemm_bf16_bf16x_avx512(w, xh + n0 * ldx, ldx, std::min(kTokenBlock, N - n0), y + n0 * w.M, bias,
                             chunks.r0(c), chunks.r1(c));
    });
    return;
  }
  const float* xf = static_cast<const float*>(x);
  if (xtype == X_BF16) {
    tls.xf.resize(size_t(N * w.K));
    const uint16_t* xh = static_cast<const uint16_t*>(x);
    for (int64_t i = 0; i < N * w.K; ++i) tls.xf[size_t(i)] = bf16_to_f32(xh[i]);
    xf = tls.xf.data();
  }
  const FGemmFn fn = fmt == W_BF16 ? t.bf16 : fmt == W_F16 ? t.f16 : t.f32;
  const RowChunks chunks(w.M, nth);
  run_tasks(nth, true, chunks.n, [&](int64_t c) { fn(w, xf, N, y, bias, chunks.r0(c), chunks.r1(c)); });
}

void packed_linear_x(int path, const void* x, int xtype, int64_t N, int fmt, const WView& w, const float* bias,
                     float* y, int nthreads) {
  const int nth = nthreads < 1 ? 1 : nthreads;
  if (is_float(fmt)) linear_half(kTables[path], fmt, x, xtype, N, w, bias, y, nth, path);
  else linear_q(kTables[path], fmt, x, xtype, N, w, bias, y, nth);
}

// y [N, M] fp32 = x [N, K] (fp32 or bf16) @ W[M, K]^T + bias.
void linear(int path, uintptr_t x, int xtype, int64_t N, int64_t K, int fmt_id, uintptr_t wq, uintptr_t wd,
            int64_t M, uintptr_t bias, uintptr_t y, int nthreads) {
  int fmt;
  bool tiled;
  if (path < 0 || path > 2 || !parse_fmt_id(fmt_id, fmt, tiled) || xtype < 0 || xtype > 1)
    throw std::invalid_argument("offload kernels: bad path, format or activation type id");
  if (N < 1 || M < 1 || K < 1 || !k_fits(fmt, K))
    throw std::invalid_argument("offload kernels: bad shape (quantized formats need K a multiple of their block)");
  const WView w{reinterpret_cast<const uint8_t*>(wq), reinterpret_cast<const uint16_t*>(wd), M, K, tiled};
  packed_linear_x(path, reinterpret_cast<const void*>(x), xtype, N, fmt, w, reinterpret_cast<const float*>(bias),
                  reinterpret_cast<float*>(y), nthreads);
}

// Quantize fp32 rows [M, K] into split-layout quants and fp16 scales (GGUF rounding).
void quantize_weights(int fmt, uintptr_t src, int64_t M, int64_t K, uintptr_t qs, uintptr_t d, int nthreads) {
  if ((fmt != W_Q8_0 && fmt != W_Q4_0) || K % QK != 0 || M < 1)
    throw std::invalid_argument("offload kernels: quantize_weights needs q8_0/q4_0 and K % 32 == 0");
  const auto fn = fmt == W_Q8_0 ? quantize_w_q8_0_rows : quantize_w_q4_0_rows;
#pragma omp parallel for schedule(static, 16) num_threads(nthreads < 1 ? 1 : nthreads)
  for (int64_t r = 0; r < M; ++r)
    fn(reinterpret_cast<const float*>(src), r, r + 1, K, reinterpret_cast<uint8_t*>(qs), reinterpret_cast<uint16_t*>(d));
}

// Reads n bytes once (split across threads): the memory-bandwidth probe of the benchmarks.
uint64_t read_bytes(uintptr_t p, int64_t n, int nthreads) {
  const bool simd = __builtin_cpu_supports("avx2");
  uint64_t total = 0;
#pragma omp parallel num_threads(nthreads < 1 ? 1 : nthreads) reduction(+ : total)
  {
    const int tid = omp_get_thread_num(), nth = omp_get_num_threads();
    const int64_t a = n * tid / nth, b = n * (tid + 1) / nth;
    const uint8_t* base = reinterpret_cast<const uint8_t*>(p);
    if (simd) total += read_bytes_avx2(base + a, b - a);
    else for (int64_t i = a; i < b; ++i) total += base[i];
  }
  return total;
}

}  // namespace

namespace offload {
void bind_layer(py::module_& m);  // layer_bindings.cpp
double peak_flops(const std::string& kind, int64_t iterations, int nthreads);  // peak.cpp

void packed_linear(int path, const float* x, int64_t N, int fmt, const WView& w, const float* bias, float* y,
                   int nthreads) {
  packed_linear_x(path, x, X_F32, N, fmt, w, bias, y, nthreads);
}

void packed_linear_bf16(int path, const uint16_t* x, int64_t N, int fmt, const WView& w, const float* bias, float* y,
                        int nthreads) {
  packed_linear_x(path, x, X_BF16, N, fmt, w, bias, y, nthreads);
}
}  // namespace offload

PYBIND11_MODULE(_C, m) {
  m.doc() = "offload CPU kernels (see offload/kernels for the Python face)";
  m.def("cpu_features", &cpu_features, "CPU features relevant to kernel dispatch");
  m.def("linear", &linear, py::call_guard<py::gil_scoped_release>(),
        "linear(path, x, xtype, N, K, fmt, wq, wd, M, bias, y, nthreads): raw pointers, see offload.kernels");
  m.def("quantize_weights", &quantize_weights, py::call_guard<py::gil_scoped_release>());
  m.def("read_bytes", &read_bytes, py::call_guard<py::gil_scoped_release>());
  m.def("peak_flops", &peak_flops, py::call_guard<py::gil_scoped_release>(),
        "peak_flops(kind, iterations, nthreads): FLOP/s of vnni_u8, vnni_s16, avx2_u8, avx2_s16 or fma32 multiply-adds");
  m.def("fp16_to_f32", [](uint16_t h) { return fp16_to_f32(h); });
  m.def("f32_to_fp16", [](float f) { return f32_to_fp16(f); });
  bind_layer(m);
}
