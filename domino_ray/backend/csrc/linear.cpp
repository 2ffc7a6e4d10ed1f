// Linear layers at decode batch sizes on CPU: out [M, N] = x [M, K] @ weight[N, K]^T + bias, x and out fp32, the weight
// fp32 or bf16 (`model.dtype: bfloat16` on CPU: half the bytes streamed; each bf16 widens exactly to fp32 in registers
// and the arithmetic is the fp32 kernel's, so a row's outputs are the same whatever its batch in both).
//
// At the 1-128 rows a CPU engine decodes, the weights are read from memory once per call and the arithmetic is
// M times that; MKL's GEMM (packed or not) overlaps the two poorly up to ~32 rows (BENCHMARKS "Our layer ops and
// linear kernel"). Here the weight is packed once into panels of 16 output columns, `[ceil(N/16), K, 16]` (the last
// one zero-padded), and each thread takes groups of 3 panels (AVX-512; 1 on AVX2). A group's weights stream once
// from memory, with a software prefetch ahead of the loads, k-block by k-block (64 k): every chunk of up to 8 rows
// of x (transposed, so one step's broadcasts share a cache line) runs over the block while it is in L1, 8 rows x 3
// panels accumulating in 24 registers. Running each chunk over the whole group in turn instead left memory idle
// while the later chunks computed (16 rows: 29.5 ms a pass against 35.9, docs/benchmarks-log.md "The linear kernel's k-blocks").
//
// Every output is the same fp32 sum whatever M, the tile, or a row's place in the batch (a verify of W+1 positions
// computes each position as a one-row step would): fused multiply-add chains over blocks of 64 k in order, the
// blocks' sums added in order (a single chain over K = 1536 would lose accuracy), then + bias.

#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <ATen/Parallel.h>

#include "ops.h"
#include "vectors.h"

#include <algorithm>
#include <cstring>
#include <vector>

