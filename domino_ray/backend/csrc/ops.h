// Our CPU ops as C++ functions (registered as torch.ops.domino_ray.* by their own files), for ops that call them
// directly (decode_layer.cpp): one library, no dispatch between them. fp32 CPU tensors; each checks its inputs.
#pragma once

#include <ATen/ATen.h>

namespace domino_ray {

at::Tensor decode_attention(const at::Tensor& query, const at::Tensor& keys, const at::Tensor& values,
                            const at::Tensor& limits, double scale);
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
at::Tensor rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);
void kv_write(at::Tensor key_buffer, at::Tensor value_buffer, const at::Tensor& rows_at, const at::Tensor& keys,
              const at::Tensor& values);
at::Tensor pack_linear(const at::Tensor& weight);
at::Tensor linear(const at::Tensor& input, const at::Tensor& packed, int64_t n, const c10::optional<at::Tensor>& bias);

}  // namespace domino_ray
