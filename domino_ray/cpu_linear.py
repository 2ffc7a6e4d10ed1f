"""Linear layers over MKL-packed weights, for decoding on CPU.

At the rows a CPU engine decodes (a few to a hundred positions per forward), fp32 `F.linear` is far from
the weight-read bound: on the 2-core VM the 211 projections of a SmolLM2-shaped model take 47-49 ms at 16 rows
against 20-22 ms at one. MKL's packed GEMM (each weight reordered once into its kernel's layout; torch
exposes it as `mkl::_mkl_linear`, what inductor's freezing uses) takes 37 ms at 16 rows, 26-32 ms at 4-8,
46 at 32 and 63 at 64 (F.linear 35-47, 54-59, 79-85): 15-30% less; at 1-2 rows and from ~144 it gains
nothing, so those stay on `F.linear` (BENCHMARKS "Packed weights": a 16-row step 11% faster).

The packed copy is the weight's size again, so `pack_linears` packs what the engine holds on CPU in fp32 when
the copies fit. The modules stay `nn.Linear`s with their own weights: state dicts and other callers are
unchanged, whenever autograd records they run `F.linear` (the packed op has no backward), and a weight changed
in place or replaced after packing (an optimizer step, `load_state_dict`) is packed again on its next call.
"""

from __future__ import annotations

import logging
import os

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger(__name__)

# Rows (positions) per call that take the packed path; outside, F.linear is as fast or faster. And the batch
# the weights are packed for, which MKL's packing depends on although any batch may use it: packed for 4, a
# 16-row call is no faster than F.linear; for 64 it is the fastest over 4-64 rows and no slower up to 256.
PACKED_ROWS = range(4, 129)
PACKED_FOR = 64


class PackedLinear(nn.Linear):
    """An `nn.Linear` that also holds its weight packed for MKL (`packed_weight`, not in the state dict)."""

    packed_weight: torch.Tensor
    packed_from: tuple[int, int]  # the weight's (data_ptr, version) when packed

    def pack(self):
        weight = self.weight.detach()
        self.packed_weight = torch.ops.mkl._mkl_reorder_linear_weight(weight, PACKED_FOR)
        self.packed_from = (weight.data_ptr(), self.weight._version)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        recording = torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad)
        if recording or rows not in PACKED_ROWS:
            return F.linear(x, self.weight, self.bias)
        if self.packed_from != (self.weight.data_ptr(), self.weight._version):
            self.pack()
        # The op's last argument must equal the input's rows, or it runs F.linear on the unpacked weight.
        return torch.ops.mkl._mkl_linear(x, self.packed_weight, self.weight, self.bias, rows)


def can_pack(model: nn.Module) -> bool:
    """fp32 weights on CPU and a torch built with MKL's packed GEMM."""
    weight = next(model.parameters(), None)
    return (weight is not None and weight.device.type == "cpu" and weight.dtype == torch.float32
            and torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_linear"))


def pack_linears(*models: nn.Module | None, budget_share: float = 0.25) -> int:
    """Turn every `nn.Linear` of `models` (those `can_pack`; None is skipped) into a `PackedLinear`, in place
    (the same module objects: references held elsewhere see the packed path too). Only when the copies fit in
    `budget_share` of the available host memory; otherwise nothing is packed and the reason is logged. Returns
    the bytes the packed copies take (0: nothing packed)."""
    linears = {id(m): m for model in models if model is not None and can_pack(model)
               for m in model.modules() if type(m) is nn.Linear}
    if not linears:
        return 0
    need = sum(m.weight.numel() * m.weight.element_size() for m in linears.values())
    available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    if need > budget_share * available:
        log.info("not packing the linear layers for MKL: the copies (%.2f GiB) would take more than %.0f%% of "
                 "the %.1f GiB of host memory available", need / 2**30, 100 * budget_share, available / 2**30)
        return 0
    for m in linears.values():
        m.__class__ = PackedLinear
        m.pack()
    log.info("packed %d linear layers for MKL (%.2f GiB)", len(linears), need / 2**30)
    return need
