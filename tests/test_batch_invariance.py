"""A row's output, statistics and even its draft tokens do not depend on what else is in the batch,
on the order of requests, or on which slot it ran in (slot reuse and compaction)."""

import random

import pytest

from domino_ray.engine.request import Request
from domino_ray.engine.core import SpecEngine
from domino_ray.spec_decode.proposer import DominoProposer
from domino_ray.sample.params import SamplingParams
from tiny_models import Recorder, ragged_prompts, tiny_draft, tiny_target


@pytest.fixture(scope="module")
def pair():
    target = tiny_target("qwen3", seed=31)
    return target, tiny_draft(target, block_size=4)


def run(pair, prompts, max_rows, order):
    target, draft = pair
    recorder = Recorder(DominoProposer(draft, target))
    requests = [Request(i, prompts[i], SamplingParams(max_new_tokens=10 + i % 5)) for i in order]
    out = SpecEngine(target, recorder, max_rows=max_rows).generate(requests)
    drafts = {}
    for rid, committed, d in recorder.records:
        drafts.setdefault(rid, []).append((committed, d))
    return {c.request_id: (c.token_ids, c.stats.to_columns()) for c in out}, drafts


def test_rows_never_leak(pair):
    prompts = ragged_prompts(9, seed=32, max_len=30)
    alone_out, alone_drafts = {}, {}
    for i in range(len(prompts)):
        out, drafts = run(pair, prompts, max_rows=1, order=[i])
        alone_out.update(out)
        alone_drafts.update(drafts)
    order = list(range(len(prompts)))
    random.Random(0).shuffle(order)
    for max_rows in (2, 4, 9):
        out, drafts = run(pair, prompts, max_rows=max_rows, order=order)
        assert out == alone_out, max_rows
        assert drafts == alone_drafts, max_rows
