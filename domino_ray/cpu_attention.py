"""Decode attention on CPU by our own kernel (`csrc/decode_attention.cpp`), built once per machine.

Torch's CPU attention reads a decode step's keys at about half the rate two cores stream them (BENCHMARKS
"Our decode-attention kernel"): each (row, K/V head) is a handful of queries against a few hundred KB of keys,
a shape SDPA's flash kernel and the matmul formulations handle with GEMM machinery built for larger ones. The
kernel reads every key and value once for all the queries of its K/V group and takes each query's key limit
instead of a mask. It is fp32-only and CPU-only, for head sizes in multiples of 8; everything else (CUDA, other
dtypes, a machine where it does not build) keeps SDPA, through the same `kv_cache.row_attention`; which one
reads a set of K/V buffers is decided when they are made (`KVBuffers.kernel`).

Built with the machine's C++ compiler for its own CPU (`-march=native`) into `~/.cache/domino-ray/kernels`
(or `DOMINO_RAY_KERNEL_CACHE`), keyed by the source, the flags, torch's version and the CPU, so a changed CPU
or source builds again (~10-20 s; `make setup` builds it). `DOMINO_RAY_CPU_ATTENTION=0` turns it off
(benchmarks compare both).
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

SOURCE = Path(__file__).parent / "csrc" / "decode_attention.cpp"
CFLAGS = ["-O3", "-march=native", "-fopenmp"]  # OpenMP: at::parallel_for, on torch's own libgomp
STALE_LOCK_S = 600  # a build takes ~10-20 s; a lock this old is left by a killed one


def kernel_enabled(device: torch.device | str, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether attention over K/V of `head_dim` on `device` in `dtype` runs our kernel (fp32 on CPU, head sizes
    in multiples of its 8-float vectors, where it built)."""
    return (torch.device(device).type == "cpu" and dtype == torch.float32 and head_dim % 8 == 0
            and decode_attention_op() is not None)


@functools.cache
def decode_attention_op():
    """`torch.ops.domino_ray.decode_attention`, built or loaded on the first call; None (with a warning once)
    where it is turned off or does not build."""
    if os.environ.get("DOMINO_RAY_CPU_ATTENTION", "1") == "0":
        return None
    name = f"domino_ray_attention_{build_key()}"
    build_dir = cache_dir() / name
    try:
        from torch.utils import cpp_extension

        build_dir.mkdir(parents=True, exist_ok=True)
        remove_stale_lock(build_dir / "lock")
        if not (build_dir / f"{name}.so").exists():
            print(f"domino_ray: building the CPU attention kernel into {build_dir} (once, ~10-20 s)", file=sys.stderr,
                  flush=True)
        cpp_extension.load(name, [str(SOURCE)], extra_cflags=CFLAGS, extra_ldflags=["-fopenmp"],
                           build_directory=str(build_dir), is_python_module=False)
    except Exception as error:  # no compiler, no ninja, a failed build: SDPA still works
        warnings.warn(f"domino_ray: the CPU attention kernel did not build ({type(error).__name__}: "
                      f"{str(error)[-300:]}); decode attention uses torch's SDPA (slower on CPU)", stacklevel=2)
        return None
    return torch.ops.domino_ray.decode_attention


def remove_stale_lock(lock: Path):
    """torch's build lock: a build killed mid-way (Ctrl-C, a killed actor) leaves it, and every later build
    would wait on it forever."""
    try:
        if time.time() - lock.stat().st_mtime > STALE_LOCK_S:
            lock.unlink(missing_ok=True)
    except FileNotFoundError:
        pass


def cache_dir() -> Path:
    return Path(os.environ.get("DOMINO_RAY_KERNEL_CACHE") or "~/.cache/domino-ray/kernels").expanduser()


def build_key() -> str:
    """What the built library depends on: the source, the flags, torch, Python and the CPU (`-march=native`)."""
    parts = [SOURCE.read_bytes(), " ".join(CFLAGS).encode(), torch.__version__.encode(), sys.version.encode(),
             cpu_identity().encode()]
    return hashlib.sha256(b"\0".join(parts)).hexdigest()[:16]


def cpu_identity() -> str:
    try:  # Linux: the model and the instruction-set flags
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        return "\n".join(sorted({ln for ln in lines if ln.startswith(("model name", "flags"))}))
    except OSError:
        return platform.processor() or platform.machine()
