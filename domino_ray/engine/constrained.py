"""The host's part of a constrained step (rows with a grammar, `logit_bias` or `allowed_token_ids`: each row's
`request.Constraint`). Between the draft and the verify the host reads the drafts, puts each row's forced tokens
(those its grammar leaves no choice about) first among them, and builds every verified position's logit adjustment
from the drafts before it; the verify adds it to the target's logits (`RowSampling.accept`). A step whose rows have no
constraint never comes here: its step mode and graph are unchanged.
"""

from __future__ import annotations

import torch

from domino_ray.engine.request import Row


def forced_tokens(rows: list[Row]) -> list[list[int]]:
    """Each row's forced next tokens (none for a row without a constraint), in slot order."""
    return [row.request.constraint.forced() if row.request.constraint is not None else [] for row in rows]


def forced_width(forced: list[list[int]], width: int, num_spec_tokens: int, costs: dict[int, float] | None = None
                 ) -> int:
    """The step's verify width with forced tokens as drafts, at least `width` and at most K. With the adaptive width's
    cost table (`costs` {W: seconds}) the width that commits the most tokens a second counting the forced drafts
    alone (a wide step for one row's forced tokens costs the whole batch); without one (a fixed K) wide enough for
    every row's forced tokens."""
    most = min(max(map(len, forced), default=0), num_spec_tokens)
    if most <= width:
        return width
    if costs is None:
        return most

    def rate(w: int) -> float:
        return (len(forced) + sum(min(len(f), w) for f in forced)) / costs[w]

    cap = min((w for w in costs if w >= most), default=max(costs))  # the narrowest width that holds them all
    return max((w for w in sorted(costs) if width <= w <= cap), key=rate, default=width)


def put_forced(drafts: torch.Tensor, forced: list[list[int]], width: int) -> list[list[int]]:
    """The rows' `drafts [n, K]` (the draft step's output buffer) read to the host, each row's first ones replaced by
    its forced tokens (also in the buffer): `[n][width]`. The step's host sync for its masks."""
    n = len(forced)
    host = drafts[:n, :width].tolist()
    for row_drafts, row_forced in zip(host, forced):
        row_drafts[:len(row_forced[:width])] = row_forced[:width]
    if any(forced) and width:
        drafts[:n, :width] = torch.tensor(host, dtype=torch.long, device=drafts.device)
    return host


def logit_adjust(rows: list[Row], drafts: list[list[int]], r: int, vocab_size: int, device) -> torch.Tensor:
    """`[r, W+1, V]` on `device`: each constrained row's `Constraint.logit_adjust` after its `drafts` (W each), 0 for
    the other rows and the padding slots."""
    adjust = torch.zeros(r, len(drafts[0]) + 1 if drafts else 1, vocab_size)
    for i, (row, row_drafts) in enumerate(zip(rows, drafts)):
        if row.request.constraint is not None:
            adjust[i] = row.request.constraint.logit_adjust(row_drafts, vocab_size)
    return adjust.to(device)
