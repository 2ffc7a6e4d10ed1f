// The one registration of our library: every op's schema (torch.ops.domino_ray.*) and its CPU kernel. The kernels
// live in their own files and are declared in ops.h; Python calls them through domino_ray/backend/ops.py only.

#include <torch/library.h>

#include "ops.h"

TORCH_LIBRARY(domino_ray, m) {
  m.def("decode_attention(Tensor query, Tensor key_pool, Tensor value_pool, Tensor block_tables, Tensor limits, "
        "float scale) -> Tensor");
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("rotary(Tensor x, Tensor cos, Tensor sin) -> Tensor");
  m.def("kv_write(Tensor(a!) key_buffer, Tensor(b!) value_buffer, Tensor at, Tensor keys, Tensor values) -> ()");
  m.def("pack_linear(Tensor weight) -> Tensor");
  m.def("linear(Tensor x, Tensor packed, int n, Tensor? bias) -> Tensor");
  m.def("decode_layer(Tensor hidden, Tensor?[] weights, int[] shape, float[] scalars, Tensor(a!) key_pool, "
        "Tensor(b!) value_pool, Tensor rows_at, Tensor cos, Tensor sin, Tensor block_tables, Tensor limits) -> Tensor");
  m.def("decode_layers(Tensor hidden, Tensor?[] weights, int[] shapes, float[] scalars, Tensor(a!)[] key_pools, "
        "Tensor(b!)[] value_pools, Tensor rows_at, Tensor cos, Tensor sin, Tensor block_tables, Tensor limits, "
        "int[] tap_layers) -> Tensor[]");
  m.def("context_update(Tensor taps, Tensor?[] weights, int[] shape, float[] scalars, Tensor(a!)[] key_buffers, "
        "Tensor(b!)[] value_buffers, Tensor rows_at, Tensor cos, Tensor sin) -> ()");
  m.def("domino_corrections(Tensor z, Tensor base, Tensor anchor, Tensor prefix, Tensor embed, Tensor w_ih, "
        "Tensor w_hh, Tensor fc1, Tensor fc2, int fc2_rows, Tensor? d2t, int num_draft) -> Tensor");
}

TORCH_LIBRARY_IMPL(domino_ray, CPU, m) {
  m.impl("decode_attention", &domino_ray::decode_attention);
  m.impl("rms_norm", &domino_ray::rms_norm);
  m.impl("rotary", &domino_ray::rotary);
  m.impl("kv_write", &domino_ray::kv_write);
  m.impl("pack_linear", &domino_ray::pack_linear);
  m.impl("linear", &domino_ray::linear);
  m.impl("decode_layer", &domino_ray::decode_layer);
  m.impl("decode_layers", &domino_ray::decode_layers);
  m.impl("context_update", &domino_ray::context_update);
  m.impl("domino_corrections", &domino_ray::domino_corrections);
}
