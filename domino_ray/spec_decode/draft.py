"""The Domino draft: a DFlash block-parallel backbone plus the GRU correction head.

Architecture (reference/domino.md §1-2; attribute names are the checkpoint's key names):
- Context: the target's hidden states at `target_layer_ids` (HF `hidden_states[l + 1]`), concatenated,
  `fc` -> `hidden_norm`. They become extra keys/values in every draft layer (each layer's own
  `k_proj`/`v_proj`/`k_norm`, no input norm).
- Block: `[anchor, MASK x (B-1)]`, embedded with the *target's* embedding, at positions
  `start .. start+B-1`. Qwen3-style layers (q/k norm, rotary, SwiGLU) attend non-causally over
  `[context ; block]`; `norm` at the end. Base logits come from the target's `lm_head`, or from the
  draft's own pruned `lm_head` whose ids map to target ids via `d2t`.
- Domino head: a bias-free GRU walks the target embeddings of `[anchor, d_1, d_2, ...]`; draft i uses
  `base_i + embed_proj(cat[z_i, s_i])`; the first P drafts are uncorrected.

The draft owns no embedding; it never runs the target. Tensor glossary: see `engine/core.py`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from domino_ray.backend import ops
from domino_ray.backend.library import takes
from domino_ray.target import layer_ops
from domino_ray.kv.pools import row_attention
from domino_ray.target.packed_linear import ONE_OP_POSITIONS, PackedLinear, weight_state
from domino_ray.spec_decode.verify import greedy_choice


@dataclass(frozen=True)
class DraftConfig:
    hidden_size: int                      # C, equal to the target's hidden size
    intermediate_size: int                # SwiGLU width
    num_hidden_layers: int                # draft decoder layers
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int                       # V, the target vocabulary
    block_size: int                       # slots per draft block: [anchor, MASK x (block_size - 1)]
    target_layer_ids: tuple[int, ...]     # target decoder layers feeding the context (hidden_states[l + 1])
    mask_token_id: int                    # id whose target embedding fills the MASK slots
    shift_label: bool = True              # True: slot j predicts position start+j+1; False: slot j predicts start+j
    num_uncorrected: int = 1              # P: leading drafts that use the base logits only
    emb_dim: int | None = None            # E, Domino head bottleneck (None: plain DFlash, no head)
    gru_hidden_dim: int | None = None     # G, Domino GRU state size
    draft_vocab_size: int | None = None   # Vd of the draft's own lm_head (None: use the target's lm_head)
    has_d2t: bool = False                 # draft ids map to target ids through d2t (pruned vocabulary)
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    attention_bias: bool = False

    @property
    def has_head(self) -> bool:
        return self.emb_dim is not None

    @property
    def max_draft_tokens(self) -> int:
        """K at most: with shift_label every slot predicts a token; without, slot 0 is unused."""
        return self.block_size if self.shift_label else self.block_size - 1

    @property
    def logits_vocab_size(self) -> int:
        return self.draft_vocab_size or self.vocab_size


def resolve_num_spec_tokens(setting, config: DraftConfig) -> tuple[int, bool]:
    """`draft.num_draft_tokens` -> (K, adaptive), the one place it is read. "auto": the verify width adapts per
    step over 0..K with K the most this checkpoint proposes; null: fixed at that most; an int: fixed K.
    Raises ValueError for a K this draft cannot propose."""
    k = config.max_draft_tokens if setting in (None, "auto") else setting
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= config.max_draft_tokens:
        raise ValueError(f"num_draft_tokens={k} is out of range: this draft (block_size={config.block_size}, "
                         f"shift_label={config.shift_label}) proposes 1..{config.max_draft_tokens} tokens per step")
    return k, setting == "auto"


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if takes(x, self.weight):  # one op instead of eight (fp32 CPU inference)
            return ops.rms_norm(x, self.weight, self.eps)
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rotary(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype):
    """cos, sin `[b, q, D]` for integer `positions [b, q]` (Qwen3/Llama half-split layout)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim))
    freqs = positions[..., None].float() * inv_freq  # [b, q, D/2]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


