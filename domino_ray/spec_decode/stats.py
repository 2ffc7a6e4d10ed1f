"""Per-row acceptance statistics (vLLM conventions; vocabulary in `verify.py`).

Invariant for every finished row: `num_generated_tokens == 1 + num_spec_steps + num_accepted_draft_tokens`
(the first token comes from prefill; each step commits its accepted drafts plus one more token, whatever
its verify width W, W = 0 being a plain decode step). When a
stop token lands inside an accepted block, the step counts the drafts before it as accepted and the
stop token as the step's last token; drafts after it are dropped.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace


@dataclass
class RowStats:
    num_spec_tokens: int                 # K, draft tokens proposed per step (0 = target only)
    num_spec_steps: int = 0              # target verify passes
    num_draft_tokens: int = 0            # drafts that could have been accepted (capped by the row's budget)
    num_accepted_draft_tokens: int = 0   # accepted drafts, excluding the bonus token
    acceptance_histogram: list[int] = field(default_factory=list)  # [K+1]: steps that accepted exactly j drafts
    verify_width_histogram: list[int] = field(default_factory=list)  # [K+1]: steps that verified W = j drafts
    # greedy tokens chosen where the target's top two logits were within 16-bit rounding (`verify.near_tie_mask`):
    # the only places speculative may differ from target-only (0 for fp32 logits: not counted)
    near_ties: int = 0
    # accepted drafts that a constraint forced (its grammar's only continuation, put ahead of the draft's: they count
    # among `num_accepted_draft_tokens` too)
    num_forced_tokens: int = 0

    def __post_init__(self):
        if not self.acceptance_histogram:
            self.acceptance_histogram = [0] * (self.num_spec_tokens + 1)
        if not self.verify_width_histogram:
            self.verify_width_histogram = [0] * (self.num_spec_tokens + 1)

    def observe_step(self, num_draft_tokens: int, num_accepted: int, width: int | None = None, forced: int = 0):
        """One verify step at width `width` (default K) that could accept `num_draft_tokens` drafts (the width
        capped by the row's budget) and accepted `num_accepted`, the first `forced` of them forced drafts (those
        accepted)."""
        assert 0 <= num_accepted <= max(num_draft_tokens, 0), (num_accepted, num_draft_tokens)
        self.num_spec_steps += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_draft_tokens += num_accepted
        self.num_forced_tokens += min(forced, num_accepted)
        self.acceptance_histogram[num_accepted] += 1
        self.verify_width_histogram[self.num_spec_tokens if width is None else width] += 1

    def copy(self) -> "RowStats":
        return replace(self, acceptance_histogram=list(self.acceptance_histogram),
                       verify_width_histogram=list(self.verify_width_histogram))

    @property
    def mean_acceptance_length(self) -> float:
        """1 + accepted / steps: tokens committed per step, bonus included (0.0 before any step)."""
        return 1.0 + self.num_accepted_draft_tokens / self.num_spec_steps if self.num_spec_steps else 0.0

    @property
    def draft_acceptance_rate(self) -> float:
        return self.num_accepted_draft_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    def to_columns(self) -> dict:
        return {
            "num_spec_tokens": self.num_spec_tokens,
            "num_spec_steps": self.num_spec_steps,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_draft_tokens": self.num_accepted_draft_tokens,
            "mean_acceptance_length": self.mean_acceptance_length,
            "draft_acceptance_rate": self.draft_acceptance_rate,
            "acceptance_histogram": list(self.acceptance_histogram),
            "verify_width_histogram": list(self.verify_width_histogram),
            "near_ties": self.near_ties,
            "num_forced_tokens": self.num_forced_tokens,
        }


def per_position_acceptance(histogram: list[int]) -> list[float]:
    """Rate at which draft position i (0-based) was accepted: steps accepting > i drafts / steps."""
    steps = sum(histogram)
    if not steps:
        return [0.0] * (len(histogram) - 1)
    return [sum(histogram[i + 1:]) / steps for i in range(len(histogram) - 1)]


def merge_histograms(histograms) -> list[int]:
    """Element-wise sum of equal-length histograms (an empty iterable gives [])."""
    total: list[int] = []
    for h in histograms:
        if not total:
            total = [0] * len(h)
        if len(h) != len(total):
            raise ValueError(f"histograms of different lengths: {len(h)} vs {len(total)}")
        total = [a + b for a, b in zip(total, h)]
    return total


def total_stats(rows) -> RowStats:
    """Sum of several rows' statistics (same K), e.g. a whole run: its mean acceptance length is
    1 + all accepted / all steps, not a mean of the rows' ratios."""
    rows = list(rows)
    total = RowStats(rows[0].num_spec_tokens if rows else 0)
    for r in rows:
        total.num_spec_steps += r.num_spec_steps
        total.num_draft_tokens += r.num_draft_tokens
        total.num_accepted_draft_tokens += r.num_accepted_draft_tokens
        total.near_ties += r.near_ties
        total.num_forced_tokens += r.num_forced_tokens
    if rows:
        total.acceptance_histogram = merge_histograms(r.acceptance_histogram for r in rows)
        total.verify_width_histogram = merge_histograms(r.verify_width_histogram for r in rows)
    return total
