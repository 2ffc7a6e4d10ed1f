"""Paged attention on CUDA: our own Triton kernel over the paged KV pool (shapes and semantics: `paged_attention`).

Why this design:
- Graph-safe. One program per (row, K/V head, split): the grid and every block size come from static shapes (rows,
  heads, the folded query count M, the table width nb, `splits`), never from key lengths. Each row's key range is
  read from `limits` inside the kernel, so one compiled kernel and one CUDA graph serve every length: no `.item()`,
  no host sync, no shape that depends on data. Scratch for splits is allocated inside the call; under graph
  capture that comes from the graph's private pool at a fixed address, so replays reuse it.
- All M folded queries of a (row, K/V head) in one BLOCK_M tile: the G query heads and the q positions of a verify
  or draft block read each key and value once. Each query is masked by its own limit (a verify block's causal
  tail, a draft block's shared limit, 0 for padding) and a row's loop stops at its own largest limit: cost follows
  the row's length, not the pool's or the batch's longest row.
- Split-KV for long contexts at few rows: rows * Hkv programs leave most SMs idle at a handful of rows, so split s
  takes the s-th share of the row's own key tiles and a second kernel merges the splits by log-sum-exp. vLLM's
  unified attention splits only single-query decode; SGLang's verify_splitkv splits a verify block; we split any
  folded block. `choose_splits` picks a static count per row bucket.
- Online softmax in fp32 (base 2), queries/keys/values/output in the pool's dtype (fp16, bf16, fp32); fp32 dots
  ask for IEEE precision (not TF32) so an fp32 pool computes fp32 attention.
- The head size is a compile-time constant (one build per model), so the head-dim mask folds away and K/V loads
  vectorize and pipeline (asynchronous copies); block ids are read per key, so a tile may span blocks.
- triton is imported on first use (`_kernels`), so this module imports on machines without it.

Tested where (tests/test_paged_triton.py): results only under Triton's interpreter (TRITON_INTERPRET=1: CPU, numpy,
fp32 and fp16; it has no bf16) against a dense torch reference; and the kernels, with the arguments this module
passes, compiled for sm_90 by triton's own ptxas without a GPU (bf16, fp16, fp32: no spills, pipelined loads). It
has never run on a GPU here: BLOCK_N and the warp counts are untuned guesses, bf16 results are unchecked, and a
BLOCK_M past 128 (M > 128 folded queries) has not been built.
"""

from __future__ import annotations

import functools
import math
import os

import torch

BLOCK_N = 32  # keys per tile; block ids are gathered per key, so any bs (a power of two) works with it
tl = None  # triton.language, bound by `_kernels` (the kernels' source reads it as a global)


def available(device: torch.device | str) -> bool:
    """Whether `paged_attention` can run on `device`: triton importable and the device CUDA, or the interpreter on."""
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    if torch.device(device).type != "cuda" and not interpreted:
        return False
    try:
        _kernels()
    except ImportError:
        return False
    return True