namespace {

constexpr int kPanel = 16;       // output columns per panel: one 16-float vector
constexpr int64_t kPrefetchBytes = 32 * kPanel * sizeof(float);  // ahead in a panel's stream (2 KB)
constexpr int64_t kBlock = 64;   // products summed in registers before joining an output's running sum
#ifdef __AVX512F__
using vec = v16;                 // a panel's row is one register
constexpr int kRows = 8;         // rows per tile: 8 x 3 accumulators of the 32 vector registers
constexpr int kPanels = 3;       // panels per group
#else  // AVX2: a panel's row is two of the 16 registers. GCC keeps a 16-float vector it cannot hold in one register in
       // memory, not in two: the accumulators went through the stack (4-11x slower, docs/benchmarks-log.md "The AVX2 build")
using vec = v8;
constexpr int kRows = 6;         // 6 x 2 accumulators, 2 for the weights, 1 for x
constexpr int kPanels = 1;
#endif
inline vec load(const float* p) { vec x; __builtin_memcpy(&x, p, sizeof x); return x; }
inline void store(float* p, vec x) { __builtin_memcpy(p, &x, sizeof x); }
constexpr int kLanes = sizeof(vec) / sizeof(float);
constexpr int kVecs = kPanel / kLanes;  // registers per panel row
// A panel's row of 16 weights as fp32 vectors: `float` panels as they are; bf16 panels (`uint16_t` bits) widened. On
// AVX2 a bf16 row is packed in pairs, the 32-bit lane j holding columns j (low half) and j + 8 (high half), so one load
// and two bit operations give both registers.
inline void load_row(const float* p, vec (&w)[kVecs]) {
  for (int v = 0; v < kVecs; ++v) w[v] = load(p + v * kLanes);
}
inline void load_row(const uint16_t* p, vec (&w)[kVecs]) {
#ifdef __AVX512F__
  w[0] = widen16(p);
#else
  u32x8 bits;
  __builtin_memcpy(&bits, p, sizeof bits);
  const u32x8 low = bits << 16, high = bits & 0xFFFF0000u;
  __builtin_memcpy(&w[0], &low, sizeof low);
  __builtin_memcpy(&w[1], &high, sizeof high);
#endif
}
// Where column j of a packed panel row sits (see `load_row`).
template <typename W>
constexpr int64_t panel_slot(int64_t j) {
#ifndef __AVX512F__
  if constexpr (sizeof(W) == 2) return j < 8 ? 2 * j : 2 * (j - 8) + 1;
#endif
  return j;
}

// sum[P][M][16] += the products of k in [start, stop) for `M` rows of xt [K, M] against `P` consecutive panels.
template <int M, int P, typename W>
inline void block(const float* xt, const W* panels, int64_t k, int64_t start, int64_t stop, float* sum,
                  bool prefetch) {
  vec acc[P][kVecs][M];
  for (int p = 0; p < P; ++p)
    for (int v = 0; v < kVecs; ++v)
      for (int m = 0; m < M; ++m) acc[p][v][m] = vec{};
  for (int64_t i = start; i < stop; ++i) {
    vec w[P][kVecs];
    for (int p = 0; p < P; ++p) {
      const W* panel = panels + p * k * kPanel + i * kPanel;
      load_row(panel, w[p]);
      if (prefetch) __builtin_prefetch(reinterpret_cast<const char*>(panel) + kPrefetchBytes);
    }
#pragma GCC unroll 16
    for (int m = 0; m < M; ++m) {
      const float x = xt[i * M + m];
      for (int p = 0; p < P; ++p)
        for (int v = 0; v < kVecs; ++v) acc[p][v][m] += w[p][v] * x;
    }
  }
  for (int p = 0; p < P; ++p)
    for (int m = 0; m < M; ++m)
      for (int v = 0; v < kVecs; ++v) {
        float* s = sum + (p * M + m) * kPanel + v * kLanes;
        store(s, load(s) + acc[p][v][m]);
      }
}

// `block<rows, P>` for a run-time `rows` in 1..M.
template <int M, int P, typename W>
inline void block_rows(int rows, const float* xt, const W* panels, int64_t k, int64_t start, int64_t stop,
                       float* sum, bool prefetch) {
  if constexpr (M > 0) {
    if (rows == M) return block<M, P, W>(xt, panels, k, start, stop, sum, prefetch);
    return block_rows<M - 1, P, W>(rows, xt, panels, k, start, stop, sum, prefetch);
  }
}

// out[0..m, 0..cols) (+ bias) against `P` consecutive panels, for the m rows of xt in chunks of `chunk`; `sum` holds
// m x P x 16 floats.
template <int P, typename W>
void group(int64_t m, int chunk, const float* xt, const W* panels, int64_t k, const float* bias, float* out,
           int64_t ldo, int64_t cols, float* sum) {
  std::fill(sum, sum + m * P * kPanel, 0.0f);
  for (int64_t start = 0; start < k; start += kBlock) {
    const int64_t stop = std::min<int64_t>(start + kBlock, k);
    for (int64_t r = 0; r < m; r += chunk) {  // the first chunk brings the block in; the others find it in L1
      const int rows = static_cast<int>(std::min<int64_t>(chunk, m - r));
      block_rows<kRows, P, W>(rows, xt + r * k, panels, k, start, stop, sum + r * P * kPanel, r == 0);
    }
  }
  for (int64_t r = 0; r < m; r += chunk) {
    const int rows = static_cast<int>(std::min<int64_t>(chunk, m - r));
    const float* s = sum + r * P * kPanel;
    for (int p = 0; p < P; ++p) {
      const int64_t c = std::min<int64_t>(kPanel, cols - p * kPanel);
      float b[kPanel] = {};
      if (bias) std::memcpy(b, bias + p * kPanel, c * sizeof(float));
      for (int j = 0; j < rows; ++j) {
        float tail[kPanel];
        float* o = out + (r + j) * ldo + p * kPanel;
        float* to = c == kPanel ? o : tail;  // a last panel's columns past N stay out of `out`
        for (int v = 0; v < kVecs; ++v)
          store(to + v * kLanes, load(s + (p * rows + j) * kPanel + v * kLanes) + load(b + v * kLanes));
        if (to == tail) std::memcpy(o, tail, c * sizeof(float));
      }
    }
  }
}

}  // namespace

