"""Paged prefill on CUDA: prompt segments attending over their rows' blocks with our own Triton kernel.

A prefill segment past offset 0 (a prompt's later chunks, a prompt after shared prefix blocks) has keys in the pool
that its own forward did not compute. Gathering the row and running SDPA with a float mask takes torch's math
kernel on CUDA, which materializes fp32 scores `[H, n, L]` (about 2 GB at n ~ L ~ 4k, 32 heads). This kernel reads
the keys in place through the segment's block table, so its only workspace is the output `[N, H, D]` (and a tile
plan of 5 ints per tile).

Why this design:
- One program per (query tile, K/V head). A tile is up to BLOCK_Q positions of one segment; its G query heads are
  folded into the M axis (BLOCK_M = BLOCK_Q * G rows, rows past that masked), so each key and value is read once
  for the whole group (GQA-native, as `paged_triton`'s decode kernel).
- Ragged segments without padding: the tiles are planned on the host (`tile_plan`, from the segments' lengths and
  offsets, which a prefill knows as ints) into one int32 table `[T, 5]`; the grid is `(T, Hkv)`. A prefill is not
  graph-captured, so a data-dependent grid is fine.
- Causal: query i of a segment at offset o sees keys [0, o + i]; a tile's loop stops at its last query's limit, and
  each key tile is masked per query. Nothing at or past a tile's last limit is read, so the rest of the pool (stale
  or never written) cannot leak in.
- Online softmax in fp32 (base 2), output in the query's dtype; fp32 dots in IEEE precision, as the decode kernel.
- No split over the keys (yet): a short segment after a long prefix is few programs, each walking the whole prefix;
  a long prompt's chunks fill the GPU with tiles.
- triton is imported on first use (`_kernel`), so this module imports on machines without it.

Tested (tests/test_paged_prefill.py) under Triton's interpreter on CPU (fp32, fp16) against a float64 reference.
The sm_90 builds are checked without a GPU (no spills, asynchronous K/V copies). Never run on a GPU here:
the tile sizes and warp count are untuned guesses, bf16 results and the speed are unchecked.
"""

from __future__ import annotations

import functools
import itertools
import math

import torch

from domino_ray.backend.paged_triton import _span

tl = None  # triton.language, bound by `_kernel` (the kernel's source reads it as a global)


def tile_plan(starts, offsets, lengths, table_starts, table_widths, block_q: int) -> list[list[int]]:
    """The query tiles of the segments: segment i's queries are rows `starts[i]..` of the packed queries, at positions
    `offsets[i]..` of a row whose block table is `table_widths[i]` entries from `table_starts[i]` of the flat table.
    One `[first row, first position, queries, table start, table width]` per tile of at most `block_q` queries."""
    plan = []
    for start, offset, length, table_start, width in zip(starts, offsets, lengths, table_starts, table_widths):
        for first in range(0, length, block_q):
            plan.append([start + first, offset + first, min(block_q, length - first), table_start, width])
    return plan


def launch_config(dtype: torch.dtype, d: int) -> tuple[int, int, int, int]:
    """(BLOCK_M folded rows, BLOCK_N keys, BLOCK_D, warps) per program. 16-bit: 128 x 64 tiles at 8 warps (sm_90
    builds at head size 128: about 180 registers, no spills, asynchronous K/V copies, wgmma); fp32 halves both (its
    128-row tiles spill). Block ids are read per key, so a key tile may span blocks of any power-of-two size."""
    wide = dtype == torch.float32
    return (64 if wide else 128), (32 if wide else 64), max(16, 1 << (d - 1).bit_length()), 8


