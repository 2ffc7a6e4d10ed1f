"""Step costs for the adaptive verify width: seconds per step by row bucket, width and key length.

`cost` in the width policy's rate (`width_policy.py`) is a table of step times measured on the device at engine
start, at the shortest and the longest key length (a step's cost is about linear in the keys it attends), and updated
from real steps (`StepCosts`). Which widths a step may run (`step_widths`) and which are timed at start-up
(`widths_to_time`) are decided here too.
"""

from __future__ import annotations

import time
from typing import Callable, Mapping, Sequence


def drafting_line(costs: Mapping[int, float]) -> Callable[[int], float] | None:
    """The least-squares line through the step times of the widths W >= 1 in `costs` (a drafting step costs a
    fixed part, the draft block and the verify forward, plus a part per verified draft; slope never below zero),
    as W -> seconds; None with fewer than two such widths."""
    drafting = sorted(w for w in costs if w >= 1)
    if len(drafting) < 2:
        return None
    n = len(drafting)
    mean_w = sum(drafting) / n
    mean_c = sum(costs[w] for w in drafting) / n
    slope = sum((w - mean_w) * (costs[w] - mean_c) for w in drafting) / sum((w - mean_w) ** 2 for w in drafting)
    slope = max(slope, 0.0)  # more positions never cost less
    return lambda w: mean_c + slope * (w - mean_w)


def smooth_costs(costs: Mapping[int, float]) -> dict[int, float]:
    """Step times measured on a noisy machine, denoised: the widths W >= 1 get `drafting_line` through their
    measurements; W = 0 (no drafting) keeps its own figure."""
    out = dict(costs)
    line = drafting_line(costs)
    if line is not None:
        out.update({w: line(w) for w in costs if w >= 1})
    if 0 in out:  # drafting is extra work: a drafting step never costs less than a plain decode step
        out.update({w: max(c, out[0]) for w, c in out.items()})
    return out


class StepCosts:
    """Seconds per step by rows and width: the start-up line `base + per_key * t` in the attended key length t,
    times the machine's pace now (`pace`, per row count).

    The start-up figures are timed with the widths interleaved, so their ratios are what the device gives; the
    machine's pace then drifts (other work on the cores, clocks). Every real step moves its row count's pace, one
    factor for all widths (a busy core slows a plain step as it slows a drafting one), and a drafting step also moves
    its own width's figure against a plain step's (W = 0 the reference). Were only the widths in use to learn, the one
    run all the time (W = 0 at many rows) would follow the machine while the others kept start-up figures, and the
    choice would follow the drift, not the widths' costs. `per_key` (how costs grow with the context) stays the
    start-up measurement's.
    """

    def __init__(self, base: dict[int, dict[int, float]], per_key: dict[int, dict[int, float]] | None = None):
        self.base = {r: dict(c) for r, c in base.items()}
        self.per_key = per_key or {r: {w: 0.0 for w in c} for r, c in base.items()}
        self.pace = {r: 1.0 for r in base}
        self.measured = sorted(self.base)  # the row buckets timed; eager steps also run the counts between
        self._line_at: tuple | None = None  # (r, t) of `_line`, `at`'s drafting widths before the pace
        self._line: dict[int, float] = {}

    def _ensure_rows(self, r: int):
        """Costs for a row count between the measured buckets (an eager step runs exactly its active rows), made
        at its first use: on the line between the neighbouring buckets' figures, the nearest bucket's outside
        them; refined by its own steps from then on."""
        if r in self.base:
            return
        lo = max((x for x in self.measured if x < r), default=self.measured[0])
        hi = min((x for x in self.measured if x > r), default=self.measured[-1])
        f = (r - lo) / (hi - lo) if hi != lo else 0.0
        for table in (self.base, self.per_key):
            table[r] = {w: (1 - f) * table[lo][w] + f * table[hi][w] for w in table[lo] if w in table[hi]}
        self.base[r] = {w: b * ((1 - f) * self.pace[lo] + f * self.pace[hi]) for w, b in self.base[r].items()}
        self.per_key[r] = {w: k * ((1 - f) * self.pace[lo] + f * self.pace[hi]) for w, k in self.per_key[r].items()}
        self.pace[r] = 1.0

    @classmethod
    def from_two_lengths(cls, short: dict, long: dict, t_short: int, t_long: int) -> "StepCosts":
        per_key = {r: {w: max(0.0, (long[r][w] - short[r][w]) / max(t_long - t_short, 1)) for w in short[r]}
                   for r in short}
        base = {r: {w: short[r][w] - per_key[r][w] * t_short for w in short[r]} for r in short}
        return cls(base, per_key)

    def at(self, r: int, t: int) -> dict[int, float]:
        """`smooth_costs` of the figures at `t` keys: the drafting widths' line is kept until `t`, the bucket or a
        drafting width's figure changes (the pace changes every step; the line is most of the work)."""
        self._ensure_rows(r)
        base, per_key, pace = self.base[r], self.per_key[r], self.pace[r]
        if self._line_at != (r, t):
            self._line_at = (r, t)
            self._line = smooth_costs({w: b + per_key[w] * t for w, b in base.items() if w})
        if 0 not in base:
            return {w: pace * c for w, c in self._line.items()}
        plain = base[0] + per_key[0] * t
        return {0: pace * plain, **{w: pace * max(c, plain) for w, c in self._line.items()}}

    def table(self, r: int, t: float) -> dict[int, float]:
        """`at` for a measured row bucket without touching the cache (safe to read from another thread)."""
        base, per_key, pace = dict(self.base[r]), dict(self.per_key[r]), self.pace[r]
        return smooth_costs({w: pace * (b + per_key[w] * t) for w, b in base.items()})

    def observe(self, r: int, w: int, t: int, seconds: float):
        """Fold in a real step. Start-up figures are the fastest of a few runs, so this tracks the lower envelope:
        faster steps pull a figure down quickly, slower ones (a stall, a busy core) raise it slowly."""
        self._ensure_rows(r)
        base, per_key = self.base[r], self.per_key[r]
        self.pace[r] *= 1 + _envelope_rate(seconds, self.pace[r] * (base[w] + per_key[w] * t))
        if w and 0 in base:  # a drafting step: its width's figure against a plain step's, at the pace now
            seconds /= self.pace[r]
            figure = base[w] + per_key[w] * t
            base[w] += _envelope_rate(seconds, figure) * figure
            self._line_at = None


