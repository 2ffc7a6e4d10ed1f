"""Our CPU kernels (`backend/`: `library.py`, `ops.py`, `csrc/`): decode attention over the paged KV pool computes
the function softmax attention computes over each row's visible keys gathered from its blocks; a decoder layer as one
op computes the layer in torch's ops, attending to the keys it writes; RMSNorm and the rotary embedding compute what
HF's modules and ops compute, on the engine's strided views."""

import importlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from domino_ray.backend import ops
from domino_ray.backend.library import STALE_LOCK_S, build_key, cache_dir, has_avx512, kernels_loaded
from domino_ray.target import layer_ops
from domino_ray.kv.pools import kernel_enabled
from domino_ray.target.layer_ops import apply_rotary

# The reference in fp64; the kernel's fp32 dot products and sums over a few hundred keys in another order, exp within
# ~2 ulp: relative error ~1e-6; 1e-5 leaves room, a wrong key, block, limit or head is off by O(1).
TOL = dict(rtol=1e-5, atol=1e-5)
# Scores of magnitude ~50 (sharp queries) carry absolute errors ~50x larger, and so do the weights.
SHARP_TOL = dict(rtol=1e-4, atol=1e-4)


def paged_reference(query, key_pool, value_pool, block_tables, limits, scale):
    """Each row's blocks gathered into dense keys `[r, Hkv, nb*bs, D]`, SDPA in fp64 under the limits' mask; a limit
    of 0 gives zeros. Table entries past a row's blocks may be anything: clamped here, masked anyway."""
    r, nb = block_tables.shape
    _, heads, bs, dim = key_pool.shape
    ids = block_tables.long().clamp(0, key_pool.shape[0] - 1)

    def dense(pool):  # [r, nb, Hkv, bs, D] -> [r, Hkv, nb*bs, D]
        return pool[ids].transpose(1, 2).reshape(r, heads, nb * bs, dim).double()

    visible = torch.arange(nb * bs) < limits[:, None, :, None]  # [r, 1, M, T]
    out = F.scaled_dot_product_attention(query.double(), dense(key_pool), dense(value_pool),
                                         attn_mask=visible, scale=scale)
    return torch.where(limits[:, None, :, None] > 0, out, 0.0).float()


def paged_inputs(rows, heads, queries, dim, block_size, blocks_per_row, *, shared=2, seed=0, sharp=1.0):
    """A pool with more blocks than the rows use, each row's table a random (permuted, non-contiguous) pick of block
    ids, its first `shared` the same for every row (a shared prefix); block 0 (the null block) used by none."""
    assert kernels_loaded()  # builds or loads the library (`ops` only calls it)
    gen = torch.Generator().manual_seed(seed)
    blocks = 1 + shared + rows * (blocks_per_row - shared) + 5
    pool = torch.randn(2, blocks, heads, block_size, dim, generator=gen)  # K, V: [2, N, Hkv, bs, D]
    ids = 1 + torch.randperm(blocks - 1, generator=gen)
    own = ids[shared:shared + rows * (blocks_per_row - shared)].view(rows, -1)
    tables = torch.cat([ids[:shared].expand(rows, shared), own], 1).to(torch.int32)  # [r, nb]
    query = sharp * torch.randn(rows, heads, queries, dim, generator=gen)
    return query, pool[0], pool[1], tables, gen


