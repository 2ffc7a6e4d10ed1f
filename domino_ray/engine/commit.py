"""A step's tokens into its rows: `update_from_output` for a decode step, `commit` for any step (the prefill's first
token too), and the rules `commit` applies in order, one function each.

A row keeps its tokens up to the first stop id (which it keeps), or up to the token that completes a stop string, and
finishes "stop"; a row that reaches its token budget finishes "length". Its statistics and logprobs count only the
tokens it keeps.
"""

from __future__ import annotations

from domino_ray.engine.request import Row, StepEvent, TokenLogprobs
from domino_ray.engine.step_types import StepOutput


def update_from_output(rows: list[Row], output: StepOutput, now: float) -> list[StepEvent]:
    """Apply a decode step's `output` to the active `rows` (slot order): each row commits its accepted drafts and the
    bonus token (`commit`), counting the drafts its budget let the step verify. The rows' events, in slot order."""
    events = []
    for i, row in enumerate(rows):
        drafted = min(output.width, row.draft_budget)  # before `commit` adds the step's tokens
        forced = output.forced[i] if output.forced else 0
        events.append(commit(row, output.committed(i), now, step=(drafted, output.width, forced),
                             logprobs=output.row_logprobs(i), near_ties=output.near_ties[i]))
    return events


def commit(row: Row, tokens: list[int], now: float, *, step: tuple[int, int, int] | None = None,
           logprobs: tuple[list, list] | None = None, near_ties: int = 0) -> StepEvent:
    """Append a step's `tokens` to `row` under its stop and length rules: the step's event, with the completion when
    the row finished. `step`: (drafts counted, verify width, forced drafts) for a decode step; None for the
    prefill's first token.
    `logprobs`: the step's (values `[q][1 + N]`, ids `[q][N]`) per position, N the step's largest (the row keeps its
    own N). `near_ties`: a bit mask over `tokens`, the near-ties (`verify.near_tie_mask`)."""
    tokens = cut_at_stop_id(row, tokens)      # 1. stop ids
    tokens = cut_at_stop_string(row, tokens)  # 2. stop strings
    if step is not None:                      # 3. statistics of the tokens kept
        row.stats.observe_step(step[0], len(tokens) - 1, step[1], step[2])
    row.stats.near_ties += count_near_ties(near_ties, len(tokens))  # 4. near-ties among them
    row.tokens.extend(tokens)
    if row.request.constraint is not None:   # 5. a constraint (a grammar's state) moves past them
        row.request.constraint.commit(tokens)
    new_logprobs = keep_logprobs(row, tokens, logprobs)  # 6. logprobs, at the row's own N
    if row.finish_reason is None and len(row.tokens) >= row.max_new:  # 7. the length limit
        row.finish_reason = "length"
    return StepEvent(row.request.request_id, tokens, row.completion(now) if row.finish_reason is not None else None,
                     new_logprobs)


def cut_at_stop_id(row: Row, tokens: list[int]) -> list[int]:
    """`tokens` through the first stop id, which finishes the row."""
    cut = next((i + 1 for i, t in enumerate(tokens) if t in row.stop_ids), None)
    if cut is None:
        return tokens
    row.finish_reason = "stop"
    return tokens[:cut]


def cut_at_stop_string(row: Row, tokens: list[int]) -> list[int]:
    """`tokens` through the one completing a stop string (`Request.stop_strings`), which finishes the row; the later
    ones are dropped. A stop id (only ever last, `cut_at_stop_id`) is no text: the matcher never sees it."""
    matcher = row.request.stop_strings
    if matcher is None:
        return tokens
    keep = matcher.push(tokens[:-1] if tokens[-1] in row.stop_ids else tokens)  # generated ids to keep, or None
    if keep is None:
        return tokens
    row.finish_reason = "stop"
    return tokens[:max(keep - len(row.tokens), 1)]


def count_near_ties(mask: int, kept: int) -> int:
    """The near-ties of a step's bit `mask` among its first `kept` tokens."""
    return (mask & ((1 << kept) - 1)).bit_count()


def keep_logprobs(row: Row, tokens: list[int], logprobs: tuple[list, list] | None) -> list[TokenLogprobs] | None:
    """The logprobs of the `tokens` the row keeps, at its own N (`params.logprobs`), appended to the row's; None when
    the row asks for none."""
    if row.logprobs is None:
        return None
    top = row.request.params.logprobs
    new = [[(t, v[0]), *zip(i[:top], v[1:top + 1])] for t, v, i in zip(tokens, *logprobs)]
    row.logprobs.extend(new)
    return new
