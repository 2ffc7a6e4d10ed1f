"""Training a Domino (or plain DFlash) draft for any HF causal-LM target, on CPU or GPU.

Recipe (reference/domino.md §1.4, §2.5):
- Data: the target's own greedy continuations of prompts (`generate_sequences`, our engine, target
  only), so every label is exactly what the draft must predict at inference.
- Random anchors p in the generated part of each sequence; per anchor one block `[x_p, MASK x (B-1)]`
  at positions p..p+B-1, embedded with the target's embedding. Several blocks share one sequence.
- Context: the target's hidden states at `target_layer_ids` (HF `hidden_states[l + 1]`, computed
  without gradients). A block's queries see context positions < p (strictly: at inference the anchor's
  own hidden state is not computed yet) plus their own block, non-causally (`training_mask`).
- Labels, in draft-index terms (i = 0..K-1, either `shift_label` layout): draft i predicts x_{p+1+i}.
  Its GRU state is teacher-forced on the true tokens x_p..x_{p+i} (target embeddings), the state
  `draft_tokens` reaches at inference once d_1..d_i were accepted, i.e. equal to the truth.
- Loss: `(1 - lam) * L_final + lam * L_base`, both position-weighted cross-entropies with weight
  `exp(-i / gamma)`; lam decays linearly from `lambda_base_start` to 0 over `lambda_base_decay_ratio`
  of training (base-anchored curriculum). A plain DFlash draft trains on L_base alone.

Logged per-position accuracy is teacher-forced, which for a prefix-accepting verifier is the exact
acceptance event, so `accept_len = 1 + sum_i P(drafts 0..i all right)` estimates the engine's mean
acceptance length on the same data. Tensor glossary: see `engine.py`; here b sequences, A anchors per
sequence, B block size, K draft tokens per block.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from domino_ray.spec.draft import DominoDraft, DraftConfig, default_target_layer_ids
from domino_ray.engine.spec_engine import SpecEngine
from domino_ray.engine.request import Request
from domino_ray.spec.proposer import DominoProposer
from domino_ray.spec.sampling_params import SamplingParams
from domino_ray.spec.stats import per_position_acceptance, total_stats


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


# ---- configuration and data ------------------------------------------------------------------------

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


def generate_sequences(target, prompts: list[list[int]], *, max_new_tokens: int, batch_size: int = 32,
                       eos_token_ids=(), on_progress: Callable[[int], None] | None = None,
                       max_model_len: int | None = None) -> list[tuple[list[int], int]]:
    """Greedy target-only continuations: `(prompt + generated ids, len(prompt))` per prompt. `max_model_len`
    bounds the KV cache (rows x length): a long-context target's own limit (SmolLM2: 8192) would reserve GBs."""
    engine = SpecEngine(target, None, max_rows=batch_size, eos_token_ids=eos_token_ids, max_model_len=max_model_len)
    params = SamplingParams(max_new_tokens=max_new_tokens)
    done: dict[int, list[int]] = {}

    def on_event(event):
        if event.completion is not None:
            done[event.request_id] = event.completion.token_ids
            if on_progress:
                on_progress(len(done))

    engine.generate([Request(i, list(p), params) for i, p in enumerate(prompts)], on_event=on_event)
    return [(list(p) + done[i], len(p)) for i, p in enumerate(prompts)]


def collate(sequences: list[tuple[list[int], int]], pad_id: int = 0):
    """ids `[b, T]` (right-padded), first generated position `[b]`, lengths `[b]`."""
    t = max(len(ids) for ids, _ in sequences)
    ids = torch.full((len(sequences), t), pad_id, dtype=torch.long)
    for row, (seq, _) in enumerate(sequences):
        ids[row, :len(seq)] = torch.tensor(seq)
    starts = torch.tensor([start for _, start in sequences])
    lengths = torch.tensor([len(seq) for seq, _ in sequences])
    return ids, starts, lengths


def frequent_ids(sequences: list[tuple[list[int], int]], size: int, vocab_size: int) -> torch.Tensor:
    """The `size` ids most frequent in the generated parts (ties and the remainder filled by prompt-token
    counts, then by id), ascending: the pruned draft vocabulary (speculators' d2t order)."""
    generated, prompt = torch.zeros(vocab_size), torch.zeros(vocab_size)
    for seq, start in sequences:
        generated += torch.bincount(torch.tensor(seq[start:], dtype=torch.long), minlength=vocab_size)[:vocab_size]
        prompt += torch.bincount(torch.tensor(seq[:start], dtype=torch.long), minlength=vocab_size)[:vocab_size]
    score = generated * (prompt.max() + 1) + prompt  # generated counts first, prompt counts break ties
    return score.topk(size, sorted=True).indices.sort().values


