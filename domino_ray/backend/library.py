"""Our CPU kernels' library (`csrc/`), built once per machine and loaded into torch (`ops.py` calls its ops).

fp32 activations on CPU only (the linear kernel also reads bf16 weights: `packed_linear.keep_bf16_weights`); CUDA,
other dtypes and a machine where they do not build keep torch's ops. Built with
the machine's C++ compiler for its own CPU (`-march=native`) into `~/.cache/domino-ray/kernels` (or
`DOMINO_RAY_KERNEL_CACHE`), keyed by the sources, the flags, torch's version and the CPU, so a changed CPU or
source builds again (~10-30 s; `make setup` builds them). `DOMINO_RAY_CPU_KERNELS=0` turns them off
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
SOURCES = [CSRC / name for name in ("registration.cpp", "decode_attention.cpp", "layer_ops.cpp", "linear.cpp",
                                     "decode_layer.cpp", "domino_head.cpp")]
HEADERS = [CSRC / "vectors.h", CSRC / "ops.h"]
STALE_LOCK_S = 600  # a build takes ~10-30 s; a lock this old is left by a killed one


def takes(x: torch.Tensor, other: torch.Tensor) -> bool:
    """Whether our ops run on `x` (with `other`, e.g. a norm's weight or the rotary table): fp32 on CPU, nothing for
    autograd to record (the ops have no backward), the library loaded."""
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
            print(f"domino_ray: building our CPU kernels into {build_dir} (once, ~10-30 s)", file=sys.stderr,
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


def build_key(csrc: Path = CSRC) -> str:
    """What the built library depends on: the sources and headers (`csrc`), the flags, torch, Python and the CPU
    (for `-march=native`), and where the sources are: torch's build file names them by path, so two checkouts of the
    same sources (a git worktree, a `ray job submit --working-dir` copy) sharing one build directory would rebuild it
    in turn, each time the other had built."""
    files = [csrc / path.name for path in SOURCES + HEADERS]
    parts = [*(path.read_bytes() for path in files), " ".join(compile_flags()).encode(), torch.__version__.encode(),
             sys.version.encode(), cpu_identity().encode(), str(csrc.resolve()).encode()]
    return hashlib.sha256(b"\0".join(parts)).hexdigest()[:16]


def has_avx512() -> bool:
    """Whether this CPU has AVX-512 (its own build takes the linear kernel's AVX-512 tiles, not the AVX2 ones)."""
    return "avx512f" in cpu_identity()


def has_bf16_arithmetic() -> bool:
    """Whether this CPU multiplies bf16 natively (AVX512_BF16: Zen 4, Cooper Lake and later Xeons; AMX: Sapphire
    Rapids and later): where `model.dtype: auto` picks bfloat16 on CPU."""
    flags = cpu_identity().split()
    return "avx512_bf16" in flags or "amx_bf16" in flags


def cpu_identity() -> str:
    try:  # Linux: the model and the instruction-set flags
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        return "\n".join(sorted({ln for ln in lines if ln.startswith(("model name", "flags"))}))
    except OSError:
        return platform.processor() or platform.machine()
