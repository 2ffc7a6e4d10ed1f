"""What a draft learns from: the target's own greedy continuations of prompts (`generate_sequences`, our engine,
target only), batched with random anchors, the target's context features (computed per step or once,
`sequence_features`), and the pruned draft vocabulary they define (`frequent_ids`, `init_pruned_vocabulary`).
Tensor glossary: see `engine/core.py`; here b sequences, A anchors per sequence.
"""

from __future__ import annotations

from typing import Callable

import torch

from domino_ray.frontend.requests import id_requests
from domino_ray.engine.core import SpecEngine
from domino_ray.spec_decode.draft import DominoDraft
from domino_ray.sample.params import SamplingParams


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

    engine.generate(id_requests(prompts, params), on_event=on_event)
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


def sample_anchors(starts: torch.Tensor, lengths: torch.Tensor, num_anchors: int,
                   generator: torch.Generator) -> torch.Tensor:
    """Anchors `[b, A]`, uniform in [start - 1, length - 2]: the anchor is the last prompt token or a generated
    one, and at least its first draft has a label."""
    lo = (starts - 1).clamp(min=0)
    hi = (lengths - 2).clamp(min=lo)
    u = torch.rand(len(starts), num_anchors, generator=generator)
    return (lo[:, None] + (u * (hi - lo + 1)[:, None]).long().clamp(max=(hi - lo)[:, None])).sort(-1).values


def context_features(target, ids: torch.Tensor, layer_ids) -> torch.Tensor:
    """Concatenated target hidden states `[b, T, F]` at `layer_ids` (HF `hidden_states[l + 1]`), as the engine
    takes them."""
    hidden_ids = [i + 1 for i in layer_ids]
    out = target.get_decoder()(input_ids=ids, output_hidden_states=hidden_ids)
    return torch.cat([out.hidden_states[i] for i in hidden_ids], -1)


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
