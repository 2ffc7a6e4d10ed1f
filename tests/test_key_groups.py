"""Key groups: a row's attention reads about what it holds (`key_groups.py`), exactly, with rows kept apart.

The grouping as pure functions (against brute force), the keys-read bound on a ragged batch (1 row of 2,000
tokens and 63 of 100), and greedy speculative == target-only, sampled rows per seed and drafts row by row at
64 and 128 rows with ragged prompts, slot moves and refills, against a one-key-bucket engine."""

import itertools
import random

import pytest

from domino_ray.engine.request import Request
from domino_ray.engine.spec_engine import SpecEngine
from domino_ray.model.key_groups import REORDER_SLACK, best_groups, groups_over, keys_read, misplaced, plan
from domino_ray.spec.proposer import DominoProposer
from domino_ray.spec.sampling_params import SamplingParams
from tiny_models import Recorder, ragged_prompts, tiny_draft, tiny_target


def brute_force(buckets, max_groups, group_cost):
    """Fewest keys (+ group_cost per group) over every cut of the lengths sorted descending."""
    ordered = sorted(buckets, reverse=True)
    best = float("inf")
    for g in range(1, max_groups + 1):
        for cuts in itertools.combinations(range(1, len(ordered)), g - 1):
            bounds = (0, *cuts, len(ordered))
            best = min(best, sum((b - a) * ordered[a] for a, b in zip(bounds, bounds[1:])) + g * group_cost)
    return best


@pytest.mark.parametrize("seed", range(30))
def test_best_groups_is_optimal(seed):
    rng = random.Random(seed)
    buckets = [rng.choice([32, 64, 96, 256, 512, 2048]) for _ in range(rng.randint(1, 9))]
    max_groups, group_cost = rng.randint(1, 4), rng.choice([0, 100])
    best = best_groups(buckets, max_groups, group_cost)
    assert sum(c for c, _ in best) == len(buckets) and len(best) <= max_groups
    assert [t for _, t in best] == sorted({t for _, t in best}, reverse=True)  # strictly decreasing
    assert sum(c * t for c, t in best) + len(best) * group_cost == brute_force(buckets, max_groups, group_cost)
    # Any slot order is read correctly (each range over its longest), and the moves put every row in place.
    rng.shuffle(buckets)
    groups = groups_over(buckets, best)
    start = 0
    for stop, t in groups:
        assert all(b <= t for b in buckets[start:stop])
        start = stop
    src, dst = misplaced(buckets, best, len(buckets))
    assert sorted(src) == sorted(dst)
    moved = list(buckets)
    for s, d in zip(src, dst):
        moved[d] = buckets[s]
    assert keys_read(groups_over(moved, best)) == sum(c * t for c, t in best)


def test_plan_moves_rows_only_when_it_pays():
    # Admitted shortest first: the long row sits last; laid over as is, its range would read 64 x 2,016.
    groups, src, dst = plan([128] * 63 + [2016], 64, max_groups=4)
    assert (groups, sorted(zip(src, dst))) == (((1, 2016), (64, 128)), [(0, 63), (63, 0)])
    # One row of 160 among the 128s: its own group would save 31 x 32 keys, which the slots as they are
    # read within REORDER_SLACK: no move, its range reads 160.
    buckets = [2016] * 32 + [128] * 31 + [160]
    groups, src, dst = plan(buckets, 64, max_groups=4)
    assert (groups, src, dst) == (((32, 2016), (33, 128), (64, 160)), [], [])
    assert keys_read(groups) <= (1 + REORDER_SLACK) * sum(c * t for c, t in best_groups(buckets, 4))
    # Padding slots (the smallest bucket, after the real rows) never move.
    groups, src, dst = plan([64, 2016, 64, 32, 32], 3, max_groups=4)
    assert groups == ((1, 2016), (3, 64), (5, 32)) and sorted(zip(src, dst)) == [(0, 1), (1, 0)]


def test_one_group_is_one_key_bucket():
    assert best_groups([64, 32, 2048, 32], 1) == [(4, 2048)]
    assert groups_over([64, 32, 2048, 32], [(4, 2048)]) == ((4, 2048),)


def test_keys_read_follow_what_rows_hold():
    """1 row of 2,000 tokens and 63 of 100: every decode step reads <= 1.3 x the sum over rows of (length + the
    step's query positions) plus one kv_chunk per row (one key bucket would read 64 x 2,016)."""
    target = tiny_target("qwen3", seed=7, max_positions=2048)
    engine = SpecEngine(target, DominoProposer(tiny_draft(target, block_size=4), target), max_rows=64)
    q = engine.num_spec_tokens + 1  # every step verifies K drafts: K + 1 query positions (>= the draft block)
    assert engine.span == q
    prompts = [[(7 * i + 3) % 90 for i in range(2000)]] + ragged_prompts(63, seed=8, min_len=100, max_len=100)
    for i, p in enumerate(prompts):
        engine.add_request(Request(i, p, SamplingParams(max_new_tokens=8)))
    steps = 0
    while engine.has_unfinished():
        before = engine.key_reads.steps
        engine.step()
        if engine.key_reads.steps == before:
            continue
        reads = engine.key_reads
        n = reads.last_groups[-1][0]  # 64 rows: the bucket is full, no padding slots
        keys = keys_read(reads.last_groups)
        assert keys <= 1.3 * reads.last_held + n * engine.kv_chunk, (reads.last_groups, reads.last_held)
        if len(engine.rows) == 64:
            steps += 1
            assert len(reads.last_groups) == 2 and keys < reads.last_held + n * engine.kv_chunk
    assert steps >= 2
    assert engine.key_reads.one_bucket > 5 * engine.key_reads.keys


