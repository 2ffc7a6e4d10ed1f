"""Proposers: what the engine asks for draft tokens each step.

A proposer is any object with these members (duck-typed; the engine needs nothing else):
- `num_spec_tokens`: K, drafts per step at most (the engine may verify fewer: `width_policy.py`);
  `block_size`: positions its block writes past a row's context.
- `target_layer_ids`: target layers whose outputs it needs as context (empty: none).
- `graph_safe`: its `propose` is device work on fixed shapes (CUDA-graph capturable).
- `allocate(num_blocks, block_size, capacity)`: its own KV pool of the engine's blocks (the rows' block tables serve
  it too: `kv/pools.py`), rows of up to `capacity` positions.
- `append_context(tables, target_hidden, offsets)`: new target hidden states `[b, q, L*C]` of positions
  `offsets[b] + arange(q)` of the rows with block tables `tables [b, nb]`; entries past a row's committed length are
  junk it must tolerate (they are overwritten later).
- `propose(r, anchor, offsets, keys, width, committed, request_ids) -> [r, width]`: `width <= K`
  drafts after `anchor [r]` at positions `offsets [r]` for slots `0..r` (padding slots included), reading
  their own blocks (`keys`, `kv_cache.StepKeys`); `committed`/`request_ids` are the host's view of the real rows
  (test proposers use them).
- optionally `draft`: its model (an `nn.Module`), whose linear layers the engine packs like the target's on
  CPU (`target/packed_linear.py`).

`DominoProposer` runs a Domino/DFlash draft. (The tests' `OracleProposer` knows the target's continuation.)
"""

from __future__ import annotations

import torch

from domino_ray.backend import ops
from domino_ray.kv.pools import KVPool, StepKeys, paged_attention, query_limits
from domino_ray.target.packed_linear import kv_dtype, one_op_layers, pack_as, packed_states
from domino_ray.target.forward import decode_layers_args
from domino_ray.spec_decode.checkpoint import check_against_target
from domino_ray.spec_decode.draft import DominoDraft, context_key_value_weights, context_keys_values, resolve_num_spec_tokens


