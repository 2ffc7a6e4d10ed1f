"""The Triton paged-prefill kernel (`backend/paged_prefill_triton.py`) under Triton's interpreter on CPU, against a
float64 dense reference, and the engine on it. Run as a script (`python tests/test_paged_prefill.py`) in a fresh
process, which prints one JSON line: TRITON_INTERPRET must be set before triton is first imported, and a pytest
worker may have imported it already (torch._inductor does).

The cases: segments laid back to back at offsets 0, inside a block and on a block boundary; lengths that are not a
multiple of a tile's queries (the direct calls take BLOCK_M 16: several tiles per segment); rows sharing prefix
blocks; GQA groups 1, 2 and 4; head size 24 (a masked head dim); fp32 and fp16 (the interpreter has no bf16). Every
pool entry at or past a row's last position, the null block and the spare blocks are NaN, so a read past a query's
keys shows.
"""

import importlib.util
import json
import os
import subprocess
import sys
import zlib
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                  reason="triton is not installed (the dev extras install it)")
# name: (segments as (offset, length), kv heads, groups, head size, block size, rows sharing prefix blocks, dtype);
# each segment is its own row, and a shared prefix is row 0's first `share` blocks, below both rows' offsets.
CASES = {
    "fp32_g1_bs8": ([(0, 13), (5, 9), (16, 20)], 2, 1, 16, 8, 0, "float32"),
    "fp32_g2_bs8_shared_d24": ([(16, 17), (19, 30), (0, 1)], 1, 2, 24, 8, 2, "float32"),
    "fp32_g4_bs16_shared": ([(32, 7), (40, 12), (3, 5)], 2, 4, 16, 16, 2, "float32"),
    "fp16_g2_bs8": ([(0, 11), (8, 19), (13, 6)], 2, 2, 16, 8, 0, "float16"),
    "fp16_g4_bs16_shared": ([(16, 9), (67, 14)], 1, 4, 16, 16, 1, "float16"),
}
# fp32: the interpreter's dots are exact fp32, so only summation order differs. fp16: the softmax weights are rounded
# to fp16 before the value dot and the output to fp16, each a relative 2^-11 of sums bounded by max |value| (about 4
# for these normal draws): 2 * 2^-11 * 4 = 3.9e-3.
TOLERANCE = {"fp32": 1e-5, "fp16": 4e-3}


