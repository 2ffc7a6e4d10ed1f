// One Llama-family decoder layer over a decode or verify step, as one op: `fused_layers.FusedLayer`'s forward
// (HF's math, in HF's order) calling our ops directly, fp32 CPU.
//
// The layer in Python is ~48 dispatched ops (views, splits, transposes around the ten that compute), each a
// Python call and a dispatch; on a small target that fixed part is a large share of a CPU step (SmolLM2 at one
// row: ~11 of 33 ms outside the linear layers), and an op's call costs more cold, after a linear layer's weights
// have streamed through the caches. Here the views are pointer arithmetic and the ops plain calls.
//
// decode_layer(hidden [r, q, C], weights, shape [H, Hkv, D, I], scalars [eps1, eps2, q_eps, k_eps, scale],
//              key_pool, value_pool [N, Hkv, bs, D] (the layer's), rows_at [r*q*Hkv] (the step's rows of the pool
//              seen as [N*Hkv*bs, D]), cos, sin [r, q, D], block_tables [r, nb] int32, limits [r, G*q] int64)
//   -> the layer's output [r, q, C]; writes the step's keys and values first, so the step attends to its own.
// weights: input_layernorm, qkv packed, qkv bias?, o_proj packed, o_proj bias?, post_attention_layernorm,
//          gate_up packed, gate_up bias?, down_proj packed, down_proj bias?, q_norm?, k_norm? (Qwen3)

#include <ATen/TensorOperators.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/silu.h>

#include <vector>

#include "ops.h"

namespace {

at::Tensor required(const c10::List<c10::optional<at::Tensor>>& weights, int64_t i) {
  c10::optional<at::Tensor> w = weights.get(i);  // a copy (a reference to the tensor, not its data)
  TORCH_CHECK(w.has_value() && w->defined(), "decode_layer: weight ", i, " is required");
  return *w;
}

// `layer_ops.rotary`: our op for head sizes in multiples of 16, HF's math in torch's ops otherwise
at::Tensor rotate(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  const int64_t half = x.size(3) / 2;
  if (x.size(3) % 16 == 0) return domino_ray::rotary(x, cos, sin);
  const auto rotated = at::cat({x.narrow(3, half, half).neg(), x.narrow(3, 0, half)}, 3);  // rotate_half(x)
  return x * cos.unsqueeze(2) + rotated * sin.unsqueeze(2);
}

}  // namespace

