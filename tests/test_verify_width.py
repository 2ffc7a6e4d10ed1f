"""The adaptive verify width: a pure policy over measured costs and acceptance estimates; lossless in the
engine whatever it picks; honest statistics with variable widths."""

from __future__ import annotations

import random

import pytest

import torch

from domino_ray.engine.context_ring import DEFERRED_STEPS
from domino_ray.engine.request import Request
from domino_ray.engine.core import SpecEngine
from domino_ray.engine.start_up_costs import measure_costs
from domino_ray.spec_decode.proposer import DominoProposer
from domino_ray.sample.params import SamplingParams
from domino_ray.spec_decode.width_costs import candidate_widths, smooth_costs, StepCosts
from domino_ray.spec_decode.width_policy import (CONTEXT_FLOOR, DRAFTING_MARGIN, HOLD_STEPS, TRIAL_TRIES, AcceptanceEstimates,
                                          best_width, choose_width, expected_tokens, WidthController, width_rates)
from oracles import OracleProposer
from speculation import FixedCosts
from tiny_models import hf_greedy, ragged_prompts, tiny_draft, tiny_target

K = 4


def compute_bound(rows: int, overhead: float = 1.0, per_position: float = 0.05) -> dict[int, float]:
    """A step costs a fixed overhead plus a cost per verified position (rows x (W+1))."""
    return {w: overhead + per_position * rows * (w + 1) for w in range(9)}


def test_expected_tokens():
    assert expected_tokens([1.0] * 8, 5, 8) == 6.0           # all accepted: W drafts + the bonus
    assert expected_tokens([1.0] * 8, 5, 2) == 3.0           # the budget caps usable drafts
    assert expected_tokens([0.5, 0.5], 2, 8) == 1.75         # 1 + 0.5 + 0.25
    assert expected_tokens([0.9] * 8, 0, 8) == 1.0           # W = 0: a plain decode step


def test_width_shrinks_as_a_compute_bound_batch_grows():
    accept = [0.8] * 8
    widths = [choose_width(compute_bound(rows), [accept] * rows, [100] * rows) for rows in (1, 4, 16, 64, 256)]
    assert widths == sorted(widths, reverse=True) and widths[0] == 8 and widths[-1] < widths[0], widths


def test_useless_drafts_give_width_zero_and_perfect_ones_the_full_block():
    flat = {w: 1.0 + 0.1 * w for w in range(9)}
    assert choose_width(flat, [[0.02] * 8] * 4, [100] * 4) == 0
    assert choose_width(flat, [[1.0] * 8] * 4, [100] * 4) == 8
    assert choose_width(flat, [[1.0] * 8], [2]) == 2  # no point verifying drafts the budget cannot take


def test_drafting_must_beat_width_zero_by_the_margin():
    """The cost table is off by a few percent: a drafting width that promises less than `DRAFTING_MARGIN` over
    W = 0 is not worth the risk; among drafting widths the best one still wins, ties to the narrower."""
    assert best_width({0: 1.0, 1: 1.0 + DRAFTING_MARGIN / 2, 2: 1.0}) == 0
    assert best_width({0: 1.0, 1: 1.0 + 2 * DRAFTING_MARGIN, 2: 1.0 + 3 * DRAFTING_MARGIN}) == 2
    assert best_width({0: 1.0, 1: 1.2, 2: 1.2}) == 1
    assert best_width({1: 1.0, 2: 1.01}) == 2  # no W = 0 to compare with (a fixed-width table)
    assert best_width({0: 1.0, 1: 1.0 + DRAFTING_MARGIN / 2}, margin=0.0) == 1


def test_a_draft_is_useless_on_evidence_not_on_the_prior():
    est = AcceptanceEstimates(4)
    assert not est.draft_is_useless()  # no evidence yet
    row_s, row_n = [0.0] * 4, [0.0] * 4
    for tries in range(1, 5):
        est.start_step()
        est.observe(4, 0, row_s, row_n)  # the first draft rejected every time
        assert est.draft_is_useless() == (tries >= 3)  # two misses (one step at 2 rows) happen to decent drafts
    assert est.pooled()[1] == pytest.approx(0.8)  # later positions: untried
    assert est.draft_is_useless(written_off=True)
    est.observe(4, 2, row_s, row_n)
    assert not est.draft_is_useless() and not est.draft_is_useless(written_off=True)  # a hit in 5 is not "almost never"
    fresh = AcceptanceEstimates(4)
    fresh.observe(4, 0, row_s, row_n)
    assert not fresh.draft_is_useless() and fresh.draft_is_useless(written_off=True)  # a written-off draft's miss
    dear = {w: 1.0 + 3.0 * w for w in range(9)}  # a good draft can still be too dear for a batch: W = 0
    assert choose_width(dear, [[0.8] * 8] * 4, [100] * 4) == 0


def test_estimates_pool_rows_decay_to_the_prior_and_refine_per_row():
    est = AcceptanceEstimates(3, decay=0.5, prior=0.8)
    assert est.pooled() == pytest.approx([0.8] * 3)  # optimistic: a new engine drafts at once
    row_s, row_n = [0.0] * 3, [0.0] * 3
    for _ in range(20):
        est.start_step()
        est.observe(3, 1, row_s, row_n)  # draft 1 accepted, draft 2 rejected, draft 3 never tried
    pooled = est.pooled()
    assert pooled[0] > 0.85 and pooled[1] < 0.5 and pooled[2] == pytest.approx(0.8)
    assert row_n == [20.0, 20.0, 0.0] and est.for_row(row_s, row_n, pooled)[0] > pooled[0]
    for _ in range(30):
        est.start_step()  # nothing verified: back to the prior, so the draft gets tried again some day
    assert all(abs(p - 0.8) < 0.01 for p in est.pooled())


