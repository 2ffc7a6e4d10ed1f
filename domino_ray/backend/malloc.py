"""glibc's allocator told to keep freed memory, for a CPU engine's large short-lived tensors.

A CPU forward allocates and frees its activations every layer. glibc serves blocks above its mmap threshold
(128 KiB, rising with use up to 32 MiB) with fresh `mmap`s and gives freed heap tops back to the kernel past
its trim threshold, so a prefill's intermediates (a 1,700-token SmolLM2 prefill: 10-20 MB a tensor) are
page-faulted in, zeroed by the kernel, again in every layer. With blocks up to 32 MiB served from the heap
and the heap never trimmed, freed memory is reused as it is (a prefill ~10% faster: docs/benchmarks-log.md). The
cost is a resident set that stays at its peak (the engine's own working set,
which it reaches again at its next prefill anyway).

Process-wide, so called where the process is the engine's (`SpecEngine` on CPU); a no-op off glibc.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os

log = logging.getLogger(__name__)

# mallopt parameters (malloc.h)
M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3
MMAP_THRESHOLD = 32 << 20   # glibc's largest (DEFAULT_MMAP_THRESHOLD_MAX on 64-bit)
TRIM_THRESHOLD = 1 << 30    # freed heap tops below this stay mapped
TOP_PAD = 64 << 20          # extra heap asked for at once, so growing the heap is rare too

_done = False


def keep_freed_memory() -> bool:
    """Set glibc's thresholds once per process; True when they are set (now or before)."""
    global _done
    if _done:
        return True
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):  # not glibc (musl, macOS): leave its allocator alone
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    _done = all(mallopt(param, value) == 1 for param, value in
                ((M_MMAP_THRESHOLD, MMAP_THRESHOLD), (M_TRIM_THRESHOLD, TRIM_THRESHOLD), (M_TOP_PAD, TOP_PAD)))
    if not _done:
        log.info("mallopt refused the allocator thresholds: large CPU tensors keep glibc's defaults")
    return _done


def host_memory_available() -> int:
    """Bytes the host can hand out without swapping: the kernel's MemAvailable (free pages plus the page cache and
    slabs it can reclaim). Free pages alone (`SC_AVPHYS_PAGES`) undercount a machine that has just read files (a CI
    runner after its installs: a few GB free, most of its memory in the cache)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:  # not Linux
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
