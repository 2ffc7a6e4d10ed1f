"""Draft checkpoints: checked, loaded and saved, without remote code (reference/domino.md §3).

The files come from `checkpoint_sources.py` (a local directory or a hub id), the layouts are parsed by
`checkpoint_layouts.py`. `check_draft` is the one ordered check, run on config.json and the safetensors headers
(plus the small `d2t` map): pre-flight runs it alone, `load_draft` runs it and then reads the weights, so a bad
checkpoint gives the same first error in both. Every mismatch (missing, unexpected or mis-shaped tensor; a draft
that does not fit the target) raises `CheckpointError` naming the key, the expected and the found value.
`save_draft` writes the HF/DFlash layout, `save_draft_speculators` the speculators one.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from domino_ray.spec_decode.checkpoint_layouts import detect_layout, parse_draft_config, tensor_names
from domino_ray.spec_decode.checkpoint_sources import CheckpointError, DraftFiles, local_files, resolve_checkpoint_dir
from domino_ray.spec_decode.draft import DominoDraft, DraftConfig


def check_draft(files: DraftFiles, target_config=None) -> tuple[DraftConfig, dict[str, str]]:
    """The one ordered check of a draft checkpoint. Pre-flight and `load_draft` both run exactly this, so
    a bad checkpoint fails with the same first error in both. Reads no tensor values but `d2t` ([Vd] ints).

    Returns the DraftConfig and our tensor names -> the checkpoint's (what the loader reads).
    """
    layout = detect_layout(files.config)
    names = tensor_names(files.header)
    header = {ours: files.header[key] for ours, key in names.items()}
    cfg = parse_draft_config(files.config, header, layout,
                             num_target_layers=getattr(target_config, "num_hidden_layers", None))
    if target_config is not None:  # before the shapes: "made for another target" explains most shape errors
        check_against_target(cfg, target_config)
    check_tensors(cfg, header)
    if target_config is not None and cfg.has_d2t:  # last: the one check on values, read once the shape is right
        check_d2t(files.read([names["d2t"]])[names["d2t"]], target_config.vocab_size)
    return cfg, names


def check_tensors(cfg: DraftConfig, tensors: dict[str, torch.Tensor]):
    """Every expected tensor present with its exact shape, nothing unexpected."""
    with torch.device("meta"):
        expected = {k: tuple(v.shape) for k, v in DominoDraft(cfg).state_dict().items()}
    missing = sorted(set(expected) - set(tensors))
    if missing:
        raise CheckpointError(f"draft checkpoint is missing tensors: {missing[:8]}{' ...' if len(missing) > 8 else ''}")
    unexpected = sorted(set(tensors) - set(expected))
    if unexpected:
        raise CheckpointError(f"draft checkpoint has unexpected tensors: {unexpected[:8]}"
                              f"{' ...' if len(unexpected) > 8 else ''}")
    for key, shape in expected.items():
        found = tuple(tensors[key].shape)
        if found != shape:
            raise CheckpointError(f"draft tensor {key}: expected shape {list(shape)}, found {list(found)}")


def check_against_target(cfg: DraftConfig, target_config):
    """The draft must share the target's hidden size and vocabulary and read existing layers."""
    t_hidden, t_vocab, t_layers = target_config.hidden_size, target_config.vocab_size, target_config.num_hidden_layers
    if cfg.hidden_size != t_hidden:
        raise CheckpointError(f"draft hidden_size: expected {t_hidden} (the target's), found {cfg.hidden_size}")
    if cfg.vocab_size != t_vocab:
        raise CheckpointError(f"draft vocab_size: expected {t_vocab} (the target's), found {cfg.vocab_size}")
    bad = [i for i in cfg.target_layer_ids if not 0 <= i < t_layers]
    if bad:
        raise CheckpointError(f"draft target_layer_ids {list(cfg.target_layer_ids)}: expected ids in "
                              f"[0, {t_layers}) for a {t_layers}-layer target, found {bad}")
    if not 0 <= cfg.mask_token_id < t_vocab:
        raise CheckpointError(f"draft mask_token_id: expected an id in [0, {t_vocab}), found {cfg.mask_token_id}")
    if cfg.draft_vocab_size and cfg.draft_vocab_size != t_vocab and not cfg.has_d2t:
        raise CheckpointError(f"draft lm_head has {cfg.draft_vocab_size} rows but the target vocabulary has "
                              f"{t_vocab} and there is no d2t map")


def check_d2t(d2t: torch.Tensor, vocab_size: int):
    """Every draft id lands in the target vocabulary (target id = draft id + d2t[draft id])."""
    mapped = torch.arange(d2t.shape[0]) + d2t.long()  # [Vd] target ids
    if int(mapped.min()) < 0 or int(mapped.max()) >= vocab_size:
        raise CheckpointError(f"draft d2t maps ids outside the target vocabulary [0, {vocab_size}): "
                              f"range [{int(mapped.min())}, {int(mapped.max())}]")


