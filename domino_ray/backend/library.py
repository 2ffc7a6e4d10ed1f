"""Our CPU kernels (`csrc/`), built once per machine: decode attention, RMSNorm, the rotary embedding and linear
layers at decode batch sizes (`cpu_linear.py`).

Decode attention (`csrc/decode_attention.cpp`): torch's CPU attention reads a decode step's keys at about half
the rate two cores stream them (BENCHMARKS "Our decode-attention kernel"): each (row, K/V head) is a handful of
queries against a few hundred KB of keys, a shape SDPA's flash kernel and the matmul formulations handle with
GEMM machinery built for larger ones. The kernel reads every key and value once for all the queries of its K/V
group and takes each query's key limit instead of a mask. For head sizes in multiples of 8; which attention reads
a set of K/V buffers is decided when they are made (`KVBuffers.kernel`), through `kv_cache.row_attention`.

RMSNorm and the rotary embedding (`csrc/layer_ops.cpp`): HF's are 8 and 9 dispatched torch ops, and at the rows
a CPU engine decodes each op's overhead outweighs its arithmetic (BENCHMARKS "Our layer ops and linear kernel").
`rms_norm` and `rotary` run one op each on fp32 CPU tensors and HF's ops on anything else
(`fused_layers.FusedLayer`; the draft's own norms and rotary embedding too, through `takes`). So does `kv_write`,
a step's new keys and values into the KV buffers (`KVBuffers.write`, target and draft): torch's `index_copy_` of
the transposed keys was 8 ops a layer, and its call cost grows cold: ~50 us after a linear layer's weights have
streamed through the caches, 5 us hot (SmolLM2 at 16 rows, a layer's write in the engine: 71-75 us against 22-24
for ours, `work/kvw/percall.py`).

A whole Llama-family layer of a decode step (`csrc/decode_layer.cpp`, `fused_layers.FusedLayer`): the ops above and
the linear kernel called from C++ (their entry points in `csrc/ops.h`), the views as pointer arithmetic. So the draft's
context update (`context_update`, same file) and the Domino head's corrections (`csrc/domino_head.cpp`).

All fp32 and CPU only; CUDA, other dtypes and a machine where they do not build keep torch's ops. Built with
the machine's C++ compiler for its own CPU (`-march=native`) into `~/.cache/domino-ray/kernels` (or
`DOMINO_RAY_KERNEL_CACHE`), keyed by the sources, the flags, torch's version and the CPU, so a changed CPU or
source builds again (~10-20 s; `make setup` builds them). `DOMINO_RAY_CPU_KERNELS=0` turns them off
(benchmarks compare both). `DOMINO_RAY_KERNEL_MARCH` builds for another CPU than this one: `haswell` (AVX2 + FMA)
is what an AMD EPYC of our 2-core kind compiles (the linear kernel's tiles are ISA-specific), so an AVX-512 machine
can test that build too (the suite does: `tests/test_cpu_kernels.py`).
"""

from __future__ import annotations

import functools
import hashlib
import os
import platform
import sys
import time
import warnings
from pathlib import Path

import torch

CSRC = Path(__file__).parent / "csrc"
SOURCES = [CSRC / name for name in ("decode_attention.cpp", "layer_ops.cpp", "linear.cpp", "decode_layer.cpp",
                                     "domino_head.cpp")]
HEADERS = [CSRC / "vectors.h", CSRC / "ops.h"]
STALE_LOCK_S = 600  # a build takes ~10-20 s; a lock this old is left by a killed one


