// Our CPU ops as C++ functions: registered as torch.ops.domino_ray.* in one place (registration.cpp), and called
// directly by the ops built on them (decode_layer.cpp, domino_head.cpp): one library, no dispatch between them.
// fp32 CPU tensors; each checks its inputs.
#pragma once

// ATen's core Tensor and the op headers each file uses, not <ATen/ATen.h>: that one header is most of a file's
// compile time (~12 s of ~13 here), and `make setup` compiles six files.
#include <ATen/core/List.h>
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

namespace domino_ray {

// A bf16 tensor's elements as their raw bits, what our kernels widen (`vectors.h`).
inline uint16_t* bf16_bits(const at::Tensor& t) { return reinterpret_cast<uint16_t*>(t.data_ptr<at::BFloat16>()); }

at::Tensor decode_attention(const at::Tensor& query, const at::Tensor& key_pool, const at::Tensor& value_pool,
                            const at::Tensor& block_tables, const at::Tensor& limits, double scale);
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
at::Tensor rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);
void kv_write(at::Tensor key_buffer, at::Tensor value_buffer, const at::Tensor& rows_at, const at::Tensor& keys,
              const at::Tensor& values);
at::Tensor pack_linear(const at::Tensor& weight);
at::Tensor linear(const at::Tensor& input, const at::Tensor& packed, int64_t n, const c10::optional<at::Tensor>& bias);
at::Tensor decode_layer(const at::Tensor& hidden, const c10::List<c10::optional<at::Tensor>>& weights,
                        at::IntArrayRef shape, at::ArrayRef<double> scalars, at::Tensor key_pool, at::Tensor value_pool,
                        const at::Tensor& rows_at, const at::Tensor& cos, const at::Tensor& sin,
                        const at::Tensor& block_tables, const at::Tensor& limits);
std::vector<at::Tensor> decode_layers(const at::Tensor& hidden, const c10::List<c10::optional<at::Tensor>>& weights,
                                      at::IntArrayRef shapes, at::ArrayRef<double> scalars, at::TensorList key_pools,
                                      at::TensorList value_pools, const at::Tensor& rows_at, const at::Tensor& cos,
                                      const at::Tensor& sin, const at::Tensor& block_tables, const at::Tensor& limits,
                                      at::IntArrayRef tap_layers);
void context_update(const at::Tensor& taps, const c10::List<c10::optional<at::Tensor>>& weights,
                    at::IntArrayRef shape, at::ArrayRef<double> scalars, at::TensorList key_buffers,
                    at::TensorList value_buffers, const at::Tensor& rows_at, const at::Tensor& cos,
                    const at::Tensor& sin);
at::Tensor domino_corrections(const at::Tensor& z, const at::Tensor& base, const at::Tensor& anchor,
                              const at::Tensor& prefix, const at::Tensor& embed, const at::Tensor& w_ih,
                              const at::Tensor& w_hh, const at::Tensor& fc1, const at::Tensor& fc2, int64_t fc2_rows,
                              const c10::optional<at::Tensor>& d2t, int64_t num_draft);

}  // namespace domino_ray