def load_draft(source: str | Path, *, target_config=None, device: str | torch.device = "cpu",
               dtype: torch.dtype | None = None) -> DominoDraft:
    """Load a Domino or plain DFlash draft from a local directory or a hub id (no remote code).

    With `target_config` (the target's HF config) the draft is checked against the target.
    `dtype=None` keeps the checkpoint's floating dtype.
    """
    files = local_files(resolve_checkpoint_dir(source))
    cfg, names = check_draft(files, target_config)
    values = files.read(list(names.values()))  # the ignored copies (embed_tokens, t2d) are not read
    tensors = {ours: values[key] for ours, key in names.items()}
    if dtype is None:
        dtype = next(v.dtype for v in tensors.values() if v.is_floating_point())
    with torch.device("meta"):
        draft = DominoDraft(cfg)
    draft.load_state_dict(tensors, strict=True, assign=True)
    return draft.to(device=device, dtype=dtype).eval()  # .to() also re-links the GRU's flat weights


def save_draft(draft: DominoDraft, directory: str | Path, **extra_config):
    """Write a draft in the HF/DFlash layout (the one the Huang2020 checkpoints use)."""
    cfg = draft.config
    if cfg.draft_vocab_size is not None:
        raise ValueError("save_draft writes the HF/DFlash layout, which has no own lm_head; this draft has one")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    dflash = {"mask_token_id": cfg.mask_token_id, "target_layer_ids": list(cfg.target_layer_ids),
              "shift_label": cfg.shift_label}
    if cfg.has_head:
        dflash.update(projector_type="domino", pure_draft_prefix_len=cfg.num_uncorrected, emb_dim=cfg.emb_dim,
                      gru_hidden_dim=cfg.gru_hidden_dim)
    config = {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3",
        "dtype": str(next(draft.parameters()).dtype).removeprefix("torch."),
        "block_size": cfg.block_size, "dflash_config": dflash,
        "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_hidden_layers, "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads, "head_dim": cfg.head_dim, "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": cfg.rope_theta, "rope_scaling": None,
        "attention_bias": cfg.attention_bias, "vocab_size": cfg.vocab_size, "tie_word_embeddings": False,
        **({"emb_dim": cfg.emb_dim} if cfg.has_head else {}),
        **extra_config,
    }
    state = {k: v.detach().contiguous().cpu() for k, v in draft.state_dict().items()}
    save_file(state, str(directory / "model.safetensors"), metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def save_draft_speculators(draft: DominoDraft, directory: str | Path, *, verifier: str = "", **extra_config):
    """Write a draft in the speculators PR #685 layout (Eros483/*-Domino-*): `transformer_layer_config`,
    `aux_hidden_state_layer_ids` (= layer ids + 1), the head under `domino_head.`, an own (pruned) lm_head
    with `d2t`/`t2d`. The copy of the target's embedding that layout carries (`embed_tokens.weight`,
    V x C) is left out: every loader here uses the target's own (`IGNORED_KEYS`), and it would be most
    of the file. PR #685 counts corrected slots from 1 + pure_draft_prefix_len, so only shift_label
    drafts with at least one uncorrected draft have this layout."""
    cfg = draft.config
    if cfg.has_head and not (cfg.shift_label and cfg.num_uncorrected >= 1):
        raise ValueError("the speculators layout needs shift_label=True and num_uncorrected >= 1 for a Domino head, "
                         f"found shift_label={cfg.shift_label}, num_uncorrected={cfg.num_uncorrected}")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().contiguous().cpu() for k, v in draft.state_dict().items()}
    tensors = {("domino_head." + k if k.startswith(("prefix_gru.", "embed_proj.")) else k): v for k, v in state.items()}
    if cfg.has_d2t:
        t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
        t2d[draft.to_target_ids(torch.arange(cfg.draft_vocab_size, device=draft.d2t.device)).cpu()] = True
        tensors["t2d"] = t2d
    layer_config = {
        "model_type": "qwen3", "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_hidden_layers, "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads, "head_dim": cfg.head_dim, "hidden_act": "silu",
        "vocab_size": cfg.vocab_size, "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": cfg.rope_theta,
        "rope_scaling": None, "attention_bias": cfg.attention_bias}
    config = {
        "speculators_model_type": "dflash", "architectures": ["DFlashSpeculator"], "speculators_version": "0.4.0",
        "dtype": str(next(draft.parameters()).dtype).removeprefix("torch."),
        "transformer_layer_config": layer_config, "draft_vocab_size": cfg.logits_vocab_size,
        "block_size": cfg.block_size, "target_hidden_size": None,
        "aux_hidden_state_layer_ids": [i + 1 for i in cfg.target_layer_ids], "mask_token_id": cfg.mask_token_id,
        "sliding_window_non_causal": False, "shift_label": cfg.shift_label,
        **({"projector_type": "domino", "pure_draft_prefix_len": cfg.num_uncorrected - 1, "emb_dim": cfg.emb_dim,
            "gru_hidden_dim": cfg.gru_hidden_dim} if cfg.has_head else {}),
        "speculators_config": {"algorithm": "dflash", "default_proposal_method": "greedy",
                               "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": cfg.block_size}],
                               "verifier": {"name_or_path": verifier}},
        **extra_config,
    }
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
