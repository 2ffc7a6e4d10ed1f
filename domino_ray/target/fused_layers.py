"""Our forward for Llama-family decoder layers (Llama, Qwen2, Qwen3): fused projections, fewer ops.

A decode step of a small target on CPU pays per op, not only per weight byte: HF's layer runs q, k, v, gate
and up as five GEMMs and the rotary embedding as separate passes over q and k (about 200 op calls per layer
with the engine's attention). `FusedLayer` runs the same math as one q/k/v GEMM, one gate/up GEMM and one
rotary pass over the query and key heads together. The norms and the rotary embedding are HF's math in HF's order:
on fp32 CPU tensors one op each (`layer_ops.py`), elsewhere HF's own modules and ops; so only the fused GEMMs'
and the norms' summation order may differ (fp32: within the tests' 1e-5).

On fp32 CPU tensors with the linears packed (`packed_linear.pack_linears`), a decode or verify step of up to 32
positions runs each layer as one op of ours (`csrc/decode_layer.cpp`: this forward's math calling our kernels
directly), not ~48 dispatched ops: 12-20% off a SmolLM2 step at 1 and 16 rows (docs/benchmarks-log.md "One op a layer").
Prefills, other dtypes and devices, larger steps and non-SiLU MLPs run the forward below.

No second copy of the weights: the fused `[q; k; v]` and `[gate; up]` matrices are built once and the HF
projections' weights become row-slices (views) of them, so the stock layers keep working for other callers
(HF `generate`, training, `save_pretrained`, which writes them as separate tensors).

Other architectures (and Llama-family layers with an unexpected structure) keep HF's layer (`fuse_layers`).
"""

from __future__ import annotations

import weakref

import torch
from torch import nn

from domino_ray.backend import ops
from domino_ray.target.layer_ops import RMS_NORMS, rms_norm, rotary
from domino_ray.target.packed_linear import packed_states
from domino_ray.target.forward import engine_attention, one_op_step

# The layer classes whose forward `FusedLayer` reproduces: pre-norm residual blocks, q/k/v/o attention with the
# rotary embedding on q and k (Qwen3: after a per-head RMSNorm of each), a gated MLP.
FUSABLE = {"LlamaDecoderLayer", "Qwen2DecoderLayer", "Qwen3DecoderLayer"}
# Their norms must be `layer_ops.RMS_NORMS`.
SILU = {"SiLUActivation", "SiLU"}  # HF's `ACT2FN["silu"]`, torch's module


def fuse_linears(*linears: nn.Linear) -> nn.Linear:
    """One `nn.Linear` computing `linears` side by side (outputs concatenated); each of `linears` keeps working,
    its weight and bias now views of the fused ones."""
    weight = torch.cat([m.weight.detach() for m in linears])   # [sum out, in]
    biased = [m.bias is not None for m in linears]
    if any(biased) and not all(biased):
        raise ValueError("fuse_linears: some of the layers have a bias and some do not")
    bias = torch.cat([m.bias.detach() for m in linears]) if all(biased) else None
    fused = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
    fused.weight = nn.Parameter(weight, requires_grad=False)
    if getattr(linears[0], "bf16_panels", False):  # `packed_linear.keep_bf16_weights`
        fused.bf16_panels = True
    if bias is not None:
        fused.bias = nn.Parameter(bias, requires_grad=False)
    start = 0
    for m in linears:
        stop = start + m.out_features
        m.weight = nn.Parameter(weight[start:stop], requires_grad=m.weight.requires_grad)
        if bias is not None:
            m.bias = nn.Parameter(bias[start:stop], requires_grad=m.bias.requires_grad)
        start = stop
    return fused


