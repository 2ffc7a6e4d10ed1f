"""Writers of tiny draft checkpoints in each published layout (reference/domino.md §3), from a
DominoDraft, so the loader is tested on files with the exact key names and config fields."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from domino_ray.spec_decode.checkpoint import save_draft
from domino_ray.spec_decode.draft import DominoDraft

HEAD_KEYS = ("prefix_gru.", "embed_proj.")


def _layer_config(cfg) -> dict:
    return {"model_type": "qwen3", "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
            "num_hidden_layers": cfg.num_hidden_layers, "num_attention_heads": cfg.num_attention_heads,
            "num_key_value_heads": cfg.num_key_value_heads, "head_dim": cfg.head_dim,
            "vocab_size": cfg.vocab_size, "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": cfg.rope_theta,
            "max_position_embeddings": 4096, "attention_bias": False}


def _write(directory: Path, tensors: dict, config: dict):
    directory.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().contiguous() for k, v in tensors.items()}, str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps(config, indent=2))


def write_dflash(draft: DominoDraft, directory, *, legacy_head: bool = False, model_prefix: bool = False):
    """Huang2020 / z-lab layout (our save_draft), optionally with legacy `logit_head.` head keys or a
    `model.` prefix on every key (both seen in the wild)."""
    directory = Path(directory)
    save_draft(draft, directory)
    if legacy_head or model_prefix:
        from safetensors.torch import load_file
        tensors = load_file(str(directory / "model.safetensors"))
        renamed = {}
        for k, v in tensors.items():
            if legacy_head and k.startswith(HEAD_KEYS):
                k = "logit_head." + k
            renamed[("model." if model_prefix else "") + k] = v
        save_file(renamed, str(directory / "model.safetensors"))


def write_speculators(draft: DominoDraft, target, directory):
    """speculators PR #685 (Eros483 style): `domino_head.*`, own lm_head/embed_tokens, d2t/t2d,
    `aux_hidden_state_layer_ids` = layer ids + 1, P counted from slot 1 when shift_label."""
    cfg = draft.config
    assert cfg.has_head and cfg.shift_label and cfg.num_uncorrected >= 1
    tensors = {}
    for k, v in draft.state_dict().items():
        tensors[("domino_head." + k) if k.startswith(HEAD_KEYS) else k] = v
    tensors["embed_tokens.weight"] = target.get_input_embeddings().weight.float()
    if cfg.has_d2t:
        t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
        t2d[(torch.arange(cfg.draft_vocab_size) + draft.d2t).clamp(0, cfg.vocab_size - 1)] = True
        tensors["t2d"] = t2d
    config = {
        "speculators_model_type": "dflash", "architectures": ["DFlashSpeculator"], "speculators_version": "0.4.0",
        "transformer_layer_config": _layer_config(cfg), "draft_vocab_size": cfg.logits_vocab_size,
        "block_size": cfg.block_size, "target_hidden_size": None,
        "aux_hidden_state_layer_ids": [i + 1 for i in cfg.target_layer_ids], "mask_token_id": cfg.mask_token_id,
        "sliding_window_non_causal": False, "projector_type": "domino", "shift_label": True,
        "pure_draft_prefix_len": cfg.num_uncorrected - 1, "emb_dim": cfg.emb_dim,
        "gru_hidden_dim": cfg.gru_hidden_dim, "lambda_base_start": 1.0, "lambda_base_decay_ratio": 0.5,
        "speculators_config": {"algorithm": "dflash", "default_proposal_method": "greedy",
                               "proposal_methods": [{"proposal_type": "greedy",
                                                     "speculative_tokens": cfg.block_size}],
                               "verifier": {"name_or_path": "tiny", "architectures": ["Qwen3ForCausalLM"]}},
    }
    _write(Path(directory), tensors, config)


def write_speculators_domino(draft: DominoDraft, directory):
    """The later speculators refactor: `logits_correction.*`, `sample_from_anchor`, P as is."""
    cfg = draft.config
    tensors = {(("logits_correction." + k) if k.startswith(HEAD_KEYS) else k): v for k, v in draft.state_dict().items()}
    config = {
        "speculators_model_type": "domino", "architectures": ["DominoSpeculator"],
        "transformer_layer_config": _layer_config(cfg), "block_size": cfg.block_size,
        "aux_hidden_state_layer_ids": [i + 1 for i in cfg.target_layer_ids], "mask_token_id": cfg.mask_token_id,
        "sample_from_anchor": cfg.shift_label, "pure_draft_prefix_len": cfg.num_uncorrected,
        "logits_correction_emb_dim": cfg.emb_dim, "gru_hidden_dim": cfg.gru_hidden_dim,
    }
    _write(Path(directory), tensors, config)


def write_hub_cache(cache: Path, repo_id: str, source_dir: Path, commit: str = "0123456789abcdef0123456789abcdef01234567"):
    """Lay out `source_dir`'s files as the Hugging Face cache holds a downloaded snapshot."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    for f in source_dir.iterdir():
        (snapshot / f.name).write_bytes(f.read_bytes())
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
