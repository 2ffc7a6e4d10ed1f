"""The host's part of a constrained step (rows with a grammar, `logit_bias` or `allowed_token_ids`: each row's
`request.Constraint`). Between the draft and the verify the host reads the drafts, puts each row's forced tokens
(those its grammar leaves no choice about) first among them, and builds every verified position's mask from the
drafts before it; the verify applies it to the target's logits (`RowSampling.accept`). A step whose rows have no
constraint never comes here: its step mode and graph are unchanged.
"""

from __future__ import annotations

import torch

from domino_ray.engine.request import Row
from domino_ray.sample.sampling import ConstraintMask

BITS = torch.arange(32, dtype=torch.int32)  # a bit mask word's bits, lowest first


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


def constraint_mask(rows: list[Row], drafts: list[list[int]], r: int, vocab_size: int, device) -> ConstraintMask:
    """The step's `ConstraintMask` over `r` slots on `device`: each constrained row's allowed tokens after its `drafts`
    (W each) and its bias; the other rows and the padding slots refuse nothing."""
    bits = torch.full((r, len(drafts[0]) + 1 if drafts else 1, -(-vocab_size // 32)), -1, dtype=torch.int32)
    bias = None  # [r, 1, V], made at the first row with a bias
    for i, (row, row_drafts) in enumerate(zip(rows, drafts)):
        constraint = row.request.constraint
        if constraint is not None:
            constraint.allowed_bits(row_drafts, bits[i])
            row_bias = constraint.bias(vocab_size)
            if row_bias is not None:
                bias = torch.zeros(r, 1, vocab_size) if bias is None else bias
                bias[i, 0] = row_bias
    refused = ((bits[..., None] >> BITS) & 1).flatten(-2)[..., :vocab_size] == 0  # [r, W+1, V]
    return ConstraintMask(refused.to(device), bias.to(device) if bias is not None else None)
