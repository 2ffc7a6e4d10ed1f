"""The training loop: a draft shaped like the target (`draft_config_for`), trained in place on target-generated
sequences with AdamW and a warm-up + cosine schedule, logged, checkpointed and resumable (`train_draft`)."""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Callable

import torch

from domino_ray.spec_decode.draft import DominoDraft, DraftConfig, default_target_layer_ids
from domino_ray.training.data import collate, collate_features, context_features, sample_anchors
from domino_ray.training.evaluation import evaluate_blocks
from domino_ray.training.objective import (TrainConfig, accuracy_stats, blended_loss, block_labels, block_logits,
                                           draft_labels, lambda_base, position_weights, target_to_draft_ids)


def draft_config_for(target_config, *, mask_token_id: int, num_layers: int = 1, block_size: int = 8,
                     target_layer_ids: tuple[int, ...] | None = None, head: bool = True, emb_dim: int = 128,
                     gru_hidden_dim: int = 256, shift_label: bool = True, num_uncorrected: int = 1,
                     draft_vocab_size: int | None = None) -> DraftConfig:
    """A draft shaped like the target's layers (hidden size, heads, RoPE) for any HF decoder config.
    `draft_vocab_size`: an own pruned lm_head of that many ids, mapped to target ids by `d2t`
    (`init_pruned_vocabulary` fills both)."""
    c = target_config
    heads = c.num_attention_heads
    rope = getattr(c, "rope_parameters", None) or {}
    n_target = c.num_hidden_layers
    # DFlash's spread over at least 3 layers (deduplicated: small targets repeat ids)
    ids = tuple(target_layer_ids or sorted(set(default_target_layer_ids(n_target, max(3, num_layers)))))
    if any(not 0 <= i < n_target for i in ids):
        raise ValueError(f"target_layer_ids {list(ids)}: expected ids in [0, {n_target}) for a {n_target}-layer target")
    if not 0 <= mask_token_id < c.vocab_size:
        raise ValueError(f"mask_token_id={mask_token_id}: expected an id in [0, {c.vocab_size})")
    if draft_vocab_size is not None and not 0 < draft_vocab_size < c.vocab_size:
        raise ValueError(f"draft_vocab_size={draft_vocab_size}: expected an int in (0, {c.vocab_size}), "
                         "or None for the target's lm_head")
    return DraftConfig(
        draft_vocab_size=draft_vocab_size, has_d2t=draft_vocab_size is not None,
        hidden_size=c.hidden_size, intermediate_size=c.intermediate_size, num_hidden_layers=num_layers,
        num_attention_heads=heads, num_key_value_heads=getattr(c, "num_key_value_heads", None) or heads,
        head_dim=getattr(c, "head_dim", None) or c.hidden_size // heads, vocab_size=c.vocab_size,
        block_size=block_size, target_layer_ids=ids, mask_token_id=mask_token_id, shift_label=shift_label,
        num_uncorrected=num_uncorrected if head else 0, emb_dim=emb_dim if head else None,
        gru_hidden_dim=gru_hidden_dim if head else None, rms_norm_eps=float(getattr(c, "rms_norm_eps", 1e-6)),
        rope_theta=float(rope.get("rope_theta") or getattr(c, "rope_theta", None) or 10000.0),
        attention_bias=bool(getattr(c, "attention_bias", False)))


