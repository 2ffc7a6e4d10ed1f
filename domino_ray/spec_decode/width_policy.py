"""The verify width W per step: how many draft tokens (0..K) the target checks, chosen every step.

A fixed K wins at batch 1 and loses as the batch fills: each step verifies `rows x (W+1)` positions,
and once the target is compute-bound the extra positions cost more than the accepted drafts save. So
each step the engine picks the W that maximises expected committed tokens per second:

    rate(W) = sum over rows of E[tokens | W] / cost(row bucket, W)
    E[tokens | W] = 1 + sum_{i=1..W} prod_{j<=i} p_j      (p_j: draft j accepted given drafts < j were)

`cost` is a table of step times measured on the device at engine start and updated from real steps
(`width_costs.py`); `p` comes from running acceptance estimates, pooled over the engine's rows with a
decaying average and refined per row from its own history. W = 0 is a plain target decode step (no
drafting at all); the Domino correction loop stops at W, so a short width also drafts less. Verifying
fewer drafts never changes what the target accepts: lossless by construction.

While the draft is useless (`AcceptanceEstimates.draft_is_useless`: its first draft lands under 5% of the
time, counted, not assumed; the verdict of the last drafting step, kept until the next one), W = 0 steps
also skip the draft's context update, and so they do while drafting is far off (`CONTEXT_FLOOR`) in an
engine that keeps the last positions' taps anyway (eager: `context_ring.DEFERRED_STEPS`). The positions decoded
then are missing from that draft's context, but for those last few where the engine keeps them (a later
probe sees the draft at its worst; rows admitted later start with their whole prompt as context); a written-off
draft's steps keep none while drafting is far off, its re-probe far away.
Exploration comes from the prior, which is optimistic (a new engine drafts at once): estimates decay towards it
while a position goes unverified, so a draft written off at W = 0 is tried again after a while (rarely: the decay
is slow; its later positions are then judged by its first, not by the prior, so a fresh row is no reason to try
it). Until a first draft has landed, a drafting step is a probe and verifies the narrowest width (whether the first
draft lands is all it asks), and the first `TRIAL_TRIES` probes come whenever the prior says drafting pays, whatever
the misses so far say: at one row a single miss would stop a draft that lands 75-90% of the time.
"""

from __future__ import annotations

from typing import Mapping, Sequence

from domino_ray.spec_decode.width_costs import StepCosts


def expected_tokens_by_width(accept: Sequence[float], usable: int, k: int) -> list[float]:
    """`[K+1]`: the tokens a row is expected to commit in one step at each width W = 0..K, with conditional
    acceptance `accept[i]` for draft i+1 and at most `usable` drafts allowed by its budget (the bonus token
    always comes). One running sum: O(K)."""
    out, total, survive = [1.0], 1.0, 1.0
    for i in range(k):
        if i < usable:
            survive *= accept[i]
            total += survive
        out.append(total)
    return out


def expected_tokens(accept: Sequence[float], width: int, usable: int) -> float:
    """`expected_tokens_by_width` at one width."""
    return expected_tokens_by_width(accept, usable, width)[width]


def width_rates(costs: Mapping[int, float], accept_rows: Sequence[Sequence[float]],
                usable: Sequence[int], counts: Sequence[int] | None = None) -> dict[int, float]:
    """Expected committed tokens per second at each width in `costs` (W -> seconds per step for this row
    bucket), summed over the rows (`accept_rows[r]`, `usable[r]` as in `expected_tokens_by_width`; `counts[r]`
    rows alike, default one each)."""
    k = max(costs)
    gain = [0.0] * (k + 1)  # gain[W] = the rows' expected tokens at W
    for accept, cap, count in zip(accept_rows, usable, counts or [1] * len(usable)):
        for w, tokens in enumerate(expected_tokens_by_width(accept, cap, k)):
            gain[w] += count * tokens
    return {w: gain[w] / c for w, c in costs.items()}


# A drafting width must promise this much more than W = 0 to be chosen. The cost table is off by several percent,
# and not evenly across widths (real drafting steps run further over it than W = 0 steps, up to ~10%), so drafting
# for a smaller promise loses about as often as it gains.
DRAFTING_MARGIN = 0.10


# While the best drafting width promises under this share of W = 0's rate, drafting is far off: an engine that keeps
# its last positions' taps anyway (`WidthController(lazy_context=True)`) stops feeding the draft's context (a few
# percent of a small target's step). Drafting needs 1 + DRAFTING_MARGIN. The floor sits below where a pair that drafts
# now and then hovers (~1.0: a floor there drops the context of steps shortly before drafting, and the drafting steps
# see the gaps) and above where a pair that never pays on a machine sits (~0.8). A useless draft's fresh rows hover
# near 1.0 too: the write-off, not the floor, is for it.
CONTEXT_FLOOR = 0.9

# A W = 0 answer stands for this many steps of the same batch (a new row or drafting evidence looks again at once): its
# estimates move by their slow decay alone meanwhile (0.2% a step), so drafting comes at most this late, and a look's
# Python costs 1-2% of a small model's CPU step.
HOLD_STEPS = 8


