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
        # Prompt segments' taps not fed yet, by the row they belong to: (its block table `[1, nb]`, the segment's first
        # position, its taps `[1, m, F]` (a view: the prefill's taps stay alive meanwhile)), in prefill order
        self.pending_prompts: dict[int, list[tuple[torch.Tensor, int, torch.Tensor]]] = {}

    def keeps(self, w: int, context: bool | None) -> bool:
        """Whether a step at width `w` keeps its taps for later instead of feeding them (`context` None: neither)."""
        return not w and self.deferred is not None and context is not None

    def hold(self, taps: list[torch.Tensor]):
        """A W = 0 step's taps (`keeps`); a full ring drops its oldest (drafting far off)."""
        self.deferred.append(taps)

    def add_prompts(self, owners: list, tables: list[torch.Tensor], offsets: list[int], taps: torch.Tensor,
                    sizes: list[int]):
        """The taps `[1, N, F]` of prompt segments just prefilled, `sizes` tokens each from position `offsets[i]` of the
        row `owners[i]` (any key: `drop` forgets it) with block table `tables[i] [1, nb]`; fed at once unless W = 0
        steps defer."""
        for owner, table, offset, segment in zip(owners, tables, offsets, taps.split(sizes, 1)):
            self.pending_prompts.setdefault(id(owner), []).append((table, offset, segment))
        if self.deferred is None:
            self.feed_prompts()

    def before_step(self, w: int, context: bool | None, n: int, lens: torch.Tensor, tables: torch.Tensor):
        """Feed what a step at width `w` needs fed first (`n` active rows at lengths `lens`): the ring before drafting
        or when full, the prompts before any step that keeps the context; a step keeping no taps empties the ring (its
        taps are no longer the last positions). Timed with the step: deferred W = 0 work counts against a drafting
        width (conservative)."""
        if self.deferred and (w or (context and len(self.deferred) == DEFERRED_STEPS)):
            self.feed_deferred(n, lens, tables)
        elif self.deferred and context is None:
            self.deferred.clear()
        if self.pending_prompts and (w or context):
            self.feed_prompts()

    def before_admission(self, n: int, lens: torch.Tensor, tables: torch.Tensor):
        """The active rows' deferred positions are the same count only while no row joins or leaves: fed first."""
        if self.deferred:
            self.feed_deferred(n, lens, tables)

    def feed_prompts(self):
        """The draft's context of the prompt segments waiting, segment by segment (padded together, each would take the
        longest one's memory)."""
        for segments in self.pending_prompts.values():
            for table, offset, taps in segments:
                start = torch.full((1,), offset, dtype=torch.long, device=self.device)
                self.proposer.append_context(table, taps, start)
        self.pending_prompts.clear()

    def feed_deferred(self, n: int, lens: torch.Tensor, tables: torch.Tensor):
        """The deferred taps into the draft's context, at once: the active rows' last `len(deferred)` positions (every
        one of the `n` active rows decoded all the deferred steps, one position a step: admission feeds
        them first), rows with block tables `tables [n, nb]`."""
        m = len(self.deferred)
        if n:
            taps = torch.cat([torch.cat(step, -1)[:n] for step in self.deferred], 1)  # [n, m, F], oldest first
            self.proposer.append_context(tables[:n], taps, lens[:n] - m)
        self.deferred.clear()

    def drop(self, owner):
        """A row giving its blocks back (finished or preempted): its prompt segments not fed yet are forgotten (their
        blocks may go to another row)."""
        self.pending_prompts.pop(id(owner), None)

    def move(self, src_index, dst_index):
        """Slot `src[i]` -> `dst[i]` (the engine's `_move_rows`; `src_index`/`dst_index` as it indexes tensors)."""
        for step_taps in self.deferred or ():  # the whole ring: its order is the same for every row
            for taps in step_taps:
                taps[dst_index] = taps[src_index]
