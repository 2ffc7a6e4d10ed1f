"""Draft checkpoint layouts: every published one, read from config.json (reference/domino.md §3; every flag read,
none assumed).

Layouts (`detect_layout`):
- `dflash`: HF / DFlash (z-lab/*-DFlash-*, Huang2020/*-Domino-*): Qwen3 fields at the top level,
  `dflash_config{mask_token_id, target_layer_ids, projector_type, pure_draft_prefix_len, emb_dim,
  gru_hidden_dim, shift_label}`, `block_size`; keys `layers.*, fc, hidden_norm, norm, prefix_gru.*,
  embed_proj.{0,2}`. Legacy SpecForge checkpoints nest the head under `logit_head.`.
- `speculators`: speculators PR #685 (Eros483/*-Domino-*): `speculators_model_type: dflash`,
  `transformer_layer_config`, `aux_hidden_state_layer_ids` (HF hidden-state indices = layer ids + 1),
  `draft_vocab_size` with `d2t`/`t2d` and an own `lm_head`, head under `domino_head.`. Its
  `pure_draft_prefix_len` counts corrected slots from 1: with shift_label, P_cfg = 0 means one
  uncorrected draft.
- `speculators-domino`: the later speculators refactor: `speculators_model_type: domino`,
  `sample_from_anchor` (= shift_label), `logits_correction_emb_dim`, head under `logits_correction.`.

Each layout has its own small parser (`dflash_fields`, ...) into `LayoutFields`; `draft_config` does
what they share. A new layout is a new parser in `LAYOUT_PARSERS` plus its case in `detect_layout`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from domino_ray.spec_decode.checkpoint_sources import CheckpointError
from domino_ray.spec_decode.draft import DraftConfig, default_target_layer_ids

DOMINO_PROJECTORS = ("domino", "causal_v5")  # causal_v5: older official alias
HEAD_PREFIXES = ("logit_head.", "domino_head.", "logits_correction.")
IGNORED_KEYS = ("embed_tokens.weight", "t2d", "verifier_lm_head.weight", "verifier_norm.weight")


def detect_layout(config: dict) -> str:
    kind = config.get("speculators_model_type")
    if kind == "domino":
        return "speculators-domino"
    if kind == "dflash":
        return "speculators"
    if kind is not None:
        raise CheckpointError(f"config.json speculators_model_type={kind!r} is not a DFlash/Domino draft "
                              "(expected 'dflash' or 'domino')")
    if "dflash_config" in config or "block_size" in config:
        return "dflash"
    raise CheckpointError("config.json is neither a DFlash/Domino draft (no 'dflash_config' or 'block_size') "
                          "nor a speculators draft (no 'speculators_model_type')")


def tensor_names(keys) -> dict[str, str]:
    """Our name -> the checkpoint's, for every tensor we read: every layout's names without `model.` and
    the head prefixes; the copies we ignore left out."""
    names = {}
    for key in keys:
        ours = key.removeprefix("model.")
        for prefix in HEAD_PREFIXES:
            ours = ours.removeprefix(prefix)
        if ours not in IGNORED_KEYS:
            names[ours] = key
    return names


def _get(cfg: dict, key: str, where: str, default=...):
    if key in cfg and cfg[key] is not None:
        return cfg[key]
    if default is ...:
        raise CheckpointError(f"config.json is missing required key {where}{key}")
    return default


def _rope_theta(layer_cfg: dict, where: str) -> float:
    scaling = layer_cfg.get("rope_scaling") or {}
    params = layer_cfg.get("rope_parameters") or {}
    kind = scaling.get("rope_type", scaling.get("type")) or params.get("rope_type") or "default"
    if kind != "default":
        raise CheckpointError(f"config.json {where}rope_scaling type {kind!r} is not supported (only default RoPE)")
    return float(layer_cfg.get("rope_theta") or params.get("rope_theta") or 10000.0)


@dataclass(frozen=True)
class LayoutFields:
    """What one layout's config.json says, in our terms; `draft_config` turns it into a DraftConfig."""
    layers: dict                     # the Qwen3 fields of the draft layers (hidden_size, heads, ...)
    where: str                       # their place in config.json, for error messages ("" = top level)
    block_size: int | None
    mask_token_id: int
    target_layer_ids: list[int]      # target layers whose outputs feed the draft (HF hidden_states[l + 1])
    projector: str | None            # "domino" (a GRU head) or None (plain DFlash, or decided by the tensors)
    shift_label: bool
    num_uncorrected: int             # our P: leading drafts without the head's correction
    emb_dim: int | None              # None: read from the tensors
    gru_hidden_dim: int | None


def dflash_fields(config: dict, num_target_layers: int | None) -> LayoutFields:
    """HF / DFlash: Qwen3 fields at the top level, the draft's own under `dflash_config`."""
    dflash = config.get("dflash_config") or {}
    for flag in ("use_bias_gate", "use_bias_norm"):
        if dflash.get(flag, config.get(flag)):
            raise CheckpointError(f"config.json {flag}=true (a legacy Domino variant) is not supported")
    mask_token_id = _get(dflash, "mask_token_id", "dflash_config.")
    ids = dflash.get("target_layer_ids")
    if ids is None:
        n_target = config.get("num_target_layers", num_target_layers)
        if n_target is None:
            raise CheckpointError("config.json has neither dflash_config.target_layer_ids nor num_target_layers")
        ids = default_target_layer_ids(n_target, _get(config, "num_hidden_layers", ""))
    return LayoutFields(
        layers=config, where="", block_size=config.get("block_size", dflash.get("block_size")),
        mask_token_id=mask_token_id, target_layer_ids=ids, projector=dflash.get("projector_type"),
        shift_label=bool(dflash.get("shift_label", False)),
        num_uncorrected=int(dflash.get("pure_draft_prefix_len", 0)),
        emb_dim=dflash.get("emb_dim", config.get("emb_dim")),
        gru_hidden_dim=dflash.get("gru_hidden_dim", config.get("gru_hidden_dim")))