def choose_splits(rows: int, kv_heads: int, sm_count: int, max_splits: int = 16) -> int:
    """How many KV splits bring rows * kv_heads programs up to about two per SM (1 once they are there): static per
    row bucket, so one graph per bucket."""
    programs = max(rows * kv_heads, 1)
    return max(1, min(max_splits, (2 * sm_count) // programs))


def paged_attention(query: torch.Tensor, key_pool: torch.Tensor, value_pool: torch.Tensor,
                    block_tables: torch.Tensor, limits: torch.Tensor, scale: float, splits: int = 1) -> torch.Tensor:
    """Folded queries `[r, Hkv, M, D]` over one layer's pool `[N, Hkv, bs, D]` -> `[r, Hkv, M, D]` (query's dtype).

    Query m of row b sees the logical keys [0, limits[b, m]) of its row (`limits [r, M]` int64, each at most
    nb * bs), key p read from block `block_tables[b, p // bs]` (`[r, nb]` int32) at offset p % bs; a limit of 0
    gives zeros. Keys below a row's largest limit must be finite (a query with a lower limit gives them weight 0,
    and 0 * NaN is NaN); nothing at or past it is read. `splits` > 1 splits each row's keys over that many programs
    and merges them (fp32 scratch `[r, Hkv, splits, M, D]` and `[r, Hkv, splits, M]` allocated here). The last
    dims of query and pools must be contiguous; other strides are passed through. The output is contiguous."""
    r, kv_heads, m, d = query.shape
    _, pool_heads, bs, pool_d = key_pool.shape
    assert (pool_heads, pool_d) == (kv_heads, d) and value_pool.shape == key_pool.shape, (query.shape, key_pool.shape)
    assert key_pool.stride(-1) == value_pool.stride(-1) == query.stride(-1) == 1
    assert block_tables.dtype == torch.int32 and limits.dtype == torch.int64 and limits.shape == (r, m)
    assert bs & (bs - 1) == 0 and splits >= 1
    attend, merge = _kernels()
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)  # [r, Hkv, M, D] contiguous
    if r == 0 or m == 0:
        return out
    block_m, block_d, warps = launch_config(m, d)
    fp32 = query.dtype == torch.float32  # IEEE dots, not TF32 (the precision is ignored for 16-bit inputs)
    if splits == 1:
        partial, lse = out, out  # lse unused: the kernel writes the normalized output in the query's dtype
    else:
        partial = torch.empty(r, kv_heads, splits, m, d, device=query.device, dtype=torch.float32)
        lse = torch.empty(r, kv_heads, splits, m, device=query.device, dtype=torch.float32)
    split_stride = partial.stride(2) if splits > 1 else 0
    attend[(r, kv_heads, splits)](
        query, key_pool, value_pool, block_tables, limits, partial, lse,
        *query.stride()[:3], *key_pool.stride()[:3], *value_pool.stride()[:3], *block_tables.stride(),
        *limits.stride(), partial.stride(0), partial.stride(1), split_stride, partial.stride(-2),
        *(lse.stride()[:3] if splits > 1 else (0, 0, 0)), m, block_tables.shape[1], scale * math.log2(math.e),
        D=d, BS=bs, SPLITS=splits, BLOCK_M=block_m, BLOCK_N=BLOCK_N, BLOCK_D=block_d,
        PRECISION="ieee" if fp32 else "tf32", WIDE=max(_span(key_pool), _span(value_pool)) >= 2**31,
        num_warps=warps)
    if splits > 1:
        merge[(r, kv_heads)](partial, lse, out, *partial.stride()[:4], *lse.stride()[:3], *out.stride()[:3], m,
                             D=d, SPLITS=splits, BLOCK_M=block_m, BLOCK_D=block_d, num_warps=warps)
    return out


def launch_config(m: int, d: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_D, warps) for M folded queries of head size d: power-of-two tiles of at least 16 (tl.dot's
    minimum), and 8 warps past 32 x 128 fp32 accumulators (fewer registers each: sm_90 builds of 64 x 128 take 139
    registers at 4 warps, 90 at 8)."""
    block_m = max(16, 1 << (m - 1).bit_length())
    block_d = max(16, 1 << (d - 1).bit_length())
    return block_m, block_d, 4 if block_m * block_d <= 32 * 128 else 8


def _span(t: torch.Tensor) -> int:
    """Elements from a tensor's first to its last: past 2^31 the kernel offsets keys in int64."""
    return 1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))


@functools.cache
def _kernels():
    """The two kernels, jitted on first use (importing triton here, not at module import)."""
    global tl
    import triton
    import triton.language as language

    tl = language
    return triton.jit(_attend_kernel), triton.jit(_merge_kernel)


# Triton source, jitted by `_kernels`. Scores live in base 2: `qk_scale` is scale * log2(e).