# A draft's first drafts are tried this often (decayed counts: three steps at one row, one at three rows or more) before
# the evidence may stop it or write it off. At one row a single miss brings the estimate from the prior's 0.8 to 0.43,
# enough to stop drafting on most cost tables, while even a good draft's first draft misses in about a quarter of its
# rows' first steps: one miss is no verdict. A useless draft costs three narrow probes.
TRIAL_TRIES = 2.5


def best_width(rates: Mapping[int, float], margin: float = DRAFTING_MARGIN) -> int:
    """The width with the highest rate, W = 0 unless a drafting width beats it by `margin`; ties go to the
    narrower width."""
    best, best_rate = 0, -1.0
    for width in sorted(rates):
        if rates[width] > best_rate * (1 + 1e-9):
            best, best_rate = width, rates[width]
    if best > 0 and 0 in rates and best_rate < rates[0] * (1 + margin):
        return 0
    return best


def choose_width(costs: Mapping[int, float], accept_rows: Sequence[Sequence[float]],
                 usable: Sequence[int]) -> int:
    return best_width(width_rates(costs, accept_rows, usable))


class AcceptanceEstimates:
    """Per-position acceptance, pooled over rows (decayed counts) with per-row refinement.

    Position i is *tried* in a step when drafts 1..i-1 were accepted and i was within the step's usable
    width; it *succeeds* when draft i is accepted. The pooled estimate is a ratio of decayed counts
    (`decay` per engine step) smoothed by a Beta prior of mean `prior` and weight `prior_weight` trials;
    a row's estimate shrinks its own counts towards the pooled one with `row_weight` pseudo-trials.
    """

    def __init__(self, num_draft_tokens: int, *, decay: float = 0.998, prior: float = 0.8, prior_weight: float = 2.0,
                 row_weight: float = 4.0):
        self.k, self.decay, self.row_weight = num_draft_tokens, decay, row_weight
        self.prior, self.prior_trials = prior, prior_weight
        self.success = [0.0] * num_draft_tokens
        self.trials = [0.0] * num_draft_tokens

    def pooled(self, chained: bool = False) -> list[float]:
        """`[K]` estimates; `chained`: each position's prior is the estimate of the one before it (the first's still
        `prior`), for a written-off draft: nothing says its later drafts land where its first never does. With the
        flat prior its fresh rows would see positions 2..K (never tried) at 0.8 and be probed again, each."""
        out, prior = [], self.prior
        for s, n in zip(self.success, self.trials):
            out.append((s + prior * self.prior_trials) / (n + self.prior_trials))
            if chained:
                prior = out[-1]
        return out

    def for_row(self, row_success: Sequence[float], row_trials: Sequence[float], pooled: Sequence[float]) -> list[float]:
        m = self.row_weight
        return [(s + m * p) / (n + m) for s, n, p in zip(row_success, row_trials, pooled)]

    def draft_is_useless(self, written_off: bool = False, max_rate: float = 0.05) -> bool:
        """The evidence, not the prior, says the first draft almost never lands: W = 0 steps may then skip
        keeping the draft's context current (the draft is useless, not merely too dear for this batch), once its
        trial is over (`TRIAL_TRIES`), or at once for a draft `written_off` already (a re-probe's miss after its
        counts decayed below the trial's is no new trial: it stays written off, and misses keep it so). A
        written-off draft still drafts when its estimates say so, and an eager engine feeds it its last positions
        first (after a gap in its context a draft accepts nearly as much as one fed every step)."""
        return bool(self.k) and (written_off or self.trials[0] >= TRIAL_TRIES) and \
            self.success[0] < max_rate * self.trials[0]

    def first_draft_landed(self) -> bool:
        """A first draft landed lately: a hit's decayed count stays over 0.5 for ~350 steps."""
        return bool(self.k) and self.success[0] >= 0.5

    def start_step(self):
        self.success = [s * self.decay for s in self.success]
        self.trials = [n * self.decay for n in self.trials]

    def observe(self, usable: int, accepted: int, row_success: list[float], row_trials: list[float]):
        """One row's step: `usable` drafts could be accepted, `accepted` were."""
        for i in range(min(usable, accepted + 1)):
            hit = i < accepted
            self.trials[i] += 1.0
            self.success[i] += hit
            row_trials[i] += 1.0
            row_success[i] += hit