namespace domino_ray {

at::Tensor decode_layer(const at::Tensor& hidden, const c10::List<c10::optional<at::Tensor>>& weights,
                        at::IntArrayRef shape, at::ArrayRef<double> scalars, at::Tensor key_pool, at::Tensor value_pool,
                        const at::Tensor& rows_at, const at::Tensor& cos, const at::Tensor& sin,
                        const at::Tensor& block_tables, const at::Tensor& limits) {
  TORCH_CHECK(hidden.dim() == 3 && weights.size() == 12 && shape.size() == 4 && scalars.size() == 5,
              "decode_layer: hidden [r, q, C], 12 weights, shape [H, Hkv, D, I], 5 scalars");
  const int64_t r = hidden.size(0), q = hidden.size(1), c = hidden.size(2);
  const int64_t heads = shape[0], kv_heads = shape[1], d = shape[2], inter = shape[3];
  const auto bias = [&](int64_t i) { return weights.get(i); };
  const c10::optional<at::Tensor> q_norm = weights.get(10), k_norm = weights.get(11);

  // attention: q/k/v in one GEMM, the rotary embedding on the query and key heads at once
  const auto qkv = linear(rms_norm(hidden, required(weights, 0), scalars[0]), required(weights, 1),
                          (heads + 2 * kv_heads) * d, bias(2)).view({r, q, heads + 2 * kv_heads, d});
  at::Tensor qk;
  if (q_norm.has_value() && q_norm->defined()) {  // Qwen3: a per-head RMSNorm before the rotary embedding
    qk = at::cat({rms_norm(qkv.narrow(2, 0, heads), *q_norm, scalars[2]),
                  rms_norm(qkv.narrow(2, heads, kv_heads), required(weights, 11), scalars[3])}, 2);
  } else {
    qk = qkv.narrow(2, 0, heads + kv_heads);
  }
  qk = rotate(qk, cos, sin);  // [r, q, H + Hkv, D]
  kv_write(key_pool, value_pool, rows_at, qk.narrow(2, heads, kv_heads).transpose(1, 2),
           qkv.narrow(2, heads + kv_heads, kv_heads).transpose(1, 2));
  // the query heads of a K/V group folded into the query axis: [r, Hkv, G*q, D]
  const auto folded = qk.narrow(2, 0, heads).transpose(1, 2).reshape({r, kv_heads, -1, d});
  const auto attended = decode_attention(folded, key_pool, value_pool, block_tables, limits, scalars[4])
                            .view({r, heads, q, d}).transpose(1, 2).reshape({r, q, heads * d});  // [r, q, H*D]
  auto out = linear(attended, required(weights, 3), c, bias(4)).add_(hidden);  // hidden + o_proj(...)

  // MLP: gate/up in one GEMM
  const auto gate_up =
      linear(rms_norm(out, required(weights, 5), scalars[1]), required(weights, 6), 2 * inter, bias(7));
  const auto act = at::silu(gate_up.narrow(-1, 0, inter)).mul_(gate_up.narrow(-1, inter, inter));
  return linear(act, required(weights, 8), c, bias(9)).add_(out);
}

// Every layer of a decode step, `decode_layer` after `decode_layer`, in one call: a call per layer (a module call, the
// weights' check, the op's arguments, 15-32 us a layer) cost a SmolLM2 step at one row 2.07 ms of 28.
// weights: 12 per layer (as decode_layer's), shapes 4 and scalars 5 per layer, one key and value pool per layer (every
// layer reads the same block tables and limits); tap_layers: ascending layer indices whose outputs come back too
// -> [the last layer's output, their outputs...].
std::vector<at::Tensor> decode_layers(const at::Tensor& hidden, const c10::List<c10::optional<at::Tensor>>& weights,
                                      at::IntArrayRef shapes, at::ArrayRef<double> scalars, at::TensorList key_pools,
                                      at::TensorList value_pools, const at::Tensor& rows_at, const at::Tensor& cos,
                                      const at::Tensor& sin, const at::Tensor& block_tables, const at::Tensor& limits,
                                      at::IntArrayRef tap_layers) {
  const int64_t layers = static_cast<int64_t>(key_pools.size());
  TORCH_CHECK(layers > 0 && static_cast<int64_t>(value_pools.size()) == layers &&
                  static_cast<int64_t>(weights.size()) == 12 * layers &&
                  static_cast<int64_t>(shapes.size()) == 4 * layers && static_cast<int64_t>(scalars.size()) == 5 * layers,
              "decode_layers: per layer 12 weights, 4 shapes, 5 scalars, a key and a value pool");
  for (size_t i = 0; i < tap_layers.size(); ++i)
    TORCH_CHECK(tap_layers[i] >= 0 && tap_layers[i] < layers && (i == 0 || tap_layers[i] > tap_layers[i - 1]),
                "decode_layers: tap layers ascending, within the layers");
  std::vector<at::Tensor> out(1);
  at::Tensor h = hidden;
  size_t tap = 0;
  for (int64_t i = 0; i < layers; ++i) {
    c10::List<c10::optional<at::Tensor>> layer_weights;
    layer_weights.reserve(12);
    for (int64_t j = 0; j < 12; ++j) layer_weights.push_back(weights.get(12 * i + j));
    h = decode_layer(h, layer_weights, shapes.slice(4 * i, 4), scalars.slice(5 * i, 5), key_pools[i], value_pools[i],
                     rows_at, cos, sin, block_tables, limits);
    if (tap < tap_layers.size() && tap_layers[tap] == i) {
      out.push_back(h);
      ++tap;
    }
  }
  out[0] = h;
  return out;
}

// The draft's context update (`draft.context_keys_values` after `DominoDraft.project_context`, then each layer's KV
// write) as one op: target taps [b, q, F] -> context = hidden_norm(fc(taps)) [b, q, C] -> every layer's keys and
// values in one GEMM, each layer's keys k-normed and rotated, written at rows_at (flat rows of
// each layer's pool seen as [rows, D]). In torch's
// ops it was ~25 dispatched ops: 261 us of a one-row drafting step of the demo pair, mostly their fixed cost.
// weights: fc packed, fc bias?, hidden_norm, k/v of every layer packed [L*2*Hkv*D rows], its bias?, k_norm [L, D];
// shape [C, Hkv, D]; scalars [hidden_eps, k_eps].
void context_update(const at::Tensor& taps, const c10::List<c10::optional<at::Tensor>>& weights,
                    at::IntArrayRef shape, at::ArrayRef<double> scalars, at::TensorList key_buffers,
                    at::TensorList value_buffers, const at::Tensor& rows_at, const at::Tensor& cos,
                    const at::Tensor& sin) {
  const int64_t layers = static_cast<int64_t>(key_buffers.size());
  TORCH_CHECK(taps.dim() == 3 && weights.size() == 6 && shape.size() == 3 && scalars.size() == 2 && layers > 0 &&
                  static_cast<int64_t>(value_buffers.size()) == layers,
              "context_update: taps [b, q, F], 6 weights, shape [C, Hkv, D], 2 scalars, a key and value buffer a layer");
  const int64_t b = taps.size(0), q = taps.size(1), c = shape[0], kv_heads = shape[1], d = shape[2];
  const at::Tensor k_norm = required(weights, 5);
  TORCH_CHECK(k_norm.dim() == 2 && k_norm.size(0) == layers && k_norm.size(1) == d, "context_update: k_norm [L, D]");
  const auto context = rms_norm(linear(taps, required(weights, 0), c, weights.get(1)), required(weights, 2), scalars[0]);
  const auto kv = linear(context, required(weights, 3), layers * 2 * kv_heads * d, weights.get(4))
                      .view({b, q, layers, 2, kv_heads, d});
  for (int64_t i = 0; i < layers; ++i) {
    const auto keys = rotate(rms_norm(kv.select(2, i).select(2, 0), k_norm[i], scalars[1]), cos, sin);  // [b, q, Hkv, D]
    kv_write(key_buffers[i], value_buffers[i], rows_at, keys.transpose(1, 2), kv.select(2, i).select(2, 1).transpose(1, 2));
  }
}

}  // namespace domino_ray
