"""Our C++ ops (`csrc/`), one thin wrapper each: the only Python that names `torch.ops.domino_ray`.

Callers decide where an op applies (fp32 CPU tensors, nothing for autograd to record, the library built:
`library.takes`) and keep torch's ops elsewhere; the wrappers check nothing. Each op checks its own
inputs in C++. The schemas are registered in one place (`csrc/registration.cpp`). An op is looked up at each
call, so a test may replace it on `torch.ops.domino_ray`.

Why each op (docs/benchmarks-log.md has the figures):
- `decode_attention` (`csrc/decode_attention.cpp`): torch's CPU attention reads a decode step's keys at about half
  the rate two cores stream them: each (row, K/V head) is a handful of queries against a few hundred KB of keys, a
  shape SDPA's flash kernel and the matmul formulations handle with GEMM machinery built for larger ones, and over
  the paged pool they would need each row's keys gathered first. The kernel reads every key and value once, from
  its page, for all the queries of its K/V group and takes each query's key limit instead of a mask. Head sizes in
  multiples of 8, block sizes powers of two from 8 (`kv_cache.kernel_enabled`).
- `rms_norm`, `rotary` (`csrc/layer_ops.cpp`): HF's are 8 and 9 dispatched torch ops, and at the rows a CPU engine
  decodes each op's overhead outweighs its arithmetic. `kv_write` (same file): torch's `index_copy_` of the
  transposed keys is 8 ops a layer, and its call cost grows cold, once a linear layer's weights have streamed
  through the caches (~3x ours in the engine).
- `pack_linear`, `linear` (`csrc/linear.cpp`): linear layers at decode row counts (`packed_linear.py`).
- `decode_layer`, `decode_layers`, `context_update` (`csrc/decode_layer.cpp`): a whole Llama-family layer of a
  decode step (`fused_layers.FusedLayer`), every layer at once, and the draft's context update: the ops above
  called from C++ (entry points in `csrc/ops.h`), the views as pointer arithmetic. `domino_corrections`
  (`csrc/domino_head.cpp`): the Domino head's correction loop.

Shapes: r rows, q queries per row, H/Hkv heads (G = H / Hkv), D head dim, C hidden size; the paged KV pool of a layer
`[N, Hkv, bs, D]` (N blocks of bs positions), a row's `block_tables [r, nb]` int32 (logical key p of row b at offset
p % bs of block `block_tables[b, p // bs]`), its folded queries' `limits [r, G*q]` int64.
"""

from __future__ import annotations

import torch


def decode_attention(query: torch.Tensor, key_pool: torch.Tensor, value_pool: torch.Tensor,
                     block_tables: torch.Tensor, limits: torch.Tensor, scale: float) -> torch.Tensor:
    """Folded queries `[r, Hkv, M, D]` over the paged keys/values `[N, Hkv, bs, D]` of each row's `block_tables
    [r, nb]`, query m of row b seeing the row's logical keys below `limits[b, m]` (`[r, M]` int64; 0: a zero output)
    -> `[r, Hkv, M, D]`."""
    return torch.ops.domino_ray.decode_attention(query, key_pool, value_pool, block_tables, limits, scale)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`weight * (x * rsqrt(mean(x^2) + eps))` over the last dim."""
    return torch.ops.domino_ray.rms_norm(x, weight, eps)


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """HF's rotary embedding of x `[b, q, H, D]` with cos/sin `[b, q, D]`."""
    return torch.ops.domino_ray.rotary(x, cos, sin)


def kv_write(key_buffer: torch.Tensor, value_buffer: torch.Tensor, at: torch.Tensor, keys: torch.Tensor,
             values: torch.Tensor) -> None:
    """`keys/values [b, Hkv, q, D]` into rows `at` of the buffers (a layer's pool) seen as `[rows, D]`, in place: key
    (i, h, p) to row `at[(i*q + p)*Hkv + h]`."""
    torch.ops.domino_ray.kv_write(key_buffer, value_buffer, at, keys, values)


def pack_linear(weight: torch.Tensor) -> torch.Tensor:
    """A linear layer's weight `[N, K]` packed into the panels `linear` reads."""
    return torch.ops.domino_ray.pack_linear(weight)


def linear(x: torch.Tensor, packed: torch.Tensor, out_features: int, bias: torch.Tensor | None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` over the weight as `pack_linear` packed it."""
    return torch.ops.domino_ray.linear(x, packed, out_features, bias)


def decode_layer(hidden: torch.Tensor, weights: list, shape: list[int], scalars: list[float], key_pool: torch.Tensor,
                 value_pool: torch.Tensor, rows_at: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 block_tables: torch.Tensor, limits: torch.Tensor) -> torch.Tensor:
    """One Llama-family decoder layer of a decode step `[r, q, C]` -> `[r, q, C]`: writes the step's keys and values
    at `rows_at` (`kv_write`) first, then attends over the pool (`decode_attention`: the step sees its own keys)."""
    return torch.ops.domino_ray.decode_layer(hidden, weights, shape, scalars, key_pool, value_pool, rows_at, cos, sin,
                                             block_tables, limits)


def decode_layers(hidden: torch.Tensor, weights: list, shapes: list[int], scalars: list[float],
                  key_pools: list[torch.Tensor], value_pools: list[torch.Tensor], rows_at: torch.Tensor,
                  cos: torch.Tensor, sin: torch.Tensor, block_tables: torch.Tensor, limits: torch.Tensor,
                  tap_layers: list[int]) -> list[torch.Tensor]:
    """Every layer as `decode_layer` (one pool each, the same tables and limits), in one call -> [the last layer's
    output, the outputs of `tap_layers`...]."""
    return torch.ops.domino_ray.decode_layers(hidden, weights, shapes, scalars, key_pools, value_pools, rows_at, cos,
                                              sin, block_tables, limits, tap_layers)


def context_update(taps: torch.Tensor, weights: list, shape: list[int], scalars: list[float],
                   key_buffers: list[torch.Tensor], value_buffers: list[torch.Tensor], rows_at: torch.Tensor,
                   cos: torch.Tensor, sin: torch.Tensor) -> None:
    """The draft's context keys and values of every layer from target taps `[b, q, F]`, written in place."""
    torch.ops.domino_ray.context_update(taps, weights, shape, scalars, key_buffers, value_buffers, rows_at, cos, sin)


def domino_corrections(z: torch.Tensor, base: torch.Tensor, anchor: torch.Tensor, prefix: torch.Tensor,
                       embed: torch.Tensor, w_ih: torch.Tensor, w_hh: torch.Tensor, fc1: torch.Tensor,
                       fc2: torch.Tensor, fc2_rows: int, d2t: torch.Tensor | None, num_draft: int) -> torch.Tensor:
    """The Domino head's corrected drafts after the uncorrected prefix `[b, P]` -> `[b, K - P]` target ids."""
    return torch.ops.domino_ray.domino_corrections(z, base, anchor, prefix, embed, w_ih, w_hh, fc1, fc2, fc2_rows,
                                                   d2t, num_draft)
