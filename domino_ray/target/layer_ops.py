"""RMSNorm and the rotary embedding, HF's math in HF's order: our one op each on fp32 CPU tensors
(`backend/ops.py`), HF's modules and torch's ops on anything else (other dtypes and devices, wherever autograd
records: the ops have no backward, and where our kernels do not build)."""

from __future__ import annotations

import torch

from domino_ray.backend import ops
from domino_ray.backend.library import takes

# HF's RMSNorm classes: `weight * (x * rsqrt(mean(x^2) + variance_epsilon))`, what our `rms_norm` op computes.
RMS_NORMS = {"LlamaRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm"}


def rms_norm(norm, x: torch.Tensor) -> torch.Tensor:
    """`norm(x)`: one op for an HF RMSNorm module (`RMS_NORMS`) where `takes`, the module's own forward otherwise."""
    if type(norm).__name__ in RMS_NORMS and takes(x, norm.weight):
        return ops.rms_norm(x, norm.weight, norm.variance_epsilon)
    return norm(x)


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """`apply_rotary(x, cos, sin, head_axis=2)` for x `[b, q, H, D]`, cos/sin `[b, q, D]`: one op where `takes` and D
    is a multiple of 16, torch's ops otherwise."""
    if x.shape[-1] % 16 == 0 and takes(x, cos):
        return ops.rotary(x, cos, sin)
    return apply_rotary(x, cos, sin, head_axis=2)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, head_axis: int = 1) -> torch.Tensor:
    """x `[b, H, q, D]` (`head_axis` 1) or `[b, q, H, D]` (2), cos/sin `[b, q, D]`: HF's rotary embedding, op for op
    (`x * cos + rotate_half(x) * sin`)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos.unsqueeze(head_axis) + rotated * sin.unsqueeze(head_axis)
