"""Counter-based uniforms on the device: per-row randomness without generators or host syncs.

A row's uniform for a token is a pure function of (its seed, the token's position), so a request's
samples are reproducible from its seed whatever else shares the batch and however many drafts each
step verified, and a step needs no host work: splitmix64 (Steele et al.) over int64 tensors, whose
multiplications wrap.
"""

from __future__ import annotations

import torch

_GOLDEN = -7046029254386353131   # 0x9e3779b97f4a7c15 as a signed int64
_M1 = -4658895280553007687       # 0xbf58476d1ce4e5b9
_M2 = -7723592293110705685       # 0x94d049bb133111eb


def _shift_right(x: torch.Tensor, s: int) -> torch.Tensor:
    """Logical (unsigned) right shift of int64."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def _mix(x: torch.Tensor) -> torch.Tensor:
    x = (x ^ _shift_right(x, 30)) * _M1
    x = (x ^ _shift_right(x, 27)) * _M2
    return x ^ _shift_right(x, 31)


def counter_uniforms(seeds: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
    """Uniforms `[r, q]` in [0, 1) (float64, 53 random bits) for rows with int64 `seeds [r]` at int64
    `counters [r, q]` (the engine uses a token's absolute position in its row)."""
    bits = _mix(_mix(seeds[:, None] * _GOLDEN + 1) + counters * _GOLDEN)
    return _shift_right(bits, 11).double() * 2.0 ** -53