def ragged_limits(rows, groups, positions, block_size, blocks_per_row, gen):
    """`[r, G*q]`, the heads of a K/V group adjacent: a full table, a draft block ending on a block boundary, a verify
    block's causal tail ending off the 8-key blocks, random limits, small ones within the first block, zeros among
    small ones."""
    top = block_size * blocks_per_row
    patterns = [torch.full((positions,), top), torch.full((positions,), block_size * (blocks_per_row // 2)),
                block_size + 2 + torch.arange(1, positions + 1), torch.randint(1, top + 1, (positions,), generator=gen),
                torch.randint(1, 10, (positions,), generator=gen), torch.randint(0, 3, (positions,), generator=gen)]
    per_row = torch.stack([patterns[b % len(patterns)] for b in range(rows)])  # [r, q]
    limits = per_row.repeat(1, groups)  # [r, G*q]
    if groups * positions > 1:  # the random row's queries differ per head too
        limits[3 % rows] = torch.randint(1, top + 1, (groups * positions,), generator=gen)
    return limits


def with_stale_entries(tables, limits, block_size, value):
    """Table entries past each row's blocks set to `value` (stale ids the kernel must neither read nor check)."""
    tables = tables.clone()
    for b in range(tables.shape[0]):
        tables[b, -(-int(limits[b].max()) // block_size):] = value
    return tables


def test_the_kernel_builds_on_this_machine():
    """`make setup` builds it; a machine without a compiler would fall back to SDPA (slower, same function)."""
    assert kernels_loaded()
    assert kernel_enabled("cpu", torch.float32, 64)
    assert not kernel_enabled("cpu", torch.float64, 64) and not kernel_enabled("meta", torch.float32, 64)
    assert not kernel_enabled("cpu", torch.float32, 12)  # not a multiple of its 8-float vectors: SDPA


@pytest.mark.parametrize("dim", [8, 24, 64, 128])
@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("groups,positions", [(1, 1), (3, 1), (3, 4), (4, 9)])
def test_paged_attention_computes_attention_over_each_rows_blocks(dim, block_size, groups, positions):
    """Permuted block tables sharing a prefix, GQA-folded queries, limits on and off the block and 8-key boundaries
    (zeros too), stale entries past each row's blocks; flat and sharp score distributions."""
    blocks_per_row = -(-300 // block_size)  # ~300 keys a row
    for sharp in (1.0, 8.0):
        query, keys, values, tables, gen = paged_inputs(6, 2, groups * positions, dim, block_size, blocks_per_row,
                                                        seed=dim + block_size + positions, sharp=sharp)
        limits = ragged_limits(6, groups, positions, block_size, blocks_per_row, gen)
        scale = dim ** -0.5
        stale = with_stale_entries(tables, limits, block_size, -1)
        torch.testing.assert_close(ops.decode_attention(query, keys, values, stale, limits, scale),
                                   paged_reference(query, keys, values, tables, limits, scale),
                                   **(SHARP_TOL if sharp > 1 else TOL))


def test_nothing_outside_a_rows_visible_keys_reaches_its_output():
    """Every other block (the null block, other rows' blocks, free ones) and the tail of a row's last block hold huge
    keys and values: the row's output is bitwise the same; and a query's output is bitwise the same with the keys
    between its limit and its row's largest poisoned too."""
    block_size = 16
    query, keys, values, tables, gen = paged_inputs(4, 2, 6, 64, block_size, 7)
    limits = torch.tensor([[100] * 6, [37] * 6, [16] * 6, [3, 9, 50, 64, 64, 21]])  # [r, M]
    clean = ops.decode_attention(query, keys, values, tables, limits, 0.125)
    for b in range(4):
        n = int(limits[b].max())
        for cutoff, check in ((n, (b,)), (int(limits[b].min()), (b, slice(None), int(limits[b].argmin())))):
            visible = torch.zeros(keys.shape[0], block_size, dtype=torch.bool)  # [N, bs]
            for p in range(cutoff):
                visible[tables[b, p // block_size], p % block_size] = True
            hidden = ~visible[:, None, :, None]  # [N, 1, bs, 1]
            poisoned = ops.decode_attention(query, keys.masked_fill(hidden, 1e30), values.masked_fill(hidden, -1e30),
                                            tables, limits, 0.125)
            assert torch.equal(poisoned[check], clean[check]), (b, cutoff)
            assert not torch.equal(keys.masked_fill(hidden, 1e30), keys)  # the poison is there


def test_a_zero_limit_gives_zeros():
    query, keys, values, tables, _ = paged_inputs(3, 2, 3, 16, 8, 3)
    limits = torch.tensor([[0, 0, 0], [5, 0, 24], [0, 1, 0]])
    out = ops.decode_attention(query, keys, values, tables, limits, 0.25)
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    assert torch.equal(out[1, :, 1], torch.zeros_like(out[1, :, 1])) and out[1, :, 0].abs().sum() > 0
    torch.testing.assert_close(out, paged_reference(query, keys, values, tables, limits, 0.25), **TOL)


def test_bad_inputs_raise_with_what_is_wrong():
    query, keys, values, tables, _ = paged_inputs(2, 2, 3, 16, 8, 4)  # nb = 4, bs = 8: limits up to 32
    limits = torch.tensor([[1, 1, 1], [1, 32, 1]])
    op = ops.decode_attention
    op(query, keys, values, tables, limits, 0.25)
    with pytest.raises(RuntimeError, match=r"key limit 33 of row 1 outside \[0, 32\]"):
        op(query, keys, values, tables, torch.tensor([[1, 1, 1], [1, 33, 1]]), 0.25)
    n = keys.shape[0]
    for bad in (n, -1):
        wrong = tables.clone()
        wrong[1, 3] = bad  # read by row 1 (limit 32)
        with pytest.raises(RuntimeError, match=rf"block id {bad} \(row 1, block 3\) out of range for a pool of {n}"):
            op(query, keys, values, wrong, limits, 0.25)
    for bs in (24, 4):  # a multiple of 8 but not a power of two; a power of two under 8
        pool = torch.zeros(keys.shape[0], 2, bs, 16)
        with pytest.raises(RuntimeError, match=f"block size {bs} must be a power of two and a multiple of 8"):
            op(query, pool, pool, tables, torch.ones(2, 3, dtype=torch.long), 0.25)
    with pytest.raises(RuntimeError, match="head dim 12"):
        op(query[..., :12].contiguous(), keys[..., :12].contiguous(), values[..., :12].contiguous(), tables, limits,
           0.25)
    with pytest.raises(RuntimeError, match="int32 block_tables"):
        op(query, keys, values, tables.long(), limits, 0.25)
    with pytest.raises(RuntimeError, match="pools must be contiguous"):
        op(query, keys.transpose(1, 2).contiguous().transpose(1, 2), values, tables, limits, 0.25)


def random_layer(channels, heads, kv_heads, dim, inter, gen):
    """A Llama-family layer's weights (a q/k/v bias, as Qwen2's) as `decode_layer` takes them, and as torch tensors."""
    def w(*shape):
        return torch.randn(*shape, generator=gen) * shape[-1] ** -0.5

    t = dict(ln1=1 + 0.1 * torch.randn(channels, generator=gen), qkv=w((heads + 2 * kv_heads) * dim, channels),
             qkv_bias=0.1 * torch.randn((heads + 2 * kv_heads) * dim, generator=gen), o=w(channels, heads * dim),
             ln2=1 + 0.1 * torch.randn(channels, generator=gen), gate_up=w(2 * inter, channels),
             down=w(channels, inter))
    weights = [t["ln1"], ops.pack_linear(t["qkv"]), t["qkv_bias"], ops.pack_linear(t["o"]), None, t["ln2"],
               ops.pack_linear(t["gate_up"]), None, ops.pack_linear(t["down"]), None, None, None]
    return weights, t


def layer_reference(hidden, t, shape, eps, key_pool, value_pool, rows_at, cos, sin, tables, limits):
    """The layer in torch's ops: the step's keys/values written at `rows_at` of the pools (in place), then attention
    over the pool (`paged_reference`), o_proj, the SwiGLU MLP."""
    r, q, _ = hidden.shape
    heads, kv_heads, dim, inter = shape

    def rms(x, weight):
        return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))

    qkv = F.linear(rms(hidden, t["ln1"]), t["qkv"], t["qkv_bias"]).view(r, q, heads + 2 * kv_heads, dim)
    qk = apply_rotary(qkv[:, :, :heads + kv_heads], cos, sin, head_axis=2)  # [r, q, H + Hkv, D]
    key_pool.view(-1, dim)[rows_at] = qk[:, :, heads:].reshape(-1, dim)  # row (i*q + p)*Hkv + h
    value_pool.view(-1, dim)[rows_at] = qkv[:, :, heads + kv_heads:].reshape(-1, dim)
    folded = qk[:, :, :heads].transpose(1, 2).reshape(r, kv_heads, -1, dim)  # [r, Hkv, G*q, D]
    attended = paged_reference(folded, key_pool, value_pool, tables, limits, dim ** -0.5)
    out = hidden + F.linear(attended.view(r, heads, q, dim).transpose(1, 2).reshape(r, q, heads * dim), t["o"])
    gate, up = F.linear(rms(out, t["ln2"]), t["gate_up"]).split(inter, -1)
    return out + F.linear(F.silu(gate) * up, t["down"])


def test_decode_layers_write_the_steps_keys_then_attend_to_them():
    """A verify step (3 positions a row, causal: each sees the keys the step writes before it and its own) over rows
    whose positions cross a block boundary, two rows sharing a prefix block: `decode_layer` computes the layer in
    torch's ops and writes what it writes; `decode_layers` is `decode_layer` after `decode_layer`, with its taps."""
    assert kernels_loaded()
    gen = torch.Generator().manual_seed(0)
    r, q, channels, heads, kv_heads, dim, inter, bs, nb, eps = 3, 3, 64, 4, 2, 16, 96, 8, 4, 1e-6
    shape, scalars = [heads, kv_heads, dim, inter], [eps, eps, 0.0, 0.0, dim ** -0.5]
    blocks = 1 + r * nb + 2
    tables = (1 + torch.randperm(blocks - 1, generator=gen)[:r * nb]).view(r, nb).to(torch.int32)
    tables[2, 0] = tables[1, 0]  # rows 1 and 2 share their first block (a prefix, written by neither)
    lens = torch.tensor([6, 16, 21])
    positions = lens[:, None] + torch.arange(q)  # [r, q]
    limits = (positions + 1).repeat(1, heads // kv_heads)  # [r, G*q]
    block = tables.long().gather(1, positions // bs)  # [r, q]
    rows_at = (((block[:, :, None] * kv_heads + torch.arange(kv_heads)) * bs + (positions % bs)[:, :, None])
               .reshape(-1))  # [r*q*Hkv]: (i*q + p)*Hkv + h
    inv_freq = 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim))
    freqs = torch.cat([positions[..., None] * inv_freq] * 2, -1)  # [r, q, D]
    cos, sin = freqs.cos(), freqs.sin()
    hidden = torch.randn(r, q, channels, generator=gen)
    layers = [random_layer(channels, heads, kv_heads, dim, inter, gen) for _ in range(2)]
    pools = [torch.randn(2, blocks, kv_heads, bs, dim, generator=gen) for _ in layers]  # K, V each

    ref_pools = [p.clone() for p in pools]
    ref_hidden = [hidden]
    for (_, t), pool in zip(layers, ref_pools):
        ref_hidden.append(layer_reference(ref_hidden[-1], t, shape, eps, pool[0], pool[1], rows_at, cos, sin, tables,
                                          limits))
    one_pools = [p.clone() for p in pools]
    one = [hidden]
    for (weights, _), pool in zip(layers, one_pools):
        one.append(ops.decode_layer(one[-1], weights, shape, scalars, pool[0], pool[1], rows_at, cos, sin, tables,
                                    limits))
    for got, ref in zip(one[1:], ref_hidden[1:]):
        torch.testing.assert_close(got, ref, **TOL)
    for got, ref, before in zip(one_pools, ref_pools, pools):
        torch.testing.assert_close(got, ref, **TOL)
        assert not torch.equal(got, before)  # the step's keys were written

    all_pools = [p.clone() for p in pools]
    last, tap = ops.decode_layers(hidden, [w for weights, _ in layers for w in weights], shape * 2, scalars * 2,
                                  [p[0] for p in all_pools], [p[1] for p in all_pools], rows_at, cos, sin, tables,
                                  limits, [0])
    assert torch.equal(tap, one[1]) and torch.equal(last, one[2])
    assert all(torch.equal(a, b) for a, b in zip(all_pools, one_pools))


def test_the_build_key_follows_the_sources_and_their_place(tmp_path):
    """The same sources elsewhere (a worktree, a job's working-dir copy) build into their own directory: torch's build
    file names the sources by path, so sharing one would rebuild it in turn. Changed sources get a new key too."""
    from domino_ray.backend.library import CSRC

    copy = shutil.copytree(CSRC, tmp_path / "csrc")
    assert build_key(CSRC) == build_key() and build_key(copy) != build_key()
    before = build_key(copy)
    (copy / "ops.h").write_text((CSRC / "ops.h").read_text() + "\n")  # the same place, a header changed
    assert build_key(copy) != before


def test_a_build_lock_left_by_a_killed_build_does_not_hang_the_next(tmp_path):
    """The built library copied into a new cache with an old lock beside it (as a killed build leaves it): a new
    process loads the kernel instead of waiting on the lock forever."""
    assert kernels_loaded()
    name = f"domino_ray_kernels_{build_key()}"
    shutil.copytree(cache_dir() / name, tmp_path / name)
    lock = tmp_path / name / "lock"
    lock.touch()
    old = lock.stat().st_mtime - STALE_LOCK_S - 60
    os.utime(lock, (old, old))
    code = "from domino_ray.backend.library import kernels_loaded; assert kernels_loaded()"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120,
                   env={**os.environ, "DOMINO_RAY_KERNEL_CACHE": str(tmp_path)})
    assert not lock.exists()


KERNEL_TESTS = ["tests/test_cpu_kernels.py", "tests/test_cpu_linear.py", "tests/test_fused_layers.py"]


@pytest.mark.slow
@pytest.mark.skipif(not has_avx512(), reason="this CPU builds the AVX2 kernels itself")
def test_the_avx2_build_passes_the_kernel_tests():
    """The linear kernel's tiles depend on the instruction set (`#ifdef __AVX512F__`): an AMD EPYC of our 2-core
    kind (AVX2, no AVX-512) builds the other ones. On an AVX-512 machine the kernels are built for `haswell` too
    (once per machine, ~35 s), checked to hold no AVX-512 register, and the kernels' tests run on that build."""
    root = Path(__file__).parent.parent
    env = {**os.environ, "DOMINO_RAY_KERNEL_MARCH": "haswell"}
    code = ("from domino_ray.backend.library import kernels_loaded, build_key, cache_dir, compile_flags; "
            "assert kernels_loaded() and '-march=haswell' in compile_flags(); "
            "print(cache_dir() / f'domino_ray_kernels_{build_key()}')")
    build = Path(subprocess.run([sys.executable, "-c", code], env=env, check=True, capture_output=True, text=True,
                                timeout=600).stdout.strip())
    library = build / f"{build.name}.so"
    if shutil.which("objdump"):
        disassembly = subprocess.run(["objdump", "-d", str(library)], check=True, capture_output=True, text=True).stdout
        assert "ymm" in disassembly and "zmm" not in disassembly
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "not avx2_build",
                          *KERNEL_TESTS], cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:]
    assert " passed" in run.stdout and "skipped" not in run.stdout, run.stdout[-3000:]


@pytest.mark.parametrize("norm_class", ["LlamaRMSNorm", "Qwen3RMSNorm"])
def test_rms_norm_computes_the_hf_module(norm_class):
    """Rows whole or strided (a Qwen3 q/k-norm reads head slices of the fused q/k/v output), feature counts on and
    off the 8-float vectors; fp32 sums of squares in another order: the dtype's tolerance."""
    module_of = {"LlamaRMSNorm": "models.llama.modeling_llama", "Qwen3RMSNorm": "models.qwen3.modeling_qwen3"}
    cls = getattr(importlib.import_module(f"transformers.{module_of[norm_class]}"), norm_class)
    gen = torch.Generator().manual_seed(0)
    for features in (8, 20, 64, 576):
        norm = cls(features, eps=1e-6)
        with torch.no_grad():
            norm.weight.copy_(torch.randn(features, generator=gen))
        fused = torch.randn(3, 5, 7, features, generator=gen) * 4  # [b, q, heads, D]: heads 2..4 are a strided view
        for x in (fused, fused[:, :, 2:5], fused[1]):
            with torch.inference_mode():
                got = layer_ops.rms_norm(norm, x)
            assert got.is_contiguous() and got.shape == x.shape
            torch.testing.assert_close(got, norm(x).detach())


@pytest.mark.parametrize("dim", [16, 64, 128])
def test_rotary_computes_hf_rotate_half(dim):
    """The query and key heads of the fused q/k/v output (a strided view), cos/sin of real positions."""
    gen = torch.Generator().manual_seed(dim)
    qkv = torch.randn(4, 3, 9, dim, generator=gen)  # [b, q, H + 2Hkv, D]
    positions = torch.randint(0, 4000, (4, 3), generator=gen)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim))
    freqs = torch.cat([positions[..., None] * inv_freq] * 2, -1)  # [b, q, D]
    cos, sin = freqs.cos(), freqs.sin()
    with torch.inference_mode():
        got = layer_ops.rotary(qkv[:, :, :6], cos, sin)
    assert got.is_contiguous()
    torch.testing.assert_close(got, apply_rotary(qkv[:, :, :6], cos, sin, head_axis=2))