def train_draft(draft: DominoDraft, target, sequences: list[tuple[list[int], int]], cfg: TrainConfig,
                log: Callable[[str], None] = print, eval_sequences: list[tuple[list[int], int]] | None = None, *,
                features: list[torch.Tensor] | None = None, eval_features: list[torch.Tensor] | None = None,
                checkpoint: Path | None = None, checkpoint_every: int = 100) -> list[dict]:
    """Train `draft` in place on target-generated sequences; returns the logged history.

    `features` (per sequence `[T_i, F]`, from `sequence_features`) replace the target's forward each step:
    on a CPU that forward costs far more than the draft's. With `checkpoint` the whole training state is
    saved there every `checkpoint_every` steps and a rerun resumes from it (same result as one run)."""
    device = next(target.parameters()).device
    target.eval().requires_grad_(False)
    draft.to(device).train()
    generator = torch.Generator().manual_seed(cfg.seed)
    optimizer, schedule = _optimizer(draft, cfg)
    k = draft.config.max_draft_tokens
    weights = position_weights(k, cfg.gamma, device)
    to_draft = target_to_draft_ids(draft, draft.config.vocab_size)
    order: list[int] = []
    history, first_step, start = [], 0, time.perf_counter()
    # bf16 autocast: on CPUs with AMX (and on GPUs) the matmuls run several times faster than in fp32
    autocast = torch.autocast(device.type, dtype=getattr(torch, cfg.autocast or "float32"), enabled=bool(cfg.autocast))
    parts = {"draft": draft, "optimizer": optimizer, "schedule": schedule}
    if checkpoint is not None and checkpoint.exists():
        order, history, first_step = _resume(checkpoint, parts, generator)
        log(f"resumed from {checkpoint} at step {first_step}")
    for step in range(first_step, cfg.steps):
        if len(order) < cfg.batch_size:  # epochs in a seeded random order
            order += torch.randperm(len(sequences), generator=generator).tolist()
        rows, order = order[:cfg.batch_size], order[cfg.batch_size:]
        ids, starts, lengths = collate([sequences[i] for i in rows])
        anchors = sample_anchors(starts, lengths, cfg.anchors_per_sequence, generator)
        ids, lengths, anchors = ids.to(device), lengths.to(device), anchors.to(device)
        with torch.no_grad():
            batch_features = (collate_features([features[i] for i in rows]).to(device) if features is not None
                              else context_features(target, ids, draft.config.target_layer_ids))
        with autocast:
            base, final = block_logits(draft, target, batch_features, ids, anchors)
            labels = block_labels(ids, lengths, anchors, k)
            lam = lambda_base(step, cfg.steps, cfg) if final is not None else 1.0
            loss = blended_loss(base, final, draft_labels(labels, to_draft), weights, lam)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(draft.parameters(), cfg.grad_clip)
        optimizer.step()
        schedule.step()
        if (step + 1) % cfg.log_every == 0 or step + 1 == cfg.steps:
            entry = {"step": step + 1, "loss": round(loss.item(), 4), "lambda_base": round(lam, 3),
                     "seconds": round(time.perf_counter() - start, 1)}
            with torch.no_grad():
                entry["train"] = _rounded(*(accuracy_stats(draft.to_target_ids(logits.argmax(-1)), labels)
                                            for logits in (base if final is None else final, base)))
                if eval_sequences:
                    entry["eval"] = _rounded(*evaluate_blocks(draft, target, eval_sequences, cfg,
                                                              features=eval_features))
            history.append(entry)
            log(_format(entry))
        if checkpoint is not None and ((step + 1) % checkpoint_every == 0 or step + 1 == cfg.steps):
            _save(checkpoint, parts, generator, order, history, step + 1)
    draft.eval()
    return history


def _optimizer(draft: DominoDraft, cfg: TrainConfig):
    """AdamW with a linear warm-up then a cosine decay to zero over `cfg.steps`."""
    optimizer = torch.optim.AdamW(draft.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95))
    warmup = max(1, int(cfg.warmup_ratio * cfg.steps))
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (
        1 + math.cos(math.pi * min(1.0, s / cfg.steps))))
    return optimizer, schedule


def _save(checkpoint: Path, parts: dict, generator, order: list[int], history: list[dict], step: int):
    """The whole training state, written atomically (a rerun resumes from it: same result as one run)."""
    state = {name: part.state_dict() for name, part in parts.items()}
    state.update(generator=generator.get_state(), order=order, history=history, step=step)
    torch.save(state, checkpoint.with_suffix(".tmp"))
    checkpoint.with_suffix(".tmp").replace(checkpoint)


def _resume(checkpoint: Path, parts: dict, generator) -> tuple[list[int], list[dict], int]:
    state = torch.load(checkpoint, weights_only=False)
    for name, part in parts.items():
        part.load_state_dict(state[name])
    generator.set_state(state["generator"])
    return state["order"], state["history"], state["step"]


def _rounded(stats: dict, base_stats: dict) -> dict:
    return {"accuracy": [round(x, 3) for x in stats["accuracy"]], "accept_len": round(stats["accept_len"], 3),
            "base_accept_len": round(base_stats["accept_len"], 3)}


def _format(entry: dict) -> str:
    parts = [f"step {entry['step']}", f"loss {entry['loss']:.3f}", f"lambda_base {entry['lambda_base']:.2f}"]
    for split in ("train", "eval"):
        if split in entry:
            s = entry[split]
            parts.append(f"{split} accept_len {s['accept_len']:.2f} (base {s['base_accept_len']:.2f}) "
                         f"acc/pos {' '.join(f'{x:.2f}' for x in s['accuracy'])}")
    parts.append(f"{entry['seconds']:.0f}s")
    return " | ".join(parts)