def init_pruned_vocabulary(draft: DominoDraft, target, draft_ids: torch.Tensor):
    """Set `d2t` (draft id i -> target id i + d2t[i]) and start the draft's lm_head from the target's rows."""
    cfg = draft.config
    if not cfg.has_d2t or len(draft_ids) != cfg.draft_vocab_size:
        raise ValueError(f"{len(draft_ids)} draft ids for a draft with draft_vocab_size={cfg.draft_vocab_size}")
    with torch.no_grad():
        draft.d2t.copy_(draft_ids - torch.arange(len(draft_ids)))
        weight = target.get_output_embeddings().weight[draft_ids.to(draft.lm_head.weight.device)]
        draft.lm_head.weight.copy_(weight.to(draft.lm_head.weight.dtype))


def target_to_draft_ids(draft: DominoDraft, vocab_size: int) -> torch.Tensor | None:
    """`[V]` long: the draft id of each target id, -100 for ids outside the pruned vocabulary; None without one."""
    if not draft.config.has_d2t:
        return None
    table = torch.full((vocab_size,), -100, dtype=torch.long, device=draft.d2t.device)
    table[draft.to_target_ids(torch.arange(len(draft.d2t), device=draft.d2t.device))] = torch.arange(
        len(draft.d2t), device=draft.d2t.device)
    return table


def sample_anchors(starts: torch.Tensor, lengths: torch.Tensor, num_anchors: int,
                   generator: torch.Generator) -> torch.Tensor:
    """Anchors `[b, A]`, uniform in [start - 1, length - 2]: the anchor is the last prompt token or a generated
    one, and at least its first draft has a label."""
    lo = (starts - 1).clamp(min=0)
    hi = (lengths - 2).clamp(min=lo)
    u = torch.rand(len(starts), num_anchors, generator=generator)
    return (lo[:, None] + (u * (hi - lo + 1)[:, None]).long().clamp(max=(hi - lo)[:, None])).sort(-1).values


def training_mask(anchors: torch.Tensor, seq_len: int, block_size: int) -> torch.Tensor:
    """Bool `[b, 1, A*B, T + A*B]` over `[context ; blocks]`: block a's queries see context positions < anchor_a
    and all of block a (non-causal), nothing of other blocks."""
    b, a = anchors.shape
    context = torch.arange(seq_len, device=anchors.device)[None, None, :] < anchors[:, :, None]  # [b, A, T]
    own_block = torch.eye(a, dtype=torch.bool, device=anchors.device).repeat_interleave(block_size, 1)  # [A, A*B]
    rows = torch.cat([context, own_block[None].expand(b, -1, -1)], -1)  # [b, A, T + A*B]
    return rows.repeat_interleave(block_size, 1)[:, None]


def context_features(target, ids: torch.Tensor, layer_ids) -> torch.Tensor:
    """Concatenated target hidden states `[b, T, F]` at `layer_ids` (HF `hidden_states[l + 1]`), as the engine
    takes them."""
    hidden_ids = [i + 1 for i in layer_ids]
    out = target.get_decoder()(input_ids=ids, output_hidden_states=hidden_ids)
    return torch.cat([out.hidden_states[i] for i in hidden_ids], -1)


# ---- the training forward --------------------------------------------------------------------------

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


# ---- the loop --------------------------------------------------------------------------------------

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
            loss = _blended_loss(base, final, draft_labels(labels, to_draft), weights, lam)
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


def _blended_loss(base, final, targets, weights, lam: float):
    """The correction head's loss blended with the base logits' (lam -> the base's share); base only
    without a head."""
    loss_base = weighted_ce(base, targets, weights)
    return loss_base if final is None else (1 - lam) * weighted_ce(final, targets, weights) + lam * loss_base


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


def draft_labels(labels: torch.Tensor, to_draft: torch.Tensor | None) -> torch.Tensor:
    """Target-id labels -> the draft's ids (-100 where the pruned vocabulary lacks the token: no loss, and
    the accuracy, measured in target ids, counts it wrong)."""
    if to_draft is None:
        return labels
    return to_draft[labels.clamp(min=0)].masked_fill(labels == -100, -100)


