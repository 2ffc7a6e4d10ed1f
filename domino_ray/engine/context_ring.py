"""The draft's context not fed yet: the taps of an eager adaptive engine's W = 0 steps, and admitted prompts' taps.

An eager adaptive engine's W = 0 steps keep the target's taps (`deferred`) and feed the draft's context with up to
`DEFERRED_STEPS` positions at once: before the next drafting step or admission, or when full. Fed one position at a
time the update is a small GEMM over the projection weights per step (~2.5x the cost per position of a batch of 8);
with CUDA graphs it stays in the step (a graph per fill level would multiply the keys).
While drafting is far off (`WidthController.choose`: context False) a full ring drops its oldest position instead of
feeding: the draft's context then misses those positions but holds the last ones. So do a written-off draft's steps
while its re-probe is near: those come mid-row too, and a draft's first draft lands far more often after a stretch of
skipped steps when it holds the last positions than when it holds none. Far from a re-probe (context None) they keep
none: its promise rises slowly as its counts decay, through near (taps kept) long before a probe. The ring holds the
tap layers' outputs themselves, joined at a feed (copying them into a buffer each step costs more).

Admitted prompts' taps wait too (`pending_prompts`), for the next step that keeps the draft's context (drafting or
not), and are never fed if none comes (a written-off draft's rows while drafting is far off).
"""

from __future__ import annotations

from collections import deque

import torch

DEFERRED_STEPS = 8


class ContextRing:
    """What the draft's context has not been fed yet, per slot; `defer`: W = 0 steps keep their taps here (an eager
    adaptive engine), else only admitted prompts wait, until the step after their admission."""

    def __init__(self, proposer, device: torch.device, defer: bool):
        self.proposer, self.device = proposer, device
        # W = 0 steps' taps not yet fed, oldest first: each step's tap-layer outputs `[r, 1, C]` (its rows then, the
        # active rows first: admission feeds the ring first, so rows only leave meanwhile); they are the active rows'
        # last `len(deferred)` positions. Full, a step's append drops the oldest (drafting far off).
        self.deferred: deque[list[torch.Tensor]] | None = deque(maxlen=DEFERRED_STEPS) if defer else None
        # Slot -> its prompt's taps `[1, m, F]` (a view: the prefill's taps stay alive meanwhile)
        self.pending_prompts: dict[int, torch.Tensor] = {}

    def keeps(self, w: int, context: bool | None) -> bool:
        """Whether a step at width `w` keeps its taps for later instead of feeding them (`context` None: neither)."""
        return not w and self.deferred is not None and context is not None

    def hold(self, taps: list[torch.Tensor]):
        """A W = 0 step's taps (`keeps`); a full ring drops its oldest (drafting far off)."""
        self.deferred.append(taps)

    def add_prompts(self, rows: slice, taps: torch.Tensor, sizes: list[int]):
        """The taps `[1, N, F]` of the prompts prefilled into slots `rows`, `sizes` tokens each; fed at once unless
        W = 0 steps defer."""
        self.pending_prompts.update(zip(range(rows.start, rows.stop), taps.split(sizes, 1)))  # [1, m, F] each
        if self.deferred is None:
            self.feed_prompts()

    def before_step(self, w: int, context: bool | None, n: int, lens: torch.Tensor):
        """Feed what a step at width `w` needs fed first (`n` active rows at lengths `lens`): the ring before drafting
        or when full, the prompts before any step that keeps the context; a step keeping no taps empties the ring (its
        taps are no longer the last positions). Timed with the step: deferred W = 0 work counts against a drafting
        width (conservative)."""
        if self.deferred and (w or (context and len(self.deferred) == DEFERRED_STEPS)):
            self.feed_deferred(n, lens)
        elif self.deferred and context is None:
            self.deferred.clear()
        if self.pending_prompts and (w or context):
            self.feed_prompts()

    def before_admission(self, n: int, lens: torch.Tensor):
        """The active rows' deferred positions are the same count only while no row joins: fed first."""
        if self.deferred:
            self.feed_deferred(n, lens)

    def feed_prompts(self):
        """The draft's context of the prompts waiting, prompt by prompt (padded together, each would take the longest
        one's memory)."""
        start = torch.zeros(1, dtype=torch.long, device=self.device)
        for slot, prompt_taps in sorted(self.pending_prompts.items()):
            self.proposer.append_context(slice(slot, slot + 1), prompt_taps, start)
        self.pending_prompts.clear()

    def feed_deferred(self, n: int, lens: torch.Tensor):
        """The deferred taps into the draft's context, at once: the active rows' last `len(deferred)` positions (every
        one of the `n` active rows decoded all the deferred steps, one position a step: admission feeds them first)."""
        m = len(self.deferred)
        if n:
            taps = torch.cat([torch.cat(step, -1)[:n] for step in self.deferred], 1)  # [n, m, F], oldest first
            self.proposer.append_context(slice(0, n), taps, lens[:n] - m)
        self.deferred.clear()

    def drop(self, slot: int):
        """A finished row's waiting prompt, before the last row moves into its slot."""
        self.pending_prompts.pop(slot, None)

    def move(self, src: list[int], dst: list[int], src_index, dst_index):
        """Slot `src[i]` -> `dst[i]` (the engine's `_move_rows`; `src_index`/`dst_index` as it indexes tensors)."""
        if self.pending_prompts:
            moved = {d: self.pending_prompts.pop(s, None) for s, d in zip(src, dst)}
            self.pending_prompts.update((d, taps) for d, taps in moved.items() if taps is not None)
        for step_taps in self.deferred or ():  # the whole ring: its order is the same for every row
            for taps in step_taps:
                taps[dst_index] = taps[src_index]