def _speculators_common(config: dict) -> dict:
    """The fields both speculators layouts share: layers under `transformer_layer_config`, target layers
    as HF hidden-state indices (= layer id + 1)."""
    aux = _get(config, "aux_hidden_state_layer_ids", "")
    return {"layers": _get(config, "transformer_layer_config", ""), "where": "transformer_layer_config.",
            "block_size": config.get("block_size"), "mask_token_id": _get(config, "mask_token_id", ""),
            "target_layer_ids": [int(i) - 1 for i in aux], "gru_hidden_dim": config.get("gru_hidden_dim")}


def speculators_fields(config: dict, num_target_layers: int | None) -> LayoutFields:
    """speculators PR #685 (`speculators_model_type: dflash`)."""
    shift_label = bool(config.get("shift_label", True))
    return LayoutFields(
        **_speculators_common(config), projector=config.get("projector_type"), shift_label=shift_label,
        # PR #685 counts corrected slots from 1 + pure_draft_prefix_len (slot j holds draft j with shift)
        num_uncorrected=int(config.get("pure_draft_prefix_len", 0)) + (1 if shift_label else 0),
        emb_dim=config.get("emb_dim"))


def speculators_domino_fields(config: dict, num_target_layers: int | None) -> LayoutFields:
    """The later speculators refactor (`speculators_model_type: domino`): always a Domino head."""
    return LayoutFields(
        **_speculators_common(config), projector=config.get("projector_type", "domino"),
        shift_label=bool(config.get("sample_from_anchor", config.get("shift_label", True))),
        num_uncorrected=int(config.get("pure_draft_prefix_len", 1)),
        emb_dim=config.get("logits_correction_emb_dim", config.get("emb_dim")))


# detect_layout's names -> their parsers; a new layout is one more function here.
LAYOUT_PARSERS = {"dflash": dflash_fields, "speculators": speculators_fields,
                  "speculators-domino": speculators_domino_fields}


def parse_draft_config(config: dict, tensors: dict[str, torch.Tensor], layout: str,
                       num_target_layers: int | None = None) -> DraftConfig:
    """A `DraftConfig` from `config.json` and the (normalised) tensors of a checkpoint; only their
    shapes are read, so the header's empty meta tensors do."""
    if layout not in LAYOUT_PARSERS:
        raise CheckpointError(f"unknown draft layout {layout!r} (expected one of {sorted(LAYOUT_PARSERS)})")
    return draft_config(LAYOUT_PARSERS[layout](config, num_target_layers), tensors)


def draft_config(f: LayoutFields, tensors: dict[str, torch.Tensor]) -> DraftConfig:
    """What every layout shares: required fields, the head's sizes (from the tensors when the config
    omits them), our DraftConfig."""
    if f.block_size is None:
        raise CheckpointError("config.json is missing required key block_size")
    if f.projector is not None and f.projector not in DOMINO_PROJECTORS:
        raise CheckpointError(f"config.json projector_type={f.projector!r} is not supported "
                              f"(expected one of {DOMINO_PROJECTORS} or none)")
    # A declared head whose tensors are missing is reported by check_tensors, naming them.
    has_head = f.projector in DOMINO_PROJECTORS or any(k.startswith(("prefix_gru.", "embed_proj.")) for k in tensors)
    emb_dim, gru_dim = f.emb_dim, f.gru_hidden_dim
    if has_head:
        if emb_dim is None and "embed_proj.0.weight" in tensors:
            emb_dim = tensors["embed_proj.0.weight"].shape[0]
        if gru_dim is None and "prefix_gru.weight_hh_l0" in tensors:
            gru_dim = tensors["prefix_gru.weight_hh_l0"].shape[1]
        if emb_dim is None or gru_dim is None:
            raise CheckpointError("config.json is missing emb_dim / gru_hidden_dim of the Domino head")
    layers, where = f.layers, f.where
    hidden = _get(layers, "hidden_size", where)
    heads = _get(layers, "num_attention_heads", where)
    return DraftConfig(
        hidden_size=hidden,
        intermediate_size=_get(layers, "intermediate_size", where),
        num_hidden_layers=_get(layers, "num_hidden_layers", where),
        num_attention_heads=heads,
        num_key_value_heads=layers.get("num_key_value_heads") or heads,
        head_dim=layers.get("head_dim") or hidden // heads,
        vocab_size=_get(layers, "vocab_size", where),
        block_size=int(f.block_size),
        target_layer_ids=tuple(int(i) for i in f.target_layer_ids),
        mask_token_id=int(f.mask_token_id),
        shift_label=f.shift_label,
        num_uncorrected=f.num_uncorrected if has_head else 0,
        emb_dim=int(emb_dim) if has_head else None,
        gru_hidden_dim=int(gru_dim) if has_head else None,
        draft_vocab_size=tensors["lm_head.weight"].shape[0] if "lm_head.weight" in tensors else None,
        has_d2t="d2t" in tensors,
        rms_norm_eps=float(layers.get("rms_norm_eps", 1e-6)),
        rope_theta=_rope_theta(layers, where),
        attention_bias=bool(layers.get("attention_bias", False)),
    )