def collate_features(features: list[torch.Tensor]) -> torch.Tensor:
    """Per-sequence features `[T_i, F]` -> `[b, T, F]`, zero-padded on the right (padding is never attended:
    a block's context is the positions before its anchor)."""
    t = max(f.shape[0] for f in features)
    out = features[0].new_zeros(len(features), t, features[0].shape[1])
    for row, f in enumerate(features):
        out[row, :f.shape[0]] = f
    return out


@torch.no_grad()
def sequence_features(target, sequences: list[tuple[list[int], int]], layer_ids, *, batch_size: int = 8,
                      dtype: torch.dtype = torch.float16) -> list[torch.Tensor]:
    """The context features of every sequence, `[T_i, F]` each, stored in `dtype` (fp16 keeps 3 decimal
    digits of the hidden states and halves the memory). Computed once, reused by every training step."""
    device = next(target.parameters()).device
    order = sorted(range(len(sequences)), key=lambda i: len(sequences[i][0]))  # similar lengths: little padding
    by_index = {}
    for i in range(0, len(order), batch_size):
        rows = order[i:i + batch_size]
        ids, _, lengths = collate([sequences[r] for r in rows])
        feats = context_features(target, ids.to(device), layer_ids).to(dtype).cpu()
        for row, r in enumerate(rows):
            by_index[r] = feats[row, :lengths[row]].clone()
    return [by_index[i] for i in range(len(sequences))]


@torch.no_grad()
def evaluate_blocks(draft: DominoDraft, target, sequences, cfg: TrainConfig, batch_size: int = 16,
                    features: list[torch.Tensor] | None = None):
    """Teacher-forced statistics (final logits, base logits) on fixed anchors of held-out sequences."""
    was_training = draft.training
    draft.eval()
    generator = torch.Generator().manual_seed(cfg.seed + 1)
    device = next(target.parameters()).device
    finals, bases, all_labels = [], [], []
    for i in range(0, len(sequences), batch_size):
        ids, starts, lengths = collate(sequences[i:i + batch_size])
        anchors = sample_anchors(starts, lengths, cfg.anchors_per_sequence, generator).to(device)
        ids, lengths = ids.to(device), lengths.to(device)
        batch_features = (collate_features(features[i:i + batch_size]).to(device) if features is not None
                          else context_features(target, ids, draft.config.target_layer_ids))
        base, final = block_logits(draft, target, batch_features, ids, anchors)
        bases.append(draft.to_target_ids(base.argmax(-1)).flatten(0, 1))  # [b*A, K]
        finals.append(draft.to_target_ids((final if final is not None else base).argmax(-1)).flatten(0, 1))
        all_labels.append(block_labels(ids, lengths, anchors, base.shape[2]).flatten(0, 1))
    draft.train(was_training)
    labels = torch.cat(all_labels)
    return accuracy_stats(torch.cat(finals), labels), accuracy_stats(torch.cat(bases), labels)


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


# ---- evaluation in the engine ----------------------------------------------------------------------

def backbone_only(draft: DominoDraft) -> DominoDraft:
    """The same draft without its GRU head (base logits only): the head ablation at equal backbone."""
    cfg = replace(draft.config, emb_dim=None, gru_hidden_dim=None, num_uncorrected=0)
    plain = DominoDraft(cfg)
    state = {k: v for k, v in draft.state_dict().items() if not k.startswith(("prefix_gru.", "embed_proj."))}
    plain.load_state_dict(state, strict=True)
    weight = next(draft.parameters())
    return plain.to(device=weight.device, dtype=weight.dtype).eval()


def engine_acceptance(target, draft: DominoDraft, prompts: list[list[int]], *, max_new_tokens: int,
                      batch_size: int = 16, eos_token_ids=(), max_model_len: int | None = None) -> dict:
    """Greedy speculative generation in the real engine: mean acceptance length and per-position acceptance."""
    engine = SpecEngine(target, DominoProposer(draft, target), max_rows=batch_size, eos_token_ids=eos_token_ids,
                        max_model_len=max_model_len)
    params = SamplingParams(max_new_tokens=max_new_tokens)
    out = engine.generate([Request(i, list(p), params) for i, p in enumerate(prompts)])
    total = total_stats(c.stats for c in out)
    return {"mean_acceptance_length": total.mean_acceptance_length, "steps": total.num_spec_steps,
            "per_position_acceptance": per_position_acceptance(total.acceptance_histogram),
            "acceptance_histogram": total.acceptance_histogram, "token_ids": [c.token_ids for c in out]}
