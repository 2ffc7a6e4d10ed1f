"""Building a `SpecEngine`: `SpecEngine.__init__` runs these stages in order, each at the line marked with its number.
  1. patch the model: our forward, fused projections, packed linears, prefill GEMMs (`patch_model`, here)
  2. plan memory: the rows and the KV pool the memory budget holds, checked against free memory before anything is
     allocated (`memory.fit_to_memory`)
  3. allocate: the block book and the queue, the per-slot device buffers (`SpecEngine._allocate`)
  4. capture: every greedy step's CUDA graph (`SpecEngine._capture`, `step_graphs.py`)
  5. start-up costs: the adaptive width's, timed on the engine's own steps (`start_up_costs.width_controller`)
"""

from __future__ import annotations

from domino_ray.backend.malloc import keep_freed_memory
from domino_ray.target.forward import install
from domino_ray.target.fused_layers import fuse_layers
from domino_ray.target.packed_linear import PackedLinear, pack_linears, weight_precision
from domino_ray.target.prefill_gemm import use_prefill_gemm


def patch_model(target, proposer) -> tuple[list, str, int | None]:
    """The target as the engine runs it: our forward (`target/forward.install`), its layers over fused projections
    (the Llama family's), and on CPU the target's and the draft's linears packed for our kernels (`packed_linear.py`),
    a bf16 target's prefills on oneDNN's bf16 GEMM where this CPU has bf16 dot products and it measures faster
    (`prefill_gemm.py`). Returns (the layers, the precision's name, e.g. "bfloat16 weights and KV, float32
    activations", the rows from which prefills take oneDNN's GEMM or None)."""
    install(target)
    if next(target.parameters()).device.type == "cpu":
        keep_freed_memory()  # the forwards' large activations reuse freed memory: `backend/malloc.py`
    layers = fuse_layers(target.get_decoder())
    pack_linears(layers, target.get_output_embeddings(), getattr(proposer, "draft", None))  # CPU, fp32
    bf16_linears = [m for layer in layers for m in layer.modules() if isinstance(m, PackedLinear) and m.bf16_panels]
    return layers, weight_precision(target), use_prefill_gemm(bf16_linears)
