"""Our CPU kernels (`backend/`: `library.py`, `ops.py`, `csrc/`): decode attention computes the function SDPA
computes under the engine's masks, on the engine's strided buffer views (and the engine's choice between the two);
RMSNorm and the rotary embedding compute what HF's modules and ops compute, on the engine's strided views."""

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
from domino_ray.model import layer_ops
from domino_ray.model.kv_cache import KVBuffers, group_visibility, kernel_enabled, visible_keys
from domino_ray.model.layer_ops import apply_rotary

# fp32 dot products and sums over a few hundred keys in another order, exp within ~2 ulp: relative error
# ~1e-6; 1e-5 leaves room, a wrong key, limit or head is off by O(1).
TOL = dict(rtol=1e-5, atol=1e-5)
# Scores of magnitude ~50 (sharp queries) carry absolute errors ~50x larger, and so do the weights.
SHARP_TOL = dict(rtol=1e-4, atol=1e-4)


def sdpa_reference(query, keys, values, limits, scale):
    mask = visible_keys(limits, torch.arange(keys.shape[2]), torch.float32)  # [r, 1, M, t]
    return F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, scale=scale)


def buffers_and_query(rows, heads, queries, dim, keys, *, seed=0, sharp=1.0):
    """Keys/values as the engine holds them: views `[rows, heads, keys, dim]` into larger buffers."""
    gen = torch.Generator().manual_seed(seed)
    big = torch.randn(2, rows + 2, heads, keys + 40, dim, generator=gen)  # [2, R, H, T, D]
    query = sharp * torch.randn(rows, heads, queries, dim, generator=gen)
    return query, big[0, :rows, :, :keys], big[1, :rows, :, :keys], gen


def test_the_kernel_builds_on_this_machine():
    """`make setup` builds it; a machine without a compiler would fall back to SDPA (slower, same function)."""
    assert kernels_loaded()
    assert kernel_enabled("cpu", torch.float32, 64)
    assert not kernel_enabled("cpu", torch.float64, 64) and not kernel_enabled("meta", torch.float32, 64)
    assert not kernel_enabled("cpu", torch.float32, 12)  # not a multiple of its 8-float vectors: SDPA


@pytest.mark.parametrize("dim", [8, 24, 64, 128])
@pytest.mark.parametrize("queries", [1, 3, 12, 27])
def test_same_function_as_sdpa_under_the_mask(dim, queries):
    """Limits anywhere in [1, t] (off the 8-key blocks too), sharp and flat score distributions."""
    op = ops.decode_attention
    for keys, sharp in ((1, 1.0), (7, 1.0), (61, 1.0), (300, 1.0), (300, 8.0)):
        query, k, v, gen = buffers_and_query(5, 3, queries, dim, keys, seed=keys + dim, sharp=sharp)
        limits = torch.randint(1, keys + 1, (5, queries), generator=gen)
        limits[0] = keys
        scale = dim ** -0.5
        torch.testing.assert_close(op(query, k, v, limits, scale), sdpa_reference(query, k, v, limits, scale),
                                   **(SHARP_TOL if sharp > 1 else TOL))


def test_nothing_past_a_limit_or_from_another_row_reaches_an_output():
    """Hidden keys (stale drafts) and other rows hold huge values: the outputs do not move."""
    op = ops.decode_attention
    query, k, v, gen = buffers_and_query(4, 2, 6, 64, 100)
    limits = torch.randint(1, 101, (4, 6), generator=gen)
    clean = op(query, k, v, limits, 0.125)
    buffer_k, buffer_v = k.clone(), v.clone()
    for b in range(4):
        top = int(limits[b].max())
        buffer_k[b, :, top:], buffer_v[b, :, top:] = 1e30, -1e30
    torch.testing.assert_close(op(query, buffer_k, buffer_v, limits, 0.125), clean, rtol=0, atol=0)
    # a row's output depends on that row alone
    other_k, other_v = k.clone(), v.clone()
    other_k[1:], other_v[1:] = 7.0, -7.0
    torch.testing.assert_close(op(query, other_k, other_v, limits, 0.125)[0], clean[0], rtol=0, atol=0)


def test_a_zero_limit_gives_zeros_and_a_bad_limit_an_error():
    op = ops.decode_attention
    query, k, v, _ = buffers_and_query(2, 2, 3, 16, 20)
    limits = torch.tensor([[0, 0, 0], [5, 20, 1]])
    out = op(query, k, v, limits, 0.25)
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    torch.testing.assert_close(out[1:], sdpa_reference(query[1:], k[1:], v[1:], limits[1:], 0.25), **TOL)
    with pytest.raises(RuntimeError, match="key limit 21 outside"):
        op(query, k, v, torch.tensor([[1, 1, 1], [1, 21, 1]]), 0.25)
    with pytest.raises(RuntimeError, match="head dim 12"):
        op(query[..., :12].contiguous(), k[..., :12].contiguous(), v[..., :12].contiguous(), limits, 0.25)


def test_the_engine_passes_limits_on_cpu_fp32_and_masks_otherwise():
    key_limit = torch.tensor([[3, 4], [9, 10]])  # [r, q]
    groups = ((1, 8), (2, 16))

    def buffers(dtype, head_dim=16):
        return KVBuffers(1, 2, 16, 1, head_dim, dtype, "cpu")

    limits = group_visibility(key_limit, 3, torch.arange(16), groups, buffers(torch.float32))
    assert [x.tolist() for x in limits] == [[[3, 4] * 3], [[9, 10] * 3]]  # [n, G*q]: heads of a group adjacent
    for kv in (buffers(torch.float64), buffers(torch.float32, head_dim=12)):
        masks = group_visibility(key_limit, 3, torch.arange(16), groups, kv)
        assert [tuple(m.shape) for m in masks] == [(1, 1, 6, 8), (1, 1, 6, 16)]
        assert masks[1].dtype == kv.all_keys.dtype
        assert masks[1][0, 0, 5].isfinite().tolist() == [True] * 10 + [False] * 6


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
