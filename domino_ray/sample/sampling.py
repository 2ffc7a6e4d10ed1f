"""Sampling on the device (torch): the target distribution that sampling parameters define, the per-slot
sampling settings, the one acceptance call every step makes and the generated tokens' logprobs. The parameters
themselves and their checks are in params.py (torch-free); penalties and min_tokens in penalties.py."""

from __future__ import annotations

from typing import Iterable, NamedTuple, Sequence

import torch

from domino_ray.sample.penalties import RowPenalties, compute_dtype
from domino_ray.sample.rng import counter_uniforms
from domino_ray.sample.params import SamplingParams
from domino_ray.spec_decode.verify import greedy_accept, near_tie_mask, rejection_accept


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


class ConstraintMask(NamedTuple):
    """What a constrained step's rows' constraints (`engine/request.Constraint`) do to the target's logits."""
    refused: torch.Tensor        # [n, W+1, V] bool: tokens a row may not emit at a position (after the drafts before)
    bias: torch.Tensor | None    # [n, 1, V] float32 added at every position (logit_bias, allowed_token_ids), or None


class StepMode(NamedTuple):
    """What a step's rows ask beyond greedy decoding, known on the host; part of a step's graph key, so each
    costs only the steps that hold such a row."""
    sampled: bool = False          # some row samples
    filtered: bool = False         # some sampled row filters (top-k/top-p: a sort over the vocabulary)
    penalized: bool = False        # some row has penalties or min_tokens (`SamplingParams.penalized`)
    logprobs: int | None = None    # the most top alternatives a row asks (None: no row asks for logprobs)
    constrained: bool = False      # some row's logits are masked or biased (`SamplingParams.constrained`): the host
    #                                reads the drafts to build each position's mask, so the step runs eagerly


GREEDY = StepMode()


def sampling_mode(params: Iterable[SamplingParams]) -> StepMode:
    """The `StepMode` of a set of rows."""
    params = list(params)
    sampled = any(not p.greedy for p in params)
    return StepMode(sampled, sampled and any(p.top_k > 0 or p.top_p < 1.0 for p in params),
                    any(p.penalized for p in params),
                    max((p.logprobs for p in params if p.logprobs is not None), default=None),
                    any(p.constrained for p in params))


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, top: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The log-softmax of raw logits `[n, q, V]` (vLLM's default: before penalties and temperature) at the chosen
    `tokens [n, q]` -> (values `[n, q, 1 + top]`: the token's logprob then the `top` largest, ids `[n, q, top]`)."""
    logprobs = logits.to(compute_dtype(logits.dtype)).log_softmax(-1)  # [n, q, V]
    best = logprobs.topk(top, -1)
    return torch.cat([logprobs.gather(-1, tokens[..., None]), best.values], -1), best.indices


class RowSampling:
    """Per-slot sampling settings on the device and the one acceptance call every step uses.

    Slots hold temperature, top-p, top-k and seed `[R]` and the penalties' state (`penalties.RowPenalties`);
    `accept` turns the target's logits at the verified positions into (accepted, tokens), after the penalties
    when the step has penalised rows, greedy rows by argmax, sampled rows by the coupled rejection sampling of
    `verify.rejection_accept`. A prefill's first token is the same call with zero drafts.
    """

    def __init__(self, max_rows: int, vocab_size: int, device, dtype: torch.dtype):
        self.temperature = torch.zeros(max_rows, device=device)                 # [R]
        self.top_p = torch.ones(max_rows, device=device)                        # [R]
        self.top_k = torch.zeros(max_rows, dtype=torch.long, device=device)     # [R]
        self.seeds = torch.zeros(max_rows, dtype=torch.long, device=device)     # [R] sampled rows' seeds
        self.penalties = RowPenalties(max_rows, vocab_size, device, compute_dtype(dtype))
        self.device = device
        # 16-bit logits: greedy rows' near-ties are counted (`verify.near_tie_mask`)
        self.tie_dtype = dtype if dtype in (torch.bfloat16, torch.float16) else None

    def load(self, rows: slice, params: Sequence[SamplingParams], seeds: Sequence[int]):
        """Settings of newly admitted rows into slots `rows`: two host->device copies."""
        ints = torch.tensor([[p.top_k, s] for p, s in zip(params, seeds)], dtype=torch.long).to(self.device)
        floats = torch.tensor([[p.temperature, p.top_p] for p in params]).to(self.device, self.temperature.dtype)
        self.top_k[rows], self.seeds[rows] = ints[:, 0], ints[:, 1]
        self.temperature[rows], self.top_p[rows] = floats[:, 0], floats[:, 1]

    def move(self, src: int | torch.Tensor, dst: int | torch.Tensor):
        for t in (self.temperature, self.top_p, self.top_k, self.seeds):
            t[dst] = t[src]
        self.penalties.move(src, dst)

    def accept(self, rows: slice, logits: torch.Tensor, drafts: torch.Tensor, limit: torch.Tensor,
               positions: torch.Tensor, mode: StepMode, mask: ConstraintMask | None = None
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """logits `[n, W+1, V]` at `positions [n, W+1]` after drafts `[n, W]`, limit `[n]` for slots `rows` ->
        (accepted `[n]`, tokens `[n, W+1]`, the greedy rows' near-ties `[n]` as bit masks with 16-bit logits, else
        None), for a step of `mode` (`sampling_mode`, host-known). `mask` (constrained steps): applied to the logits
        after the penalties, -inf where a row's constraint refuses a token, its bias added: the target's distribution is
        the constrained one at every position, so a refused draft is rejected there."""
        if mode.penalized:
            logits = self.penalties.apply(rows, logits, drafts)
        if mask is not None:
            logits = logits.masked_fill(mask.refused, float("-inf"))
            if mask.bias is not None:
                logits = logits + mask.bias.to(logits.dtype)
        temperature = self.temperature[rows]
        ties = near_tie_mask(logits, temperature == 0, self.tie_dtype) if self.tie_dtype else None
        accepted, tokens = greedy_accept(target_logits=logits, drafts=drafts, limit=limit)
        if mode.sampled:
            probs = sampling_probs(logits, temperature, self.top_k[rows], self.top_p[rows], filtered=mode.filtered)
            # One uniform per token position (the position the token is written at): see rejection_accept.
            uniforms = counter_uniforms(self.seeds[rows], positions + 1)
            s_accepted, s_tokens = rejection_accept(target_probs=probs, drafts=drafts, limit=limit, uniforms=uniforms)
            is_sampled = temperature > 0
            accepted = torch.where(is_sampled, s_accepted, accepted)
            tokens = torch.where(is_sampled[:, None], s_tokens, tokens)
        return accepted, tokens, ties
