"""Prefill's linear layers on oneDNN's bf16 GEMM, on CPUs with bf16 dot products (AVX512_BF16, AMX-BF16).

Our kernel (`packed_linear.py`) streams bf16 panels and multiplies in fp32: ahead of every GEMM at the rows a decode
or verify step has, behind oneDNN's bf16 GEMM at a prompt chunk's on a CPU that multiplies bf16 natively (SmolLM2's
projections on a Zen 4: ours 37.5 / 110.0 ms, oneDNN 36.6 / 68.1 ms at 48 / 144 rows; issue 50). oneDNN's GEMM (torch's
`F.linear` on bf16 tensors) rounds its input to bf16, as vLLM's CPU path does, and accumulates in fp32.

Only prefill forwards take it (inside `prefill_gemms()`), from the row count measured on this CPU when the engine is
built (`gemm_from_rows`); decode and verify steps keep our kernel, whose numbers for a row do not depend on the step's
shape: what keeps speculation exact on CPU (`packed_linear.py`). A prompt's KV and first token then come from oneDNN in
the speculative and the target-only engine alike, so greedy speculative == target-only holds for prompts both prefill
in the same chunks; a row recomputed after preemption, or chunked differently, may part at a counted near-tie, the rule
CUDA lives by (docs/engine.md "Verify width").
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

# The prompt-chunk sizes timed when an engine is built (rows per call)
CALIBRATION_ROWS = (32, 64, 128, 256, 512)
_STATE = threading.local()  # `on` while this thread runs a prefill forward


@contextlib.contextmanager
def prefill_gemms():
    """The linear layers called inside run as a prefill's (`PackedLinear.forward`)."""
    before = getattr(_STATE, "on", False)
    _STATE.on = True
    try:
        yield
    finally:
        _STATE.on = before


def in_prefill() -> bool:
    return getattr(_STATE, "on", False)


def bf16_gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """A linear layer on oneDNN's bf16 GEMM: `x [..., in]` rounded to bf16, `weight [out, in]` bf16, fp32 out (`bias`
    added in fp32)."""
    out = F.linear(x.to(torch.bfloat16), weight).to(x.dtype)  # [..., out]
    return out + bias if bias is not None else out


def gemm_from_rows(linear: nn.Module, rows: tuple[int, ...] = CALIBRATION_ROWS,
                   seconds: Callable[[str, int], float] | None = None) -> int | None:
    """The fewest of `rows` from which oneDNN's bf16 GEMM ("gemm") beats our kernel ("ours") on `linear` at every
    count of `rows` from there up; None where it does not win at the largest. `seconds(path, rows)`: a call's time
    (default: the best of 3 timed here)."""
    seconds = seconds or (lambda path, r: _best_seconds(linear, path, r))
    start = None
    for r in sorted(rows, reverse=True):
        if seconds("gemm", r) >= seconds("ours", r):
            break
        start = r
    return start


def _best_seconds(linear: nn.Module, path: str, rows: int, repeats: int = 3) -> float:
    from domino_ray.backend import ops

    x = torch.randn(rows, linear.in_features, generator=torch.Generator().manual_seed(rows))
    weight = linear.weight.detach().to(torch.bfloat16) if path == "gemm" else None  # [out, in]
    run = ((lambda: bf16_gemm(x, weight, linear.bias)) if path == "gemm" else
           (lambda: ops.linear(x, linear.current_pack(), linear.out_features, linear.bias)))
    run()  # warm: oneDNN picks and caches its kernel for the shape
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - started)
    return best


def use_prefill_gemm(linears: list[nn.Module], seconds: Callable[[str, int], float] | None = None) -> int | None:
    """Where this CPU multiplies bf16 natively: time the largest of `linears` (a target's `PackedLinear`s over bf16
    panels) on both paths (`gemm_from_rows`) and let all of them take oneDNN's GEMM in prefills from that row count.
    Returns it (None: prefills keep our kernel; also when the weights' bf16 copies for the GEMM would take more than a
    quarter of the available host memory). `seconds` as `gemm_from_rows` (tests; it also skips the CPU check)."""
    from domino_ray.backend.library import has_bf16_arithmetic
    from domino_ray.backend.malloc import host_memory_available

    if not linears or (seconds is None and not has_bf16_arithmetic()):
        return None
    if 2 * sum(m.weight.numel() for m in linears) > 0.25 * host_memory_available():  # the GEMM's bf16 copies
        return None
    largest = max(linears, key=lambda m: m.weight.numel())
    start = gemm_from_rows(largest, seconds=seconds)
    for m in linears:
        m.gemm_from_rows = start
    return start