@pytest.fixture(scope="module")
def results():
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(TESTS.parent)}
    done = subprocess.run([sys.executable, __file__], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


@needs_triton
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("path", ["kernel", "prefill_attention"])
def test_matches_the_dense_reference(results, case, path):
    """Each query sees its row's keys up to its own position, through the row's (possibly shared) blocks; nothing
    past them leaks (NaN there). `kernel`: every segment through the kernel, the query a strided view of [1, H, N, D];
    `prefill_attention`: the pool's Triton path (offset-0 segments by SDPA, the others by the kernel, one output)."""
    got = results["cases"][case][path]
    assert got["finite"], f"{case}/{path}: a read past a query's keys reached the output"
    assert got["err"] <= TOLERANCE[case.split("_")[0]], (case, path, got["err"])


@needs_triton
def test_the_engine_on_the_triton_path_with_chunks_and_shared_prefixes_gives_hfs_tokens(results):
    """Target-only greedy with the pool's Triton path (as on CUDA, here interpreted): prompts sharing a prefix of two
    blocks and a half, prefilled in chunks of 12 (offsets inside blocks and on their boundaries), give HF's tokens."""
    got = results["engine"]
    assert got["prefix_hit_tokens"] > 0, "no prompt started from shared blocks"
    offsets = set(got["kernel_offsets"])
    assert any(o % 8 for o in offsets) and any(o % 8 == 0 for o in offsets), offsets  # inside a block; a boundary
    assert got["tokens"] == got["hf"]


@needs_triton
@pytest.mark.slow
def test_builds_for_h100_without_spills_and_with_pipelined_loads(tmp_path):
    """The kernel, with the arguments `paged_prefill` passes at the launch config it picks, lowers to an sm_90 cubin
    with triton's own ptxas (no GPU): no register spills (stack 0) and asynchronous K/V copies, for Qwen3-4B's
    shapes in bf16, a group of 5 (a non-power-of-two fold), fp16 at head size 64, fp32, and a pool past 2^31."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(PYTHONPATH=str(TESTS.parent), TRITON_CACHE_DIR=str(tmp_path))
    done = subprocess.run([sys.executable, __file__, "--compile"], capture_output=True, text=True, timeout=300,
                          env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    built = json.loads(done.stdout.splitlines()[-1])
    assert len(built) == len(COMPILED), built
    for name, usage in built.items():
        assert usage["stack"] == 0 and usage["async_loads"], (name, usage)


def test_tiles_cover_every_query_once_and_stay_in_their_segment():
    from domino_ray.backend.paged_prefill_triton import tile_plan

    lengths, offsets, starts = [13, 1, 32, 0, 7], [0, 9, 16, 4, 40], [0, 13, 14, 46, 46]
    plan = tile_plan(starts, offsets, lengths, [0, 3, 5, 9, 9], [3, 2, 4, 0, 6], block_q=8)
    rows = [row for first, _, count, _, _ in plan for row in range(first, first + count)]
    assert sorted(rows) == list(range(sum(lengths)))  # each packed query once; the empty segment has no tile
    for first, position, count, table_start, width in plan:
        i = max(j for j in range(len(starts)) if starts[j] <= first and lengths[j])  # the tile's segment
        assert 1 <= count <= 8 and first + count <= starts[i] + lengths[i]
        assert position - offsets[i] == first - starts[i] and (table_start, width) == ([0, 3, 5, 9, 9][i],
                                                                                        [3, 2, 4, 0, 6][i])


# ---- run as a script, in a fresh process with TRITON_INTERPRET=1 ----

def make_case(seed, segments, kv_heads, groups, d, bs, share, dtype):
    """Pool `[Nb, Hkv, bs, D]`, one row per segment (random permuted blocks; row 1 takes row 0's first `share`), the
    packed queries `[1, H, N, D]` (a strided view of `[1, N, H, D]`, as HF's attention passes it) and each row's
    keys and values up to its last position `[Hkv, o + n, D]`; every pool entry no row holds is NaN."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    nbs = [-(-(o + n) // bs) for o, n in segments]
    total = 1 + sum(nbs) + 2
    key_pool = torch.randn(total, kv_heads, bs, d, generator=gen)
    value_pool = torch.randn(total, kv_heads, bs, d, generator=gen)
    ids = (torch.randperm(total - 1, generator=gen) + 1).to(torch.int32)
    tables, used, held = [], 0, torch.zeros(total, bs, dtype=torch.bool)
    for i, ((offset, n), nb) in enumerate(zip(segments, nbs)):
        table = torch.cat([ids[used:used + nb], ids[-1:]])  # [nb + 1]: a spare (NaN) block past the row's blocks
        used += nb
        if i == 1 and share:
            assert share * bs <= min(segments[0][0], offset), "a shared block lies below both rows' offsets"
            table[:share] = tables[0][0, :share]
        for p in range(offset + n):
            held[table[p // bs], p % bs] = True
        tables.append(table[None])
    for pool in (key_pool, value_pool):
        pool.masked_fill_(~held[:, None, :, None], float("nan"))
    n_total = sum(n for _, n in segments)
    query = torch.randn(1, n_total, kv_heads * groups, d, generator=gen).to(dtype).transpose(1, 2)  # [1, H, N, D]
    key_pool, value_pool = key_pool.to(dtype), value_pool.to(dtype)
    rows = []
    for (offset, n), table in zip(segments, tables):
        blocks = table[0, :-(-(offset + n) // bs)].long()
        rows.append([pool[blocks].transpose(0, 1).reshape(kv_heads, -1, d)[:, :offset + n]  # [Hkv, o + n, D]
                     for pool in (key_pool, value_pool)])
    return query, key_pool, value_pool, tables, rows


def reference(query, segments, rows, groups, scale):
    """float64 causal attention `[N, H, D]`: query j of a segment at offset o over its row's keys [0, o + j]."""
    import torch

    out, start = [], 0
    for (offset, n), (keys, values) in zip(segments, rows):
        q = query[0, :, start:start + n].double()  # [H, n, D]
        keys, values = (t.double().repeat_interleave(groups, 0) for t in (keys, values))  # [H, o + n, D]
        scores = q @ keys.transpose(1, 2) * scale  # [H, n, o + n]
        hidden = torch.arange(offset + n)[None, :] > torch.arange(offset, offset + n)[:, None]  # [n, o + n]
        out.append((torch.softmax(scores.masked_fill(hidden, float("-inf")), -1) @ values).transpose(0, 1))
        start += n
    return torch.cat(out)


def run_cases():
    import torch

    from domino_ray.backend import paged_prefill_triton
    from domino_ray.kv.pools import KVPool, prefill_attention

    results = {}
    for name, (segments, kv_heads, groups, d, bs, share, dtype) in CASES.items():
        seed = zlib.crc32(name.encode())
        query, key_pool, value_pool, tables, rows = make_case(seed, segments, kv_heads, groups, d, bs, share,
                                                              getattr(torch, dtype))
        scale = d ** -0.5
        want = reference(query, segments, rows, groups, scale)
        offsets, lengths = [o for o, _ in segments], [n for _, n in segments]
        starts = [sum(lengths[:i]) for i in range(len(lengths))]
        q = query[0].transpose(0, 1)  # [N, H, D], strided
        direct = paged_prefill_triton.paged_prefill(q, key_pool, value_pool, tables, starts, offsets, lengths, scale,
                                                    torch.full_like(q, float("nan")), block_m=16)
        pool = KVPool(1, key_pool.shape[0], bs, kv_heads, d, query.dtype, "cpu")
        pool.keys[0].copy_(key_pool)
        pool.values[0].copy_(value_pool)
        pool.kernel, pool.triton = False, True  # the CUDA path
        own = [torch.cat([row[j][:, o:] for row, (o, _) in zip(rows, segments)], 1)[None] for j in (0, 1)]
        wired = prefill_attention(query, *own, scale, tuple(lengths), tuple(offsets), tuple(tables), pool, 0)[0]
        results[name] = {path: {"err": (out.double() - want).abs().max().item(), "finite": bool(out.isfinite().all())}
                         for path, out in (("kernel", direct), ("prefill_attention", wired))}
    return results


def run_engine():
    """Target-only greedy on the pool's Triton path: two prompts sharing 20 tokens (2 whole blocks of 8), prefilled in
    chunks of 12, against HF; records the offsets the kernel saw."""
    import torch

    from domino_ray.backend import paged_prefill_triton
    from domino_ray.engine.core import SpecEngine
    from domino_ray.engine.request import Request
    from domino_ray.sample.params import SamplingParams
    from tiny_models import hf_greedy, ragged_prompts, tiny_target

    target = tiny_target("qwen3", dtype=torch.float32, head_dim=16, layers=2)
    prefix = ragged_prompts(1, seed=7, min_len=20, max_len=20)[0]
    prompts = [prefix + tail for tail in ragged_prompts(2, seed=8, min_len=5, max_len=9)]
    offsets, kernel = [], paged_prefill_triton.paged_prefill
    paged_prefill_triton.paged_prefill = lambda *a, **k: offsets.extend(a[5]) or kernel(*a, **k)
    engine = SpecEngine(target, None, max_rows=2, max_model_len=64, kv_block_size=8, kv_cache_tokens=80,
                        max_prefill_tokens=12)
    engine.runner.kv.kernel, engine.runner.kv.triton = False, True  # the CUDA path: our Triton kernels
    engine.gathers = False
    new = 3
    done = engine.generate([Request(i, p, SamplingParams(max_new_tokens=new, ignore_eos=True))
                            for i, p in enumerate(prompts)])
    return {"tokens": [c.token_ids for c in done], "hf": [hf_greedy(target, p, new) for p in prompts],
            "kernel_offsets": offsets, **engine.kv_cache_stats()}


# (dtype, query heads, K/V heads, head size, pool blocks): 2^20 blocks of 8 x 16 x 128 is past 2^31 elements
COMPILED = [("bfloat16", 32, 8, 128, 256), ("bfloat16", 40, 8, 128, 256), ("float16", 16, 8, 64, 256),
            ("float32", 32, 8, 128, 256), ("bfloat16", 32, 8, 128, 1 << 20)]


def compile_for_sm90():
    """Each of COMPILED built for sm_90 without a GPU (`paged_triton_cases.build_for_sm90`), from the launch that
    `paged_prefill` makes on meta tensors (300 queries after 17 positions)."""
    import torch

    from domino_ray.backend import paged_prefill_triton
    from paged_triton_cases import _Recorder, build_for_sm90

    calls, kernel = [], paged_prefill_triton._kernel()
    paged_prefill_triton._kernel = lambda: _Recorder(kernel, calls)
    results = {}
    for dtype, heads, kv_heads, d, blocks in COMPILED:
        dt = getattr(torch, dtype)
        query = torch.empty(300, heads, d, dtype=dt, device="meta")
        pool = torch.empty(blocks, kv_heads, 16, d, dtype=dt, device="meta")
        table = torch.empty(1, 20, dtype=torch.int32, device="meta")
        paged_prefill_triton.paged_prefill(query, pool, pool, [table], [0], [17], [300], d ** -0.5,
                                           torch.empty_like(query))
        _, args, kwargs = calls.pop()
        results[f"{dtype}_h{heads}_kv{kv_heads}_d{d}_blocks{blocks}"] = build_for_sm90(kernel, args, kwargs)
    return results


if __name__ == "__main__":
    sys.path.insert(0, str(TESTS))
    if sys.argv[1:2] == ["--compile"]:
        print(json.dumps(compile_for_sm90()))
        sys.exit()
    os.environ["TRITON_INTERPRET"] = "1"
    import torch

    from paged_triton_cases import patch_interpreter_index

    patch_interpreter_index()
    torch.set_num_threads(1)
    print(json.dumps({"cases": run_cases(), "engine": run_engine()}))
