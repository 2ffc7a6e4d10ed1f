"""The training objective: blocks at the anchors, their labels, the position-weighted loss and its curriculum, and
the teacher-forced accuracy that estimates acceptance. Tensor glossary: see `engine/core.py`; here b
sequences, A anchors per sequence, B block size, K draft tokens per block.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from domino_ray.spec_decode.draft import DominoDraft


@dataclass
class TrainConfig:
    steps: int = 1000
    batch_size: int = 16                  # sequences per step
    anchors_per_sequence: int = 32        # blocks per sequence (A)
    lr: float = 1e-3
    weight_decay: float = 0.0
    warmup_ratio: float = 0.04
    gamma: float = 4.0                    # position weight exp(-i / gamma); 4 for B=8, 7 for B=16
    lambda_base_start: float = 1.0        # curriculum: weight of L_base at step 0 ...
    lambda_base_decay_ratio: float = 0.5  # ... decaying linearly to 0 over this fraction of the steps
    grad_clip: float = 1.0
    seed: int = 0
    log_every: int = 50
    autocast: str | None = None           # e.g. "bfloat16": mixed-precision forward (weights and optimizer stay fp32)


def training_mask(anchors: torch.Tensor, seq_len: int, block_size: int) -> torch.Tensor:
    """Bool `[b, 1, A*B, T + A*B]` over `[context ; blocks]`: block a's queries see context positions < anchor_a
    and all of block a (non-causal), nothing of other blocks."""
    b, a = anchors.shape
    context = torch.arange(seq_len, device=anchors.device)[None, None, :] < anchors[:, :, None]  # [b, A, T]
    own_block = torch.eye(a, dtype=torch.bool, device=anchors.device).repeat_interleave(block_size, 1)  # [A, A*B]
    rows = torch.cat([context, own_block[None].expand(b, -1, -1)], -1)  # [b, A, T + A*B]
    return rows.repeat_interleave(block_size, 1)[:, None]


def block_logits(draft: DominoDraft, target, features: torch.Tensor, ids: torch.Tensor, anchors: torch.Tensor):
    """Training-mode logits for every anchor: base `[b, A, K, V]` and final `[b, A, K, V]` (None without a head);
    V is the draft's vocabulary (pruned: draft ids, see `target_to_draft_ids`).

    ids `[b, T]` are the true tokens; draft i of the block at anchor p predicts ids[p + 1 + i].
    """
    cfg = draft.config
    embed, lm_head = target.get_input_embeddings(), target.get_output_embeddings()
    b, t = ids.shape
    a, bs, k = anchors.shape[1], cfg.block_size, cfg.max_draft_tokens
    offsets = torch.arange(bs, device=ids.device)
    block_ids = torch.full((b, a, bs), cfg.mask_token_id, dtype=torch.long, device=ids.device)
    block_ids[:, :, 0] = ids.gather(1, anchors)
    positions = (anchors[:, :, None] + offsets).reshape(b, a * bs)  # [b, A*B]
    hidden = draft.block_hidden(features, embed(block_ids.reshape(b, a * bs)), positions,
                                training_mask(anchors, t, bs))  # [b, A*B, C]
    z = draft.select_draft_hidden(hidden.reshape(b * a, bs, -1), k)  # [b*A, K, C]
    base = draft.base_logits(z, lm_head)  # [b*A, K, V]
    if not cfg.has_head:
        return base.view(b, a, k, -1), None
    # Teacher forcing: the GRU reads x_p..x_{p+K-1}; its output i is the state after x_p..x_{p+i}.
    index = (anchors[:, :, None] + offsets[:k]).clamp(max=t - 1).reshape(b, a * k)
    gru_in = embed(ids.gather(1, index)).reshape(b * a, k, -1)  # [b*A, K, C]
    states, _ = draft.prefix_gru(gru_in.to(draft.prefix_gru.weight_hh_l0.dtype))  # [b*A, K, G]
    delta = draft.embed_proj(torch.cat([z.to(states.dtype), states], -1))  # [b*A, K, V]
    corrected = (torch.arange(k, device=ids.device) >= cfg.num_uncorrected)[None, :, None]
    final = torch.where(corrected, base + delta.to(base.dtype), base)
    return base.view(b, a, k, -1), final.view(b, a, k, -1)


def block_labels(ids: torch.Tensor, lengths: torch.Tensor, anchors: torch.Tensor, k: int) -> torch.Tensor:
    """Labels `[b, A, K]`: ids[p + 1 + i], or -100 past the sequence's end."""
    index = anchors[:, :, None] + 1 + torch.arange(k, device=ids.device)  # [b, A, K]
    labels = ids.gather(1, index.clamp(max=ids.shape[1] - 1).flatten(1)).view_as(index)
    return labels.masked_fill(index >= lengths[:, None, None], -100)


def position_weights(k: int, gamma: float, device=None) -> torch.Tensor:
    return torch.exp(-torch.arange(k, device=device, dtype=torch.float32) / gamma)  # [K]


def weighted_ce(logits: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Position-weighted mean cross-entropy of logits `[b, A, K, V]` against labels `[b, A, K]`."""
    ce = F.cross_entropy(logits.flatten(0, 2).float(), labels.flatten(), ignore_index=-100, reduction="none")
    w = (weights[None, None, :] * (labels != -100)).flatten()
    return (ce * w).sum() / w.sum().clamp(min=1e-9)


def lambda_base(step: int, steps: int, cfg: TrainConfig) -> float:
    decay_steps = cfg.lambda_base_decay_ratio * steps
    if decay_steps <= 0:
        return 0.0
    return cfg.lambda_base_start * max(0.0, 1.0 - step / decay_steps)


def blended_loss(base, final, targets, weights, lam: float):
    """The correction head's loss blended with the base logits' (lam -> the base's share); base only
    without a head."""
    loss_base = weighted_ce(base, targets, weights)
    return loss_base if final is None else (1 - lam) * weighted_ce(final, targets, weights) + lam * loss_base


def draft_labels(labels: torch.Tensor, to_draft: torch.Tensor | None) -> torch.Tensor:
    """Target-id labels -> the draft's ids (-100 where the pruned vocabulary lacks the token: no loss, and
    the accuracy, measured in target ids, counts it wrong)."""
    if to_draft is None:
        return labels
    return to_draft[labels.clamp(min=0)].masked_fill(labels == -100, -100)


def target_to_draft_ids(draft: DominoDraft, vocab_size: int) -> torch.Tensor | None:
    """`[V]` long: the draft id of each target id, -100 for ids outside the pruned vocabulary; None without one."""
    if not draft.config.has_d2t:
        return None
    table = torch.full((vocab_size,), -100, dtype=torch.long, device=draft.d2t.device)
    table[draft.to_target_ids(torch.arange(len(draft.d2t), device=draft.d2t.device))] = torch.arange(
        len(draft.d2t), device=draft.d2t.device)
    return table


def accuracy_stats(predictions: torch.Tensor, labels: torch.Tensor) -> dict:
    """Per-position accuracy of predictions `[..., K]` (target ids) and the acceptance-length estimate over
    blocks whose K labels all exist."""
    right = predictions == labels
    valid = labels != -100
    per_pos = [(right[..., i] & valid[..., i]).sum().item() / max(valid[..., i].sum().item(), 1)
               for i in range(labels.shape[-1])]
    full = valid.all(-1)
    accepted = right.long().cumprod(-1).sum(-1)[full].float()
    return {"accuracy": per_pos, "accept_len": 1.0 + (accepted.mean().item() if len(accepted) else 0.0)}
