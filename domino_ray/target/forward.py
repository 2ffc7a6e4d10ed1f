"""Our own pass over a stock HF decoder (Qwen3, Llama): a paged KV pool, hidden-state taps, no masks.

We run `embed_tokens`, the model's rotary embedding, each decoder layer and `norm` ourselves, so the
hidden states the draft needs are taken between layers (no `output_hidden_states` capture), and the keys
and values go to the engine's paged pool (`kv/pools.py`). The layers are the engine's (`fused_layers.py`: our forward for the Llama family
over the same weights, HF's own layer otherwise); the attention function is ours either way, installed
through transformers' attention-function registration under the name `domino_ray`. It reads the
`RowAttention` passed through the layers' keyword arguments; any other caller of the model (HF
`generate`, training, a test oracle) passes none and gets stock SDPA, so the model keeps working
outside the engine.
"""

from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass

import torch

from domino_ray.backend import ops
from domino_ray.kv.pools import KVPool, StepKeys, paged_attention, prefill_attention
from domino_ray.target.layer_ops import rms_norm
from domino_ray.target.packed_linear import one_op_layers

ATTENTION = "domino_ray"


@dataclass
class RowAttention:
    """What one forward's attention needs, shared by every layer.

    Every layer writes its new keys at `write_at` (`KVPool.flat_index`: flat rows of its pool) first. Decode: slots
    `0..r` attend over their own blocks (`keys`, `kv_cache.StepKeys`), each folded query below its key limit
    (`limits [r, G*q]`, `kv_cache.query_limits`). Prefill (`prefill_lengths` set): prompt segments back to back in one
    row of queries, segment i `prefill_lengths[i]` tokens from position `prefill_offsets[i]`, reading its row's
    earlier positions through `prefill_tables[i]` (`kv_cache.prefill_attention`).
    """
    pool: KVPool
    write_at: torch.Tensor
    keys: StepKeys | None = None
    limits: torch.Tensor | None = None
    prefill_lengths: tuple[int, ...] = ()
    prefill_offsets: tuple[int, ...] = ()
    prefill_tables: tuple = ()
    native: bool | None = None  # whether the step's fused layers run as our one op (`one_op_step`), decided once


def one_op_step(hidden: torch.Tensor, step: RowAttention | None) -> bool:
    """Whether a layer's forward over `hidden` may be our one op: an engine decode step (not a prefill) that
    `packed_linear.one_op_layers` takes. The same for every layer of a forward: decided once."""
    if step is None or step.prefill_lengths:
        return False
    if step.native is None:
        step.native = one_op_layers(step.pool.kernel, hidden.shape[0] * hidden.shape[1])
    return step.native


# Per list of layers: (each layer's `FusedLayer.decode_layer_args` when flattened, `decode_layers`' arguments from them)
_ONE_OP: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def one_op_args(layers, hidden: torch.Tensor, step: RowAttention) -> tuple | None:
    """`decode_layers`' weights, shapes, scalars, key and value buffers where every layer of this decode step runs as
    our one op (`fused_layers.FusedLayer`, its weights packed), else None: each layer then runs on its own."""
    if not one_op_step(hidden, step):
        return None
    per_layer = []
    for i, layer in enumerate(layers):
        args = layer.decode_layer_args() if getattr(layer, "native", False) and layer.layer_idx == i else None
        if args is None:
            return None
        per_layer.append(args)  # a new tuple when a weight changed
    cached = _ONE_OP.get(layers)
    if cached is None or len(cached[0]) != len(per_layer) or any(a is not b for a, b in zip(cached[0], per_layer)):
        cached = _ONE_OP[layers] = (per_layer, decode_layers_args(per_layer))
    return (*cached[1], step.pool.keys, step.pool.values)  # layer i's KV is the pool's i-th


def decode_layers_args(per_layer) -> tuple[list, list, list]:
    """Each layer's `decode_layer` (weights, shape, scalars), in order, as `decode_layers`' three flat lists."""
    return tuple([x for layer_args in per_layer for x in layer_args[i]] for i in range(3))


