"""The target distribution that sampling parameters define (torch); the parameters themselves and their
checks are in sampling_params.py."""

from __future__ import annotations

import torch


def sampling_probs(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                   filtered: bool) -> torch.Tensor:
    """Target distribution `[n, q, V]` from logits `[n, q, V]` and per-row temperature/top_k/top_p `[n]`.

    Rows with temperature 0 get a finite distribution too (their result is not used). `filtered=False`
    skips the sort when no row uses top-k or top-p (host knows this without a sync).
    """
    t = torch.where(temperature > 0, temperature, torch.ones_like(temperature))
    scaled = logits.float() / t[:, None, None]
    if filtered:
        v = scaled.shape[-1]
        sorted_logits, order = scaled.sort(-1, descending=True)  # [n, q, V]
        rank = torch.arange(v, device=logits.device)
        k = torch.where(top_k > 0, top_k, torch.full_like(top_k, v))
        keep = rank[None, None, :] < k[:, None, None]
        probs_sorted = sorted_logits.masked_fill(~keep, float("-inf")).softmax(-1)
        mass_before = probs_sorted.cumsum(-1) - probs_sorted  # mass of strictly more likely tokens
        keep = keep & (mass_before < top_p[:, None, None])
        sorted_logits = sorted_logits.masked_fill(~keep, float("-inf"))
        scaled = torch.empty_like(scaled).scatter_(-1, order, sorted_logits)
    return scaled.softmax(-1)