def test_smoothing_removes_a_stall_and_keeps_the_trend():
    measured = {0: 1.0, 1: 2.0, 2: 2.1, 3: 5.0, 4: 2.3, 5: 2.4}  # a stall at W = 3
    smooth = smooth_costs(measured)
    assert smooth[0] == 1.0 and all(smooth[w] <= smooth[w + 1] for w in range(1, 5)) and smooth[3] < 3.0
    assert smooth_costs({0: 1.0, 1: 2.0, 2: 1.5}) == {0: 1.0, 1: 1.75, 2: 1.75}  # never cheaper with more drafts


def test_rows_without_history_count_once_for_the_same_choice():
    """`choose` counts the rows never verified (whose budget allows every width) once, with their number: the same
    rates, so the same width, as summing every row's own estimate."""
    rng = random.Random(0)
    for case in range(40):
        rows = rng.randint(1, 16)
        costs = compute_bound(rows, per_position=rng.uniform(0.01, 0.3))
        controller = WidthController(K, 16, StepCosts({rows: {w: c for w, c in costs.items() if w <= K}}))
        for i in range(rows):
            if rng.random() < 0.5:  # some rows with history of their own
                controller.tried[i] = [float(rng.randint(0, 9)) for _ in range(K)]
                controller.succeeded[i] = [rng.uniform(0, t) for t in controller.tried[i]]
        for landed in [K, K] + [rng.randint(0, K) for _ in range(rng.randint(0, 20))]:  # first drafts land: no
            controller.estimates.observe(K, landed, [0.0] * K, [0.0] * K)  # probe narrows the width
        usable = [rng.choice([1, 2, K, 50]) for _ in range(rows)]
        pooled = controller.estimates.pooled()
        every_row = [controller.estimates.for_row(controller.succeeded[i], controller.tried[i], pooled)
                     for i in range(rows)]
        costs = controller.costs.at(rows, 0)
        expected = width_rates(costs, every_row, usable)
        w, _ = controller.choose(rows, 0, usable)
        assert w == best_width(expected), case
        fresh = [i for i in range(rows) if usable[i] >= K and not any(controller.tried[i])]
        kept = [i for i in range(rows) if i not in fresh]
        grouped = width_rates(costs, [every_row[i] for i in kept] + [pooled], [usable[i] for i in kept] + [K],
                              [1] * len(kept) + [len(fresh)])
        assert grouped == pytest.approx(expected, rel=1e-12)


def test_candidate_widths():
    assert candidate_widths(8, graphs=False) == list(range(9))
    # with graphs: verify blocks of 2, 4, 8, 16 positions (whole MMA row tiles); a K between them is not graphed
    assert candidate_widths(16, graphs=True) == candidate_widths(15, graphs=True) == [0, 1, 3, 7, 15]
    assert candidate_widths(8, graphs=True) == [0, 1, 3, 7] and candidate_widths(1, graphs=True) == [0, 1]


@pytest.fixture(scope="module")
def target():
    return tiny_target("qwen3", seed=5)


def check_stats(c, k):
    s = c.stats
    assert len(c.token_ids) == 1 + s.num_spec_steps + s.num_accepted_draft_tokens
    assert sum(s.verify_width_histogram) == s.num_spec_steps == sum(s.acceptance_histogram)
    assert len(s.verify_width_histogram) == len(s.acceptance_histogram) == k + 1
    assert s.num_accepted_draft_tokens <= s.num_draft_tokens <= sum(w * n for w, n in enumerate(s.verify_width_histogram))


def test_adaptive_greedy_equals_target_only(target):
    """Ragged prompts, 3 slots for 7 rows (slot reuse), stop tokens mid-block, real draft."""
    prompts = ragged_prompts(7, seed=3, max_len=20)
    params = [SamplingParams(max_new_tokens=n, stop_token_ids=(s,)) for n, s in zip((5, 17, 9, 23, 12, 30, 8),
                                                                                   (7, 11, 3, 50, 60, 1, 2))]
    base = SpecEngine(target, None, max_rows=3).generate([Request(i, p, sp) for i, (p, sp) in
                                                          enumerate(zip(prompts, params))])
    for costs in (None, {r: {w: 1.0 + 0.01 * w for w in range(K + 1)} for r in (1, 2, 3)}):  # measured; cheap drafts
        engine = SpecEngine(target, DominoProposer(tiny_draft(target, block_size=K), target), max_rows=3,
                            adaptive=True, width_costs=costs)
        out = engine.generate([Request(i, p, sp) for i, (p, sp) in enumerate(zip(prompts, params))])
        assert [c.token_ids for c in out] == [c.token_ids for c in base]
        for c in out:
            check_stats(c, K)
    assert sum(sum(c.stats.verify_width_histogram[1:]) for c in out) > 0  # cheap drafts: some steps drafted


class FeedRecorder(DominoProposer):
    """Records each context update as (slots, positions, first offset)."""

    def __init__(self, *args):
        super().__init__(*args)
        self.feeds = []

    def append_context(self, rows, target_hidden, offsets):
        self.feeds.append((target_hidden.shape[0], target_hidden.shape[1], offsets.tolist()))
        super().append_context(rows, target_hidden, offsets)