def kernel_enabled(device: torch.device | str, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether attention over K/V of `head_dim` on `device` in `dtype` runs our kernel (fp32 on CPU, head sizes
    in multiples of its 8-float vectors, where it built)."""
    return (torch.device(device).type == "cpu" and dtype == torch.float32 and head_dim % 8 == 0
            and decode_attention_op() is not None)


def decode_attention_op():
    """`torch.ops.domino_ray.decode_attention`; None where our kernels are off or do not build."""
    return torch.ops.domino_ray.decode_attention if kernels_loaded() else None


# HF's RMSNorm classes: `weight * (x * rsqrt(mean(x^2) + variance_epsilon))`, what our `rms_norm` op computes.
RMS_NORMS = {"LlamaRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm"}


def rms_norm(norm, x: torch.Tensor) -> torch.Tensor:
    """`norm(x)`: one op for an HF RMSNorm module (`RMS_NORMS`) on fp32 CPU tensors, the module's own forward
    otherwise (any other norm, other devices and dtypes, and wherever autograd records: the op has no backward)."""
    if type(norm).__name__ in RMS_NORMS and takes(x, norm.weight):
        return torch.ops.domino_ray.rms_norm(x, norm.weight, norm.variance_epsilon)
    return norm(x)


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """`draft.apply_rotary(x, cos, sin, head_axis=2)` for x `[b, q, H, D]`, cos/sin `[b, q, D]`: one op on fp32 CPU
    tensors with D a multiple of 16, torch's ops otherwise."""
    if x.shape[-1] % 16 == 0 and takes(x, cos):
        return torch.ops.domino_ray.rotary(x, cos, sin)
    from domino_ray.spec.draft import apply_rotary  # here: draft imports kv_cache, which imports this module

    return apply_rotary(x, cos, sin, head_axis=2)


def kv_write(key_buffer: torch.Tensor, value_buffer: torch.Tensor, at: torch.Tensor, keys: torch.Tensor,
             values: torch.Tensor) -> bool:
    """`keys/values [b, Hkv, q, D]` into rows `at` of the buffers seen as `[rows, D]` (`kv_cache.KVBuffers.write`) as
    one op, on fp32 CPU tensors with the last dims contiguous; False (nothing written) otherwise."""
    if not (takes(keys, values) and key_buffer.dtype == keys.dtype and key_buffer.is_contiguous()
            and value_buffer.is_contiguous() and keys.stride(-1) == 1 and values.stride(-1) == 1):
        return False
    torch.ops.domino_ray.kv_write(key_buffer, value_buffer, at, keys, values)
    return True


def takes(x: torch.Tensor, other: torch.Tensor) -> bool:
    """Whether our layer ops run on `x` (with `other`, the norm's weight or the rotary table): fp32 on CPU, nothing
    for autograd to record."""
    recording = torch.is_grad_enabled() and (x.requires_grad or other.requires_grad)
    return x.dtype == torch.float32 and x.device.type == "cpu" and not recording and kernels_loaded()


@functools.cache
def kernels_loaded() -> bool:
    """Our kernels' library built or loaded (on the first call); False (with a warning once) where they are turned
    off or do not build."""
    if os.environ.get("DOMINO_RAY_CPU_KERNELS", "1") == "0":
        return False
    name = f"domino_ray_kernels_{build_key()}"
    build_dir = cache_dir() / name
    try:
        from torch.utils import cpp_extension

        build_dir.mkdir(parents=True, exist_ok=True)
        remove_stale_lock(build_dir / "lock")
        if not (build_dir / f"{name}.so").exists():
            print(f"domino_ray: building our CPU kernels into {build_dir} (once, ~10-20 s)", file=sys.stderr,
                  flush=True)
        cpp_extension.load(name, [str(source) for source in SOURCES], extra_cflags=compile_flags(),
                           extra_ldflags=["-fopenmp"], build_directory=str(build_dir), is_python_module=False)
    except Exception as error:  # no compiler, no ninja, a failed build: SDPA still works
        warnings.warn(f"domino_ray: our CPU kernels did not build ({type(error).__name__}: "
                      f"{str(error)[-300:]}); torch's ops run instead (SDPA, HF's norms: slower on CPU)", stacklevel=2)
        return False
    return True


def remove_stale_lock(lock: Path):
    """torch's build lock: a build killed mid-way (Ctrl-C, a killed actor) leaves it, and every later build
    would wait on it forever."""
    try:
        if time.time() - lock.stat().st_mtime > STALE_LOCK_S:
            lock.unlink(missing_ok=True)
    except FileNotFoundError:
        pass


def compile_flags() -> list[str]:
    """`-march` from `DOMINO_RAY_KERNEL_MARCH` (default `native`, this CPU); OpenMP: at::parallel_for, on torch's own
    libgomp."""
    return ["-O3", f"-march={os.environ.get('DOMINO_RAY_KERNEL_MARCH') or 'native'}", "-fopenmp"]


def cache_dir() -> Path:
    return Path(os.environ.get("DOMINO_RAY_KERNEL_CACHE") or "~/.cache/domino-ray/kernels").expanduser()


def build_key() -> str:
    """What the built library depends on: the sources and headers, the flags, torch, Python and the CPU (for
    `-march=native`)."""
    parts = [*(path.read_bytes() for path in SOURCES + HEADERS), " ".join(compile_flags()).encode(),
             torch.__version__.encode(), sys.version.encode(), cpu_identity().encode()]
    return hashlib.sha256(b"\0".join(parts)).hexdigest()[:16]


def has_avx512() -> bool:
    """Whether this CPU has AVX-512 (its own build takes the linear kernel's AVX-512 tiles, not the AVX2 ones)."""
    return "avx512f" in cpu_identity()


def cpu_identity() -> str:
    try:  # Linux: the model and the instruction-set flags
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        return "\n".join(sorted({ln for ln in lines if ln.startswith(("model name", "flags"))}))
    except OSError:
        return platform.processor() or platform.machine()
