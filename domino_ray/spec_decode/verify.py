"""Verification: which draft tokens the target keeps, and the token it adds.

Vocabulary (used in code, output columns and logs alike):
- **K** (`num_spec_tokens`): the most draft tokens a step may verify, fixed per engine.
- **verify width** W (0..K): the draft tokens this step verifies; K every step, or chosen per step by the
  adaptive width (`width_policy.py`). W = 0 is a plain target decode step (no drafting).
- **draft tokens**: the W tokens the draft proposes for the step, d_1..d_W.
- **step**: one target verify pass over `[anchor, d_1..d_W]`; the anchor is the last committed token.
- **accepted**: draft tokens the target keeps, a prefix d_1..d_a (0 <= a <= W); excludes the bonus.
- **bonus**: the one token the target adds after the accepted prefix (its own choice at position a:
  a correction when d_{a+1} was rejected, a free extra token when all W were accepted).
- Every step commits a + 1 tokens; `mean_acceptance_length = 1 + accepted / steps` (includes the bonus).

Greedy: accept the longest prefix where d_i == argmax of the target at the previous position.
Sampled (temperature > 0): the draft proposal is one-hot, so speculative sampling reduces to: accept
d_i with probability p_i(d_i); at the first rejection sample from p with d_i removed and renormalised;
if all W are accepted, sample the bonus from p_W. The output is distributed exactly as the target's.
We realise it coupled to the target's own inverse-CDF sample at each position (`rejection_accept`), so
with per-position uniforms the sampled text does not depend on the draft at all.

`limit [n]` caps how many drafts may be accepted (the row's remaining token budget minus the bonus), so
a step never commits more tokens than the row may still emit.
"""

from __future__ import annotations

import torch


def greedy_choice(logits: torch.Tensor) -> torch.Tensor:
    """`logits [..., V]` -> the index of each row's largest logit `[...]`, the first on ties (as `argmax`).
    `max(-1)` rather than `argmax`: on CPU (torch 2.13) argmax over a vocabulary is several times slower."""
    return logits.max(-1).indices


# A greedy position is a near-tie when its top two logits are within this many units in the last place of a 16-bit
# logits dtype at the top one: there, speculative decoding may pick another token than target-only, because a verify
# forward of W + 1 positions rounds differently from a one-position one (`bench_gpu.tie_check` judges partings by it).
TIE_ULPS = 2


def near_tie_mask(logits: torch.Tensor, greedy: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """logits `[n, q, V]` computed in the 16-bit `dtype` (penalties may have made them fp32), greedy `[n]` (bool:
    temperature 0) -> `[n]` int64 bit masks, bit i set where position i of a greedy row is a near-tie (`TIE_ULPS`)."""
    top2 = logits.topk(2, dim=-1).values.float()                       # [n, q, 2]
    _, exponent = torch.frexp(top2[..., 0])
    ulp = torch.ldexp(torch.full_like(top2[..., 0], torch.finfo(dtype).eps), exponent - 1)  # [n, q]
    near = (top2[..., 0] - top2[..., 1] <= TIE_ULPS * ulp) & greedy[:, None]                       # [n, q]
    bits = 2 ** torch.arange(logits.shape[1], device=logits.device)                                # [q]
    return (near.long() * bits).sum(1)


def greedy_accept(*, target_logits: torch.Tensor, drafts: torch.Tensor, limit: torch.Tensor):
    """target_logits `[n, K+1, V]`, drafts `[n, K]`, limit `[n]` -> (accepted `[n]`, tokens `[n, K+1]`).

    `tokens[:, :accepted+1]` are the committed tokens d_1..d_a, bonus.
    """
    n, k = drafts.shape
    if target_logits.shape[:2] != (n, k + 1):
        raise ValueError(f"target_logits {tuple(target_logits.shape)} does not match drafts {tuple(drafts.shape)}")
    target = greedy_choice(target_logits)  # [n, K+1]
    usable = torch.arange(k, device=drafts.device)[None, :] < limit[:, None]
    accepted = ((drafts == target[:, :k]) & usable).cumprod(1).sum(1)  # [n]
    return accepted, target  # accepted drafts equal the target's own choices, so target is the output


def rejection_accept(*, target_probs: torch.Tensor, drafts: torch.Tensor, limit: torch.Tensor,
                     uniforms: torch.Tensor):
    """Lossless speculative sampling with a one-hot (greedy) draft proposal, coupled to the target's own sample.

    target_probs `[n, K+1, V]` (after temperature/top-k/top-p), drafts `[n, K]`, limit `[n]`, uniforms
    `[n, K+1]` in [0, 1) -> (accepted `[n]`, tokens `[n, K+1]`).

    x_i is the target's own sample at position i (inverse CDF of `uniforms[:, i]`); draft i is accepted
    iff it equals x_i, and the bonus is x at the first rejection. That is speculative sampling for a
    one-hot proposal (accept d with probability p(d); on rejection, x is distributed as p with d removed
    and renormalised), and the committed tokens are always the x's: with uniforms indexed by absolute
    token position, the output is the one target-only sampling gives with the same seed, whatever the
    draft proposed or how many drafts were verified.
    """
    n, k = drafts.shape
    samples = sample_from_probs(target_probs, uniforms)  # [n, K+1]
    usable = torch.arange(k, device=drafts.device)[None, :] < limit[:, None]
    accepted = ((drafts == samples[:, :k]) & usable).cumprod(1).sum(1)  # [n]
    return accepted, samples


def sample_from_probs(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling: probs `[..., V]` (unnormalised is fine), uniforms `[...]` in [0, 1) -> ids `[...]`.

    `right=True` picks the first index whose cumulative mass exceeds u * total, which always has
    positive probability. No host sync (unlike torch.multinomial with a generator per row).
    """
    cdf = probs.double().cumsum(-1)  # [..., V]
    threshold = (uniforms.double() * cdf[..., -1])[..., None]
    return torch.searchsorted(cdf, threshold, right=True)[..., 0].clamp(max=probs.shape[-1] - 1)
