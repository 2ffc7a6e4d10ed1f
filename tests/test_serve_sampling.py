"""Regression (found by the Serve tests): top-k/top-p sampling with drafts verifies K+1 positions at once;
it used to crash the engine loop (an in-place broadcast of a [n, 1, V] mask against [n, K+1, V])."""

import torch

from domino_ray.engine.request import Request
from domino_ray.engine.core import SpecEngine
from domino_ray.spec_decode.proposer import DominoProposer
from domino_ray.sample.sampling import sampling_probs
from domino_ray.sample.params import SamplingParams
from tiny_models import tiny_draft, tiny_target


def test_filtered_probs_per_position_equal_single_position():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 96, generator=g)  # [n, K+1, V]
    temperature, top_k, top_p = torch.tensor([0.9, 0.5, 1.0]), torch.tensor([40, 0, 3]), torch.tensor([0.95, 0.8, 1.0])
    probs = sampling_probs(logits, temperature, top_k, top_p, filtered=True)
    for q in range(5):
        one = sampling_probs(logits[:, q:q + 1], temperature, top_k, top_p, filtered=True)
        torch.testing.assert_close(one[:, 0], probs[:, q])
    assert ((probs > 0).sum(-1)[2] <= 3).all()  # top_k=3 keeps at most 3 tokens


def test_sampled_top_k_top_p_requests_run_with_a_draft_and_reproduce():
    target = tiny_target("qwen3", seed=4)

    def run():
        engine = SpecEngine(target, DominoProposer(tiny_draft(target), target), max_rows=2)
        params = SamplingParams(max_new_tokens=12, temperature=0.8, top_k=20, top_p=0.9, seed=5, ignore_eos=True)
        return engine.generate([Request(0, [1, 2, 3], params), Request(1, [4, 5], params)])

    first, second = run(), run()
    assert [c.token_ids for c in first] == [c.token_ids for c in second]
    assert all(len(c.token_ids) == 12 for c in first)