def _envelope_rate(seconds: float, figure: float) -> float:
    """The relative step `observe` moves a figure by towards a step's `seconds`: the lower envelope's rates."""
    error = seconds / figure - 1
    return (0.3 if error < 0 else 0.02) * error


# With CUDA graphs, widths whose verify would exceed this many positions (rows x (W+1)) are left out of a row
# bucket: on an H100/H200 a Qwen3-4B-sized verify is compute-bound past ~200-400 positions (the issue's
# arithmetic: width 15 past ~13 rows, width 7 past ~34), and beyond that its cost grows with the positions
# as fast as full acceptance could repay it. Fewer widths are also fewer graphs and a smaller step peak.
MAX_VERIFY_POSITIONS = 1024


def candidate_widths(num_spec_tokens: int, graphs: bool) -> list[int]:
    """Every width 0..K eagerly; with CUDA graphs a few (each width is its own set of graphs): W = 0 and the widths
    `2^i - 1` up to K (1, 3, 7, 15), whose verify blocks of W + 1 = 2, 4, 8, 16 positions (times the GQA groups
    folded into the attention's rows) fill the tensor cores' row tiles, where powers of two (W + 1 = 3, 5, 9, 17)
    left up to half of a tile's rows padding. A K that is not of that form is not graphed itself (b16: 15, not 16)."""
    if not graphs:
        return list(range(num_spec_tokens + 1))
    return [0] + [(1 << i) - 1 for i in range(1, num_spec_tokens.bit_length() + 1) if (1 << i) - 1 <= num_spec_tokens]


def step_widths(row_buckets: Sequence[int], num_spec_tokens: int, adaptive: bool, graphs: bool) -> dict[int, list[int]]:
    """The verify widths a step of each row bucket may run: K alone for a fixed width; adaptively
    `candidate_widths`, and with graphs only those within `MAX_VERIFY_POSITIONS` (W = 0 always)."""
    if not adaptive:
        return {r: [num_spec_tokens] for r in row_buckets}
    widths = candidate_widths(num_spec_tokens, graphs)
    return {r: [w for w in widths if not graphs or w == 0 or r * (w + 1) <= MAX_VERIFY_POSITIONS]
            for r in row_buckets}


def widths_to_time(widths: Sequence[int]) -> list[int]:
    """The widths start-up times: W = 0 and three drafting widths (the narrowest, the widest and one between)
    when there are more; the others lie on their `drafting_line`, as `smooth_costs` would put them anyway."""
    drafting = sorted(w for w in widths if w >= 1)
    if len(drafting) <= 3:
        return sorted(widths)
    return sorted({w for w in widths if w < 1} | {drafting[0], drafting[len(drafting) // 2], drafting[-1]})


def measure_step_costs(run_step: Callable[[int, int, int], None], widths: Mapping[int, Sequence[int]],
                       key_lengths: tuple[int, int], repeats: int = 3) -> StepCosts:
    """Seconds per step for every row bucket and its widths (`widths[r]`) at the shortest and the longest
    key length.

    `run_step(r, t, w)` is the engine's own device step (the one a real step runs) for `r` padding rows over
    `t` keys at width `w`, returning once the device is done. The fastest of `repeats` runs after a warm-up
    run; widths interleaved so each sees the same machine state. Only `widths_to_time` are run; the other
    drafting widths get their line's figure (K = 8 eagerly: 4 widths timed instead of 9)."""
    tables = []
    for t in key_lengths:
        table: dict[int, dict[int, float]] = {}
        for r, bucket_widths in widths.items():
            times: dict[int, list[float]] = {w: [] for w in widths_to_time(bucket_widths)}
            for _ in range(repeats + 1):
                for w in times:
                    start = time.perf_counter()
                    run_step(r, t, w)
                    times[w].append(time.perf_counter() - start)
            measured = {w: min(ts[1:]) for w, ts in times.items()}
            line = drafting_line(measured)
            table[r] = {w: measured[w] if w in measured else line(w) for w in bucket_widths}
        tables.append(table)
    return StepCosts.from_two_lengths(tables[0], tables[1], *key_lengths)