def _attend_kernel(q_ptr, k_ptr, v_ptr, table_ptr, limit_ptr, out_ptr, lse_ptr,
                   sq_r, sq_h, sq_m, sk_n, sk_h, sk_t, sv_n, sv_h, sv_t, st_r, st_n, slim_r, slim_m,
                   so_r, so_h, so_s, so_m, slse_r, slse_h, slse_s,
                   M, NB, qk_scale,
                   D: tl.constexpr, BS: tl.constexpr, SPLITS: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, PRECISION: tl.constexpr, WIDE: tl.constexpr):
    row = tl.program_id(0)
    head = tl.program_id(1)
    split = tl.program_id(2)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    in_m = offs_m < M
    in_d = offs_d < D

    limit = tl.load(limit_ptr + row * slim_r + offs_m * slim_m, mask=in_m, other=0).to(tl.int32)  # [BLOCK_M]
    length = tl.max(limit, axis=0)  # the row's keys: [0, its largest limit)
    tiles = tl.cdiv(length, BLOCK_N)
    per_split = tl.cdiv(tiles, SPLITS)
    lo = split * per_split * BLOCK_N
    hi = tl.minimum(lo + per_split * BLOCK_N, length)

    q_base = q_ptr + row * sq_r + head * sq_h
    q = tl.load(q_base + offs_m[:, None] * sq_m + offs_d[None, :], mask=in_m[:, None] & in_d[None, :], other=0.0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running max (base 2)
    l_i = tl.zeros([BLOCK_M], tl.float32)  # running sum of exponentials
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        pos = start + offs_n  # [BLOCK_N] logical key positions
        live = pos < hi
        block = tl.load(table_ptr + row * st_r + (pos // BS) * st_n, mask=live & (pos // BS < NB), other=0)
        if WIDE:
            block = block.to(tl.int64)
        offset = pos % BS
        kv_mask = live[:, None] & in_d[None, :]
        k = tl.load(k_ptr + block[:, None] * sk_n + head * sk_h + offset[:, None] * sk_t + offs_d[None, :],
                    mask=kv_mask, other=0.0)  # [BLOCK_N, BLOCK_D]
        v = tl.load(v_ptr + block[:, None] * sv_n + head * sv_h + offset[:, None] * sv_t + offs_d[None, :],
                    mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale  # [BLOCK_M, BLOCK_N]
        s = tl.where(pos[None, :] < limit[:, None], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a query that sees nothing yet: exp2(-inf) = 0
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new

    seen = l_i > 0.0
    o = acc / tl.where(seen, l_i, 1.0)[:, None]  # zeros where a query saw no key (limit 0, or none in this split)
    o_ptrs = out_ptr + row * so_r + head * so_h + split * so_s + offs_m[:, None] * so_m + offs_d[None, :]
    o_mask = in_m[:, None] & in_d[None, :]
    if SPLITS == 1:
        tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=o_mask)
    else:
        tl.store(o_ptrs, o, mask=o_mask)
        lse = tl.where(seen, m_i + tl.log2(tl.where(seen, l_i, 1.0)), float("-inf"))
        tl.store(lse_ptr + row * slse_r + head * slse_h + split * slse_s + offs_m, lse, mask=in_m)


def _merge_kernel(part_ptr, lse_ptr, out_ptr, sp_r, sp_h, sp_s, sp_m, sl_r, sl_h, sl_s, so_r, so_h, so_m, M,
                  D: tl.constexpr, SPLITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    # Each split's normalized output weighted by 2^(its log-sum-exp), online over the splits; an empty split has
    # lse -inf (weight 0), a query no split saw stays 0.
    row = tl.program_id(0)
    head = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    in_m = offs_m < M
    mask = in_m[:, None] & (offs_d[None, :] < D)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    weight = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for split in range(SPLITS):
        lse = tl.load(lse_ptr + row * sl_r + head * sl_h + split * sl_s + offs_m, mask=in_m, other=float("-inf"))
        part = tl.load(part_ptr + row * sp_r + head * sp_h + split * sp_s + offs_m[:, None] * sp_m + offs_d[None, :],
                       mask=mask, other=0.0)
        m_new = tl.maximum(m_i, lse)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        w = tl.exp2(lse - m_safe)
        weight = weight * alpha + w
        acc = acc * alpha[:, None] + part * w[:, None]
        m_i = m_new
    o = acc / tl.where(weight > 0.0, weight, 1.0)[:, None]
    tl.store(out_ptr + row * so_r + head * so_h + offs_m[:, None] * so_m + offs_d[None, :],
             o.to(out_ptr.dtype.element_ty), mask=mask)
