"""Runs `paged_triton.paged_attention` under Triton's interpreter on CPU against a dense torch reference, one case
per entry of CASES, and prints a JSON object {"cases": {case: {"err": max |kernel - reference|, "zeros": whether
the rows whose limits are all 0 came out exactly 0, "finite": no NaN/inf in the output, "out": the output}},
"without_triton": whether the module imported and said unavailable while triton could not be imported}; with
`--compile`, builds the kernels for an H100 instead (`compile_for_sm90`). For tests/test_paged_triton.py.

A script, run in a fresh process: TRITON_INTERPRET must be set before triton is first imported (and unset for
`--compile`), and a pytest worker may have imported triton already (torch._inductor does).
"""

import json
import os
import sys
import zlib

COMPILE = sys.argv[1:2] == ["--compile"]
if not COMPILE:
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

sys.modules["triton"] = None  # `import triton` raises ImportError until the `del` below
from domino_ray.backend import paged_triton  # noqa: E402

WITHOUT_TRITON = not paged_triton.available("cuda") and not paged_triton.available("cpu")
del sys.modules["triton"]


def patch_interpreter_index():
    """Triton 3.6.0's interpreter turns a loop bound into an int with `int(array of shape (1,))`, which numpy 2.4
    refuses (triton issue #9171, fixed upstream by PR #9172 after 3.6.0): every kernel whose loop bounds are
    computed at run time (ours: each row's own key range) fails under it. Re-patch `__index__` as the fix does."""
    from triton.runtime import interpreter

    patch = interpreter._patch_lang_tensor

    def patched(tensor, scope):
        patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interpreter._patch_lang_tensor = patched


