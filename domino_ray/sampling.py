"""Sampling parameters and the target distribution they define."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from domino_ray.config import SAMPLING_CHECKS, invalid_value


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 256                # generated tokens at most (the stop token counts)
    temperature: float = 0.0                 # 0 = greedy
    top_p: float = 1.0                       # nucleus mass kept, (0, 1]
    top_k: int = 0                           # keep the k most likely tokens; 0 = all
    seed: int | None = None                  # per-request seed (sampled decoding only)
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)  # besides the model's EOS ids
    ignore_eos: bool = False                 # do not stop at the model's EOS ids

    def __post_init__(self):
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        self.validate()

    def validate(self):
        """Raise ValueError naming the field for a bad value (the checks config.validate uses too)."""
        for name, (ok, expected) in SAMPLING_CHECKS.items():
            value = getattr(self, name)
            if not ok(value):
                raise ValueError("sampling parameter " + invalid_value(name, value, expected))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def stop_ids(self, eos_token_ids) -> frozenset[int]:
        """The ids that end this request: its own stop ids plus the model's EOS ids unless `ignore_eos`."""
        return frozenset(self.stop_token_ids) | (frozenset() if self.ignore_eos else frozenset(eos_token_ids))


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
