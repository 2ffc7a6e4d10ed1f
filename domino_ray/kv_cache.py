"""Per-row KV buffers: every row writes at its own offset, nothing is ever cropped.

Rows of a batch occupy slots `0..n` of preallocated buffers `[B, Hkv, T, D]`. A forward pass runs on a
contiguous slot range (`rows`), writes its new keys/values at `offsets[b] + arange(q)` and attends over
the first `kv_len` positions under an explicit mask. Positions beyond a row's committed length hold
stale keys from rejected draft tokens; the mask hides them and the next step overwrites them, so a
rejection costs nothing.

`RowKVCache` adapts the buffers to stock transformers decoders (Qwen3, Llama) through the `Cache`
interface: their attention calls `update(key_states, value_states, layer_idx, ...)` and attends over
whatever it returns.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache


class KVBuffers:
    """Static key/value storage for one model: per layer `[B, Hkv, T, D]`."""

    def __init__(self, num_layers: int, max_rows: int, max_len: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str):
        shape = (max_rows, num_kv_heads, max_len, head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.max_len = max_len

    def write(self, layer: int, rows: slice, index: torch.Tensor, keys: torch.Tensor, values: torch.Tensor):
        """Scatter `keys/values [b, Hkv, q, D]` to positions `index [b, q]` of slots `rows`."""
        b, h, q, d = keys.shape
        idx = index[:, None, :, None].expand(b, h, q, d)
        self.keys[layer][rows].scatter_(2, idx, keys)
        self.values[layer][rows].scatter_(2, idx, values)

    def view(self, layer: int, rows: slice, kv_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values `[b, Hkv, kv_len, D]` of slots `rows` (views, no copy)."""
        return self.keys[layer][rows, :, :kv_len], self.values[layer][rows, :, :kv_len]

    def move_row(self, src: int, dst: int, length: int):
        """Copy the first `length` positions of slot `src` into slot `dst` (slot compaction)."""
        for buf in (*self.keys, *self.values):
            buf[dst, :, :length] = buf[src, :, :length]


def write_index(offsets: torch.Tensor, q: int) -> torch.Tensor:
    """Positions `[b, q]` = `offsets[b] + arange(q)`."""
    return offsets[:, None] + torch.arange(q, device=offsets.device)


def causal_row_mask(query_pos: torch.Tensor, kv_len: int, dtype: torch.dtype) -> torch.Tensor:
    """Mask `[b, 1, q, kv_len]`: a query at position p sees keys at positions <= p of its own row."""
    keys = torch.arange(kv_len, device=query_pos.device)
    return additive_mask((keys[None, None, :] <= query_pos[:, :, None])[:, None], dtype)


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """0 where allowed, -inf elsewhere: SDPA runs faster with an additive mask than with a bool one."""
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed, float("-inf"))


class RowKVCache(Cache):
    """A transformers `Cache` over `KVBuffers` for one forward at a time.

    Call `prepare(rows, offsets, q, kv_len)` before each forward; `update` then scatters each layer's
    new `[b, Hkv, q, D]` keys/values at the rows' offsets and returns the `[b, Hkv, kv_len, D]` views.
    """

    def __init__(self, buffers: KVBuffers):
        super().__init__(layers=[])
        self.buffers = buffers
        self.rows = slice(0, 0)
        self.index = None  # [b, q] write positions of the current forward
        self.kv_len, self.prefill = 0, False

    def prepare(self, rows: slice, offsets: torch.Tensor, q: int, kv_len: int, prefill: bool = False):
        """`prefill`: every row starts at offset 0 and kv_len == q, so the new keys are the whole context."""
        assert kv_len <= self.buffers.max_len, (kv_len, self.buffers.max_len)
        assert not prefill or kv_len == q
        self.rows, self.index, self.kv_len, self.prefill = rows, write_index(offsets, q), kv_len, prefill

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        self.buffers.write(layer_idx, self.rows, self.index, key_states, value_states)
        if self.prefill:  # attend over the contiguous new keys rather than strided buffer views
            return key_states, value_states
        return self.buffers.view(layer_idx, self.rows, self.kv_len)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.kv_len

    def __len__(self) -> int:
        return len(self.buffers.keys)
