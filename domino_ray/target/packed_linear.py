"""Linear layers over packed weights, for decoding on CPU: our kernel (`csrc/linear.cpp`).

At the rows a CPU engine decodes (a few to a hundred positions per forward), fp32 `F.linear` is far from
the weight-read bound. Our kernel reads the weight packed once into panels of 16 output columns, streamed once a
call with a prefetch while chunks of up to 8 rows accumulate in registers block by block.

Every decode and verify step up to `OUR_ROWS` positions takes our kernel, whatever its size, and prefills beyond
take `F.linear` (on a CPU with bf16 dot products, a bf16 model's prefills take oneDNN's bf16 GEMM from a measured
row count: `prefill_gemm.py`). Our kernel gives a row the same numbers whatever batch it is in, so a verify of W + 1 positions
computes each position's logits bit for bit as a one-position step would (with the other ops of a step, per row as
well): speculative decoding is then invariant to the verify's shape on CPU, sampled rows included
(`tests/test_shape_invariance.py`). That is why no other GEMM (MKL's, oneDNN's) takes a verify, even at row counts
where one measures faster: it rounds differently, so a wide verify could pick another sample than target-only's
one-position steps (figures by row count: docs/benchmarks-log.md "bf16 on CPU").

`pack_linears` packs what the engine holds on CPU in fp32 when the copy fits and our kernels built
(`backend/library.py`).

`model.dtype: bfloat16` on CPU (`keep_bf16_weights`): the modules turn fp32 and each linear layer's panels keep the
weight in bf16, half the bytes a decode step streams; our kernel widens each weight exactly and computes in fp32, so
a bf16 checkpoint's linear layers compute what its fp32 copy's do, bit for bit (the same sums in the same order). The
KV pools are bf16 then too (`kv_dtype`), each key and value rounded once as it is written.

The modules stay `nn.Linear`s with their own weights: state dicts and other callers are unchanged, whenever autograd
records they run `F.linear` (the packed ops have no backward), and a weight changed in place or replaced after
packing (an optimizer step, `load_state_dict`) is packed again on its next call.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from domino_ray.backend import ops
from domino_ray.backend.library import kernels_loaded
from domino_ray.backend.malloc import host_memory_available
from domino_ray.target.prefill_gemm import bf16_gemm, in_prefill

log = logging.getLogger(__name__)

# Rows (positions) per call that take our kernel: every decode and verify step up to 64 rows x 16 positions; larger
# calls (prefills) take `F.linear`'s GEMM.
OUR_ROWS = range(1, 1025)
# Positions of a step whose layers may run as one op each (`one_op_layers`) and whose Domino head runs in C++.
ONE_OP_POSITIONS = range(1, 33)


class PackedLinear(nn.Linear):
    """An `nn.Linear` that also holds its weight packed for our kernel (`packed_weight`, not in the state dict).
    `bf16_panels` (set by `keep_bf16_weights`): the panels in bf16."""

    packed_weight: torch.Tensor
    packed_from: tuple[int, int]  # the weight's (data_ptr, version) when packed
    bf16_panels: bool = False
    gemm_from_rows: int | None = None  # prefill calls of this many rows or more take oneDNN's bf16 GEMM (prefill_gemm)

    def pack(self):
        weight = self.weight.detach()
        self.packed_weight = pack_as(weight, self)
        self.packed_from = weight_state(self.weight)

    def current_pack(self) -> torch.Tensor:
        """The packed weight for our kernel, packed again if the weight changed since."""
        if self.packed_from != weight_state(self.weight):
            self.pack()
        return self.packed_weight

    def gemm_weight(self) -> torch.Tensor:
        """The weight in bf16 for oneDNN's GEMM (`prefill_gemm.bf16_gemm`), made again if the weight changed since (as
        `current_pack`)."""
        state = weight_state(self.weight)
        if getattr(self, "_gemm_from", None) != state:
            self._gemm_weight, self._gemm_from = self.weight.detach().to(torch.bfloat16), state
        return self._gemm_weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        if torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad):
            return F.linear(x, self.weight, self.bias)
        if self.gemm_from_rows is not None and rows >= self.gemm_from_rows and in_prefill():
            return bf16_gemm(x, self.gemm_weight(), self.bias)
        if rows not in OUR_ROWS:
            return F.linear(x, self.weight, self.bias)
        return ops.linear(x, self.current_pack(), self.out_features, self.bias)


def pack_as(weight: torch.Tensor, like: nn.Module) -> torch.Tensor:
    """`weight` packed for our kernel in the panels' dtype of the linear layer `like` (bf16 after `keep_bf16_weights`):
    for weights built from a layer's (fused projections, the draft's context projections)."""
    return ops.pack_linear(weight.to(torch.bfloat16) if getattr(like, "bf16_panels", False) else weight)


def one_op_layers(kernel_attention: bool, positions: int) -> bool:
    """Whether a decode step's layers may each run as our `decode_layer` op: attention by our CPU kernel
    (`KVPool.kernel`: fp32 on CPU, block tables and key limits), `positions` (rows x queries) within
    `ONE_OP_POSITIONS`, and nothing for autograd to record (the op has no backward). The target's layers and the draft
    block's ask it."""
    return kernel_attention and positions in ONE_OP_POSITIONS and not torch.is_grad_enabled()


