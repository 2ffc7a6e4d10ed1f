"""Key groups: each row's attention reads about what the row holds, not what the longest row holds.

A decode forward runs on slots `0..r` (the row bucket). With one key length for all of them (the longest
row's, rounded up to `kv_chunk`), attention reads `r x longest` keys per layer: on 1 row of 2,000 tokens and
63 of 100 that is 64 x 2,016 keys where the rows hold 8,300. Instead the slots are cut into a few
*contiguous* ranges, each attending over its own key bucket (the longest of its rows, rounded up); the
projections, the MLP and the acceptance stay batched over all `r` rows, only the attention call (and its
mask) is made per range. The target's verify forward and the draft's block forward use the same groups.

Why these choices:
- Contiguous slot ranges: a range's keys are a view of the KV buffers `[R, Hkv, T, D]`; nothing is gathered
  or copied per step, and each range is an ordinary dense SDPA call on CPU and CUDA alike, so every row
  sees the same keys, limit and math as before (a key beyond its limit is masked either way; only the
  padded length of the masked tail changes).
- Longest rows first: for a set of lengths the grouping that reads the fewest keys puts the longest rows
  together, i.e. it cuts the lengths sorted in descending order (`best_groups`, an exact DP over the
  distinct buckets). The engine keeps the slots in that order *lazily* (`plan`): a step lays the best
  groups' sizes over the slots as they are (`groups_over`, each range reading its own longest row), and
  only when that reads more than `REORDER_SLACK` above the best does it move the misplaced rows into
  place, all at once (`misplaced`; a move copies one row's KV, about two steps of that row's attention
  reads). A finished row, refilled from the last slot, typically costs one move per group; an admitted
  wave lands at the end, usually in place.
- A few groups (`max_groups`, 4 by default in the engine): each group is one more attention call (and
  mask) per layer, so a split must also save more than `group_cost` keys.
- With CUDA graphs the engine keeps one group (a graph per group structure would make the graph keys
  combinatorial): the grouped path is for eager steps, CPU and `cuda_graphs: off`. Where a graph-friendly
  form would go next: keys as data (a paged or varlen attention kernel reading each row's length from a
  tensor), or piecewise graphs with attention outside them.

Key reads are counted per layer (every layer of a forward reads the same keys) and include padding slots.
Groups are written `((stop, t), ...)`: slots `[previous stop, stop)` attend over buffer positions
`[0, t)`; the first range starts at slot 0 and the last stop is `r`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

Groups = tuple[tuple[int, int], ...]

REORDER_SLACK = 0.125  # move rows once the slots as they are read this much more than the best grouping
MAX_DISTINCT = 64      # distinct key buckets `best_groups` tells apart (its DP is quadratic in them)
# What one more key group (an attention call and a mask per layer) is worth, in keys read: measured 600-2,600
# on the 2-core CPU with the demo pair; on a GPU, eager, ~8 kernel launches per layer (~40 us) read ~40k keys
# of a Qwen3-4B layer (4 KiB each at ~4 TB/s).
GROUP_COST = {"cpu": 1024, "cuda": 32768}


def best_groups(buckets: Sequence[int], max_groups: int, group_cost: int = 0) -> list[tuple[int, int]]:
    """The grouping of key buckets (any order) that reads the fewest keys plus `group_cost` per group, with at
    most `max_groups` groups: `[(count, t), ...]`, longest first (t strictly decreasing).

    A DP over the m distinct buckets sorted descending, O(max_groups x m^2): exact up to `MAX_DISTINCT`
    distinct buckets; beyond, runs of neighbouring buckets count as their longest (many rows, short chunks).
    """
    values = sorted(set(buckets), reverse=True)
    counts = [0] * len(values)
    index = {v: i for i, v in enumerate(values)}
    for b in buckets:
        counts[index[b]] += 1
    if len(values) > MAX_DISTINCT:  # keep the host's work per step small: merge runs of neighbours
        run = -(-len(values) // MAX_DISTINCT)
        values = values[::run]
        counts = [sum(counts[i:i + run]) for i in range(0, len(counts), run)]
    m = len(values)
    before = [0] * (m + 1)  # before[j]: rows with the j largest buckets
    for j, c in enumerate(counts):
        before[j + 1] = before[j] + c
    inf = float("inf")
    # cost[g][j]: fewest keys for the rows of the j largest buckets in g groups; cut[g][j]: where the last starts
    cost = [[inf] * (m + 1) for _ in range(max_groups + 1)]
    cut = [[0] * (m + 1) for _ in range(max_groups + 1)]
    cost[0][0] = 0
    for g in range(1, max_groups + 1):
        for j in range(1, m + 1):
            for i in range(g - 1, j):  # the last group holds buckets i..j-1; its longest is values[i]
                c = cost[g - 1][i] + (before[j] - before[i]) * values[i]
                if c < cost[g][j]:
                    cost[g][j], cut[g][j] = c, i
    g = min(range(1, max_groups + 1), key=lambda g: cost[g][m] + g * group_cost)
    out, j = [], m
    while g:
        i = cut[g][j]
        out.append((before[j] - before[i], values[i]))
        j, g = i, g - 1
    return out[::-1]


def group_of(bucket: int, best: Sequence[tuple[int, int]]) -> int:
    """Index in `best` (from `best_groups`) of the group a row with this bucket belongs to."""
    g = 0
    while g + 1 < len(best) and best[g + 1][1] >= bucket:
        g += 1
    return g


def groups_over(buckets: Sequence[int], best: Sequence[tuple[int, int]]) -> Groups:
    """`best`'s group sizes laid over the slots as they are (`buckets[s]` of slot s): each range reads the
    longest bucket it holds, so any slot order is correct, and the best order reads the fewest keys."""
    out, start = [], 0
    for count, _ in best:
        out.append((start + count, max(buckets[start:start + count])))
        start += count
    return tuple(out)


def misplaced(buckets: Sequence[int], best: Sequence[tuple[int, int]], rows: int) -> tuple[list[int], list[int]]:
    """The moves that put each of the first `rows` slots (the real rows; padding slots after them hold the
    smallest bucket and are in place) into its group's range: (sources, destinations), a permutation of the
    misplaced slots (pairs may form cycles). Every other row stays where it is."""
    stops, start = [], 0
    for count, _ in best:
        start += count
        stops.append(start)
    sources: dict[int, list[int]] = {}
    holes: dict[int, list[int]] = {}
    g = 0
    for s in range(rows):
        while s >= stops[g]:
            g += 1
        want = group_of(buckets[s], best)
        if want != g:
            sources.setdefault(want, []).append(s)
            holes.setdefault(g, []).append(s)
    src, dst = [], []
    for g, slots in sources.items():
        src += slots
        dst += holes[g]
    return src, dst


def plan(buckets: Sequence[int], rows: int, max_groups: int, group_cost: int = 0
         ) -> tuple[Groups, list[int], list[int]]:
    """A step's key groups for slots with key `buckets` (the first `rows` real, the rest padding), and the
    moves to make first, `(groups, sources, destinations)`: none while the slots as they are read at most
    `REORDER_SLACK` above the best grouping; otherwise every misplaced row, and the best groups."""
    if max_groups == 1:  # one key bucket for all (CUDA graphs): nothing to plan, no DP on the step's host path
        return ((len(buckets), max(buckets)),), [], []
    best = best_groups(buckets, max_groups, group_cost)
    groups = groups_over(buckets, best)
    if keys_read(groups) <= (1 + REORDER_SLACK) * sum(c * t for c, t in best):
        return groups, [], []
    src, dst = misplaced(buckets, best, rows)
    moved = list(buckets)
    for s, d in zip(src, dst):
        moved[d] = buckets[s]
    return groups_over(moved, best), src, dst


def keys_read(groups: Groups) -> int:
    """Keys one layer's attention reads over all slots of a forward with these groups."""
    total, start = 0, 0
    for stop, t in groups:
        total += (stop - start) * t
        start = stop
    return total


@dataclass
class KeyReads:
    """The engine's count of keys read per layer by decode steps (target verify and draft alike: both use the
    step's groups), beside what the rows hold and what one key bucket (the longest row's) would read."""
    steps: int = 0
    keys: int = 0          # total over steps: `keys_read` of the step's groups (padding slots included)
    held: int = 0          # total over steps, over real rows: KV positions + the step's span (what it writes)
    one_bucket: int = 0    # total over steps: r x the longest row's bucket (one key length for all)
    moves: int = 0         # rows moved to put slots in their groups (eviction refills not counted)
    last_groups: Groups = ()
    last_held: int = 0

    def observe(self, groups: Groups, held: int, longest: int, moves: int):
        self.steps += 1
        self.moves += moves
        self.keys += keys_read(groups)
        self.held += held
        self.one_bucket += groups[-1][0] * longest
        self.last_groups, self.last_held = groups, held

    def per_step(self) -> dict[str, float]:
        n = max(self.steps, 1)
        return {"keys": self.keys / n, "held": self.held / n, "one_bucket": self.one_bucket / n,
                "moves": self.moves / n}