def test_random_draft_settles_on_plain_decoding_at_no_cost(target):
    """A useless draft: W = 0 almost always, and those steps skip the draft's context too."""
    costs = {r: {w: 1.0 + 0.3 * w for w in range(K + 1)} for r in (1, 2, 4)}
    proposer = FeedRecorder(tiny_draft(target, block_size=K, seed=9), target)
    engine = SpecEngine(target, proposer, max_rows=4, adaptive=True, width_costs=costs)
    out = engine.generate([Request(i, p, SamplingParams(max_new_tokens=120, ignore_eos=True))
                           for i, p in enumerate(ragged_prompts(4, seed=1))])
    widths = [sum(c.stats.verify_width_histogram[w] for c in out) for w in range(K + 1)]
    assert widths[0] >= 0.85 * sum(widths), widths
    steps = max(c.stats.num_spec_steps for c in out)
    assert len(proposer.feeds) < 0.2 * steps, (proposer.feeds, steps)  # prompts + the few drafting steps
    for c in out:
        check_stats(c, K)


def test_an_admitted_prompt_reaches_the_draft_only_before_a_step_that_keeps_its_context(target):
    """An eager adaptive engine feeds an admitted row's prompt to the draft's context before the first step that keeps
    that context, once, not at admission: while every step skips it (drafting far off) no prompt is ever fed. The
    tokens are the target's either way."""
    prompts = ragged_prompts(5, seed=6, max_len=20)
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    for context in (False, True):
        proposer = FeedRecorder(tiny_draft(target, block_size=K), target)
        engine = SpecEngine(target, proposer, max_rows=2, adaptive=True,
                            width_costs={r: {w: 1.0 + w for w in range(K + 1)} for r in (1, 2)})
        engine.width.choose = lambda r, t, usable: (0, context)
        join, waiting = engine._join, []  # rows join right after their prompts' taps reach the ring
        engine._join = lambda *a: (waiting.append(len(engine.ring.pending_prompts)), join(*a))[1]
        out = engine.generate([Request(i, p, params) for i, p in enumerate(prompts)])
        assert [c.token_ids for c in out] == [hf_greedy(target, p, 12) for p in prompts]
        assert all(waiting) and not engine.ring.pending_prompts
        prompt_feeds = sorted(q for slots, q, offsets in proposer.feeds if offsets == [0])  # a prompt from position 0
        assert prompt_feeds == (sorted(len(p) for p in prompts) if context else [])
        assert context or not proposer.feeds  # far off: nothing fed at all (a full ring drops its oldest)


class ContextRecorder(DominoProposer):
    """Records the draft's context (every layer's keys and values of each row's committed positions) at each
    drafting step, and the positions each context update brings."""

    def __init__(self, *args):
        super().__init__(*args)
        self.seen, self.updates = [], []

    def append_context(self, rows, target_hidden, offsets):
        self.updates.append(target_hidden.shape[1])
        super().append_context(rows, target_hidden, offsets)

    def propose(self, r, anchor, offsets, keys, *args):
        held = []
        for slot, length in enumerate(offsets.tolist()):
            for layer in range(len(self.kv.keys)):
                k, v = self.kv.gather(layer, keys.tables[slot:slot + 1], keys.tables.shape[1] * self.kv.block_size)
                held += [k[0, :, :length], v[0, :, :length]]
        self.seen.append(held)
        return super().propose(r, anchor, offsets, keys, *args)


def test_deferred_context_gives_the_draft_what_an_update_every_step_gives(target):
    """An eager adaptive engine's W = 0 steps keep their taps and feed the draft's context in batches: at every
    drafting step each row's draft context equals the one updated every step, through a full buffer, admissions
    while taps wait, rows finishing (slot moves) and key-group moves."""
    prompts = ragged_prompts(7, seed=5, max_len=30)
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (60, 23, 47, 19, 53, 31, 37)]
    schedule = [0] * 11 + [2] + [0] * 3 + [K] + [0] * 2 + [1] + [0] * 5 + [3]  # widths, repeated
    costs = {r: {w: 1.0 + w for w in range(K + 1)} for r in (1, 2, 3)}
    runs = []
    for defer in (True, False):
        proposer = ContextRecorder(tiny_draft(target, block_size=K), target)
        engine = SpecEngine(target, proposer, max_rows=3, adaptive=True, width_costs=costs)
        assert engine.defer_context
        if not defer:  # the same engine, but its W = 0 steps feed their taps at once
            engine.ring.deferred = None
        steps = iter(schedule * 20)
        engine.width.choose = lambda r, t, usable: (next(steps), True)
        out = engine.generate([Request(i, p, sp) for i, (p, sp) in enumerate(zip(prompts, params))])
        runs.append(([c.token_ids for c in out], proposer.seen, proposer.updates))
    (tokens, seen, updates), (tokens_every_step, seen_every_step, updates_every_step) = runs
    assert tokens == tokens_every_step
    assert len(seen) == len(seen_every_step) > 10
    for step, step_every in zip(seen, seen_every_step):
        assert len(step) == len(step_every)
        for context, context_every in zip(step, step_every):
            torch.testing.assert_close(context, context_every)  # the dtype's tolerance: one GEMM or several
    assert DEFERRED_STEPS in updates and any(1 < q < DEFERRED_STEPS for q in updates)  # full, and fed early
    assert len(updates) < 0.6 * len(updates_every_step)


