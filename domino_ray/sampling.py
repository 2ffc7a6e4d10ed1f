"""Sampling parameters and the target distribution they define."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


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
        """Raise ValueError naming the field for out-of-range values."""
        checks = [
            ("max_new_tokens", isinstance(self.max_new_tokens, int) and self.max_new_tokens >= 1, "an int >= 1"),
            ("temperature", _is_number(self.temperature) and 0.0 <= self.temperature <= 100.0, "a number in [0, 100]"),
            ("top_p", _is_number(self.top_p) and 0.0 < self.top_p <= 1.0, "a number in (0, 1]"),
            ("top_k", isinstance(self.top_k, int) and self.top_k >= 0, "an int >= 0"),
            ("seed", self.seed is None or (isinstance(self.seed, int) and 0 <= self.seed < 2**63), "null or an int in [0, 2**63)"),
            ("stop_token_ids", all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids), "a list of ints >= 0"),
        ]
        for name, ok, expected in checks:
            if not ok:
                raise ValueError(f"sampling parameter {name}={getattr(self, name)!r} is invalid: expected {expected}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x == x


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
        keep = keep & (mass_before < top_p[:, None, None])  # [n, q, V]; keep was [n, 1, V], so not in place
        sorted_logits = sorted_logits.masked_fill(~keep, float("-inf"))
        scaled = torch.empty_like(scaled).scatter_(-1, order, sorted_logits)
    return scaled.softmax(-1)
