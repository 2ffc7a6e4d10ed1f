"""Our own pass over a stock HF decoder (Qwen3, Llama): per-row KV buffers, hidden-state taps, no masks.

We run `embed_tokens`, the model's rotary embedding, each decoder layer and `norm` ourselves, so the
hidden states the draft needs are taken between layers (no `output_hidden_states` capture), and no
4-D mask is ever built. The layers stay HF's own: only their attention function is ours, installed
through transformers' attention-function registration under the name `domino_ray`. It reads the
`RowAttention` passed through the layers' keyword arguments; any other caller of the model (HF
`generate`, training, a test oracle) passes none and gets stock SDPA, so the model keeps working
outside the engine.

For the Llama and Qwen3 layers (`FUSED_LAYERS`) our pass runs the layer's few lines itself over fused
weights: q/k/v as one GEMM and gate/up as one (`fuse_projections`: the stock modules' weights become
slices of the fused matrices, so nothing is copied and HF's own forward still works), and none of the
per-layer Python of HF's modules. The norms, the rotary function and the activation are the layer's own.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from domino_ray.kv_cache import KVBuffers, causal_prefill_attention, grouped_attention

ATTENTION = "domino_ray"
# Decoder layers whose forward `_fused_layer` reproduces (pre-norm attention + gated MLP; Qwen3 adds q/k norms).
FUSED_LAYERS = ("LlamaDecoderLayer", "Qwen3DecoderLayer")


@dataclass
class RowAttention:
    """What one forward's attention needs, shared by every layer.

    Decode: new keys go to `write_index [r, q]` of slots `0..r`; each slot range of `key_groups`
    (`((stop, t), ...)`, `key_groups.py`) attends over its first `t` buffer positions where its mask in
    `visible` says (`kv_cache.group_masks`). Prefill (`prefill_rows` set): the new keys are positions `0..m`
    of slots `prefill_rows`, attention is causal over them.
    """
    buffers: KVBuffers
    write_index: torch.Tensor
    visible: tuple[torch.Tensor, ...] = ()
    key_groups: tuple[tuple[int, int], ...] = ()
    prefill_rows: slice | None = None


def _attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, domino_rows=None, **kwargs):
    """HF attention-function signature: query `[r, H, q, D]`, key/value `[r, Hkv, q, D]` (rotated) ->
    (`[r, q, H, D]`, None)."""
    if domino_rows is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                      **kwargs)
    step, layer = domino_rows, module.layer_idx
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    if step.prefill_rows is not None:
        step.buffers.write(layer, step.prefill_rows, step.write_index, key, value)
        return causal_prefill_attention(query, key, value, scale), None
    rows = slice(0, query.shape[0])
    step.buffers.write(layer, rows, step.write_index, key, value)
    return grouped_attention(query, step.buffers, layer, step.key_groups, step.visible, scale), None


def install(target) -> None:
    """Route the target's attention through `_attention` (stock SDPA for callers other than the engine)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTENTION, _attention)
    AttentionMaskInterface.register(ATTENTION, sdpa_mask)  # HF's own forward still builds its SDPA masks
    layer_types = set(getattr(target.config, "layer_types", None) or ["full_attention"])
    if layer_types != {"full_attention"}:
        raise ValueError(f"target layer types {sorted(layer_types)}: only full-attention decoders are supported")
    target.config._attn_implementation = ATTENTION
    fuse_projections(target.get_decoder())


def fuse_projections(decoder) -> None:
    """Each `FUSED_LAYERS` layer gets `fused_qkv` and `fused_gate_up` (weight, bias or None) and its q/k/v and
    gate/up modules' weights become views of them (once; no memory added)."""
    for layer in decoder.layers:
        if type(layer).__name__ in FUSED_LAYERS and not hasattr(layer, "fused_qkv"):
            attn, mlp = layer.self_attn, layer.mlp
            layer.fused_qkv = _fuse(attn.q_proj, attn.k_proj, attn.v_proj)
            layer.fused_gate_up = _fuse(mlp.gate_proj, mlp.up_proj)


def _fuse(*linears: nn.Linear) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One `[sum N, C]` weight (and bias) whose row slices replace the linears' own."""
    weight = torch.cat([lin.weight.detach() for lin in linears])
    bias = torch.cat([lin.bias.detach() for lin in linears]) if linears[0].bias is not None else None
    start = 0
    for lin in linears:
        n = lin.weight.shape[0]
        lin.weight = nn.Parameter(weight[start:start + n], requires_grad=False)
        if bias is not None:
            lin.bias = nn.Parameter(bias[start:start + n], requires_grad=False)
        start += n
    return weight, bias


def _fused_layer(layer, hidden: torch.Tensor, rotary, attention: RowAttention) -> torch.Tensor:
    """HF's Llama/Qwen3 decoder layer over the fused weights: hidden `[r, q, C]` -> `[r, q, C]`."""
    attn, mlp = layer.self_attn, layer.mlp
    r, q, _ = hidden.shape
    qkv = F.linear(layer.input_layernorm(hidden), *layer.fused_qkv)  # [r, q, (H + 2 Hkv) D]
    sizes = (attn.q_proj.weight.shape[0], attn.k_proj.weight.shape[0], attn.v_proj.weight.shape[0])
    queries, keys, values = (x.view(r, q, -1, attn.head_dim) for x in qkv.split(sizes, -1))  # [r, q, h, D]
    if hasattr(attn, "q_norm"):  # Qwen3
        queries, keys = attn.q_norm(queries), attn.k_norm(keys)
    rotate = sys.modules[type(attn).__module__].apply_rotary_pos_emb
    queries, keys = rotate(queries.transpose(1, 2), keys.transpose(1, 2), *rotary)  # [r, h, q, D]
    out, _ = _attention(attn, queries, keys, values.transpose(1, 2), None, scaling=attn.scaling,
                        domino_rows=attention)  # [r, q, H, D]
    hidden = hidden + attn.o_proj(out.reshape(r, q, -1))
    gate, up = F.linear(layer.post_attention_layernorm(hidden), *layer.fused_gate_up).chunk(2, -1)
    return hidden + mlp.down_proj(mlp.act_fn(gate) * up)


def run_decoder(decoder, input_ids: torch.Tensor, positions: torch.Tensor, attention: RowAttention,
                tap_layers: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """input_ids/positions `[r, q]` -> (normed last hidden `[r, q, C]`, taps `[r, q, L*C]` or None).

    `tap_layers`: decoder layers whose outputs feed the draft, as HF's `hidden_states[l + 1]` (which is
    after the final norm for the last layer).
    """
    hidden = decoder.embed_tokens(input_ids)              # [r, q, C]
    rotary = decoder.rotary_emb(hidden, positions)        # cos, sin [r, q, D]
    taps = {}
    for i, layer in enumerate(decoder.layers):
        if hasattr(layer, "fused_qkv"):
            hidden = _fused_layer(layer, hidden, rotary, attention)
        else:
            hidden = layer(hidden, attention_mask=None, position_ids=positions, position_embeddings=rotary,
                           domino_rows=attention)
        if i in tap_layers:
            taps[i] = hidden
    hidden = decoder.norm(hidden)
    taps[len(decoder.layers) - 1] = hidden
    return hidden, (torch.cat([taps[i] for i in tap_layers], -1) if tap_layers else None)
