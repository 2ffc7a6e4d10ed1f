"""Paged KV: one pool of fixed-size blocks per model, each row reading its own blocks through its block table.

A model's keys and values live in `[L, N, Hkv, bs, D]` (N blocks of `bs` positions). A row holds a *block table*, the
ids of its blocks in order: its position p is block `table[p // bs]`, offset `p % bs`. Rows take blocks as they grow
and give them back when they end, so the pool holds what the rows hold, not `max_model_len` per row; rows whose
prompts share whole blocks share those blocks (`kv/blocks.py`). Block 0 is the *null block*: padding rows (a CUDA
graph's row bucket above the active rows) and free slots point every entry there and write into it; no real row ever
reads it. The target and the draft's context use the same table (the same positions), each in its own pool.

A decode step's queries see their own row's keys below their *key limit*: for a verify block at `lens[b] + i` that is
`lens[b] + i + 1` (causal after the committed prefix); for a draft block it is `lens[b] + S` for every slot
(non-causal over `[context ; block]`). Positions beyond a row's committed length hold stale keys from rejected drafts;
the limit hides them and the next step overwrites them, so a rejection costs nothing.

Attention is GQA-native: the query heads that share a K/V head are folded into the query axis (`[r, Hkv, G*q, D]`),
so K and V are read as stored. Three paths compute the same function (`paged_attention`): our CPU kernel in fp32, over
an fp32 or bf16 pool (`backend/ops.py`), our Triton kernel on CUDA (`backend/paged_triton.py`: lengths and tables as tensors, so one CUDA
graph serves every key length), and elsewhere a gather of the rows' blocks into dense keys and SDPA with a mask.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from domino_ray.backend import ops, paged_prefill_triton, paged_triton
from domino_ray.backend.library import kernels_loaded, takes

NULL_BLOCK = 0


@dataclass(frozen=True)
class StepKeys:
    """What a decode step's attention reads: the rows' block tables `[r, nb]` (int32), and for the gather path
    (`paged_attention`) `key_len`, the keys to gather (a multiple of the block size covering every row's limit; the
    kernels read each row's own), and the Triton kernel's split over the keys."""
    tables: torch.Tensor
    key_len: int
    splits: int = 1


def kernel_enabled(device: torch.device | str, dtype: torch.dtype, head_dim: int, block_size: int = 16) -> bool:
    """Whether attention over K/V of `head_dim` on `device` in `dtype` runs our CPU kernel (fp32 on CPU, head sizes and
    blocks in multiples of its 8-float vectors, where it built)."""
    return torch.device(device).type == "cpu" and dtype == torch.float32 and head_dim % 8 == 0 and \
        block_size % 8 == 0 and kernels_loaded()


def reads_in_place(device: torch.device | str, dtype: torch.dtype, head_dim: int, block_size: int) -> bool:
    """Whether attention over a pool of these reads each row's blocks in place (our CPU kernel, our Triton kernel on
    CUDA) rather than gathering them up to the longest row's length (`paged_attention`)."""
    device = torch.device(device)
    return kernel_enabled(device, dtype, head_dim, block_size) or \
        (device.type == "cuda" and paged_triton.available(device))


def kv_write(key_buffer: torch.Tensor, value_buffer: torch.Tensor, at: torch.Tensor, keys: torch.Tensor,
             values: torch.Tensor) -> bool:
    """`keys/values [b, Hkv, q, D]` into rows `at` of the buffers seen as `[rows, D]` (`KVPool.write`) as our one op,
    on fp32 CPU tensors with the last dims contiguous, into fp32 or bf16 buffers; False (nothing written) otherwise."""
    if not (takes(keys, values) and key_buffer.dtype in (keys.dtype, torch.bfloat16) and key_buffer.is_contiguous()
            and value_buffer.is_contiguous() and keys.stride(-1) == 1 and values.stride(-1) == 1):
        return False
    ops.kv_write(key_buffer, value_buffer, at, keys, values)
    return True