def packed_states(linears) -> tuple | None:
    """Each of `linears`' weight state (data_ptr, version), to key what is built from their packed weights (rebuilt
    when a weight changed, as `current_pack` packs it again); None unless all are `PackedLinear`s. Runs for every layer
    of every step: `_parameters` directly (`m.weight` goes through `Module.__getattr__`, ~1 us a lookup; this way the
    check over a layer's four linears takes ~1.5 us instead of ~8)."""
    states = []
    for m in linears:
        if not isinstance(m, PackedLinear):
            return None
        weight = m._parameters["weight"]
        states.append(weight_state(weight))
    return tuple(states)


def can_pack(model: nn.Module) -> bool:
    """fp32 weights on CPU and our kernels built."""
    weight = next(model.parameters(), None)
    return weight is not None and weight.device.type == "cpu" and weight.dtype == torch.float32 and kernels_loaded()


def pack_linears(*models: nn.Module | None, budget_share: float = 0.25) -> int:
    """Turn every `nn.Linear` of `models` (those `can_pack`; None is skipped) into a `PackedLinear`, in place
    (the same module objects: references held elsewhere see the packed path too). Only when the packed copies fit in
    `budget_share` of the available host memory; otherwise nothing is packed and the reason is logged. Returns
    the bytes the packed copies take (0: nothing packed)."""
    linears = {id(m): m for model in models if model is not None and can_pack(model)
               for m in model.modules() if type(m) is nn.Linear}
    if not linears:
        return 0
    need = sum(m.weight.numel() * (2 if getattr(m, "bf16_panels", False) else 4)  # the panels
               for m in linears.values())
    available = host_memory_available()
    if need > budget_share * available:
        log.info("not packing the linear layers: the copies (%.2f GiB) would take more than %.0f%% of "
                 "the %.1f GiB of host memory available", need / 2**30, 100 * budget_share, available / 2**30)
        return 0
    for m in linears.values():
        m.__class__ = PackedLinear
        m.pack()
    log.info("packed %d linear layers for our kernel (%.2f GiB)", len(linears), need / 2**30)
    return need


def weight_state(weight: torch.Tensor) -> tuple[int, int]:
    """(data_ptr, version): what a pack was made from. Tensors made under inference mode (a model built inside it)
    keep no version counter: their version is 0 (they cannot be changed in place outside inference mode)."""
    return weight.data_ptr(), 0 if weight.is_inference() else weight._version


def keep_bf16_weights(*models: nn.Module | None, budget_share: float = 0.25) -> bool:
    """CPU, `model.dtype: bfloat16` (`llm.build_engine`, before the proposer copies any weight): bf16 `models` (None
    skipped) turn fp32 in place, each `nn.Linear` marked to pack its weight into bf16 panels (`PackedLinear`): the
    linear layers stream bf16, everything else computes in fp32. Only on CPU, with our kernels, and when the fp32
    copies and the panels (4 more bytes a parameter) fit in `budget_share` of the available host memory; otherwise the
    models stay as they are (torch's bf16 ops) and the reason is logged. True when converted."""
    present = [m for m in models if m is not None]
    weight = next(present[0].parameters(), None) if present else None
    if weight is None or weight.device.type != "cpu" or weight.dtype != torch.bfloat16:
        return False
    if not kernels_loaded():
        log.info("model.dtype=bfloat16 on CPU runs torch's bf16 ops: our CPU kernels are off or did not build")
        return False
    params = {id(p): p.numel() for m in present for p in m.parameters()}  # shared weights once
    need, available = 4 * sum(params.values()), host_memory_available()
    if need > budget_share * available:
        log.info("model.dtype=bfloat16 on CPU runs torch's bf16 ops: fp32 activations with bf16 panels need %.2f GiB "
                 "more, over %.0f%% of the %.1f GiB available", need / 2**30, 100 * budget_share, available / 2**30)
        return False
    for model in present:
        for m in model.modules():
            if type(m) is nn.Linear:
                m.bf16_panels = True
        model.float()
    return True


def weight_precision(model: nn.Module) -> str:
    """What `model` computes in, for reports: "bfloat16 weights and KV, float32 activations" after `keep_bf16_weights`,
    otherwise its dtype's name."""
    if has_bf16_panels(model):
        return "bfloat16 weights and KV, float32 activations"
    return str(next(model.parameters()).dtype).removeprefix("torch.")


def kv_dtype(model: nn.Module) -> torch.dtype:
    """The dtype of `model`'s KV pool: bf16 after `keep_bf16_weights` (our attention kernel widens it as it reads),
    otherwise its parameters'."""
    return torch.bfloat16 if has_bf16_panels(model) else next(model.parameters()).dtype


def has_bf16_panels(model: nn.Module) -> bool:
    return any(getattr(m, "bf16_panels", False) for m in model.modules())