def test_layer_ops_fall_back_to_torch_where_they_do_not_apply():
    """float64 tensors and head sizes off the kernel's 16 run torch's ops; the op itself refuses them."""
    x = torch.randn(2, 3, 4, 24)
    cos, sin = torch.randn(2, 3, 24), torch.randn(2, 3, 24)
    torch.testing.assert_close(layer_ops.rotary(x, cos, sin), apply_rotary(x, cos, sin, head_axis=2))
    with pytest.raises(RuntimeError, match="multiple of 16"):
        ops.rotary(x, cos, sin)
    x64 = torch.randn(3, 8, dtype=torch.float64)
    norm = type("Norm", (), {"weight": torch.ones(8, dtype=torch.float64), "variance_epsilon": 1e-6,
                             "__call__": lambda self, v: v * 2})()
    assert torch.equal(layer_ops.rms_norm(norm, x64), x64 * 2)  # the module's own forward
    x32 = torch.randn(3, 8)
    norm.weight = torch.ones(8)
    with torch.inference_mode():  # fp32, but not one of HF's RMSNorm classes (a final norm of another family)
        assert torch.equal(layer_ops.rms_norm(norm, x32), x32 * 2)
    with pytest.raises(RuntimeError, match="fp32"):
        ops.rms_norm(x64, norm.weight, 1e-6)