class KVPool:
    """Paged key/value storage for one model: per layer `[N, Hkv, bs, D]`, block 0 the null block. `dtype`: the
    model's activations; `storage`: the pool's (default `dtype`; bf16 under fp32 activations on CPU, where our kernel
    reads it: `packed_linear.kv_dtype`)."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str, storage: torch.dtype | None = None):
        if block_size < 1 or block_size & (block_size - 1):
            raise ValueError(f"kv_block_size={block_size} must be a power of two")
        storage = storage or dtype
        shape = (num_layers, num_blocks, num_kv_heads, block_size, head_dim)
        self.all_keys = torch.zeros(shape, dtype=storage, device=device)    # [L, N, Hkv, bs, D]
        self.all_values = torch.zeros(shape, dtype=storage, device=device)
        self.dtype = dtype
        # Per-layer views by indexing (not unbind, whose views refuse in-place writes outside inference mode).
        self.keys = [self.all_keys[i] for i in range(num_layers)]
        self.values = [self.all_values[i] for i in range(num_layers)]
        self.num_blocks, self.block_size, self.num_kv_heads, self.head_dim = num_blocks, block_size, num_kv_heads, head_dim
        # Which attention path reads the pool (`paged_attention`), decided (the kernel built or loaded) here, once,
        # before any step is timed.
        self.kernel = kernel_enabled(device, dtype, head_dim, block_size) and storage in (dtype, torch.bfloat16)
        self.triton = torch.device(device).type == "cuda" and paged_triton.available(torch.device(device)) and \
            storage == dtype
        if storage != dtype and not self.kernel:
            raise ValueError(f"a {storage} KV pool under {dtype} activations needs our CPU attention kernel")

    @property
    def nbytes(self) -> int:
        return 2 * self.all_keys.numel() * self.all_keys.element_size()

    def flat_index(self, tables: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Where `write` puts positions `positions [b, q]` of rows with block tables `tables [b, nb]`: `[b * q * Hkv]`
        rows of a layer's pool seen as `[N * Hkv * bs, D]`, in (row, position, head) order. On the device, from the
        tables as tensors (no host sync, CUDA-graph safe); computed once per forward, for every layer."""
        bs = self.block_size
        blocks = tables.gather(1, torch.div(positions, bs, rounding_mode="floor")).long()  # [b, q]
        return self.flat_index_of(blocks, positions % bs)

    def flat_index_of(self, blocks: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """`flat_index` for tokens given one by one: token i (any shape, flattened in order) goes to offset `offsets[i]`
        of block `blocks[i]`."""
        head = torch.arange(self.num_kv_heads, device=blocks.device)  # [Hkv]
        return ((blocks[..., None] * self.num_kv_heads + head) * self.block_size + offsets[..., None]).reshape(-1)

    def write(self, layer: int, at: torch.Tensor, keys: torch.Tensor, values: torch.Tensor):
        """`keys/values [b, Hkv, q, D]` to rows `at` of layer `layer` (`flat_index`): one op of ours on fp32 CPU tensors
        (`kv_write`), torch's otherwise."""
        if kv_write(self.keys[layer], self.values[layer], at, keys, values):
            return
        d, storage = keys.shape[-1], self.all_keys.dtype
        self.keys[layer].view(-1, d).index_copy_(0, at, keys.transpose(1, 2).reshape(-1, d).to(storage))
        self.values[layer].view(-1, d).index_copy_(0, at, values.transpose(1, 2).reshape(-1, d).to(storage))

    def write_all_layers(self, at: torch.Tensor, keys: torch.Tensor, values: torch.Tensor):
        """`keys/values [L, b, Hkv, q, D]` of every layer to rows `at` (`flat_index`) of each layer, at once."""
        n, d, storage = keys.shape[0], keys.shape[-1], self.all_keys.dtype
        self.all_keys.view(n, -1, d).index_copy_(1, at, keys.transpose(2, 3).reshape(n, -1, d).to(storage))
        self.all_values.view(n, -1, d).index_copy_(1, at, values.transpose(2, 3).reshape(n, -1, d).to(storage))

    def gather(self, layer: int, tables: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values `[b, Hkv, length, D]` of the rows with `tables [b, nb]` (copies in the activations' dtype),
        `length` a multiple of the block size within the tables."""
        b, blocks = tables.shape[0], length // self.block_size
        ids = tables[:, :blocks].long()  # [b, nb']
        out = []
        for pool in (self.keys[layer], self.values[layer]):
            dense = pool[ids].to(self.dtype)  # [b, nb', Hkv, bs, D]
            out.append(dense.transpose(1, 2).reshape(b, self.num_kv_heads, length, self.head_dim))
        return out[0], out[1]


def query_limits(key_limit: torch.Tensor, groups: int) -> torch.Tensor:
    """`key_limit [r, q]` for the folded queries of a K/V group (`paged_attention`) -> `[r, G*q]`."""
    r, q = key_limit.shape
    return key_limit[:, None, :].expand(r, groups, q).reshape(r, groups * q)


def paged_attention(query: torch.Tensor, pool: KVPool, layer: int, tables: torch.Tensor, limits: torch.Tensor,
                    scale: float, key_len: int, splits: int = 1) -> torch.Tensor:
    """Attention of each row's queries over its own blocks, GQA-native.

    query `[r, H, q, D]`; `tables [r, nb]` int32; `limits [r, G*q]` int64 (`query_limits`) -> `[r, q, H, D]` (the layout
    HF's attention functions return). `key_len`: a multiple of the block size covering every limit, read only by the
    gather path (the kernels read each row's limits); `splits`: the Triton kernel's split over the keys.
    """
    if not (pool.kernel or pool.triton):
        visible = visible_keys(limits, torch.arange(key_len, device=query.device), query.dtype)
        return row_attention(query, *pool.gather(layer, tables, key_len), visible, scale)
    r, h, q, d = query.shape
    folded = query.reshape(r, pool.num_kv_heads, -1, d)  # [r, Hkv, G*q, D]: heads of a group are adjacent
    if pool.kernel:
        out = ops.decode_attention(folded, pool.keys[layer], pool.values[layer], tables, limits, scale)
    else:
        out = paged_triton.paged_attention(folded, pool.keys[layer], pool.values[layer], tables, limits, scale, splits)
    return out.reshape(r, h, q, d).transpose(1, 2)


def visible_keys(limits: torch.Tensor, key_positions: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Additive mask `[r, 1, M, T]` in `dtype` for SDPA (0 where visible, -inf elsewhere): folded query m of a row sees
    key positions below `limits [r, M]`; `key_positions` = `arange(T)`."""
    hidden = key_positions >= limits[:, None, :, None]  # [r, 1, M, T]
    return torch.zeros(hidden.shape, dtype=dtype, device=hidden.device).masked_fill_(hidden, float("-inf"))


def prefill_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float,
                      lengths: tuple[int, ...], offsets: tuple[int, ...], tables: tuple, pool: KVPool,
                      layer: int) -> torch.Tensor:
    """Prefill over prompt segments laid back to back in one row (no padding): segment i is `lengths[i]` tokens at
    positions `offsets[i]..`, its row's earlier positions already in the pool (a shared prefix, earlier chunks) and its
    own keys written there by this layer. Causal within each segment's row. query `[1, H, N, D]`, keys/values
    `[1, Hkv, N, D]` (the segments' own), `tables[i]` segment i's block table `[1, nb]` -> `[1, N, H, D]`.

    A segment from offset 0 runs SDPA causal over its own keys (flash or memory-efficient kernels on CUDA). A later one
    reads its row's blocks in place with our Triton kernel where the pool takes it (`pool.triton`: no `[H, n, L]`
    scores); elsewhere its row is gathered and SDPA runs with a mask (on CUDA the math kernel, fp32 scores)."""
    if pool.triton and any(offsets):
        return _prefill_in_place(query, keys, values, scale, lengths, offsets, tables, pool, layer)
    gqa = query.shape[1] != keys.shape[1]
    out = []
    for q, k, v, offset, table in zip(query.split(lengths, 2), keys.split(lengths, 2), values.split(lengths, 2),
                                      offsets, tables):
        if offset == 0:  # a whole prompt from its start: its own keys, causal
            out.append(F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa))
            continue
        n = q.shape[2]
        length = -(-(offset + n) // pool.block_size) * pool.block_size
        k, v = pool.gather(layer, table, length)  # [1, Hkv, length, D]: the prefix and this segment
        limits = torch.arange(offset + 1, offset + n + 1, device=q.device)[None]  # [1, n]: causal after the prefix
        mask = visible_keys(limits, torch.arange(length, device=q.device), q.dtype)  # [1, 1, n, length]
        out.append(F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa))
    return (out[0] if len(out) == 1 else torch.cat(out, 2)).transpose(1, 2)


def _prefill_in_place(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float,
                      lengths: tuple[int, ...], offsets: tuple[int, ...], tables: tuple, pool: KVPool,
                      layer: int) -> torch.Tensor:
    """`prefill_attention` on the Triton path: one kernel launch for the segments past offset 0, SDPA for the others,
    each writing its rows of one output `[1, N, H, D]` (the only workspace: no gathered row, no mask, no scores)."""
    _, h, n, d = query.shape
    out = torch.empty(1, n, h, d, dtype=query.dtype, device=query.device)  # [1, N, H, D]
    starts = [0, *itertools.accumulate(lengths)][:-1]  # each segment's first row
    late = [i for i, offset in enumerate(offsets) if offset > 0]
    for i, offset in enumerate(offsets):
        if offset == 0:
            rows = slice(starts[i], starts[i] + lengths[i])
            out[:, rows] = F.scaled_dot_product_attention(query[:, :, rows], keys[:, :, rows], values[:, :, rows],
                                                          is_causal=True, scale=scale,
                                                          enable_gqa=h != keys.shape[1]).transpose(1, 2)
    q = query[0].transpose(0, 1)  # [N, H, D], a view
    if q.stride(-1) != 1:
        q = q.contiguous()
    paged_prefill_triton.paged_prefill(q, pool.keys[layer], pool.values[layer], [tables[i] for i in late],
                                       [starts[i] for i in late], [offsets[i] for i in late],
                                       [lengths[i] for i in late], scale, out[0])
    return out


def row_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, visible: torch.Tensor,
                  scale: float) -> torch.Tensor:
    """Dense attention of each row's queries over its own keys under an additive or bool mask, GQA-native (the
    gather path of `paged_attention`; the draft's stateless forward: training and the tests' oracle). query `[r, H, q, D]`, keys/values `[r, Hkv, T, D]`,
    `visible [r, 1, G*q, T]` -> `[r, q, H, D]`."""
    r, h, q, d = query.shape
    folded = query.reshape(r, keys.shape[1], -1, d)  # [r, Hkv, G*q, D]
    out = F.scaled_dot_product_attention(folded, keys, values, attn_mask=visible, scale=scale)
    return out.reshape(r, h, q, d).transpose(1, 2)