def reference(query, key_pool, value_pool, block_tables, limits, scale):
    """Dense attention in float64: each row's keys gathered through its table, each query masked by its limit."""
    r, kv_heads, m, d = query.shape
    bs = key_pool.shape[2]
    out = torch.zeros(r, kv_heads, m, d, dtype=torch.float64)
    for b in range(r):
        length = int(limits[b].max())
        if length == 0:
            continue
        blocks = block_tables[b, :(length + bs - 1) // bs].long()
        keys = key_pool[blocks].transpose(0, 1).reshape(kv_heads, -1, d)[:, :length].double()  # [Hkv, T, D]
        values = value_pool[blocks].transpose(0, 1).reshape(kv_heads, -1, d)[:, :length].double()
        scores = query[b].double() @ keys.transpose(1, 2) * scale  # [Hkv, M, T]
        hidden = torch.arange(length)[None, :] >= limits[b][:, None]  # [M, T]
        scores = scores.masked_fill(hidden, float("-inf"))
        weights = torch.softmax(scores, -1).nan_to_num(0.0)  # a query with limit 0: all -inf -> zeros
        out[b] = weights @ values
    return out


def make_case(seed, rows, kv_heads, groups, q, d, bs, nb, limit_rows, dtype, share=0, strided=False):
    """Pool, tables and folded queries for `limit_rows` (each row's key limit per query position, length q).
    Blocks are a random permutation of the pool; row 1 shares row 0's first `share` blocks. Every pool entry no
    row may see is NaN (block 0, the spare blocks, the tails past a row's largest limit) and a row's table entries
    past its blocks name NaN blocks, so a read outside a row's visible keys shows in its output. `strided`: the
    tables and limits are views with strides of 2 along each row."""
    gen = torch.Generator().manual_seed(seed)
    n = 1 + rows * nb + 3
    key_pool = torch.randn(n, kv_heads, bs, d, generator=gen)
    value_pool = torch.randn(n, kv_heads, bs, d, generator=gen)
    ids = (torch.randperm(n - 1, generator=gen) + 1).to(torch.int32)
    tables = ids[:rows * nb].reshape(rows, nb).clone()
    if share:
        tables[1, :share] = tables[0, :share]
    key_limit = torch.tensor(limit_rows, dtype=torch.int64)  # [r, q]
    limits = key_limit[:, None, :].expand(rows, groups, q).reshape(rows, groups * q)  # [r, G*q], as query_limits
    seen = torch.zeros(n, bs, dtype=torch.bool)
    for b in range(rows):
        length = int(limits[b].max())
        used = (length + bs - 1) // bs
        for p in range(length):
            seen[tables[b, p // bs], p % bs] = True
        tables[b, used:] = ids[rows * nb]  # a spare block: stale entries
    for pool in (key_pool, value_pool):
        pool.masked_fill_(~seen[:, None, :, None], float("nan"))
    query = torch.randn(rows, kv_heads, groups * q, d, generator=gen)
    if strided:
        tables = tables.repeat_interleave(2, 1)[:, ::2]  # [r, nb], strides (2 nb, 2)
        limits = limits.repeat_interleave(2, 1)[:, ::2]  # [r, M], strides (2 M, 2)
    scale = d ** -0.5
    return [t.to(dtype) for t in (query, key_pool, value_pool)] + [tables, limits, scale]


CASES = {
    # name: (make_case arguments, splits)
    "fp32_decode_bs8_ragged": (dict(rows=5, kv_heads=2, groups=1, q=1, d=16, bs=8, nb=5,
                                    limit_rows=[[1], [8], [40], [23], [0]], dtype=torch.float32), 1),
    "fp32_verify_bs16_gqa2": (dict(rows=3, kv_heads=2, groups=2, q=3, d=16, bs=16, nb=3, strided=True,
                                   limit_rows=[[17, 18, 19], [1, 2, 3], [46, 47, 48]], dtype=torch.float32), 1),
    "fp32_draft_bs16_gqa4_shared_d24": (dict(rows=3, kv_heads=1, groups=4, q=4, d=24, bs=16, nb=3, share=2,
                                             limit_rows=[[40] * 4, [36] * 4, [0] * 4], dtype=torch.float32), 1),
    "fp32_verify_bs8_gqa2_split1": (dict(rows=3, kv_heads=2, groups=2, q=2, d=16, bs=8, nb=12,
                                         limit_rows=[[95, 96], [7, 8], [0, 0]], dtype=torch.float32), 1),
    "fp32_verify_bs8_gqa2_split3": (dict(rows=3, kv_heads=2, groups=2, q=2, d=16, bs=8, nb=12,
                                         limit_rows=[[95, 96], [7, 8], [0, 0]], dtype=torch.float32), 3),
    "fp16_verify_bs16_gqa4": (dict(rows=2, kv_heads=2, groups=4, q=3, d=16, bs=16, nb=4, share=1,
                                   limit_rows=[[62, 63, 64], [30, 31, 32]], dtype=torch.float16), 1),
    "fp16_verify_bs8_gqa2_split3": (dict(rows=3, kv_heads=2, groups=2, q=2, d=16, bs=8, nb=12,
                                         limit_rows=[[95, 96], [7, 8], [0, 0]], dtype=torch.float16), 3),
}


def run(names):
    results = {}
    for name in names:
        kwargs, splits = CASES[name]
        seed = zlib.crc32(repr(sorted(kwargs.items())).encode())  # the same data for the same shapes and limits
        query, key_pool, value_pool, tables, limits, scale = make_case(seed, **kwargs)
        out = paged_triton.paged_attention(query, key_pool, value_pool, tables, limits, scale, splits=splits)
        assert out.dtype == query.dtype and out.shape == query.shape
        want = reference(query, key_pool, value_pool, tables, limits, scale)
        empty = limits.max(1).values == 0
        results[name] = {"err": (out.double() - want).abs().max().item(), "finite": bool(out.isfinite().all()),
                         "zeros": bool((out[empty] == 0).all()), "out": out.double().flatten().tolist()}
    return results


def compile_for_sm90(configs):
    """Builds each (dtype, M, D, splits, pool blocks) for sm_90 with no GPU (`build_for_sm90`): the kernels get exactly
    the arguments `paged_attention` passes (recorded from a call on meta tensors)."""
    kernels = paged_triton._kernels()
    calls = []
    paged_triton._kernels = lambda: [_Recorder(kernel, calls) for kernel in kernels]
    results = {}
    for dtype, m, d, splits, blocks in configs:
        rows, kv_heads, bs, nb = 4, 8, 16, 64
        dt = getattr(torch, dtype)
        pool = torch.empty(blocks, kv_heads, bs, d, dtype=dt, device="meta")
        query = torch.empty(rows, kv_heads, m, d, dtype=dt, device="meta")
        tables = torch.empty(rows, nb, dtype=torch.int32, device="meta")
        limits = torch.empty(rows, m, dtype=torch.int64, device="meta")
        calls.clear()
        paged_triton.paged_attention(query, pool, pool, tables, limits, d ** -0.5, splits=splits)
        for kernel, args, kwargs in calls:
            wide = "_wide" if kwargs.get("WIDE") else ""
            results[f"{dtype}_m{m}_d{d}_splits{splits}{wide}_{kernel.fn.__name__.strip('_')}"] = build_for_sm90(
                kernel, args, kwargs)
    return results


def build_for_sm90(kernel, args, kwargs) -> dict:
    """One recorded launch (`_Recorder`) built for sm_90 with triton's own ptxas, specialized as a launch specializes
    it (16-aligned pointers assumed), and read back: registers and stack bytes (spills) from the cubin, and whether
    its loads are asynchronous copies (vectorized, pipelined)."""
    import re
    import subprocess
    import tempfile

    import triton
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend, GPUTarget
    from triton.compiler import ASTSource

    tool = os.path.join(triton.__path__[0], "backends", "nvidia", "bin", "cuobjdump")
    types = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.int32: "i32",
             torch.int64: "i64"}
    kwargs = dict(kwargs)
    warps = kwargs.pop("num_warps")
    signature, constants, attrs = {}, {}, {}
    values = {**dict(zip(kernel.arg_names, args)), **kwargs}
    for i, name in enumerate(kernel.arg_names):
        value = values[name]
        if isinstance(value, torch.Tensor):
            signature[name] = "*" + types[value.dtype]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(value, float):
            signature[name] = "fp32"
        elif isinstance(value, int) and not kernel.params[i].is_constexpr:
            kind, key = native_specialize_impl(BaseBackend, value, False, True, True)
            signature[name] = kind
            if kind == "constexpr":
                constants[name] = value
            elif key == "D":
                attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            signature[name] = "constexpr"
            constants[name] = value
    built = triton.compile(ASTSource(kernel, signature, constants, attrs), target=GPUTarget("cuda", 90, 32),
                           options={"num_warps": warps})
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(built.asm["cubin"])
        cubin.flush()
        usage = subprocess.run([tool, "-res-usage", cubin.name], capture_output=True, text=True).stdout
    regs, stack = re.search(r"REG:(\d+).*?STACK:(\d+)", usage).groups()
    return {"regs": int(regs), "stack": int(stack), "async_loads": "cp.async" in built.asm["ptx"]}


class _Recorder:
    """Stands in for a jitted kernel: `kernel[grid](*args, **kwargs)` records the call instead of launching."""

    def __init__(self, kernel, calls):
        self.kernel, self.calls = kernel, calls

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.calls.append((self.kernel, args, kwargs))


# (dtype, M, D, splits, pool blocks): 2^20 blocks of 8 x 16 x 128 is past 2^31 elements (int64 key offsets)
COMPILED = [("bfloat16", 8, 128, 1, 256), ("bfloat16", 68, 128, 4, 256), ("float16", 20, 64, 1, 256),
            ("float32", 4, 128, 1, 256), ("bfloat16", 8, 128, 1, 1 << 20)]

if __name__ == "__main__":
    if COMPILE:
        print(json.dumps(compile_for_sm90(COMPILED)))
    else:
        assert paged_triton.available("cpu")
        patch_interpreter_index()
        print(json.dumps({"cases": run(sys.argv[1:] or list(CASES)), "without_triton": WITHOUT_TRITON}))
