// Linear layers at decode batch sizes on CPU, fp32: out [M, N] = x [M, K] @ weight[N, K]^T + bias.
//
// At the 1-128 rows a CPU engine decodes, the weights are read from memory once per call and the arithmetic is
// M times that; MKL's GEMM (packed or not) overlaps the two poorly up to ~32 rows (BENCHMARKS "Our layer ops and
// linear kernel"). Here the weight is packed once into panels of 16 output columns, `[ceil(N/16), K, 16]` (the last
// one zero-padded), streamed once per call with a software prefetch ahead of the loads, while up to 16 rows of x
// (transposed, so one step's broadcasts share a cache line) accumulate in registers: 16 accumulators x 16 floats.
// From 24 rows two panels share each broadcast (12 rows x 2 panels), which keeps the FMA units busier.
//
// Every output is the same fp32 sum whatever M, the tile, or a row's place in the batch (a verify of W+1 positions
// computes each position as a one-row step would): fused multiply-add chains over blocks of 64 k in order, the
// blocks' sums added in order (a single chain over K = 1536 would lose accuracy), then + bias.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "vectors.h"

#include <algorithm>
#include <cstring>
#include <vector>

namespace {

constexpr int kPanel = 16;       // output columns per panel: one 16-float vector
constexpr int64_t kPrefetch = 128 * kPanel;  // floats ahead in a panel's stream (8 KB)
constexpr int64_t kBlock = 64;   // products summed in registers before joining an output's running sum
#ifdef __AVX512F__
constexpr int kRows = 16;        // rows per one-panel tile: 16 accumulators of the 32 vector registers
constexpr int kPairRows = 12;    // rows per two-panel tile: 24 accumulators
constexpr int64_t kPairFrom = 24;  // rows from which two-panel tiles run
#else  // AVX2: a 16-float vector is two of the 16 registers
constexpr int kRows = 6;
constexpr int kPairRows = 3;
constexpr int64_t kPairFrom = 1 << 30;  // never: too few registers to gain
#endif

// out[m, 0..cols) (+ bias) for `M` rows of xt [K, M] against `P` consecutive panels.
template <int M, int P>
inline void tile(const float* xt, const float* panels, int64_t k, const float* bias, float* out, int64_t ldo,
                 int64_t cols) {
  alignas(64) float sum[P][M][kPanel] = {};  // the blocks' sums, in L1: the registers hold the block being summed
  for (int64_t start = 0; start < k; start += kBlock) {
    const int64_t stop = std::min<int64_t>(start + kBlock, k);
    v16 acc[P][M];
    for (int p = 0; p < P; ++p)
      for (int m = 0; m < M; ++m) acc[p][m] = v16{};
    for (int64_t i = start; i < stop; ++i) {
      v16 w[P];
      for (int p = 0; p < P; ++p) {
        const float* panel = panels + p * k * kPanel + i * kPanel;
        w[p] = load16(panel);
        __builtin_prefetch(panel + kPrefetch);
      }
#pragma GCC unroll 16
      for (int m = 0; m < M; ++m) {
        const float x = xt[i * M + m];
        for (int p = 0; p < P; ++p) acc[p][m] += w[p] * x;
      }
    }
    for (int p = 0; p < P; ++p)
      for (int m = 0; m < M; ++m) store16(sum[p][m], load16(sum[p][m]) + acc[p][m]);
  }
  for (int p = 0; p < P; ++p) {
    const int64_t c = std::min<int64_t>(kPanel, cols - p * kPanel);
    float b[kPanel] = {};
    if (bias) std::memcpy(b, bias + p * kPanel, c * sizeof(float));
    for (int m = 0; m < M; ++m) {
      const v16 r = load16(sum[p][m]) + load16(b);
      if (c == kPanel) {
        store16(out + m * ldo + p * kPanel, r);
      } else {
        float tail[kPanel];
        store16(tail, r);
        std::memcpy(out + m * ldo + p * kPanel, tail, c * sizeof(float));
      }
    }
  }
}

// `tile<rows, P>` for a run-time `rows` in 1..M.
template <int M, int P>
inline void tile_rows(int rows, const float* xt, const float* panels, int64_t k, const float* bias, float* out,
                      int64_t ldo, int64_t cols) {
  if constexpr (M > 0) {
    if (rows == M) return tile<M, P>(xt, panels, k, bias, out, ldo, cols);
    return tile_rows<M - 1, P>(rows, xt, panels, k, bias, out, ldo, cols);
  }
}

at::Tensor pack_linear(const at::Tensor& weight) {
  TORCH_CHECK(weight.device().is_cpu() && weight.scalar_type() == at::kFloat && weight.dim() == 2,
              "pack_linear: an fp32 CPU weight [N, K]");
  const int64_t n = weight.size(0), k = weight.size(1), panels = (n + kPanel - 1) / kPanel;
  const auto w = weight.contiguous();
  auto out = at::zeros({panels, k, kPanel}, w.options());
  const float* src = w.data_ptr<float>();
  float* dst = out.data_ptr<float>();
  at::parallel_for(0, panels, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t p = lo; p < hi; ++p)
      for (int64_t j = 0; j < kPanel && p * kPanel + j < n; ++j)
        for (int64_t i = 0; i < k; ++i) dst[(p * k + i) * kPanel + j] = src[(p * kPanel + j) * k + i];
  });
  return out;
}

