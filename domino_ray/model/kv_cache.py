"""Per-row KV buffers and the attention over them: every row writes at its own offset, nothing is cropped.

Rows of a batch occupy slots `0..n` of preallocated buffers `[R, Hkv, T, D]`. A decode forward runs on
the first `r` slots (`r` = the row bucket, padding slots included); each contiguous range of them attends
over the first `t` positions, its own key bucket (`key_groups.py`: `((stop, t), ...)`). A query sees the
keys of its own row below its *key limit*: for a verify block at `lens[b] + i` that is `lens[b] + i + 1`
(causal after the committed prefix); for a draft block it is `lens[b] + B` for every slot (non-causal
over `[context ; block]`). Positions beyond a row's committed length hold stale keys from rejected
drafts; the limit hides them and the next step overwrites them, so a rejection costs nothing.

Attention is GQA-native: the query heads that share a K/V head are folded into the query axis
(`[b, Hkv, G*q, D]`), so K and V are read as stored, never repeated per query head. On CPU in fp32 it is our
kernel (`backend/ops.py`), which takes each query's key limit; elsewhere SDPA with an additive mask.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from domino_ray.backend import ops
from domino_ray.backend.library import kernels_loaded, takes


def kernel_enabled(device: torch.device | str, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether attention over K/V of `head_dim` on `device` in `dtype` runs our kernel (fp32 on CPU, head sizes
    in multiples of its 8-float vectors, where it built)."""
    return torch.device(device).type == "cpu" and dtype == torch.float32 and head_dim % 8 == 0 and kernels_loaded()


def kv_write(key_buffer: torch.Tensor, value_buffer: torch.Tensor, at: torch.Tensor, keys: torch.Tensor,
             values: torch.Tensor) -> bool:
    """`keys/values [b, Hkv, q, D]` into rows `at` of the buffers seen as `[rows, D]` (`KVBuffers.write`) as our one
    op, on fp32 CPU tensors with the last dims contiguous; False (nothing written) otherwise."""
    if not (takes(keys, values) and key_buffer.dtype == keys.dtype and key_buffer.is_contiguous()
            and value_buffer.is_contiguous() and keys.stride(-1) == 1 and values.stride(-1) == 1):
        return False
    ops.kv_write(key_buffer, value_buffer, at, keys, values)
    return True


