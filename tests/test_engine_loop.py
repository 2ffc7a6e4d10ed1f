"""EngineLoop: concurrent callers share one engine thread; bad requests fail alone; aborts free slots."""

import asyncio

import pytest

from domino_ray.engine.loop import EngineLoop, QueueFull
from domino_ray.engine.request import Request
from domino_ray.engine.spec_engine import SpecEngine
from domino_ray.spec.proposer import DominoProposer
from domino_ray.spec.sampling_params import SamplingParams
from tiny_models import hf_greedy, ragged_prompts, tiny_draft, tiny_target


@pytest.fixture(scope="module")
def target():
    return tiny_target("qwen3", seed=4)


def test_concurrent_requests_match_target_and_overlap(target):
    prompts = ragged_prompts(12, seed=9)
    loop = EngineLoop(SpecEngine(target, DominoProposer(tiny_draft(target), target), max_rows=4))

    async def main():
        streams = [loop.submit(Request(i, p, SamplingParams(max_new_tokens=10))) for i, p in enumerate(prompts)]
        return await asyncio.gather(*(s.completion() for s in streams))

    try:
        completions = asyncio.run(main())
    finally:
        loop.stop()
    assert [c.token_ids for c in completions] == [hf_greedy(target, p, 10) for p in prompts]


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