def paged_prefill(query: torch.Tensor, key_pool: torch.Tensor, value_pool: torch.Tensor, tables, starts, offsets,
                  lengths, scale: float, out: torch.Tensor, block_m: int | None = None) -> torch.Tensor:
    """Causal attention of prompt segments over their rows' blocks, written into `out` (returned).

    query `[N, H, D]` (packed segments; any strides, the last dim contiguous); one layer's pool `[Nb, Hkv, bs, D]`;
    segment i: `lengths[i]` queries at rows `starts[i]..` of query and `out`, at positions `offsets[i]..` of a row
    whose blocks are `tables[i]` (`[1, nb]` int32 on the device) and whose keys up to `offsets[i] + lengths[i]` are in
    the pool. Query j of segment i sees the row's keys [0, offsets[i] + j]. `out [N, H, D]` (query's dtype): only the
    segments' rows are written. `block_m`: folded rows per program (a power of two >= 16 and >= G; default
    `launch_config`'s)."""
    n, heads, d = query.shape
    _, kv_heads, bs, pool_d = key_pool.shape
    groups = heads // kv_heads
    assert (pool_d, heads % kv_heads) == (d, 0) and value_pool.shape == key_pool.shape, (query.shape, key_pool.shape)
    assert query.stride(-1) == key_pool.stride(-1) == value_pool.stride(-1) == out.stride(-1) == 1
    assert out.shape == query.shape and out.dtype == query.dtype and bs & (bs - 1) == 0
    assert all(t.dtype == torch.int32 for t in tables)
    default_m, block_n, block_d, warps = launch_config(query.dtype, d)
    block_m = block_m or max(default_m, 1 << (groups - 1).bit_length())
    assert block_m >= max(16, groups) and block_m & (block_m - 1) == 0, (block_m, groups)
    if not lengths or max(lengths) == 0:
        return out
    widths = [t.shape[-1] for t in tables]
    flat = torch.cat([t.reshape(-1) for t in tables])  # [sum nb] int32: every segment's table, back to back
    table_starts = [0, *itertools.accumulate(widths)][:-1]
    block_q = block_m // groups
    plan = tile_plan(starts, offsets, lengths, table_starts, widths, block_q)
    tiles = torch.tensor(plan, dtype=torch.int32).to(query.device)  # [T, 5]
    _kernel()[(len(plan), kv_heads)](
        query, key_pool, value_pool, flat, tiles, out, tiles.stride(0), *query.stride()[:2], *key_pool.stride()[:3],
        *value_pool.stride()[:3], *out.stride()[:2], scale * math.log2(math.e),
        D=d, BS=bs, G=groups, BLOCK_Q=block_q, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d,
        PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        WIDE=max(_span(key_pool), _span(value_pool)) >= 2**31, num_warps=warps)
    return out


@functools.cache
def _kernel():
    """The kernel, jitted on first use (importing triton here, not at module import)."""
    global tl
    import triton
    import triton.language as language

    tl = language
    return triton.jit(_prefill_kernel)


# Triton source, jitted by `_kernel`. Scores live in base 2: `qk_scale` is scale * log2(e).

def _prefill_kernel(q_ptr, k_ptr, v_ptr, table_ptr, tile_ptr, out_ptr,
                    st, sq_n, sq_h, sk_n, sk_h, sk_t, sv_n, sv_h, sv_t, so_n, so_h, qk_scale,
                    D: tl.constexpr, BS: tl.constexpr, G: tl.constexpr, BLOCK_Q: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, PRECISION: tl.constexpr,
                    WIDE: tl.constexpr):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    first_row = tl.load(tile_ptr + tile * st)  # the tile's row of `tile_plan`
    first_pos = tl.load(tile_ptr + tile * st + 1)
    count = tl.load(tile_ptr + tile * st + 2)
    table_start = tl.load(tile_ptr + tile * st + 3)
    width = tl.load(tile_ptr + tile * st + 4)

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    query_i = offs_m // G  # [BLOCK_M] the tile's query of each folded row; its head is kv_head * G + offs_m % G
    head = kv_head * G + offs_m % G
    in_m = (offs_m < BLOCK_Q * G) & (query_i < count)
    in_d = offs_d < D
    limit = tl.where(in_m, first_pos + query_i + 1, 0)  # [BLOCK_M] keys [0, limit) visible: causal
    hi = first_pos + count  # the tile's last query's limit: nothing at or past it is read

    rows = (first_row + query_i).to(tl.int64)
    q = tl.load(q_ptr + rows[:, None] * sq_n + head[:, None] * sq_h + offs_d[None, :],
                mask=in_m[:, None] & in_d[None, :], other=0.0)  # [BLOCK_M, BLOCK_D]
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running max (base 2)
    l_i = tl.zeros([BLOCK_M], tl.float32)  # running sum of exponentials
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for start in range(0, hi, BLOCK_N):
        pos = start + offs_n  # [BLOCK_N] logical key positions
        live = pos < hi
        block = tl.load(table_ptr + table_start + pos // BS, mask=live & (pos // BS < width), other=0)
        if WIDE:
            block = block.to(tl.int64)
        offset = pos % BS
        kv_mask = live[:, None] & in_d[None, :]
        k = tl.load(k_ptr + block[:, None] * sk_n + kv_head * sk_h + offset[:, None] * sk_t + offs_d[None, :],
                    mask=kv_mask, other=0.0)  # [BLOCK_N, BLOCK_D]
        v = tl.load(v_ptr + block[:, None] * sv_n + kv_head * sv_h + offset[:, None] * sv_t + offs_d[None, :],
                    mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale  # [BLOCK_M, BLOCK_N]
        s = tl.where(pos[None, :] < limit[:, None], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a masked-out row: exp2(-inf) = 0, not NaN
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new

    o = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    tl.store(out_ptr + rows[:, None] * so_n + head[:, None] * so_h + offs_d[None, :],
             o.to(out_ptr.dtype.element_ty), mask=in_m[:, None] & in_d[None, :])
