"""Which rows hold which KV blocks: the queue, admission by free blocks, chunked prefill, the choice of preemption.

Host bookkeeping only (`SpecEngine` does the device side), handed over as a `StepPlan` (`step_types.py`): rows wait in
`pending` in order; the rows at its front that hold blocks are being prefilled. Admission is by free blocks, not a slot
count: a row not started takes the blocks for its prompt and first step (its prompt's published whole blocks shared,
`blocks.BlockPool.share_prefix`) only if the pool has them beside what the active rows take over their next `HEADROOM`
positions (so admitting it does not force a preemption soon), and nobody jumps the queue. Prompts are prefilled in
order within a per-step token budget, a long one in chunks over several steps, while the active rows keep decoding
(`schedule`). When the active rows' next step needs more blocks than are free, the latest admitted row gives its blocks
back (`victim`): preemption by recompute, as vLLM does; then the active rows take their next step's blocks
(`make_room`).
"""

from __future__ import annotations

from collections import deque
from dataclasses import replace
from itertools import takewhile

from domino_ray.kv.blocks import BlockPool
from domino_ray.engine.request import Row
from domino_ray.engine.step_types import BlockGrant, PrefillSegment, StepPlan

HEADROOM = 64  # positions admission leaves each active row: rows admitted into a full pool get preempted as they grow


class Scheduler:
    """The queue and the blocks of the rows of one engine: `max_rows` rows in flight at most, `span` positions a step
    writes past a row's committed context, `max_prefill_tokens` prompt tokens prefilled per step."""

    def __init__(self, blocks: BlockPool, *, max_rows: int, span: int, max_prefill_tokens: int):
        self.blocks, self.max_rows, self.span, self.max_prefill_tokens = blocks, max_rows, span, max_prefill_tokens
        self.pending: deque[Row] = deque()
        self.admitted = 0  # rows admitted so far: each row's `order`

    def needs(self, rows: list[Row], ahead: int = 0) -> list[int]:
        """Blocks each active row still takes for its next step (positions up to `committed - 1 + span`), and `ahead`
        positions more."""
        return [self.blocks.blocks_for(row.committed - 1 + self.span + ahead) - len(row.blocks) for row in rows]

    def growth(self, rows: list[Row], ahead: int = 0) -> int:
        return sum(max(n, 0) for n in self.needs(rows, ahead))

    def holders(self) -> list[Row]:
        """Pending rows holding blocks (being prefilled): the queue's leading rows with blocks, as rows take blocks in
        queue order, and a row requeued at the front has none (the latest admitted row, a holder when there is one,
        is preempted first). Walks those only, not the whole queue: it runs every step."""
        return list(takewhile(lambda row: bool(row.blocks), self.pending))

    def schedule(self, rows: list[Row]) -> StepPlan:
        """This step's prefill beside the active `rows` (the plan's decode part comes after it: `make_room`): pending
        rows in order within `max_prefill_tokens` tokens, each row not started first taking its blocks (`take_blocks`)
        beside the active rows' `HEADROOM`; stops at the first row with no room. Publishes the whole blocks each segment
        writes, so the rows behind it in the same forward share them already (a layer writes every segment's keys
        before any segment attends)."""
        if not self.pending:  # the steady state of a drained queue: nothing to walk
            return StepPlan(prefill=[])
        budget, segments, growth = self.max_prefill_tokens, [], self.growth(rows, HEADROOM)
        holders = len(self.holders())
        for row in self.pending:
            if budget == 0:
                break
            context = row.context_ids()
            if not row.blocks:
                if len(rows) + holders >= self.max_rows or not self.take_blocks(row, context, growth):
                    break
                holders += 1  # the rows behind it leave room for its headroom too
                growth += self.blocks.blocks_for(len(context) + self.span + HEADROOM) - len(row.blocks)
            n = min(len(context) - row.prefilled, budget)
            segments.append(PrefillSegment(row, context, row.prefilled, n))
            budget -= n
            stop = (row.prefilled + n) // self.blocks.block_size
            row.published = self.blocks.publish(context, row.blocks, row.published, stop)
        return StepPlan(prefill=segments)

    def finish_segments(self, segments: list[PrefillSegment]) -> tuple[list[Row], list[int]]:
        """After the prefill forward: the rows whose context is now in (leaving the queue) and each one's last token's
        index in the forward's positions."""
        done, ends, end = [], [], 0
        for segment in segments:
            end += segment.length
            segment.row.prefilled = segment.start + segment.length
            if segment.row.prefilled == len(segment.context):  # every segment but the last completes its row
                ends.append(end - 1)
                done.append(self.pending.popleft())
        return done, ends

    def make_room(self, plan: StepPlan, rows: list[Row]) -> StepPlan:
        """`plan` with its decode part, for the active `rows` once the prefill's rows joined: while their next step
        needs more blocks than are free, the latest admitted row (active or being prefilled, `victim`) gives its
        blocks back and waits at the front of the queue (`preempt`; the engine frees the active ones' slots); then
        each active row left takes the blocks its next step needs (`grants`)."""
        preempt = []
        while self.growth(rows) > self.blocks.free_count:
            row = self.victim(rows)
            rows = [active for active in rows if active is not row]
            self.release(row)
            self.requeue(row)
            preempt.append(row)
        grants = []
        for row, n in zip(rows, self.needs(rows)):
            if n > 0:
                grants.append(BlockGrant(row, len(row.blocks), self.blocks.take(n)))
                row.blocks += grants[-1].blocks
        return replace(plan, preempt=preempt, grants=grants)

    def take_blocks(self, row: Row, context: list[int], growth: int) -> bool:
        """Blocks for `row`'s `context` and its first step, the published whole blocks it starts with shared (not the
        block of its last position, which its prefill writes), if the pool has the rest beside `growth`."""
        bs = self.blocks.block_size
        shared = self.blocks.share_prefix(context, (len(context) - 1) // bs)
        need = self.blocks.blocks_for(len(context) + self.span) - len(shared)
        if need > self.blocks.free_count - growth:
            self.blocks.release(shared)
            return False
        row.blocks = shared + self.blocks.take(need)
        row.prefilled, row.published = len(shared) * bs, len(shared)
        row.order, self.admitted = self.admitted, self.admitted + 1
        self.blocks.stats.prefix_hit_tokens += len(shared) * bs
        return True

    def victim(self, rows: list[Row]) -> Row:
        """The row to preempt: the latest admitted of the active `rows` and the rows being prefilled."""
        return max(self.holders() + rows, key=lambda row: row.order)

    def requeue(self, row: Row):
        """A preempted row (its blocks released) waits at the front of the queue."""
        if row in self.pending:
            self.pending.remove(row)
        self.pending.appendleft(row)
        self.blocks.stats.preemptions += 1

    def release(self, row: Row):
        self.blocks.release(row.blocks)
        row.blocks, row.prefilled, row.published = [], 0, 0
