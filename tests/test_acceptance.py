"""Acceptance logic and statistics, driven by a proposer that knows the target's continuation and is
wrong from a chosen draft position: every acceptance length 0..K happens and is checked exactly."""

import pytest

from domino_ray.engine.request import Request
from domino_ray.engine.spec_engine import SpecEngine
from domino_ray.spec.sampling_params import SamplingParams
from oracles import OracleProposer
from tiny_models import ragged_prompts, tiny_target

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