class KVBuffers:
    """Static key/value storage for one model: per layer `[R, Hkv, T, D]`."""

    def __init__(self, num_layers: int, max_rows: int, max_len: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str):
        shape = (num_layers, max_rows, num_kv_heads, max_len, head_dim)
        self.all_keys = torch.zeros(shape, dtype=dtype, device=device)    # [L, R, Hkv, T, D]
        self.all_values = torch.zeros(shape, dtype=dtype, device=device)
        # Per-layer views by indexing (not unbind, whose views refuse in-place writes outside inference mode).
        self.keys = [self.all_keys[i] for i in range(num_layers)]
        self.values = [self.all_values[i] for i in range(num_layers)]
        self.max_len = max_len
        # Attended by our CPU kernel (key limits) or SDPA (masks): `group_visibility`. Decided (and the kernel
        # built or loaded) here, once, before any step is timed.
        self.kernel = kernel_enabled(device, dtype, head_dim)

    @property
    def nbytes(self) -> int:
        return 2 * self.all_keys.numel() * self.all_keys.element_size()

    def flat_index(self, rows: slice, index: torch.Tensor) -> torch.Tensor:
        """Where `write` puts positions `index [b, q]` of slots `rows`: `[b * q * Hkv]` rows of a layer's buffer
        seen as `[R * Hkv * T, D]`, in (slot, position, head) order. Computed once per forward, for every layer."""
        b, q = index.shape
        slots = torch.arange(rows.start, rows.start + b, device=index.device)[:, None].expand(b, q)  # [b, q]
        return self.flat_index_of(slots, index)

    def flat_index_of(self, slots: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """`flat_index` for tokens given one by one: token i (of any shape, flattened in order) goes to position
        `positions[i]` of slot `slots[i]`."""
        _, heads, length, _ = self.keys[0].shape
        head = torch.arange(heads, device=positions.device)  # [Hkv]
        return ((slots[..., None] * heads + head) * length + positions[..., None]).reshape(-1)

    def write(self, layer: int, at: torch.Tensor, keys: torch.Tensor, values: torch.Tensor):
        """`keys/values [b, Hkv, q, D]` to the positions `at` of layer `layer` (`flat_index`): one op of ours on fp32
        CPU tensors (`kv_write`), torch's otherwise."""
        if kv_write(self.keys[layer], self.values[layer], at, keys, values):
            return
        d = keys.shape[-1]
        self.keys[layer].view(-1, d).index_copy_(0, at, keys.transpose(1, 2).reshape(-1, d))
        self.values[layer].view(-1, d).index_copy_(0, at, values.transpose(1, 2).reshape(-1, d))

    def write_all_layers(self, rows: slice, index: torch.Tensor, keys: torch.Tensor, values: torch.Tensor):
        """`keys/values [L, b, Hkv, q, D]` of every layer to positions `index [b, q]` of slots `rows`, at once."""
        n, b, h, q, d = keys.shape
        idx = index[None, :, None, :, None].expand(n, b, h, q, d)
        self.all_keys[:, rows].scatter_(3, idx, keys)
        self.all_values[:, rows].scatter_(3, idx, values)

    def view(self, layer: int, rows: slice, kv_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values `[b, Hkv, kv_len, D]` of slots `rows` (views, no copy)."""
        return self.keys[layer][rows, :, :kv_len], self.values[layer][rows, :, :kv_len]

    def move_row(self, src: int | torch.Tensor, dst: int | torch.Tensor, length: int, block: int = 256):
        """Copy the first `length` positions of slot `src` into slot `dst` (compaction), or of slots `src[i]`
        into `dst[i]` (index tensors `[m]`, regrouping). The pairs may form cycles: each block of positions is
        read for every pair before any is written, so the scratch is one layer's `[m, Hkv, block, D]`."""
        if isinstance(src, int):
            for buf in (self.all_keys, self.all_values):
                buf[:, dst, :, :length] = buf[:, src, :, :length]
            return
        for buf in (*self.keys, *self.values):
            for p in range(0, length, block):
                end = min(p + block, length)
                buf[dst, :, p:end] = buf[src, :, p:end]


def visible_keys(limits: torch.Tensor, key_positions: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Additive mask `[r, 1, M, T]` in `dtype` for SDPA (0 where visible, -inf elsewhere): folded query m of a
    row sees key positions below `limits [r, M]` (`query_limits`); `key_positions` = `arange(T)`. Built once
    per forward and shared by its layers: SDPA would turn a bool mask into this in every layer's call."""
    hidden = key_positions >= limits[:, None, :, None]  # [r, 1, M, T]
    return torch.zeros(hidden.shape, dtype=dtype, device=hidden.device).masked_fill_(hidden, float("-inf"))


def query_limits(key_limit: torch.Tensor, groups: int) -> torch.Tensor:
    """`key_limit [r, q]` for the folded queries of a K/V group (`row_attention`) -> `[r, G*q]`."""
    r, q = key_limit.shape
    return key_limit[:, None, :].expand(r, groups, q).reshape(r, groups * q)


def group_visibility(key_limit: torch.Tensor, groups: int, key_positions: torch.Tensor, key_groups: tuple,
                     buffers: KVBuffers) -> tuple[torch.Tensor, ...]:
    """What each range of `key_groups` (`((stop, t), ...)`) attends under in `buffers`, for `row_attention`: the
    key limits of its folded queries `[stop - start, G*q]` (int64) where our CPU kernel reads them
    (`buffers.kernel`), else the additive masks of `visible_keys` `[stop - start, 1, G*q, t]`. Once per forward,
    shared by its layers. One range (the graphs' case) takes the limits whole: no slicing call."""
    out, start = [], 0
    for stop, t in key_groups:
        limit = key_limit if len(key_groups) == 1 else key_limit[start:stop]
        limits = query_limits(limit, groups)
        out.append(limits if buffers.kernel else visible_keys(limits, key_positions[:t], buffers.all_keys.dtype))
        start = stop
    return tuple(out)


def decode_layer_groups(key_groups: tuple, visible: tuple[torch.Tensor, ...]
                        ) -> tuple[list[int], list[int], list[torch.Tensor]]:
    """`key_groups` and their key limits (`group_visibility`) as `decode_layer` takes them: group stops, key lengths,
    key limits."""
    return [stop for stop, _ in key_groups], [t for _, t in key_groups], list(visible)


def grouped_attention(query: torch.Tensor, buffers: KVBuffers, layer: int, key_groups: tuple,
                      visible: tuple[torch.Tensor, ...], scale: float) -> torch.Tensor:
    """`row_attention` of query `[r, H, q, D]` over layer `layer` of `buffers`, one call per range of
    `key_groups` over that range's own key bucket (views: no copy), visibility from `group_visibility` ->
    `[r, q, H, D]`. One range (the graphs' case) takes the queries whole and concatenates nothing."""
    out, start = [], 0
    for (stop, t), seen in zip(key_groups, visible):
        keys, values = buffers.view(layer, slice(start, stop), t)
        rows = query if len(key_groups) == 1 else query[start:stop]
        out.append(row_attention(rows, keys, values, seen, scale))
        start = stop
    return out[0] if len(out) == 1 else torch.cat(out)


def row_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, visible: torch.Tensor,
                  scale: float) -> torch.Tensor:
    """Attention of each row's queries over its own keys, GQA-native.

    query `[r, H, q, D]`, keys/values `[r, Hkv, T, D]`, visible: the additive mask `[r, 1, G*q, T]`
    (`visible_keys`: SDPA) or the key limits `[r, G*q]` (`query_limits`: our CPU kernel) -> `[r, q, H, D]`
    (the layout HF's attention functions return). The G query heads of a K/V group are folded into the
    query axis, so the keys are attended as stored: no per-head copies.
    """
    r, h, q, d = query.shape
    folded = query.reshape(r, keys.shape[1], -1, d)  # [r, Hkv, G*q, D]: heads of a group are adjacent
    if visible.dtype == torch.int64:
        out = ops.decode_attention(folded, keys, values, visible, scale)
    else:
        out = F.scaled_dot_product_attention(folded, keys, values, attn_mask=visible, scale=scale)
    return out.reshape(r, h, q, d).transpose(1, 2)


def causal_prefill_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float,
                             lengths: tuple[int, ...]) -> torch.Tensor:
    """Prefill over prompts laid back to back in one row (no padding), each from position 0: causal attention
    within each prompt, one call per prompt. query `[1, H, N, D]`, keys/values `[1, Hkv, N, D]`, `lengths`
    the prompts' (summing to N) -> `[1, N, H, D]`."""
    gqa = query.shape[1] != keys.shape[1]
    out = [F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
           for q, k, v in zip(query.split(lengths, 2), keys.split(lengths, 2), values.split(lengths, 2))]
    return (out[0] if len(out) == 1 else torch.cat(out, 2)).transpose(1, 2)
