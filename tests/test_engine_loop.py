"""EngineLoop: concurrent callers share one engine thread; bad requests fail alone; aborts free slots."""

import asyncio

import pytest

from domino_ray.engine.loop import EngineLoop, QueueFull
from domino_ray.engine.request import Request
from domino_ray.engine.core import SpecEngine
from domino_ray.spec_decode.proposer import DominoProposer
from domino_ray.sample.params import SamplingParams
from tiny_models import hf_greedy, ragged_prompts, tiny_draft, tiny_target


@pytest.fixture(scope="module")
def target():
    return tiny_target("qwen3", seed=4)


def test_concurrent_requests_match_target_and_overlap(target):
    """12 callers at once on 4 slots: each gets the target's greedy tokens, and the engine decoded their rows
    together, counted in engine steps (not time): some step carried tokens of 4 requests, and a request got its
    first token before another in flight had finished.
    Fails if the loop serializes requests: checked by making `_run` admit the next request only once the engine is
    idle (then one request a step)."""
    prompts = ragged_prompts(12, seed=9)
    engine = SpecEngine(target, DominoProposer(tiny_draft(target), target), max_rows=4)
    per_step, step = [], engine.step

    def recording_step():  # the requests each engine step gave tokens to, and those it finished
        events = step()
        per_step.append(({e.request_id for e in events}, {e.request_id for e in events if e.completion}))
        return events
    engine.step = recording_step
    loop = EngineLoop(engine)

    async def main():
        streams = [loop.submit(Request(i, p, SamplingParams(max_new_tokens=10))) for i, p in enumerate(prompts)]
        return await asyncio.gather(*(s.completion() for s in streams))

    try:
        completions = asyncio.run(main())
    finally:
        loop.stop()
    assert [c.token_ids for c in completions] == [hf_greedy(target, p, 10) for p in prompts]
    first = {rid: next(i for i, (got, _) in enumerate(per_step) if rid in got) for rid in range(len(prompts))}
    last = {rid: next(i for i, (_, done) in enumerate(per_step) if rid in done) for rid in range(len(prompts))}
    assert max(len(got) for got, _ in per_step) == engine.max_rows, per_step  # the batch filled up
    assert any(a != b and first[a] <= first[b] < last[a] for a in first for b in first), per_step  # together


def test_bad_request_fails_alone_and_abort_frees_slot(target):
    loop = EngineLoop(SpecEngine(target, None, max_rows=1), max_waiting=2)

    async def main():
        long = loop.submit(Request("long", [1, 2, 3], SamplingParams(max_new_tokens=400)))
        bad = loop.submit(Request("bad", [], SamplingParams()))
        with pytest.raises(ValueError, match="non-empty"):
            await bad.completion()
        async for event in long.events():  # wait until it is running, then abort it
            break
        loop.abort("long")
        done = await long.completion()
        assert done.finish_reason == "abort" and len(done.token_ids) < 400
        short = loop.submit(Request("short", [4, 5], SamplingParams(max_new_tokens=3)))
        assert len((await short.completion()).token_ids) == 3

    try:
        asyncio.run(main())
    finally:
        loop.stop()


def test_queue_limit(target):
    loop = EngineLoop(SpecEngine(target, None, max_rows=1), max_waiting=1)

    async def main():
        first = loop.submit(Request(0, [1], SamplingParams(max_new_tokens=200)))
        async for _ in first.events():  # request 0 is running
            break
        loop.submit(Request(1, [1], SamplingParams(max_new_tokens=200)))  # request 1 waits
        with pytest.raises(QueueFull):
            loop.submit(Request(2, [1], SamplingParams(max_new_tokens=2)))
        loop.abort(0)
        loop.abort(1)

    try:
        asyncio.run(main())
    finally:
        loop.stop()