class DraftAttention(nn.Module):
    def __init__(self, cfg: DraftConfig):
        super().__init__()
        c, d = cfg.hidden_size, cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, d
        self.q_proj = nn.Linear(c, cfg.num_attention_heads * d, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(c, cfg.num_key_value_heads * d, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(c, cfg.num_key_value_heads * d, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(cfg.num_attention_heads * d, c, bias=cfg.attention_bias)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps)

    def key_value(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """Rotated keys and values `[b, Hkv, q, D]` of `x [b, q, C]` (block tokens or context)."""
        b, q, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(b, q, self.num_kv_heads, self.head_dim))  # [b, q, Hkv, D]
        v = self.v_proj(x).view(b, q, self.num_kv_heads, self.head_dim).transpose(1, 2)
        return layer_ops.rotary(k, cos, sin).transpose(1, 2), v

    def query(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, q, _ = x.shape
        qs = self.q_norm(self.q_proj(x).view(b, q, self.num_heads, self.head_dim))  # [b, q, H, D]
        return layer_ops.rotary(qs, cos, sin).transpose(1, 2)  # [b, H, q, D]

    def output(self, attended: torch.Tensor) -> torch.Tensor:
        """Attention output `[b, q, H, D]` -> `[b, q, C]`."""
        b, n = attended.shape[:2]
        return self.o_proj(attended.reshape(b, n, self.num_heads * self.head_dim))

    def attend(self, q, keys, values, mask) -> torch.Tensor:
        """q `[b, H, q, D]` over keys/values `[b, Hkv, T, D]` under `mask [b, 1, q, T]` (bool or additive) -> `[b, q, C]`.
        Query heads folded per K/V head (`row_attention`): SDPA with a mask and `enable_gqa` has only the math
        kernel on CUDA."""
        groups = self.num_heads // self.num_kv_heads
        visible = mask.expand(q.shape[0], 1, -1, -1).repeat(1, 1, groups, 1)  # [b, 1, G*q, T]
        return self.output(row_attention(q, keys, values, visible, self.head_dim ** -0.5))


def context_key_value_weights(layers) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Every layer's k/v projections as one matrix `[L*2*Hkv*D, C]` (+ bias) and the k_norm weights `[L, D]`:
    the context keys/values of all layers in one GEMM (`context_keys_values`)."""
    attn = [layer.self_attn for layer in layers]
    weight = torch.cat([torch.cat([a.k_proj.weight, a.v_proj.weight]) for a in attn])
    bias = torch.cat([torch.cat([a.k_proj.bias, a.v_proj.bias]) for a in attn]) if attn[0].k_proj.bias is not None \
        else None
    return weight, bias, torch.stack([a.k_norm.weight for a in attn])


def context_keys_values(context: torch.Tensor, weights, eps: float, head_dim: int, cos, sin):
    """Rotated keys and values `[L, b, Hkv, q, D]` of every layer for context `[b, q, C]`: the same numbers as
    each layer's `key_value`, from `context_key_value_weights`."""
    weight, bias, k_norm = weights
    b, q, _ = context.shape
    kv = F.linear(context, weight, bias).view(b, q, k_norm.shape[0], 2, -1, head_dim)  # [b, q, L, 2, Hkv, D]
    k, v = kv[:, :, :, 0], kv[:, :, :, 1]                                              # [b, q, L, Hkv, D]
    dtype = k.dtype
    k = k.float()
    k = k_norm[:, None, :] * (k * torch.rsqrt(k.pow(2).mean(-1, keepdim=True) + eps)).to(dtype)
    k, v = k.permute(2, 0, 3, 1, 4), v.permute(2, 0, 3, 1, 4)                           # [L, b, Hkv, q, D]
    return layer_ops.apply_rotary(k, cos, sin), v


class DraftMLP(nn.Module):
    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DraftLayer(nn.Module):
    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.self_attn = DraftAttention(cfg)
        self.mlp = DraftMLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class DominoDraft(nn.Module):
    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.config = cfg
        c = cfg.hidden_size
        self.layers = nn.ModuleList(DraftLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.fc = nn.Linear(len(cfg.target_layer_ids) * c, c, bias=False)
        self.hidden_norm = RMSNorm(c, cfg.rms_norm_eps)
        self.norm = RMSNorm(c, cfg.rms_norm_eps)
        self._gru_fp32: tuple | None = None  # (the GRU weights' states, their fp32 copies): `gru_weights_fp32`
        if cfg.has_head:
            self.prefix_gru = nn.GRU(c, cfg.gru_hidden_dim, num_layers=1, batch_first=True, bias=False)
            self.embed_proj = nn.Sequential(nn.Linear(c + cfg.gru_hidden_dim, cfg.emb_dim, bias=False), nn.SiLU(),
                                            nn.Linear(cfg.emb_dim, cfg.logits_vocab_size, bias=False))
        if cfg.draft_vocab_size is not None:
            self.lm_head = nn.Linear(c, cfg.draft_vocab_size, bias=False)
        if cfg.has_d2t:
            self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))

    # ---- backbone -------------------------------------------------------------------------------

    def rope(self, positions: torch.Tensor, dtype: torch.dtype):
        return rotary(positions, self.config.head_dim, self.config.rope_theta, dtype)

    def project_context(self, target_hidden: torch.Tensor) -> torch.Tensor:
        """`[b, q, L*C]` concatenated target hidden states -> context `[b, q, C]`."""
        return self.hidden_norm(self.fc(target_hidden.to(self.fc.weight.dtype)))

    def run_layers(self, block: torch.Tensor, cos, sin, attend_layer) -> torch.Tensor:
        """Pre-norm residual stack over block embeddings `[b, q, C]` -> normed hidden `[b, q, C]`.

        `attend_layer(i, layer, x_normed, cos, sin)` returns the attention output `[b, q, C]`; the caller decides
        where the context keys live (inference KV buffers or a training batch).
        """
        h = block.to(self.fc.weight.dtype)
        for i, layer in enumerate(self.layers):
            h = h + attend_layer(i, layer, layer.input_layernorm(h), cos, sin)
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return self.norm(h)

    def block_hidden(self, target_hidden: torch.Tensor, block: torch.Tensor, block_positions: torch.Tensor,
                     mask: torch.Tensor) -> torch.Tensor:
        """Stateless forward: context from scratch, no KV buffers (training, and the tests' oracle).

        target_hidden `[b, T, F]` at positions 0..T-1; block embeddings `[b, q, C]` at `block_positions
        [b, q]` (one or several blocks); bool `mask [b, 1, q, T + q]` over `[context ; block]` keys.
        Returns the normed block hidden states `[b, q, C]`.
        """
        context = self.project_context(target_hidden)  # [b, T, C]
        ctx_positions = torch.arange(context.shape[1], device=context.device).expand(context.shape[0], -1)
        ctx_cos, ctx_sin = self.rope(ctx_positions, context.dtype)
        cos, sin = self.rope(block_positions, context.dtype)

        def attend_layer(i, layer, x, cos, sin):
            ctx_k, ctx_v = layer.self_attn.key_value(context, ctx_cos, ctx_sin)
            k, v = layer.self_attn.key_value(x, cos, sin)
            q = layer.self_attn.query(x, cos, sin)
            return layer.self_attn.attend(q, torch.cat([ctx_k, k], 2), torch.cat([ctx_v, v], 2), mask)

        return self.run_layers(block, cos, sin, attend_layer)

    # ---- head -----------------------------------------------------------------------------------

    def to_target_ids(self, ids: torch.Tensor) -> torch.Tensor:
        return ids + self.d2t[ids] if self.config.has_d2t else ids

    def base_logits(self, z: torch.Tensor, target_lm_head: nn.Module) -> torch.Tensor:
        """Draft hidden `[b, K, C]` -> base logits `[b, K, Vd or V]`."""
        head = self.lm_head if self.config.draft_vocab_size is not None else target_lm_head
        return head(z.to(head.weight.dtype))

    def select_draft_hidden(self, hidden: torch.Tensor, num_draft: int) -> torch.Tensor:
        """Block hidden `[b, B, C]` -> the `[b, K, C]` rows that predict d_1..d_K (per `shift_label`)."""
        return hidden[:, :num_draft] if self.config.shift_label else hidden[:, 1:num_draft + 1]

    def gru_weights_fp32(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The GRU's `w_ih [3G, C]`, `w_hh [3G, G]` in float32 for `draft_tokens`' loop. bf16/fp16 weights are
        converted once and kept until a weight changes (its data_ptr, version, dtype or device), not at every draft
        step (~44 MB a step for the 4B draft). fp32 weights are returned as they are; with autograd on, a copy per
        call (a kept copy's graph would be freed by the first backward), as in a compiled step (Dynamo cannot trace the
        check: the conversion is part of its graph). A captured step reads the copies made by its eager warm-up: like
        the proposer's fused context weights, it does not see a later change."""
        weights = self.prefix_gru.weight_ih_l0, self.prefix_gru.weight_hh_l0
        if torch.is_grad_enabled() or torch.compiler.is_compiling() or all(w.dtype == torch.float32 for w in weights):
            return weights[0].float(), weights[1].float()
        made_from = [(weight_state(w), w.dtype, w.device) for w in weights]
        if self._gru_fp32 is None or self._gru_fp32[0] != made_from:
            self._gru_fp32 = made_from, (weights[0].float(), weights[1].float())
        return self._gru_fp32[1]

    def draft_tokens(self, hidden: torch.Tensor, anchor: torch.Tensor, num_draft: int,
                     embed: nn.Module, target_lm_head: nn.Module) -> torch.Tensor:
        """Greedy draft tokens `[b, K]` (target ids) from block hidden `[b, B, C]` and `anchor [b]`.

        Base logits for all K positions come from one GEMM; only the small GRU cell + MLP runs step by
        step, carrying the GRU state (O(K) GRU work, not O(K^2)). The cell is explicit math (no cuDNN
        `nn.GRU` call), so the loop is capturable in a CUDA graph. The GRU state and `base + delta` are
        float32 whatever the model dtype: over up to 16 steps bf16 rounding would compound (it is cheap).
        """
        z = self.select_draft_hidden(hidden, num_draft)  # [b, K, C]
        base = self.base_logits(z, target_lm_head)       # [b, K, Vd]
        if not self.config.has_head:
            return self.to_target_ids(greedy_choice(base))
        p = min(self.config.num_uncorrected, num_draft)
        tokens = [self.to_target_ids(greedy_choice(base[:, :p]))]  # [b, P] uncorrected prefix
        if num_draft <= p:  # no corrected draft: the GRU's state would go unused (a narrow probe, W = 1)
            return tokens[0]
        fc1, fc2 = self.embed_proj[0], self.embed_proj[2]
        if one_op_head(z, base, fc2, embed):  # the loop below as our op, the same calls from C++ (`domino_head.cpp`)
            corrected = ops.domino_corrections(
                z, base, anchor, tokens[0], embed.weight, self.prefix_gru.weight_ih_l0, self.prefix_gru.weight_hh_l0,
                fc1.weight, fc2.current_pack(), fc2.out_features, self.d2t if self.config.has_d2t else None, num_draft)
            return torch.cat([tokens[0], corrected], 1)
        w_ih, w_hh = self.gru_weights_fp32()  # [3G, C], [3G, G]
        prefix = embed(torch.cat([anchor[:, None], tokens[0]], 1)).float()  # [b, P+1, C]
        state = prefix.new_zeros(prefix.shape[0], w_hh.shape[1])            # [b, G] float32
        for j in range(prefix.shape[1]):
            state = gru_cell(prefix[:, j], state, w_ih, w_hh)
        c = z.shape[-1]
        z_part = F.linear(z.to(fc1.weight.dtype), fc1.weight[:, :c])  # [b, K, E], batched over positions
        w_state = fc1.weight[:, c:]                                    # [E, G]
        for i in range(p, num_draft):
            delta = fc2(F.silu(z_part[:, i] + F.linear(state.to(w_state.dtype), w_state)))  # [b, Vd]
            tok = self.to_target_ids(greedy_choice(base[:, i].float() + delta.float()))  # [b]
            tokens.append(tok[:, None])
            if i + 1 < num_draft:
                state = gru_cell(embed(tok).float(), state, w_ih, w_hh)
        return torch.cat(tokens, 1)


def one_op_head(z: torch.Tensor, base: torch.Tensor, fc2: nn.Module, embed: nn.Module) -> bool:
    """Whether `draft_tokens`' corrections may run as our op: `fc2` packed by the engine (fp32 CPU, our kernels built),
    rows our linear kernel takes (`PackedLinear` runs it there too, so the op computes what the loop computes), a plain
    fp32 embedding and base logits, nothing for autograd to record."""
    return isinstance(fc2, PackedLinear) and type(embed) is nn.Embedding and z.shape[0] in ONE_OP_POSITIONS and \
        z.dtype == base.dtype == embed.weight.dtype == torch.float32 and not torch.is_grad_enabled()


def gru_cell(x: torch.Tensor, state: torch.Tensor, w_ih: torch.Tensor, w_hh: torch.Tensor) -> torch.Tensor:
    """One step of a bias-free GRU with `nn.GRU`'s weights and gate order (reset, update, new):
    x `[b, C]`, state `[b, G]`, w_ih `[3G, C]`, w_hh `[3G, G]` -> new state `[b, G]`."""
    i_r, i_z, i_n = F.linear(x, w_ih).chunk(3, -1)
    h_r, h_z, h_n = F.linear(state, w_hh).chunk(3, -1)
    reset, update = torch.sigmoid(i_r + h_r), torch.sigmoid(i_z + h_z)
    new = torch.tanh(i_n + reset * h_n)
    return new + update * (state - new)  # (1 - update) * new + update * state


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> tuple[int, ...]:
    """DFlash's spread of context layers when a checkpoint does not list them."""
    if num_draft_layers == 1:
        return (num_target_layers // 2,)
    return tuple(round(1 + i * (num_target_layers - 4) / (num_draft_layers - 1)) for i in range(num_draft_layers))
