// A decoder layer's elementwise passes on CPU, one op each instead of a chain of torch ops, fp32.
//
// At the rows a CPU engine decodes (16 rows x 576 features), HF's RMSNorm is eight dispatched ops over a few KB
// and the rotary embedding nine: per-op overhead, not arithmetic (docs/benchmarks-log.md "Our layer ops and linear kernel").
// The math is HF's, in HF's order per element: RMSNorm `weight * (x * rsqrt(mean(x^2) + eps))` with the mean in
// fp32, the rotary embedding `x * cos + rotate_half(x) * sin`; only the sum of squares' order differs (and the
// compiler may fuse a multiply-add): within fp32 rounding.
//
// rms_norm(x [..., C], weight [C], eps) -> [..., C] contiguous; x's last dim contiguous, other strides any
// rotary(x [b, q, H, D], cos [b, q, D], sin [b, q, D]) -> [b, q, H, D] contiguous; last dims contiguous, D % 16 == 0
// kv_write(key_buffer, value_buffer, at [b*q*Hkv], keys [b, Hkv, q, D], values [b, Hkv, q, D]): key (i, h, p) to row
//   at[(i*q + p)*Hkv + h] of key_buffer seen as [rows, D] (contiguous buffers), the same for values. What
//   `index_copy_` of the transposed keys does, as one op: in a decode step that was 8 ops (two transposing copies),
//   and index_copy_'s call cost ~50 us cold after a linear layer's weights have streamed through the caches.

#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>

#include "ops.h"
#include "vectors.h"

#include <cmath>
#include <cstring>

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

}  // namespace

namespace domino_ray {

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

void kv_write(at::Tensor key_buffer, at::Tensor value_buffer, const at::Tensor& rows_at, const at::Tensor& keys,
              const at::Tensor& values) {
  const bool bf16 = key_buffer.scalar_type() == at::kBFloat16;
  TORCH_CHECK(key_buffer.device().is_cpu() && (bf16 || key_buffer.scalar_type() == at::kFloat) &&
              value_buffer.scalar_type() == key_buffer.scalar_type() && keys.scalar_type() == at::kFloat &&
              values.scalar_type() == at::kFloat && rows_at.scalar_type() == at::kLong,
              "kv_write: fp32 keys/values into fp32 or bf16 CPU buffers, int64 at");
  TORCH_CHECK(keys.dim() == 4 && values.sizes() == keys.sizes() && keys.stride(3) == 1 && values.stride(3) == 1,
              "kv_write: keys/values [b, Hkv, q, D], last dim contiguous");
  const int64_t b = keys.size(0), heads = keys.size(1), q = keys.size(2), d = keys.size(3);
  TORCH_CHECK(key_buffer.is_contiguous() && value_buffer.is_contiguous() &&
              value_buffer.sizes() == key_buffer.sizes() && key_buffer.size(-1) == d,
              "kv_write: contiguous buffers of the same shape, last dim D");
  TORCH_CHECK(rows_at.is_contiguous() && rows_at.numel() == b * q * heads, "kv_write: at [b*q*Hkv] contiguous");
  const int64_t rows = key_buffer.numel() / std::max<int64_t>(d, 1);
  const int64_t* index = rows_at.data_ptr<int64_t>();
  for (int64_t n = 0; n < rows_at.numel(); ++n)
    TORCH_CHECK(index[n] >= 0 && index[n] < rows, "kv_write: index ", index[n], " out of range for ", rows, " rows");
  const float *ks = keys.data_ptr<float>(), *vs = values.data_ptr<float>();
  // One row of d values into the buffer at element offset `to`: copied, or rounded to bf16 (to nearest even, as
  // torch's `.to(torch.bfloat16)`).
  const auto put = [&](const at::Tensor& buffer, int64_t to, const float* from) {
    if (bf16) {
      at::BFloat16* dst = buffer.data_ptr<at::BFloat16>() + to;
      for (int64_t e = 0; e < d; ++e) dst[e] = at::BFloat16(from[e]);
    } else {
      std::memcpy(buffer.data_ptr<float>() + to, from, d * sizeof(float));
    }
  };
  at::parallel_for(0, b * q, std::max<int64_t>(1, kGrainElements / (2 * heads * d)), [&](int64_t lo, int64_t hi) {
    for (int64_t bq = lo; bq < hi; ++bq) {
      const int64_t i = bq / q, p = bq % q;
      for (int64_t h = 0; h < heads; ++h) {
        const int64_t row = index[bq * heads + h];
        put(key_buffer, row * d, ks + i * keys.stride(0) + h * keys.stride(1) + p * keys.stride(2));
        put(value_buffer, row * d, vs + i * values.stride(0) + h * values.stride(1) + p * values.stride(2));
      }
    }
  });
}

}  // namespace domino_ray
