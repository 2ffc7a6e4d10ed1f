"""Penalties and min_tokens on the device, lossless under speculation.

vLLM's order, on the target's raw logits before temperature/top-k/top-p: min_tokens (the row's stop ids get
-inf while fewer than min_tokens tokens are generated), then `repetition_penalty` (HF/vLLM: a logit of a token
in the prompt or generated so far is divided by p when positive, multiplied by p otherwise), then
`frequency_penalty` and `presence_penalty` (OpenAI: minus frequency x the token's count in the generated
tokens, minus presence when that count is positive).

Lossless: verify position j of a block `[anchor, d_1..d_W]` picks the token after d_j, so it sees the counts
as they would be after d_1..d_j were committed (and j more generated tokens for min_tokens); whatever a
position accepts is then what target-only decoding would have chosen there. The state is per slot, on the
device, updated with each step's committed tokens (accepted + bonus) inside the step: no host sync.
A row without penalties holds neutral values (p = 1, 0, 0, min_tokens 0), under which the adjustment is
exact identity, so one penalised row in a step changes no other row's tokens.
"""

from __future__ import annotations

from typing import Sequence

import torch

from domino_ray.sample.params import SamplingParams


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Logits are adjusted (and logprobs taken) in float32, or float64 for a float64 model."""
    return torch.promote_types(dtype, torch.float32)


class RowPenalties:
    """Per-slot penalty state `[R, V]` at fixed addresses: generated-token counts, the prompt's tokens, the ids
    min_tokens suppresses; and per slot the three penalties, min_tokens and the generated count `[R]`."""

    def __init__(self, max_rows: int, vocab_size: int, device, dtype: torch.dtype):
        r, v = max_rows, vocab_size
        self.dtype = dtype
        self.counts = torch.zeros(r, v, dtype=torch.int32, device=device)     # [R, V] generated tokens' counts
        self.prompt = torch.zeros(r, v, dtype=torch.bool, device=device)      # [R, V] tokens of the prompt
        self.stop = torch.zeros(r, v, dtype=torch.bool, device=device)        # [R, V] ids min_tokens suppresses
        self.repetition = torch.ones(r, dtype=dtype, device=device)           # [R]
        self.frequency = torch.zeros(r, dtype=dtype, device=device)           # [R]
        self.presence = torch.zeros(r, dtype=dtype, device=device)            # [R]
        self.min_tokens = torch.zeros(r, dtype=torch.long, device=device)     # [R]
        self.generated = torch.zeros(r, dtype=torch.long, device=device)      # [R] tokens generated so far
        self.device = device

    @staticmethod
    def nbytes(max_rows: int, vocab_size: int) -> int:
        """The state's bytes (the memory plan's share): int32 counts and two boolean masks per slot and id."""
        return max_rows * vocab_size * 6

    def load(self, rows: slice, params: Sequence[SamplingParams], stop_ids: Sequence[frozenset], ids: torch.Tensor,
             sizes: Sequence[int], penalized: bool):
        """Newly admitted rows into slots `rows`: their values and, when some of them is `penalized`, no generated
        tokens, the prompts' tokens (`ids [N]` on the device, `sizes` tokens each) and, for rows with min_tokens,
        their stop ids. Rows that are all neutral skip the rest: under neutral values their state is never read."""
        values = torch.tensor([[p.repetition_penalty, p.frequency_penalty, p.presence_penalty, p.min_tokens]
                               for p in params], dtype=torch.float64).to(self.device)
        self.repetition[rows], self.frequency[rows], self.presence[rows] = values[:, :3].to(self.dtype).unbind(1)
        self.min_tokens[rows] = values[:, 3].long()
        if not penalized:
            return
        self.generated[rows] = 0
        self.counts[rows] = 0
        self.prompt[rows] = False
        which = torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(sizes)).to(self.device)
        self.prompt[rows][which, ids] = True
        self.stop[rows] = False
        pairs = [(i, t) for i, (p, s) in enumerate(zip(params, stop_ids)) if p.min_tokens for t in s]
        if pairs:
            slot, token = torch.tensor(pairs).to(self.device).unbind(1)
            self.stop[rows][slot, token] = True

    def restore(self, rows: slice, generated: Sequence[Sequence[int]]):
        """Rows coming back after a preemption (`load`ed): the counts of the tokens they had generated."""
        pairs = [(i, t) for i, tokens in enumerate(generated) for t in tokens]
        if pairs:
            slot, token = torch.tensor(pairs).to(self.device).unbind(1)
            self.counts[rows].index_put_((slot, token), torch.ones_like(token, dtype=torch.int32), accumulate=True)
        self.generated[rows] = torch.tensor([len(g) for g in generated]).to(self.device)

    def move(self, src, dst):
        for t in (self.counts, self.prompt, self.stop, self.repetition, self.frequency, self.presence,
                  self.min_tokens, self.generated):
            t[dst] = t[src]

    def apply(self, rows: slice, logits: torch.Tensor, drafts: torch.Tensor) -> torch.Tensor:
        """logits `[n, W+1, V]` at the positions after `[anchor, d_1..d_W]` (drafts `[n, W]`) for slots `rows` ->
        adjusted logits `[n, W+1, V]` in `self.dtype` (a new tensor: the raw logits stay for logprobs)."""
        n, q, v = logits.shape
        x = logits.to(self.dtype, copy=True)
        counts = torch.zeros(n, q, v, dtype=self.dtype, device=logits.device)
        counts[:, 1:].scatter_(2, drafts[:, :, None], 1.0)  # position j holds d_j ...
        counts = counts.cumsum_(1).add_(self.counts[rows, None])  # ... so position j counts d_1..d_j too
        generated = self.generated[rows, None] + torch.arange(q, device=logits.device)  # [n, W+1] before the token
        early = generated < self.min_tokens[rows, None]
        x.masked_fill_(early[:, :, None] & self.stop[rows, None], float("-inf"))
        seen, positive = (counts > 0) | self.prompt[rows, None], x > 0
        one = torch.ones((), dtype=self.dtype, device=logits.device)
        repetition = self.repetition[rows, None, None]
        x.div_(torch.where(seen & positive, repetition, one))   # exactly x / p where it applies, x / 1 elsewhere
        x.mul_(torch.where(seen & ~positive, repetition, one))
        x.sub_(self.frequency[rows, None, None] * counts)
        x.sub_(self.presence[rows, None, None] * (counts > 0))
        return x

    def commit(self, rows: slice, tokens: torch.Tensor, accepted: torch.Tensor, active: torch.Tensor):
        """The step's committed tokens `tokens[:, :accepted+1]` (`[n, W+1]`, accepted `[n]`) into the counts of
        slots `rows`, for `active [n]` rows only (padding slots never advance)."""
        q = tokens.shape[1]
        kept = (torch.arange(q, device=tokens.device)[None] <= accepted[:, None]) & active[:, None]  # [n, W+1]
        self.counts[rows].scatter_add_(1, tokens, kept.to(torch.int32))
        self.generated[rows] += kept.sum(1)
