"""Acceptance logic and statistics: every acceptance length 0..K happens and is checked exactly, driven
by the real proposer with a draft the target mostly accepts (ragged rows, several K and row counts, rows
joining mid-run), and by a proposer that knows the target's continuation and is wrong from a chosen
draft position (each length on schedule)."""

import pytest

from domino_ray.engine.request import Request
from domino_ray.engine.core import SpecEngine
from domino_ray.spec_decode.proposer import DominoProposer
from domino_ray.sample.params import SamplingParams
from oracles import OracleProposer
from tiny_models import Recorder, ragged_prompts, successor_draft, successor_target, tiny_target

K = 5
MAX_NEW = 40


@pytest.fixture(scope="module")
def setup():
    target = tiny_target("qwen3", seed=11)
    prompts = ragged_prompts(6, seed=12)
    base = SpecEngine(target, None, max_rows=6).generate(
        [Request(i, p, SamplingParams(max_new_tokens=MAX_NEW)) for i, p in enumerate(prompts)])
    references = {i: p + c.token_ids for i, (p, c) in enumerate(zip(prompts, base))}
    return target, prompts, base, references


def expected_steps(schedule: list[int], max_new: int, k: int) -> list[int]:
    """Accepted counts per step when the proposer is right up to schedule[s] and the row may emit
    max_new tokens (the first comes from prefill)."""
    accepted, emitted, step = [], 1, 0
    while emitted < max_new:
        a = min(schedule[step % len(schedule)], k, max_new - emitted - 1)
        accepted.append(a)
        emitted += a + 1
        step += 1
    return accepted


@pytest.fixture(scope="module")
def agreeing_target():
    return successor_target()


@pytest.mark.parametrize("k,max_rows", [(2, 3), (4, 2), (8, 5)])
def test_every_acceptance_length_through_the_real_proposer(agreeing_target, k, max_rows):
    """More requests than rows, ragged prompts and budgets: rows join while others are mid-run. Every
    acceptance length 0..K occurs, output equals target-only, and each step's accepted count is what its
    drafts earned (the longest prefix equal to the tokens the row then committed). Fails if a step commits
    one token more than it accepted: checked by making `greedy_accept` return `accepted + 1` after a partial
    acceptance (every K here fails)."""
    target, vectors, predecessor = agreeing_target
    draft = successor_draft(target, vectors, predecessor, block_size=k, shift_label=True, num_uncorrected=1)
    prompts = ragged_prompts(12, seed=40 + k, max_len=30)
    requests = [Request(i, p, SamplingParams(max_new_tokens=24 + 3 * i)) for i, p in enumerate(prompts)]
    recorder = Recorder(DominoProposer(draft, target))
    out = SpecEngine(target, recorder, max_rows=max_rows).generate(requests)
    alone = SpecEngine(target, None, max_rows=len(requests)).generate(requests)
    assert [c.token_ids for c in out] == [c.token_ids for c in alone]

    histogram = [0] * (k + 1)
    for c in out:
        start, budget = len(c.prompt_token_ids), requests[c.request_id].params.max_new_tokens
        earned = []
        for rid, committed, drafts in recorder.records:
            if rid == c.request_id:
                done, following = committed - start, c.token_ids[committed - start:]
                matched = next((i for i, (d, t) in enumerate(zip(drafts, following)) if d != t),
                               min(len(drafts), len(following)))
                earned.append(min(matched, budget - done - 1))  # a step never commits past the budget
        assert c.stats.acceptance_histogram == [earned.count(a) for a in range(k + 1)], c.request_id
        histogram = [h + n for h, n in zip(histogram, c.stats.acceptance_histogram)]
    assert all(histogram), histogram  # every length 0..K
    seen: dict = {}
    joined_mid_run = False
    for rid, *_ in recorder.records:
        joined_mid_run |= rid not in seen and any(n > 1 for n in seen.values())
        seen[rid] = seen.get(rid, 0) + 1
    assert joined_mid_run


def test_every_acceptance_length_is_exercised_and_counted(setup):
    target, prompts, base, references = setup
    schedules = {i: [(i + s) % (K + 1) for s in range(K + 1)] for i in references}  # rotations of 0..K
    proposer = OracleProposer(references, K, target.config.vocab_size, wrong_at=schedules)
    out = SpecEngine(target, proposer, max_rows=4).generate(
        [Request(i, p, SamplingParams(max_new_tokens=MAX_NEW)) for i, p in enumerate(prompts)])
    seen = set()
    for c, b in zip(out, base):
        assert c.token_ids == b.token_ids  # lossless whatever the drafts
        steps = expected_steps(schedules[c.request_id], MAX_NEW, K)
        seen.update(steps)
        s = c.stats
        assert s.num_spec_steps == len(steps)
        assert s.num_accepted_draft_tokens == sum(steps)
        assert s.acceptance_histogram == [steps.count(j) for j in range(K + 1)]
        assert len(c.token_ids) == 1 + s.num_spec_steps + s.num_accepted_draft_tokens
        assert s.mean_acceptance_length == pytest.approx(1 + sum(steps) / len(steps))
        assert s.draft_acceptance_rate == pytest.approx(s.num_accepted_draft_tokens / s.num_draft_tokens)
    assert seen == set(range(K + 1))


def test_full_acceptance_and_budget_cap(setup):
    target, prompts, base, references = setup
    out = SpecEngine(target, OracleProposer(references, K, target.config.vocab_size), max_rows=3).generate(
        [Request(i, p, SamplingParams(max_new_tokens=MAX_NEW)) for i, p in enumerate(prompts)])
    for c, b in zip(out, base):
        assert c.token_ids == b.token_ids
        steps = expected_steps([K], MAX_NEW, K)
        assert c.stats.acceptance_histogram == [steps.count(j) for j in range(K + 1)]
        # Drafts beyond the remaining budget are not counted as proposed.
        assert c.stats.num_draft_tokens == sum(min(K, MAX_NEW - e - 1) for e in _emitted_before(steps))


def _emitted_before(steps):
    emitted = 1
    for a in steps:
        yield emitted
        emitted += a + 1


@pytest.mark.parametrize("wrong_at", [K, 2, 0])
def test_stop_token_inside_an_accepted_block(setup, wrong_at):
    target, prompts, base, references = setup
    for rid, (p, b) in enumerate(zip(prompts, base)):
        # Stop at the token at generated index 7 (inside a block for most schedules).
        stop = b.token_ids[7]
        cut = b.token_ids.index(stop) + 1
        proposer = OracleProposer(references, K, target.config.vocab_size, wrong_at={rid: [wrong_at]})
        (c,) = SpecEngine(target, proposer, max_rows=2).generate(
            [Request(rid, p, SamplingParams(max_new_tokens=MAX_NEW, stop_token_ids=(stop,)))])
        assert c.token_ids == b.token_ids[:cut]
        assert c.finish_reason == "stop"
        assert len(c.token_ids) == 1 + c.stats.num_spec_steps + c.stats.num_accepted_draft_tokens
        assert sum(c.stats.acceptance_histogram) == c.stats.num_spec_steps


def test_stop_token_as_first_token(setup):
    target, prompts, base, references = setup
    first = base[0].token_ids[0]
    (c,) = SpecEngine(target, OracleProposer(references, K, target.config.vocab_size)).generate(
        [Request(0, prompts[0], SamplingParams(stop_token_ids=(first,)))])
    assert c.token_ids == [first] and c.finish_reason == "stop" and c.stats.num_spec_steps == 0
