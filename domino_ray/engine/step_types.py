"""What the parts of one engine step hand each other: the scheduler's `StepPlan` and the runner's `StepOutput`.

The scheduler decides on the host which prompt segments a step prefills, which rows give their blocks back and which
blocks the active rows take (`scheduler.Scheduler.schedule`, `.make_room`); the runner's step reads its outcome to the
host at one sync (`runner.StepRunner.read_output`), which `commit.update_from_output` applies to the rows. Host values
only (ints and lists): shapes in brackets, n the active rows, W the step's verify width, N the step's most logprobs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from domino_ray.engine.request import Row


@dataclass(frozen=True)
class PrefillSegment:
    """Context tokens of one row that a step's prefill forward writes into the KV: `context[start:start + length]`."""
    row: Row
    context: list[int]  # the row's context ids (`Row.context_ids`): its prompt, and a preempted row's tokens but one
    start: int          # the first position written (the positions before it are in the pool already)
    length: int         # tokens written

    @property
    def ids(self) -> list[int]:
        return self.context[self.start:self.start + self.length]


@dataclass(frozen=True)
class BlockGrant:
    """Blocks an active row takes for its next step: entries `index..` of its block table."""
    row: Row
    index: int          # the first table entry they fill (the row held `index` blocks before)
    blocks: list[int]   # [g] block ids, in table order


@dataclass(frozen=True)
class StepPlan:
    """The scheduler's decisions for one step, made in two parts: the prefill before the step's prefill forward
    (`Scheduler.schedule`), the rest once its rows joined (`Scheduler.make_room`), as their first tokens may finish
    rows whose blocks the decode's part then counts."""
    prefill: list[PrefillSegment]                            # in the forward's order (the queue's)
    # Rows preempted, latest admitted first: their blocks are back in the pool and they wait at the front of the queue;
    # the engine frees the slots of the active ones
    preempt: list[Row] = field(default_factory=list)
    grants: list[BlockGrant] = field(default_factory=list)   # blocks the active rows take, in the rows' order


@dataclass(frozen=True)
class StepOutput:
    """A decode step's outcome on the host, read at its one sync; rows in slot order."""
    width: int                          # W: drafts verified per row
    accepted: list[int]                 # [n] a: drafts accepted (the bonus not counted)
    tokens: list[list[int]]             # [n][W+1] the verified positions' tokens: a row commits its first a + 1
    near_ties: list[int]                # [n] bit masks over `tokens`: near-ties (`verify.near_tie_mask`), 0: uncounted
    logprobs: list | None = None        # [n][W+1][1+N] each position's token's logprob, then the top N's; None: unasked
    logprob_ids: list | None = None     # [n][W+1][N] the top N's ids
    forced: list[int] = field(default_factory=list)  # [n] leading drafts a constraint forced (none: empty)

    def committed(self, i: int) -> list[int]:
        """Row `i`'s accepted drafts and its bonus token, before any stop rule."""
        return self.tokens[i][:self.accepted[i] + 1]

    def row_logprobs(self, i: int) -> tuple[list, list] | None:
        """Row `i`'s (values `[W+1][1+N]`, ids `[W+1][N]`), or None when no row asked."""
        return (self.logprobs[i], self.logprob_ids[i]) if self.logprobs is not None else None