namespace domino_ray {

namespace {

// The panels of an [N, K] weight of element `W` (fp32, or bf16 as its bits).
template <typename W>
void pack(const W* src, W* dst, int64_t n, int64_t k, int64_t panels) {
  at::parallel_for(0, panels, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t p = lo; p < hi; ++p)
      for (int64_t j = 0; j < kPanel && p * kPanel + j < n; ++j)
        for (int64_t i = 0; i < k; ++i) dst[(p * k + i) * kPanel + panel_slot<W>(j)] = src[(p * kPanel + j) * k + i];
  });
}

// out [m, n] = the m rows of xt (transposed chunk by chunk) against the panels, + bias.
template <typename W>
void run(int64_t m, int chunk, const float* xt, const W* wp, int64_t k, int64_t n, int64_t panels, const float* bp,
         float* op) {
  const int64_t groups = (panels + kPanels - 1) / kPanels;
  at::parallel_for(0, groups, 1, [&](int64_t lo, int64_t hi) {
    std::vector<float> sum(m * kPanels * kPanel);
    for (int64_t g = lo; g < hi; ++g) {
      const int64_t p = g * kPanels, group_panels = std::min<int64_t>(kPanels, panels - p), col = p * kPanel;
      const int64_t cols = std::min<int64_t>(group_panels * kPanel, n - col);
      const W* panel = wp + p * k * kPanel;
      const float* b = bp ? bp + col : nullptr;
      if (group_panels == kPanels) {
        group<kPanels, W>(m, chunk, xt, panel, k, b, op + col, n, cols, sum.data());
      } else {  // the last panels, one at a time
        for (int64_t q = 0; q < group_panels; ++q)
          group<1, W>(m, chunk, xt, panel + q * k * kPanel, k, b ? b + q * kPanel : nullptr, op + col + q * kPanel,
                      n, std::min<int64_t>(kPanel, cols - q * kPanel), sum.data());
      }
    }
  });
}

}  // namespace

at::Tensor pack_linear(const at::Tensor& weight) {
  const bool bf16 = weight.scalar_type() == at::kBFloat16;
  TORCH_CHECK(weight.device().is_cpu() && (bf16 || weight.scalar_type() == at::kFloat) && weight.dim() == 2,
              "pack_linear: an fp32 or bf16 CPU weight [N, K]");
  const int64_t n = weight.size(0), k = weight.size(1), panels = (n + kPanel - 1) / kPanel;
  const auto w = weight.contiguous();
  auto out = at::zeros({panels, k, kPanel}, w.options());
  if (bf16)
    pack(bf16_bits(w), bf16_bits(out), n, k, panels);
  else
    pack(w.data_ptr<float>(), out.data_ptr<float>(), n, k, panels);
  return out;
}

at::Tensor linear(const at::Tensor& input, const at::Tensor& packed, int64_t n, const c10::optional<at::Tensor>& bias) {
  const bool bf16 = packed.scalar_type() == at::kBFloat16;
  TORCH_CHECK(input.device().is_cpu() && input.scalar_type() == at::kFloat &&
              (bf16 || packed.scalar_type() == at::kFloat), "linear: fp32 CPU input, fp32 or bf16 packed weight");
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
  const float* xp = x.data_ptr<float>();
  const float* bp = has_bias ? bias->data_ptr<float>() : nullptr;
  float* op = out.data_ptr<float>();
  const int chunks = static_cast<int>((m + kRows - 1) / kRows);
  const int chunk = static_cast<int>((m + chunks - 1) / chunks);  // balanced: 9 rows are 5 + 4, not 8 + 1
  // x transposed chunk by chunk: rows [r, r + rows) as [K, rows]
  std::vector<float> xt(m * k);
  for (int64_t r = 0; r < m; r += chunk) {
    const int rows = static_cast<int>(std::min<int64_t>(chunk, m - r));
    float* t = xt.data() + r * k;
    for (int j = 0; j < rows; ++j) {
      const float* row = xp + (r + j) * k;
      for (int64_t i = 0; i < k; ++i) t[i * rows + j] = row[i];
    }
  }
  if (bf16)
    run(m, chunk, xt.data(), bf16_bits(packed), k, n, panels, bp, op);
  else
    run(m, chunk, xt.data(), packed.data_ptr<float>(), k, n, panels, bp, op);
  return out;
}

}  // namespace domino_ray