class FusedLayer(nn.Module):
    """One HF decoder layer's forward over fused q/k/v and gate/up projections; called as the HF layer is.

    Holds the HF layer's norms, `o_proj`, `down_proj` and activation as submodules (shared, not copied) and not
    the layer itself, so walking its modules (`pack_linears`) finds exactly the linears this forward calls.
    """

    def __init__(self, layer: nn.Module):
        super().__init__()
        attn, mlp = layer.self_attn, layer.mlp
        self.layer_idx, self.scaling, self.head_dim = attn.layer_idx, attn.scaling, attn.head_dim
        self.heads = attn.q_proj.out_features // attn.head_dim
        self.kv_heads = attn.k_proj.out_features // attn.head_dim
        self.qkv = fuse_linears(attn.q_proj, attn.k_proj, attn.v_proj)
        self.gate_up = fuse_linears(mlp.gate_proj, mlp.up_proj)
        self.intermediate = mlp.gate_proj.out_features
        self.o_proj, self.down_proj, self.act_fn = attn.o_proj, mlp.down_proj, mlp.act_fn
        self.input_layernorm, self.post_attention_layernorm = layer.input_layernorm, layer.post_attention_layernorm
        self.q_norm, self.k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)  # Qwen3
        # Whether decode steps may run as our one op (`csrc/decode_layer.cpp`): its MLP activation is SiLU's
        self.native = type(self.act_fn).__name__ in SILU and (self.q_norm is None) == (self.k_norm is None)
        self._native_args: tuple | None = None  # (the linears' weight states, (decode_layer's weights, shape, scalars))
        self._linears = (self.qkv, self.o_proj, self.gate_up, self.down_proj)  # a plain tuple: no submodule lookups

    def forward(self, hidden: torch.Tensor, *, position_embeddings: tuple[torch.Tensor, torch.Tensor], domino_rows,
                **kwargs) -> torch.Tensor:
        """hidden `[r, q, C]`, cos/sin `[r, q, D]`, the step's `RowAttention` -> `[r, q, C]` (the engine's
        forward only: other keyword arguments of HF's layer call are ignored)."""
        r, q, _ = hidden.shape
        if self.native and one_op_step(hidden, domino_rows):
            out = self._native_forward(hidden, position_embeddings, domino_rows)
            if out is not None:
                return out
        h, hkv, d = self.heads, self.kv_heads, self.head_dim
        x = self.qkv(rms_norm(self.input_layernorm, hidden)).view(r, q, h + 2 * hkv, d)  # [r, q, H + 2Hkv, D]
        query, key, value = x.split((h, hkv, hkv), 2)
        if self.q_norm is not None:
            query, key = rms_norm(self.q_norm, query), rms_norm(self.k_norm, key)
        # The rotary embedding on the query and key heads at once
        qk = torch.cat((query, key), 2) if self.q_norm is not None else x[:, :, :h + hkv]  # [r, q, H + Hkv, D]
        qk = rotary(qk, *position_embeddings)
        out, _ = engine_attention(self, qk[:, :, :h].transpose(1, 2), qk[:, :, h:].transpose(1, 2),
                                  value.transpose(1, 2), None, scaling=self.scaling, domino_rows=domino_rows)
        hidden = hidden + self.o_proj(out.reshape(r, q, h * d))
        gate, up = self.gate_up(rms_norm(self.post_attention_layernorm, hidden)).split(self.intermediate, -1)
        return hidden + self.down_proj(self.act_fn(gate) * up)

    def _native_forward(self, hidden: torch.Tensor, position_embeddings, step) -> torch.Tensor | None:
        """`forward` of a decode step as our one op over the packed weights (`csrc/decode_layer.cpp`), or None where
        a linear is not packed (`packed_linear.pack_linears`)."""
        args = self.decode_layer_args()
        if args is None:
            return None
        pool, layer = step.pool, self.layer_idx
        return ops.decode_layer(hidden, *args, pool.keys[layer], pool.values[layer], step.write_at,
                                *position_embeddings, step.keys.tables, step.limits)

    def decode_layer_args(self) -> tuple | None:
        """`decode_layer`'s weights, shape and scalars, built once (per layer and step the Python around the op was ~60
        us, ~8% of a 1-row SmolLM2 step) and again when a linear's weight changed, which packs it again; None where a
        linear is not packed. The same tuple until a weight changes (`target_forward.one_op_args` keys on it)."""
        linears = self._linears
        state = packed_states(linears)
        if state is None:
            return None
        if self._native_args is None or self._native_args[0] != state:
            (qkv, o, gate_up, down), norms = [m.current_pack() for m in linears], (self.q_norm, self.k_norm)
            weights = [self.input_layernorm.weight, qkv, self.qkv.bias, o, self.o_proj.bias,
                       self.post_attention_layernorm.weight, gate_up, self.gate_up.bias, down, self.down_proj.bias,
                       *(n.weight if n is not None else None for n in norms)]
            scalars = [self.input_layernorm.variance_epsilon, self.post_attention_layernorm.variance_epsilon,
                       *(n.variance_epsilon if n is not None else 0.0 for n in norms), self.scaling]
            self._native_args = (state, (weights, [self.heads, self.kv_heads, self.head_dim, self.intermediate], scalars))
        return self._native_args[1]


# Per decoder, its fused layers: engines built on one target share them (and their packed weights).
_FUSED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def fuse_layers(decoder: nn.Module) -> nn.ModuleList:
    """The layers the engine's forward runs over `decoder`: a `FusedLayer` for each Llama-family layer, HF's own
    layer otherwise. Built once per decoder, again if a projection's weight was replaced since."""
    layers = _FUSED.get(decoder)
    if layers is None or not all(_fused_over(mine, theirs) for mine, theirs in zip(layers, decoder.layers)):
        layers = _FUSED[decoder] = nn.ModuleList([FusedLayer(layer) if _fusable(layer) else layer
                                                  for layer in decoder.layers])
    return layers


def _fused_over(mine: nn.Module, layer: nn.Module) -> bool:
    """`mine` (from `fuse_layers`) still computes `layer`: the same module, or fused from its current weights."""
    if not isinstance(mine, FusedLayer):
        return mine is layer
    attn, mlp = layer.self_attn, layer.mlp
    return (all(_views_of(mine.qkv, m) for m in (attn.q_proj, attn.k_proj, attn.v_proj))
            and all(_views_of(mine.gate_up, m) for m in (mlp.gate_proj, mlp.up_proj))
            and attn.o_proj is mine.o_proj and mlp.down_proj is mine.down_proj)


def _views_of(fused: nn.Linear, linear: nn.Linear) -> bool:
    return linear.weight.untyped_storage().data_ptr() == fused.weight.untyped_storage().data_ptr()


def _fusable(layer: nn.Module) -> bool:
    if type(layer).__name__ not in FUSABLE:
        return False
    attn, mlp = layer.self_attn, layer.mlp
    linears = (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj)
    norms = [m for m in (layer.input_layernorm, layer.post_attention_layernorm, getattr(attn, "q_norm", None),
                         getattr(attn, "k_norm", None)) if m is not None]
    # Anything a subclass or a hook might have changed keeps HF's forward
    return (all(isinstance(m, nn.Linear) for m in linears) and all(type(m).__name__ in RMS_NORMS for m in norms)
            and not any(m._forward_hooks or m._forward_pre_hooks for m in (layer, attn, mlp, *linears, *norms)))
