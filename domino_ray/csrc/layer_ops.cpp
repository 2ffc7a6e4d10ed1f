// A decoder layer's elementwise passes on CPU, one op each instead of a chain of torch ops, fp32.
//
// At the rows a CPU engine decodes (16 rows x 576 features), HF's RMSNorm is eight dispatched ops over a few KB
// and the rotary embedding nine: per-op overhead, not arithmetic (BENCHMARKS "Our layer ops and linear kernel").
// The math is HF's, in HF's order per element: RMSNorm `weight * (x * rsqrt(mean(x^2) + eps))` with the mean in
// fp32, the rotary embedding `x * cos + rotate_half(x) * sin`; only the sum of squares' order differs (and the
// compiler may fuse a multiply-add): within fp32 rounding.
//
// rms_norm(x [..., C], weight [C], eps) -> [..., C] contiguous; x's last dim contiguous, other strides any
// rotary(x [b, q, H, D], cos [b, q, D], sin [b, q, D]) -> [b, q, H, D] contiguous; last dims contiguous, D % 16 == 0

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "vectors.h"

#include <cmath>

namespace {

constexpr int64_t kGrainElements = 1 << 15;  // below this much work a thread's start-up costs more than it saves

// The element offset of row `row` of `x` viewed as [rows, C] (row-major over x's leading dims, any strides).
inline int64_t row_offset(int64_t row, const at::Tensor& x) {
  int64_t offset = 0;
  for (int64_t d = x.dim() - 2; d >= 0; --d) {
    offset += (row % x.size(d)) * x.stride(d);
    row /= x.size(d);
  }
  return offset;
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat,
              "rms_norm: fp32 CPU tensors only");
  const int64_t c = x.size(-1);
  TORCH_CHECK(x.stride(-1) == 1 && weight.dim() == 1 && weight.size(0) == c && weight.is_contiguous(),
              "rms_norm: x's last dim must be contiguous and weight [C]");
  auto out = at::empty(x.sizes(), x.options());
  const int64_t rows = c ? x.numel() / c : 0;
  const float* src = x.data_ptr<float>();
  const float* w = weight.data_ptr<float>();
  float* dst = out.data_ptr<float>();
  const float eps_f = static_cast<float>(eps), inv_c = 1.0f / static_cast<float>(c);
  const int64_t c8 = c - c % 8;
  at::parallel_for(0, rows, std::max<int64_t>(1, kGrainElements / std::max<int64_t>(c, 1)), [&](int64_t lo, int64_t hi) {
    for (int64_t row = lo; row < hi; ++row) {
      const float* xr = src + row_offset(row, x);
      float* o = dst + row * c;
      v8 acc = splat(0.0f);
      for (int64_t i = 0; i < c8; i += 8) { const v8 v = load8(xr + i); acc += v * v; }
      float ss = lane_sum(acc);
      for (int64_t i = c8; i < c; ++i) ss += xr[i] * xr[i];
      const float scale = 1.0f / std::sqrt(ss * inv_c + eps_f);
      const v8 s = splat(scale);
      for (int64_t i = 0; i < c8; i += 8) store8(o + i, load8(w + i) * (load8(xr + i) * s));
      for (int64_t i = c8; i < c; ++i) o[i] = w[i] * (xr[i] * scale);
    }
  });
  return out;
}

at::Tensor rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && cos.scalar_type() == at::kFloat &&
              sin.scalar_type() == at::kFloat, "rotary: fp32 CPU tensors only");
  TORCH_CHECK(x.dim() == 4 && cos.dim() == 3 && sin.sizes() == cos.sizes() && cos.size(0) == x.size(0) &&
              cos.size(1) == x.size(1) && cos.size(2) == x.size(3), "rotary: x [b, q, H, D], cos/sin [b, q, D]");
  const int64_t b = x.size(0), q = x.size(1), heads = x.size(2), d = x.size(3), half = d / 2;
  TORCH_CHECK(d % 16 == 0 && x.stride(3) == 1 && cos.stride(2) == 1 && sin.stride(2) == 1,
              "rotary: D a multiple of 16, last dims contiguous");
  auto out = at::empty(x.sizes(), x.options());
  const float *src = x.data_ptr<float>(), *cs = cos.data_ptr<float>(), *sn = sin.data_ptr<float>();
  float* dst = out.data_ptr<float>();
  at::parallel_for(0, b * q, std::max<int64_t>(1, kGrainElements / (heads * d)), [&](int64_t lo, int64_t hi) {
    for (int64_t bq = lo; bq < hi; ++bq) {
      const int64_t i = bq / q, p = bq % q;
      const float* c = cs + i * cos.stride(0) + p * cos.stride(1);
      const float* s = sn + i * sin.stride(0) + p * sin.stride(1);
      for (int64_t h = 0; h < heads; ++h) {
        const float* xr = src + i * x.stride(0) + p * x.stride(1) + h * x.stride(2);
        float* o = dst + ((bq * heads) + h) * d;
        for (int64_t j = 0; j < half; j += 8) {  // rotate_half(x) = [-x[half:], x[:half]]
          const v8 first = load8(xr + j), second = load8(xr + half + j);
          store8(o + j, first * load8(c + j) + (-second) * load8(s + j));
          store8(o + half + j, second * load8(c + half + j) + first * load8(s + half + j));
        }
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(domino_ray, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("rotary(Tensor x, Tensor cos, Tensor sin) -> Tensor");
}

TORCH_LIBRARY_IMPL(domino_ray, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("rotary", &rotary);
}