class ContextChecker(DominoProposer):
    """At each drafting step, checks every active row's draft context position by position against an oracle: the
    target's own taps over the row's committed tokens (HF's forward), fed to a fresh proposer at once. Records
    (position, prompt length, length, whether it matches) per row and step."""

    def __init__(self, draft, target):
        super().__init__(draft, target)
        self.target, self.engine, self.checked = target, None, []

    def propose(self, r, anchor, offsets, keys, *args):
        bs, nb = self.kv.block_size, keys.tables.shape[1]
        for slot, length in enumerate(offsets.tolist()):
            row = self.engine.rows[slot]
            ids = (list(row.request.prompt_token_ids) + row.tokens)[:length]  # the context; the anchor comes next
            hidden = self.target(torch.tensor([ids]), output_hidden_states=True).hidden_states
            oracle = DominoProposer(self.draft, self.target)
            oracle.allocate(1 + nb, bs, nb * bs)
            table = torch.arange(1, 1 + nb, dtype=torch.int32)[None]
            oracle.append_context(table, torch.cat([hidden[i + 1] for i in self.target_layer_ids], -1),
                                  torch.zeros(1, dtype=torch.long))
            pairs = []  # [Hkv, T, D] each
            for layer in range(len(self.kv.keys)):
                mine = self.kv.gather(layer, keys.tables[slot:slot + 1], nb * bs)
                theirs = oracle.kv.gather(layer, table, nb * bs)
                pairs += [(mine[0][0], theirs[0][0]), (mine[1][0], theirs[1][0])]
            for p in range(length):  # fp32 from other shapes (one GEMM over a prompt or a few positions): a tolerance
                match = all(torch.allclose(mine[:, p], theirs[:, p], rtol=1e-4, atol=1e-5) for mine, theirs in pairs)
                self.checked.append((p, len(row.request.prompt_token_ids), length, match))
        return super().propose(r, anchor, offsets, keys, *args)


@torch.inference_mode()
def test_while_drafting_is_far_off_the_draft_context_keeps_the_prompt_and_the_last_positions(target):
    """W = 0 steps that skip the draft's context (drafting far off, or the draft written off) keep their taps in a ring
    of the last `DEFERRED_STEPS` positions and feed no context: at a drafting step after such a stretch, each row's
    draft context holds its prompt and its last `DEFERRED_STEPS` positions exactly, and misses positions between.
    Rows admitted get their prompt's context before the next step that keeps it, not at admission.
    With the context kept current at every step, every position matches (the oracle's own check)."""
    prompts = ragged_prompts(5, seed=3, max_len=20)
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (70, 25, 55, 33, 61)]
    far, nothing = (0, False), (0, None)
    schedule = [far] * 13 + [(2, True)] + [(0, True)] * 3 + [far] * 9 + [(K, True)] + [far] * 4 + [(1, True)] + \
        [far] * 5 + [(0, True)] * 6 + [(3, True)] + [far] * 3 + [nothing] * 7 + [far] * 9 + [(2, True)]
    # a ring overfull, just full, part full, mixed with kept steps; a written-off draft's steps keeping nothing
    for skip in (True, False):
        proposer = ContextChecker(tiny_draft(target, block_size=K), target)
        engine = SpecEngine(target, proposer, max_rows=3, adaptive=True,
                            width_costs={r: {w: 1.0 + w for w in range(K + 1)} for r in (1, 2, 3)})
        proposer.engine = engine
        steps = iter(schedule * 20)
        engine.width.choose = lambda r, t, usable: next(steps) if skip else (next(steps)[0], True)
        join, waiting = engine._join, []  # rows join right after their prompts' taps reach the ring
        engine._join = lambda *a: (waiting.append(len(engine.ring.pending_prompts)), join(*a))[1]
        out = engine.generate([Request(i, p, sp) for i, (p, sp) in enumerate(zip(prompts, params))])
        assert all(waiting) and not engine.ring.pending_prompts  # each admission's prompts wait for a step, then none
        assert [c.token_ids for c in out] == [hf_greedy(target, p, sp.max_new_tokens) for p, sp in zip(prompts, params)]
        kept = [match for p, prompt, length, match in proposer.checked if p < prompt or p >= length - DEFERRED_STEPS]
        between = [match for p, prompt, length, match in proposer.checked if prompt <= p < length - DEFERRED_STEPS]
        assert len(kept) > 200 and all(kept)
        if skip:  # the stretches' older positions were never fed
            assert len(between) > 200 and between.count(False) > 50
        else:
            assert len(between) > 200 and all(between)


def test_a_step_keeping_no_taps_empties_the_ring(target):
    """A W = 0 step whose context is None (a written-off draft, drafting far off) keeps no taps and drops the ring's:
    they are no longer the rows' last positions. Tokens stay the target's."""
    engine = SpecEngine(target, DominoProposer(tiny_draft(target, block_size=K), target), max_rows=2, adaptive=True,
                        width_costs={r: {w: 1.0 + w for w in range(K + 1)} for r in (1, 2)})
    steps = iter([(0, False)] * 5 + [(0, None)] + [(0, False)] * 2 + [(0, None)] * 50)
    engine.width.choose = lambda r, t, usable: next(steps)
    prompts = ragged_prompts(2, seed=6)
    for i, prompt in enumerate(prompts):
        engine.add_request(Request(i, prompt, SamplingParams(max_new_tokens=30, ignore_eos=True)))
    held, out = [], {0: [], 1: []}
    while engine.has_unfinished():
        for event in engine.step():
            out[event.request_id] += event.new_token_ids
        held.append(len(engine.ring.deferred))
    assert held[:9] == [1, 2, 3, 4, 5, 0, 1, 2, 0]  # the admission's step, then one a step
    assert [out[i] for i in range(2)] == [hf_greedy(target, p, 30) for p in prompts]