def engine_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, domino_rows=None, **kwargs):
    """HF attention-function signature: query `[r, H, q, D]`, key/value `[r, Hkv, q, D]` (rotated) ->
    (`[r, q, H, D]`, None)."""
    if domino_rows is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                      **kwargs)
    step, layer = domino_rows, module.layer_idx
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    step.pool.write(layer, step.write_at, key, value)
    if step.prefill_lengths:
        return prefill_attention(query, key, value, scale, step.prefill_lengths, step.prefill_offsets,
                                 step.prefill_tables, step.pool, layer), None
    keys = step.keys
    return paged_attention(query, step.pool, layer, keys.tables, step.limits, scale, keys.key_len, keys.splits), None


def install(target) -> None:
    """Route the target's attention through `engine_attention` (stock SDPA for callers other than the engine)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTENTION, engine_attention)
    AttentionMaskInterface.register(ATTENTION, sdpa_mask)  # HF's own forward still builds its SDPA masks
    layer_types = set(getattr(target.config, "layer_types", None) or ["full_attention"])
    if layer_types != {"full_attention"}:
        raise ValueError(f"target layer types {sorted(layer_types)}: only full-attention decoders are supported")
    target.config._attn_implementation = ATTENTION


# HF's rope types whose cos/sin depend on the position alone ("dynamic" and "longrope" also on the lengths seen)
STATIC_ROPE = {"default", "linear", "llama3"}


def rotary_table(decoder, length: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The decoder's rotary cos/sin `[T, D]` of every position below `length`, computed by its own rotary embedding,
    for `run_decoder` to look up (computed per forward they took 44 us of the demo target's one-row step, 75-90 us of
    SmolLM2's); None for a rope type outside `STATIC_ROPE`."""
    rotary = decoder.rotary_emb
    if getattr(rotary, "rope_type", None) not in STATIC_ROPE:
        return None
    positions = torch.arange(length, device=rotary.inv_freq.device)[None]  # [1, T]
    cos, sin = rotary(torch.empty(0, dtype=dtype, device=positions.device), positions)
    return cos[0], sin[0]


def run_decoder(decoder, layers, input_ids: torch.Tensor, positions: torch.Tensor, attention: RowAttention,
                tap_layers: tuple[int, ...], join_taps: bool = True, cos_sin: tuple | None = None
                ) -> tuple[torch.Tensor, torch.Tensor | list | None]:
    """input_ids/positions `[r, q]` -> (normed last hidden `[r, q, C]`, taps `[r, q, L*C]` or None); `join_taps`
    False: the taps as the tap layers' own outputs `[[r, q, C], ...]`, not concatenated (the engine's ring of deferred
    taps holds them as they are); `cos_sin`: a `rotary_table` to look the positions up in (None: the decoder's rotary
    embedding computes them).

    `layers`: the decoder's layers as the engine runs them (`fused_layers.fuse_layers`: ours for the Llama
    family, HF's otherwise). `tap_layers`: decoder layers whose outputs feed the draft, as HF's
    `hidden_states[l + 1]` (which is after the final norm for the last layer).
    """
    hidden = decoder.embed_tokens(input_ids)              # [r, q, C]
    rotary = (cos_sin[0][positions], cos_sin[1][positions]) if cos_sin is not None else \
        decoder.rotary_emb(hidden, positions)  # cos, sin [r, q, D]
    taps = {}
    one_op = one_op_args(layers, hidden, attention)
    if one_op is not None:  # every layer in one call; the last layer's tap is the normed output (below)
        inner = _inner_taps(tap_layers, len(layers))
        hidden, *outputs = ops.decode_layers(hidden, *one_op, attention.write_at, *rotary, attention.keys.tables,
                                             attention.limits, inner)
        taps.update(zip(inner, outputs))
    else:
        for i, layer in enumerate(layers):
            hidden = layer(hidden, attention_mask=None, position_ids=positions, position_embeddings=rotary,
                           domino_rows=attention)
            if i in tap_layers:
                taps[i] = hidden
    hidden = rms_norm(decoder.norm, hidden)  # our op for HF's RMSNorm: one op, not HF's 8
    taps[len(layers) - 1] = hidden
    if not tap_layers:
        return hidden, None
    taps = [taps[i] for i in tap_layers]
    return hidden, torch.cat(taps, -1) if join_taps else taps


@functools.lru_cache(maxsize=64)
def _inner_taps(tap_layers: tuple[int, ...], layers: int) -> list[int]:
    """`decode_layers`' tap layers: ascending, once each (a layer may feed the draft twice), the last layer's left out
    (its tap is the normed output)."""
    return sorted({i for i in tap_layers if i < layers - 1})