at::Tensor linear(const at::Tensor& input, const at::Tensor& packed, int64_t n, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(input.device().is_cpu() && input.scalar_type() == at::kFloat && packed.scalar_type() == at::kFloat,
              "linear: fp32 CPU tensors only");
  const int64_t k = input.size(-1);
  TORCH_CHECK(packed.dim() == 3 && packed.size(1) == k && packed.size(2) == kPanel && packed.is_contiguous() &&
              packed.size(0) == (n + kPanel - 1) / kPanel, "linear: packed weight [ceil(N/16), K, 16] (pack_linear)");
  const bool has_bias = bias.has_value() && bias->defined();
  TORCH_CHECK(!has_bias || (bias->scalar_type() == at::kFloat && bias->numel() == n && bias->is_contiguous()),
              "linear: bias [N] fp32");
  const auto x = input.contiguous();
  const int64_t m = k ? x.numel() / k : 0, panels = packed.size(0);
  auto sizes = x.sizes().vec();
  sizes.back() = n;
  auto out = at::empty(sizes, x.options());
  if (m == 0) return out;
  const float *xp = x.data_ptr<float>(), *wp = packed.data_ptr<float>();
  const float* bp = has_bias ? bias->data_ptr<float>() : nullptr;
  float* op = out.data_ptr<float>();
  const bool pairs = m >= kPairFrom && panels % 2 == 0;
  const int chunk = pairs ? kPairRows : kRows;
  // x transposed chunk by chunk: rows [r, r + rows) as [K, rows]
  std::vector<float> xt(m * k);
  for (int64_t r = 0; r < m; r += chunk) {
    const int rows = static_cast<int>(std::min<int64_t>(chunk, m - r));
    float* t = xt.data() + r * k;
    for (int64_t i = 0; i < k; ++i)
      for (int j = 0; j < rows; ++j) t[i * rows + j] = xp[(r + j) * k + i];
  }
  const int step = pairs ? 2 : 1;  // panels per tile
  at::parallel_for(0, panels / step, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t t = lo; t < hi; ++t) {
      const int64_t p = t * step, col = p * kPanel, cols = std::min<int64_t>(step * kPanel, n - col);
      const float* panel = wp + p * k * kPanel;
      const float* b = bp ? bp + col : nullptr;
      for (int64_t r = 0; r < m; r += chunk) {
        const int rows = static_cast<int>(std::min<int64_t>(chunk, m - r));
        if (pairs)
          tile_rows<kPairRows, 2>(rows, xt.data() + r * k, panel, k, b, op + r * n + col, n, cols);
        else
          tile_rows<kRows, 1>(rows, xt.data() + r * k, panel, k, b, op + r * n + col, n, cols);
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(domino_ray, m) {
  m.def("pack_linear(Tensor weight) -> Tensor");
  m.def("linear(Tensor x, Tensor packed, int n, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(domino_ray, CPU, m) {
  m.impl("pack_linear", &pack_linear);
  m.impl("linear", &linear);
}