def test_deferred_taps_are_in_the_memory_plan_of_eager_adaptive_engines_only(target):
    def plan(**kwargs):
        engine = SpecEngine(target, DominoProposer(tiny_draft(target, block_size=K), target), max_rows=3,
                            width_costs={r: {w: 1.0 + w for w in range(K + 1)} for r in (1, 2, 3)}, **kwargs)
        return engine, engine.memory_plan()

    engine, adaptive = plan(adaptive=True)
    engine.width.choose = lambda r, t, usable: (0, False)  # drafting far off: every step keeps its taps, a full ring
    for i, prompt in enumerate(ragged_prompts(3, seed=4)):
        engine.add_request(Request(i, prompt, SamplingParams(max_new_tokens=DEFERRED_STEPS + 4, ignore_eos=True)))
    for _ in range(DEFERRED_STEPS + 2):
        engine.step()
    assert len(engine.rows) == 3 and len(engine.ring.deferred) == DEFERRED_STEPS
    assert adaptive["deferred_taps"] == sum(t.nbytes for taps in engine.ring.deferred for t in taps) > 0
    engine, fixed = plan()
    assert "deferred_taps" not in fixed and engine.ring.deferred is None


def test_start_up_costs_time_rows_that_fill_the_keys_timed(target):
    """Attention reads only the keys a row holds: the start-up timing gives its padding rows the lengths it times (so
    a step at t keys reads t keys, as a real one would) over distinct blocks (on the null block alone they would read
    one block from the cache), and leaves them at 0 on the null block."""
    engine = SpecEngine(target, DominoProposer(tiny_draft(target, block_size=K), target), max_rows=2, adaptive=True,
                        width_costs={r: {w: 1.0 + w for w in range(K + 1)} for r in (1, 2)})
    seen, device_step = [], engine._device_step

    def recording(r, key_len, *args):
        tables = engine.runner.block_tables[:r]
        seen.append((key_len, engine.runner.lens[:r].tolist(), len(set(tables.flatten().tolist()))))
        return device_step(r, key_len, *args)

    engine._device_step = recording
    measure_costs(engine, {1: [0, 2], 2: [0, 2]}, repeats=1)
    shortest = -(-engine.span // engine.block_size) * engine.block_size
    assert {t for t, *_ in seen} == {shortest, engine.capacity}
    assert all(lens == [t - engine.span] * len(lens) for t, lens, _ in seen), seen
    assert all(distinct == min(len(lens) * engine.capacity // engine.block_size, engine.kv_blocks - 1)
               for _, lens, distinct in seen), seen
    assert engine.runner.lens.tolist() == [0, 0] and not engine.runner.block_tables.any()


def full_acceptance_run(target, width_costs):
    """One row, 60 tokens, an oracle draft that is always right, the adaptive width: (engine, its completion,
    target-only's)."""
    prompt = ragged_prompts(1, seed=8)[0]
    (ref,) = SpecEngine(target, None, max_rows=1).generate([Request(0, prompt, SamplingParams(max_new_tokens=60))])
    oracle = OracleProposer({0: prompt + ref.token_ids}, K, target.config.vocab_size)
    engine = SpecEngine(target, oracle, max_rows=1, adaptive=True, width_costs=width_costs)
    (c,) = engine.generate([Request(0, prompt, SamplingParams(max_new_tokens=60))])
    return engine, c, ref


def test_oracle_at_full_acceptance_verifies_the_full_block_at_batch_one(target):
    """Cheap drafts (a fixed table) and every draft right: the full block on every step but the first (a probe at
    the narrowest width, until a first draft lands) and the last (capped by the budget). Fails if the policy stops
    widening: checked by making `choose` keep the probe's narrowest width (W = 1 on 29 of 30 steps)."""
    _, c, ref = full_acceptance_run(target, FixedCosts({1: {w: 1.0 + 0.1 * w for w in range(K + 1)}}))
    assert c.token_ids == ref.token_ids
    widths = c.stats.verify_width_histogram
    assert widths[0] == 0 and widths[K] >= c.stats.num_spec_steps - 2, widths
    check_stats(c, K)


def test_measured_step_costs_let_full_acceptance_draft(target):
    """The same run on the costs the engine measures on this machine at start-up (and refines with its real
    steps): a figure for every width, and drafting on most steps. Tolerant on purpose, the figures being this
    machine's: only a gross mis-measurement (drafting looking many times dearer than it is) fails it.
    Fails if drafting is mis-timed: checked by making `measure_step_costs` report drafting widths 10x their time
    (then W = 0 on every step)."""
    engine, c, ref = full_acceptance_run(target, None)
    assert c.token_ids == ref.token_ids
    measured = engine.width.costs.at(1, 0)
    assert sorted(measured) == list(range(K + 1)) and all(0 < x < 1 for x in measured.values()), measured
    widths = c.stats.verify_width_histogram
    assert sum(widths[1:]) >= 0.5 * c.stats.num_spec_steps, (widths, measured)
    check_stats(c, K)


def test_adaptive_sampling_is_reproducible_per_seed(target):
    prompts = ragged_prompts(3, seed=6)
    params = SamplingParams(max_new_tokens=20, temperature=0.9, seed=123)
    costs = {r: {w: 1.0 + 0.01 * w for w in range(K + 1)} for r in (1, 2, 4)}

    def run(rows, ps):
        engine = SpecEngine(target, DominoProposer(tiny_draft(target, block_size=K), target), max_rows=rows,
                            adaptive=True, width_costs=costs)
        return [c.token_ids for c in engine.generate([Request(i, p, params) for i, p in enumerate(ps)])]

    together = run(4, prompts)
    assert together[1] == run(1, prompts[1:2])[0]


@pytest.mark.parametrize("top_p", [1.0, 0.8])
def test_sampled_text_is_the_target_only_sample_for_the_same_seed(target, top_p):
    """The coupled acceptance commits the target's own per-position samples, so with the same seeds the
    speculative engine (fixed or adaptive width, any draft, any batch) writes exactly the target-only text."""
    prompts = ragged_prompts(5, seed=12)
    params = [SamplingParams(max_new_tokens=24, temperature=0.9, top_p=top_p, seed=100 + i) for i in range(5)]
    requests = lambda: [Request(i, p, sp) for i, (p, sp) in enumerate(zip(prompts, params))]  # noqa: E731
    base = [c.token_ids for c in SpecEngine(target, None, max_rows=5).generate(requests())]
    refs = {i: p + b for i, (p, b) in enumerate(zip(prompts, base))}
    costs = {r: {w: 1.0 + 0.01 * w for w in range(K + 1)} for r in (1, 2)}
    for proposer, adaptive in ((DominoProposer(tiny_draft(target, block_size=K), target), False),
                               (DominoProposer(tiny_draft(target, block_size=K), target), True),
                               (OracleProposer(refs, K, target.config.vocab_size, wrong_at={i: [2, 4, 0] for i in refs}),
                                False)):
        engine = SpecEngine(target, proposer, max_rows=2, adaptive=adaptive, width_costs=costs)
        out = engine.generate(requests())
        assert [c.token_ids for c in out] == base
    assert sum(c.stats.num_accepted_draft_tokens for c in out) > 0  # the oracle's drafts were accepted, not replaced


def test_step_costs_grow_with_the_context_and_learn_from_real_steps():
    from domino_ray.spec_decode.width_costs import StepCosts

    def fresh():
        return StepCosts.from_two_lengths({1: {0: 1.0, 4: 2.0}}, {1: {0: 2.0, 4: 6.0}}, 100, 500)

    costs = fresh()
    assert costs.at(1, 100) == {0: 1.0, 4: 2.0} and costs.at(1, 300) == {0: 1.5, 4: 4.0}
    for _ in range(1000):
        costs.observe(1, 4, 300, 5.0)  # the W = 4 step is dearer than measured
    assert costs.at(1, 300)[4] == pytest.approx(5.0)
    assert costs.at(1, 300)[4] / costs.at(1, 300)[0] > 4.0 / 1.5  # ... and dearer against a plain step
    assert costs.at(1, 500)[4] > costs.at(1, 300)[4]  # still growing with the context

    costs = fresh()
    costs.observe(1, 0, 300, 100.0)  # a stall moves the figures a little
    assert 1.5 < costs.at(1, 300)[0] < 4.0
    for _ in range(20):
        costs.observe(1, 0, 300, 1.0)  # faster steps bring them down quickly
    assert costs.at(1, 300)[0] == pytest.approx(1.0, abs=0.01)


def test_a_machine_that_changes_pace_keeps_the_widths_ratios():
    """Only W = 0 runs (drafting does not pay at many rows), and the machine slows down or speeds up (other work on
    the cores): the drafting widths follow the plain step's pace, so the choice between them is still what the
    widths cost, not the drift (a W = 0 figure tracking the machine alone made drafting look cheaper or dearer)."""
    from domino_ray.spec_decode.width_costs import StepCosts

    for pace in (1.5, 0.7):
        costs = StepCosts.from_two_lengths({1: {0: 1.0, 4: 2.0}}, {1: {0: 2.0, 4: 6.0}}, 100, 500)
        for _ in range(1000):
            costs.observe(1, 0, 300, 1.5 * pace)
        now = costs.at(1, 300)
        assert now[0] == pytest.approx(1.5 * pace, rel=1e-3)
        assert now[4] / now[0] == pytest.approx(4.0 / 1.5, rel=1e-6)
        assert costs.at(1, 100)[4] / costs.at(1, 100)[0] == pytest.approx(2.0, rel=1e-6)


def test_row_counts_between_the_timed_buckets_start_on_the_line_between_them():
    """Eager steps run exactly their active rows: a count start-up never timed gets the line between the
    neighbouring buckets (the nearest bucket's figure outside them), then learns from its own steps alone."""
    from domino_ray.spec_decode.width_costs import StepCosts

    costs = StepCosts.from_two_lengths({2: {0: 2.0, 1: 3.0}, 4: {0: 4.0, 1: 7.0}},
                                       {2: {0: 4.0, 1: 5.0}, 4: {0: 8.0, 1: 11.0}}, 100, 300)
    assert costs.at(3, 100) == pytest.approx({0: 3.0, 1: 5.0})
    assert costs.at(3, 300) == pytest.approx({0: 6.0, 1: 8.0})  # the per-key slope interpolated too
    assert costs.at(1, 100) == costs.at(2, 100) and costs.at(9, 100) == costs.at(4, 100)
    for _ in range(100):
        costs.observe(3, 0, 100, 1.0)
    assert costs.at(3, 100)[0] == pytest.approx(1.0, abs=0.01)
    assert costs.at(2, 100)[0] == 2.0 and costs.at(4, 100)[0] == 4.0  # the timed buckets keep their figures
    costs.observe(5, 1, 100, 7.0)  # a count first met in a real step
    assert 5 in costs.base and costs.at(4, 100)[1] == 7.0


def test_a_step_that_captured_a_graph_teaches_acceptance_not_cost():
    """`learn(seconds=None)` (the engine's first use of a lazily captured graph: a stall, not a step's cost)
    updates the acceptance counts and leaves the cost table as it was; a timed step moves it."""
    from domino_ray.spec_decode.width_costs import StepCosts
    from domino_ray.spec_decode.width_policy import WidthController

    width = WidthController(4, 2, StepCosts({2: {0: 1.0, 4: 2.0}}))
    before = width.costs.at(2, 0)
    width.learn(2, 0, 4, None, [4, 0], [4, 4])
    assert width.costs.at(2, 0) == before
    assert width.tried[0] == [1.0] * 4 and width.succeeded[0] == [1.0] * 4 and width.succeeded[1] == [0.0] * 4
    width.learn(2, 0, 4, 0.5, [4, 4], [4, 4])
    assert width.costs.at(2, 0)[4] < before[4]


def test_a_written_off_draft_stays_written_off_until_a_drafting_step_says_otherwise():
    """The verdict comes from drafting steps only: W = 0 steps add no evidence, so however far the decayed counts
    fall meanwhile, they keep skipping the draft's context until the next drafting step decides again."""
    costs = StepCosts({1: {w: 1.0 + 2.0 * w for w in range(5)}})  # dear drafts: W = 0 once the evidence is in
    width = WidthController(4, 1, costs)
    for _ in range(4):
        width.learn(1, 64, 4, 9.0, [0], [100])  # drafting steps: the first draft rejected every time
    assert width.written_off and width.choose(1, 64, [100]) == (0, False)
    for _ in range(2000):  # the decayed counts fall far below the verdict's minimum of evidence
        assert width.choose(1, 64, [100])[1] is False
        width.learn(1, 64, 0, 1.0, [0], [100])
    assert width.estimates.trials[0] < 0.1 and width.written_off
    width.learn(1, 64, 4, 9.0, [3], [100])  # a probe that lands: the draft is back
    assert not width.written_off and width.choose(1, 64, [100])[1] is True


def test_far_off_drafting_skips_the_context_of_lazy_engines_only_and_w0_holds_for_a_few_steps():
    """Drafting far off (the best drafting rate under `CONTEXT_FLOOR` of W = 0's): W = 0, and the context skipped where
    the engine keeps its last taps (`lazy_context`); near the margin it is kept. A W = 0 answer, far off or near,
    stands for `HOLD_STEPS` steps of the same batch: a new batch, a new row or a drafting step's evidence looks
    again."""
    def controller(draft_cost, lazy=True):
        return WidthController(4, 2, StepCosts({r: {0: 1.0, **{w: draft_cost + 0.01 * w for w in range(1, 5)}}
                                                for r in (1, 2)}), lazy_context=lazy)

    prior_rate = expected_tokens([0.8] * 4, 4, 100)  # 3.36 tokens a row at the prior, W = 4
    near, far = prior_rate / (1 + DRAFTING_MARGIN / 2), prior_rate / (CONTEXT_FLOOR * 0.9)  # drafting costs
    assert controller(far, lazy=False).choose(1, 64, [100]) == (0, True)
    for cost, context in ((near, True), (far, False)):  # close to paying: W = 0, context kept; far off: skipped
        width = controller(cost)
        looks = []
        rates = width.costs.at
        width.costs.at = lambda r, t: looks.append(r) or rates(r, t)
        for _ in range(HOLD_STEPS):
            assert width.choose(1, 64, [100]) == (0, context)
            width.learn(1, 64, 0, 1.0, [0], [100])
        assert len(looks) == 1
    width.choose(1, 64, [100])
    width.choose(2, 64, [100, 100])  # another batch
    width.reset_slot(1)
    width.choose(2, 64, [100, 100])  # a new row
    assert len(looks) == 4
    width.learn(2, 64, 4, None, [4, 4], [100, 100])  # a drafting step's evidence
    width.choose(2, 64, [100, 100])
    assert len(looks) == 5
    # The engine asks `held` first (no key length, no budgets): the look's t and context, for this batch only
    width = controller(far)
    assert width.held(1, 1) is None and width.choose(1, 80, [100]) == (0, False)
    assert [width.held(1, 1) for _ in range(HOLD_STEPS)] == [(80, False)] * (HOLD_STEPS - 1) + [None]
    width.choose(1, 80, [100])
    assert width.held(2, 2) is None and width.held(1, 1) == (80, False)


def test_a_written_off_draft_is_probed_again_late_and_at_the_narrowest_width():
    """Drafting with a fixed cost and nearly free extra drafts: on the prior's optimism the policy would verify the
    widest block at once for a new row. But a written-off draft's later positions are judged by its first (`pooled`
    chained): its fresh row is no reason to probe it, the decaying counts are, some hundred steps on. Its probe then
    verifies the narrowest width, since whether the first draft lands is the verdict's whole question; once it lands,
    the policy's own choice again."""
    def unclamped(width):
        accept = width.estimates.for_row(width.succeeded[0], width.tried[0], width.estimates.pooled())
        return best_width(width_rates(width.costs.at(1, 64), [accept], [100]))

    for widths, narrowest in ((range(5), 1), ((0, 2, 4), 2)):  # every width, or a graphs-style subset
        width = WidthController(4, 1, StepCosts({1: {w: 1.0 + 0.5 * (w > 0) + 0.01 * w for w in widths}}),
                                lazy_context=True)
        for _ in range(4):
            width.learn(1, 64, 4, 1.54, [0], [100])  # the first draft rejected every time: written off
        width.reset_slot(0)  # a new row in the slot
        assert width.written_off and unclamped(width) == 4  # the flat prior alone would probe it now
        contexts = _steps_until_drafting(width)
        assert 100 < len(contexts) < 1000 and True not in contexts
        # far off at first (no taps kept: None), near for the last steps before the probe (the ring kept: False)
        near = HOLD_STEPS + DEFERRED_STEPS
        assert contexts[0] is None and contexts[-near:] == [False] * near
        assert width.choose(1, 64, [100]) == (narrowest, True)
        width.learn(1, 64, narrowest, 1.5, [1], [100])  # it lands: the draft is back
        assert not width.written_off and width.choose(1, 64, [100]) == (unclamped(width), True) == (4, True)


def _steps_until_drafting(width) -> list:
    """The contexts of the W = 0 steps (skipping the draft's context: written off) until the next `choose` would
    draft, which it then answers again (a drafting answer holds no state)."""
    contexts = []
    for _ in range(2000):
        w, context = width.choose(1, 64, [100])
        if w:
            return contexts
        contexts.append(context)
        width.learn(1, 64, 0, 1.0, [0], [100])
    raise AssertionError("never probed again")


def test_a_written_off_draft_missing_its_re_probe_stays_written_off():
    """A re-probe comes when the decayed counts have fallen below the trial's (`TRIAL_TRIES`): its miss keeps the draft
    written off (one probe, not a new trial of three), so the next steps skip the draft's context again."""
    width = WidthController(4, 1, StepCosts({1: {0: 1.0, **{w: 1.9 + 0.01 * w for w in range(1, 5)}}}))
    for _ in range(3):
        width.learn(1, 64, 1, 1.9, [0], [100])  # the trial's three misses
    assert width.written_off
    _steps_until_drafting(width)
    assert width.estimates.trials[0] + 1 < TRIAL_TRIES  # so the trial's own count would not write it off
    w, _ = width.choose(1, 64, [100])
    width.learn(1, 64, w, 1.9, [0], [100])  # missed
    assert width.written_off and width.choose(1, 64, [100]) == (0, False)


def test_a_new_draft_gets_a_trial_of_narrow_probes_before_misses_stop_it():
    """One row, drafting dear enough that a single miss stops it by the estimates alone: still, until a first draft
    lands, the first `TRIAL_TRIES` probes come whenever the prior says drafting pays, each at the narrowest width. A
    landing hands the choice back to the estimates; three misses write the draft off, and its decaying counts do not
    put it on trial again. Where even the prior says drafting does not pay, no trial."""
    costs = {0: 1.0, **{w: 2.2 + 0.01 * w for w in range(1, 5)}}

    def unclamped(width):
        accept = width.estimates.for_row(width.succeeded[0], width.tried[0], width.estimates.pooled())
        return best_width(width_rates(width.costs.at(1, 64), [accept], [100]))

    useless = WidthController(4, 1, StepCosts({1: costs}), lazy_context=True)
    assert unclamped(useless) == 4  # the prior: the widest block
    for probe in range(3):
        assert useless.choose(1, 64, [100]) == (1, True)
        useless.learn(1, 64, 1, 2.2, [0], [100])  # missed
        assert unclamped(useless) == 0 and useless.written_off == (probe == 2)  # the estimates alone would stop
    for _ in range(300):  # written off: W = 0 without the context (far off: no taps kept), while the counts decay
        assert useless.choose(1, 64, [100]) == (0, None)
        useless.learn(1, 64, 0, 1.0, [0], [100])
    assert useless.estimates.trials[0] < TRIAL_TRIES

    good = WidthController(4, 1, StepCosts({1: costs}), lazy_context=True)
    assert good.choose(1, 64, [100]) == (1, True)
    good.learn(1, 64, 1, 2.2, [0], [100])  # an unlucky first draft
    assert good.choose(1, 64, [100]) == (1, True)  # on trial: probed again
    good.learn(1, 64, 1, 2.2, [1], [100])  # it lands
    assert good.choose(1, 64, [100]) == (unclamped(good), True) == (4, True)

    dear = WidthController(4, 1, StepCosts({1: {0: 1.0, **{w: 5.0 for w in range(1, 5)}}}))
    assert dear.choose(1, 64, [100]) == (0, True)  # the prior says drafting does not pay: no trial


def test_start_up_times_four_widths_and_puts_the_rest_on_their_line():
    """Eagerly every width 0..K is a candidate, but start-up runs W = 0 and three drafting widths per bucket and
    length; the other widths get the figure of the line through the timed ones (where `smooth_costs` puts them)."""
    from domino_ray.spec_decode.width_costs import drafting_line, measure_step_costs, widths_to_time

    assert widths_to_time(range(9)) == [0, 1, 5, 8] and widths_to_time([0, 1, 2, 4, 8]) == [0, 1, 4, 8]
    assert widths_to_time([0, 1, 2, 3]) == [0, 1, 2, 3] and widths_to_time([0]) == [0]
    ran = []
    costs = measure_step_costs(lambda r, t, w: ran.append((r, t, w)), {1: list(range(9)), 4: [0, 2]}, (16, 64),
                               repeats=1)
    assert sorted(set(ran)) == sorted({(1, t, w) for t in (16, 64) for w in (0, 1, 5, 8)}
                                      | {(4, t, w) for t in (16, 64) for w in (0, 2)})
    assert len(ran) == 2 * 2 * (4 + 2)  # a warm-up run and `repeats` timed runs of each
    assert set(costs.base[1]) == set(range(9)) and set(costs.base[4]) == {0, 2}
    # At the short length the table is the timed figures and their line (at the long one, a width whose time
    # fell with more keys is clamped to no growth, each on its own)
    short = {w: costs.base[1][w] + costs.per_key[1][w] * 16 for w in range(9)}
    line = drafting_line({w: short[w] for w in (1, 5, 8)})
    assert all(short[w] == pytest.approx(line(w), rel=1e-6, abs=1e-12) for w in (2, 3, 4, 6, 7))