class DominoProposer:
    graph_safe = True

    def __init__(self, draft: DominoDraft, target, num_spec_tokens: int | None = None):
        """`num_spec_tokens`: K, drafts per step at most; None = the most the checkpoint proposes."""
        cfg = draft.config
        if isinstance(num_spec_tokens, str):
            raise TypeError("num_spec_tokens is an int; resolve 'auto' with draft.resolve_num_spec_tokens and pass "
                            "adaptive=True to the engine")
        k, _ = resolve_num_spec_tokens(num_spec_tokens, cfg)
        self.draft, self.config, self.num_spec_tokens = draft, cfg, k
        self.block_size = cfg.block_size
        self.target_layer_ids = cfg.target_layer_ids
        check_against_target(cfg, target.config)  # a draft built in code meets the loader's checks too
        self.embed = target.get_input_embeddings()
        self.lm_head = target.get_output_embeddings()
        weight = next(draft.parameters())
        self.device, self.dtype = weight.device, weight.dtype
        with torch.inference_mode():
            mask_id = torch.tensor([cfg.mask_token_id], device=self.embed.weight.device)
            self.mask_embedding = self.embed(mask_id).to(self.device, self.dtype)  # [1, C]
        self.block_offsets = torch.arange(cfg.block_size, device=self.device)   # [B]
        # All layers' context k/v projections fused (a copy: build the proposer after the draft's last update).
        self.context_weights = context_key_value_weights(draft.layers)
        self.groups = cfg.num_attention_heads // cfg.num_key_value_heads
        self.kv: KVPool | None = None
        self.key_positions: torch.Tensor | None = None
        self._native: tuple | None = None  # (the draft linears' weight states, `decode_layers`' arguments from them)
        self._linears: list | None = None  # the draft layers' 14 linears (`_native_layers`), listed at first use
        self._context_native: tuple | None = None  # (fc's weight state, `context_update`'s arguments from it)

    def allocate(self, num_blocks: int, block_size: int, max_len: int):
        cfg = self.config
        self.kv = KVPool(cfg.num_hidden_layers, num_blocks, block_size, cfg.num_key_value_heads, cfg.head_dim,
                         self.dtype, self.device, kv_dtype(self.draft))
        self.key_positions = torch.arange(max_len, device=self.device)  # [T]
        # Every position's rotary cos/sin, looked up by each call (computed per call they were ~10 ops: ~45 us of a
        # demo draft's one-row step on CPU, twice a drafting step)
        cos, sin = self.draft.rope(self.key_positions[None], self.dtype)
        self.rope_cos, self.rope_sin = cos[0], sin[0]  # [T, D]

    def append_context(self, tables: torch.Tensor, target_hidden: torch.Tensor, offsets: torch.Tensor):
        taps = target_hidden.to(self.device)  # [b, q, F]
        positions = offsets[:, None] + self.key_positions[:taps.shape[1]]  # [b, q]
        cos, sin = self.rope_cos[positions], self.rope_sin[positions]  # [b, q, D]
        ours = one_op_layers(self.kv.kernel, taps.shape[0] * taps.shape[1]) and taps.dtype == torch.float32
        native = self._native_context() if ours else None
        if native is not None:  # one op of ours for ~25 torch ops (`decode_layer.cpp`)
            ops.context_update(taps, *native, self.kv.keys, self.kv.values, self.kv.flat_index(tables, positions),
                               cos, sin)
            return
        context = self.draft.project_context(taps)  # [b, q, C]
        k, v = context_keys_values(context, self.context_weights, self.config.rms_norm_eps, self.config.head_dim, cos, sin)
        self.kv.write_all_layers(self.kv.flat_index(tables, positions), k, v)

    def _native_context(self) -> tuple[list, list[int], list[float]] | None:
        """`context_update`'s weights, shape and scalars: `fc` packed, and every layer's k/v projections packed from
        `context_weights` (a copy, as those are), made once and again when `fc`'s weight changed; None where the engine
        left `fc` unpacked."""
        fc, norm, cfg = self.draft.fc, self.draft.hidden_norm, self.config
        state = packed_states([fc])
        if state is None:
            return None
        if self._context_native is None or self._context_native[0] != state:
            weight, bias, k_norm = self.context_weights
            weights = [fc.current_pack(), fc.bias, norm.weight, pack_as(weight, fc), bias, k_norm]
            self._context_native = (state, (weights, [cfg.hidden_size, cfg.num_key_value_heads, cfg.head_dim],
                                            [norm.eps, cfg.rms_norm_eps]))
        return self._context_native[1]

    def propose(self, r: int, anchor: torch.Tensor, offsets: torch.Tensor, keys: StepKeys, width: int,
                committed=None, request_ids=None) -> torch.Tensor:
        slots = block_slots(self.block_size, width, self.config.shift_label)
        block = torch.cat([self.embed(anchor)[:, None].to(self.dtype),
                           self.mask_embedding.expand(r, slots - 1, -1)], 1)  # [r, S, C]
        positions = offsets[:, None] + self.block_offsets[:slots]  # [r, S]
        # Non-causal: every slot sees the whole context and every slot of the step.
        limits = query_limits((offsets + slots)[:, None].expand(r, slots), self.groups)  # [r, G*S]
        cos, sin = self.rope_cos[positions], self.rope_sin[positions]  # [r, S, D]
        write_at = self.kv.flat_index(keys.tables, positions)

        def attend_layer(i, layer, x, cos, sin):
            attn = layer.self_attn
            q = attn.query(x, cos, sin)
            k, v = attn.key_value(x, cos, sin)
            self.kv.write(i, write_at, k, v)
            return attn.output(paged_attention(q, self.kv, i, keys.tables, limits, attn.head_dim ** -0.5, keys.key_len,
                                               keys.splits))

        native = self._native_layers() if one_op_layers(self.kv.kernel, r * slots) else None
        if native is None:
            hidden = self.draft.run_layers(block, cos, sin, attend_layer)  # [r, S, C]
        else:  # the layers as our one op, all in one call (`csrc/decode_layer.cpp`): the draft's layers are Qwen3's
            hidden, = ops.decode_layers(block, *native, self.kv.keys, self.kv.values, write_at, cos, sin, keys.tables,
                                        limits, [])
            hidden = self.draft.norm(hidden)
        return self.draft.draft_tokens(hidden, anchor, width, self.embed, self.lm_head)  # the GRU loop stops at W

    def _native_layers(self) -> tuple[list, list[int], list[float]] | None:
        """`decode_layers`' weights, shapes and scalars of the draft's layers, each layer's as `decode_layer` takes them:
        q/k/v and gate/up fused (copies, packed for our kernel: one op call instead of ~40 a layer; the demo draft's
        block at one row 0.9 ms instead of 1.5), built once and again when a weight changed; None where the engine left
        the linears unpacked."""
        layers = self.draft.layers
        if self._linears is None:  # the same module objects for the proposer's life (packing changes their class)
            self._linears = [m for layer in layers for attn, mlp in [(layer.self_attn, layer.mlp)]
                             for m in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj,
                                       mlp.down_proj)]
        state = packed_states(self._linears)
        if state is None:
            return None
        if self._native is None or self._native[0] != state:
            self._native = (state, decode_layers_args([_decode_layer_args(layer) for layer in layers]))
        return self._native[1]


def _decode_layer_args(layer) -> tuple[list, list[int], list[float]]:
    """A draft layer (`draft.DraftLayer`: Qwen3's, SiLU MLP) as `decode_layer` takes it."""
    attn, mlp = layer.self_attn, layer.mlp
    fused = [(attn.q_proj, attn.k_proj, attn.v_proj), (mlp.gate_proj, mlp.up_proj)]
    (qkv, qkv_bias), (gate_up, _) = [
        (pack_as(torch.cat([m.weight.detach() for m in ms]), ms[0]),
         torch.cat([m.bias.detach() for m in ms]) if ms[0].bias is not None else None) for ms in fused]
    weights = [layer.input_layernorm.weight, qkv, qkv_bias, attn.o_proj.current_pack(), attn.o_proj.bias,
               layer.post_attention_layernorm.weight, gate_up, None, mlp.down_proj.current_pack(), None,
               attn.q_norm.weight, attn.k_norm.weight]
    scalars = [layer.input_layernorm.eps, layer.post_attention_layernorm.eps, attn.q_norm.eps, attn.k_norm.eps,
               attn.head_dim ** -0.5]
    return weights, [attn.num_heads, attn.num_kv_heads, attn.head_dim, mlp.gate_proj.out_features], scalars


def block_slots(block_size: int, width: int, shift_label: bool) -> int:
    """Slots of the draft block a step of `width` drafts runs: `width` more past the last slot that drafts, not the
    whole block. The slots past a step's drafts only shape the earlier slots' attention, and the draft's work grows
    with its slots (at W = 1, two slots accept about as many drafts as all eight, at a higher rate of tokens)."""
    return min(block_size, 2 * width + (0 if shift_label else 1))