class WidthController:
    """The adaptive width's state and policy in one place: acceptance estimates (pooled, and per slot), the
    step-cost table, the candidate widths. The engine asks `choose` before a step and calls `learn` after it;
    `reset_slot` / `move_slots` follow its slot bookkeeping (a slot's counts belong to the row in it)."""

    def __init__(self, num_spec_tokens: int, max_rows: int, costs: StepCosts, lazy_context: bool = False):
        """`lazy_context`: the engine keeps the last positions' taps of W = 0 steps that skip the draft's context,
        and feeds them before drafting: the policy may then skip the context while drafting is far off, and not
        only while the draft is written off."""
        self.k, self.costs, self.lazy_context = num_spec_tokens, costs, lazy_context
        self.estimates = AcceptanceEstimates(num_spec_tokens)
        self.tried = [[0.0] * num_spec_tokens for _ in range(max_rows)]      # [R][K] steps position i was verified
        self.succeeded = [[0.0] * num_spec_tokens for _ in range(max_rows)]  # [R][K] ... and accepted
        # The verdict of the last drafting step's evidence (`draft_is_useless`): it stands through the W = 0
        # steps after it, which add no evidence (the decayed counts alone would otherwise drop below the
        # minimum and bring the context updates back without a single new draft being tried).
        self.written_off = False
        self.hold: tuple | None = None  # (steps left, batch, (t, context)) while W = 0 stands without a look

    def held(self, r: int, n: int) -> tuple[int, bool | None] | None:
        """(the look's key length t, context) while its W = 0 answer stands for this batch (bucket `r`, `n` rows),
        counting the step; None: `choose` must look. The engine asks first: a held step needs neither its t nor its
        rows' budgets (their Python was 15-17 us of a 16-row step)."""
        if self.hold is None:
            return None
        left, batch, answer = self.hold
        if not left or batch != (r, n):
            return None
        self.hold = (left - 1, batch, answer)
        return answer

    def choose(self, r: int, t: int, usable: Sequence[int]) -> tuple[int, bool | None]:
        """(W, context) for the active rows in slots `0..len(usable)` (`usable[i]`: drafts row i's budget allows),
        bucket `r`, `t` keys. `context`: True, the step keeps the draft's context current; False (the draft written
        off, or with `lazy_context` drafting far off), it does not, and a lazy engine keeps the step's taps for later;
        None (with `lazy_context`, the draft written off and drafting far off), it keeps no taps either. A W = 0
        answer stands for `HOLD_STEPS` steps of the same batch (`held`)."""
        answer = self.held(r, len(usable))
        if answer is not None:
            return 0, answer[1]
        pooled = self.estimates.pooled(chained=self.written_off)
        # Rows never verified whose budget allows every width share the pooled estimate: counted once (a large
        # batch at W = 0 is all such rows, and this runs every step)
        fresh = {i for i, u in enumerate(usable) if u >= self.k and not any(self.tried[i])}
        own = [i for i in range(len(usable)) if i not in fresh]
        accept = [self.estimates.for_row(self.succeeded[i], self.tried[i], pooled) for i in own] + [pooled]
        caps, counts = [usable[i] for i in own] + [self.k], [1] * len(own) + [len(fresh)]
        costs = self.costs.at(r, t)
        rates = width_rates(costs, accept, caps, counts)
        w = best_width(rates)
        landed = self.estimates.first_draft_landed()
        # Until a first draft lands (and while written off) a drafting step is a probe: whether the first draft lands
        # is its whole question, asked at the narrowest width (the least verify and correction). A draft never
        # written off is on trial until `TRIAL_TRIES` probes: the prior decides whether to probe, not the misses so far
        trial = not (landed or self.written_off) and self.estimates.trials[0] < TRIAL_TRIES and best_width(
            width_rates(costs, [[self.estimates.prior] * self.k] * len(caps), caps, counts)) > 0
        if trial or (w > 0 and (self.written_off or not landed)):
            w = min(x for x in costs if x > 0)
        self.hold = None
        if w > 0:
            return w, True
        far = max((v for x, v in rates.items() if x), default=0.0) < CONTEXT_FLOOR * rates[0]
        context = not self.written_off and not (far and self.lazy_context)
        if far and self.written_off and self.lazy_context:
            context = None  # no taps kept either: a re-probe comes as the estimates decay, through near (taps kept)
        self.hold = (HOLD_STEPS - 1, (r, len(usable)), (t, context))
        return 0, context

    def learn(self, r: int, t: int, w: int, seconds: float | None, accepted: Sequence[int], usable: Sequence[int]):
        """Fold one step into the acceptance estimates and the cost table (a decaying average); `seconds`
        None: the step's time says nothing about its width (it captured a CUDA graph)."""
        self.estimates.start_step()
        for i, (a, u) in enumerate(zip(accepted, usable) if w else ()):  # a W = 0 step verified no draft
            self.estimates.observe(min(w, u), a, self.succeeded[i], self.tried[i])
        if w > 0:
            self.written_off = self.estimates.draft_is_useless(self.written_off)
            self.hold = None  # new evidence: look again
        if seconds is not None:
            self.costs.observe(r, w, t, seconds)

    def reset_slot(self, slot: int):
        self.tried[slot], self.succeeded[slot] = [0.0] * self.k, [0.0] * self.k
        self.hold = None  # a new row: look again

    def move_slots(self, src: list[int], dst: list[int]):
        """Slot `src[i]`'s counts to slot `dst[i]` (the pairs may form cycles)."""
        moved = [(self.tried[s], self.succeeded[s]) for s in src]
        for d, (tried, succeeded) in zip(dst, moved):
            self.tried[d], self.succeeded[d] = tried, succeeded
