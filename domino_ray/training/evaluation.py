"""A draft measured: teacher-forced statistics on held-out sequences (`evaluate_blocks`), and acceptance in the real
engine (`engine_acceptance`), with the head ablated at equal backbone (`backbone_only`)."""

from __future__ import annotations

from dataclasses import replace

import torch

from domino_ray.frontend.requests import id_requests
from domino_ray.engine.core import SpecEngine
from domino_ray.spec_decode.draft import DominoDraft
from domino_ray.spec_decode.proposer import DominoProposer
from domino_ray.sample.params import SamplingParams
from domino_ray.spec_decode.stats import per_position_acceptance, total_stats
from domino_ray.training.data import collate, collate_features, context_features, sample_anchors
from domino_ray.training.objective import TrainConfig, accuracy_stats, block_labels, block_logits


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
    out = engine.generate(id_requests(prompts, params))
    total = total_stats(c.stats for c in out)
    return {"mean_acceptance_length": total.mean_acceptance_length, "steps": total.num_spec_steps,
            "per_position_acceptance": per_position_acceptance(total.acceptance_histogram),
            "acceptance_histogram": total.acceptance_histogram, "token_ids": [c.token_ids for c in out]}