@pytest.fixture(scope="module")
def pair():
    target = tiny_target("qwen3", seed=41)
    return target, tiny_draft(target, block_size=4)


def requests(prompts):
    """Greedy and seeded sampled rows with budgets of 4..15 tokens: rows finish at different steps."""
    out = []
    for i, p in enumerate(prompts):
        params = SamplingParams(max_new_tokens=4 + i % 12, ignore_eos=True)
        if i % 4 == 3:
            params = SamplingParams(max_new_tokens=4 + i % 12, ignore_eos=True, temperature=0.8, seed=i)
        out.append(Request(i, p, params))
    return out


def run(pair, prompts, max_rows, speculative, **kwargs):
    target, draft = pair
    recorder = Recorder(DominoProposer(draft, target)) if speculative else None
    engine = SpecEngine(target, recorder, max_rows=max_rows, **kwargs)
    for req in requests(prompts):
        engine.add_request(req)
    out, most_groups = {}, 0
    while engine.has_unfinished():
        for event in engine.step():
            if event.completion is not None:
                out[event.request_id] = event.completion.token_ids
        most_groups = max(most_groups, len(engine.key_reads.last_groups))
    drafts = {}
    for rid, committed, d in (recorder.records if recorder else ()):
        drafts.setdefault(rid, []).append((committed, d))
    return out, drafts, engine, most_groups


@pytest.mark.parametrize("rows", [64, 128])
def test_rows_kept_apart_at_scale(pair, rows):
    """More ragged prompts than slots (refills, slot moves, several key groups) at 64 and 128 rows: greedy rows
    equal target-only; every row's tokens (sampled ones per seed) and drafts equal those of a small
    speculative engine with one key bucket."""
    rng = random.Random(rows)
    prompts = ragged_prompts(rows + rows // 4, seed=rows, max_len=40)
    for i in rng.sample(range(len(prompts)), len(prompts) // 8):  # some long rows among the short
        prompts[i] = prompts[i] * 8
    reference, _, _, _ = run(pair, prompts, 16, speculative=False, max_key_groups=1)
    small, small_drafts, one, _ = run(pair, prompts, 16, speculative=True, max_key_groups=1)
    assert one.key_reads.keys == one.key_reads.one_bucket and one.key_reads.moves == 0  # one key bucket
    out, drafts, engine, most_groups = run(pair, prompts, rows, speculative=True)
    greedy = [i for i in range(len(prompts)) if i % 4 != 3]
    assert [out[i] for i in greedy] == [reference[i] for i in greedy]
    assert out == small and drafts == small_drafts  # sampled rows too: per seed, whatever the batch
    assert most_groups >= 2 and engine.key_reads.moves > 0
    assert engine.key_reads.keys < 0.7 * engine.key_reads.one_bucket


def test_adaptive_width_over_moving_rows_keeps_each_rows_budget_and_tokens(pair):
    """The adaptive width where key groups move rows between slots and W = 0 steps plan their groups over a
    shorter span than drafting steps: each row's budget, statistics and tokens stay its own (greedy rows equal
    target-only; sampled ones the target-only sample for their seed)."""
    from oracles import OracleProposer
    from test_verify_width import check_stats

    target, _ = pair
    rng = random.Random(5)
    prompts = ragged_prompts(40, seed=5, max_len=40)
    for i in rng.sample(range(len(prompts)), 6):  # some long rows among the short: groups, moves
        prompts[i] = prompts[i] * 8
    reference, _, _, _ = run(pair, prompts, 16, speculative=False, max_key_groups=1)
    k = 4
    # Right drafts, or wrong from position 0 (W = 0 pays then): the width moves between 0 and K.
    oracle = OracleProposer({i: p + reference[i] for i, p in enumerate(prompts)}, k, target.config.vocab_size,
                            wrong_at={i: [k, 0, 0, k, 2, 0][i % 3:] for i in range(len(prompts))})
    costs = {r: {w: 1.0 + 0.1 * w for w in range(k + 1)} for r in (1, 2, 4, 8, 16)}
    engine = SpecEngine(target, oracle, max_rows=16, adaptive=True, width_costs=costs)
    completions = engine.generate(requests(prompts))
    assert [c.token_ids for c in completions] == [reference[i] for i in range(len(prompts))]
    widths = [sum(c.stats.verify_width_histogram[w] for c in completions) for w in range(k + 1)]
    assert widths[0] > 0 and sum(widths[1:]) > widths[0], widths
    assert engine.key_reads.moves > 0
    for c in completions:
        check_stats(c, k)
