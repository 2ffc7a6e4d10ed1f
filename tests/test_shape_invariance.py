"""On CPU with our kernels, a verify forward of W + 1 positions computes every position bit for bit as a one-position
step would (`target/packed_linear.py`: every decode and verify step takes our row-invariant linear kernel; attention,
norms and sampling are per row). So speculative decoding equals target-only exactly, not only where no near-tie or
sampling boundary is met: greedy tokens and their logprobs (the logits' log-softmax, compared as floats), and sampled
tokens per seed, on the demo pair (it accepts ~6 drafts a step) at 16 rows and K = 8: verifies of 144 positions
against target-only's 16, both in fp32 and with bf16 weights.
"""

from __future__ import annotations

import pytest
import torch

from domino_ray.backend.library import kernels_loaded
from domino_ray.engine.request import Request
from domino_ray.llm import build_engine
from domino_ray.target.packed_linear import keep_bf16_weights
from domino_ray.sample.params import SamplingParams
from tests.tiny_models import load_demo_pair

pytestmark = pytest.mark.skipif(not kernels_loaded(), reason="our CPU kernels did not build")

ROWS = 16


@pytest.mark.parametrize("bf16", [False, True])
def test_a_verify_computes_each_position_as_a_one_position_step(bf16):
    target, tokenizer, draft = load_demo_pair()
    if bf16:
        target, draft = target.bfloat16(), draft.bfloat16()
        assert keep_bf16_weights(target, draft)
    assert next(target.parameters()).dtype == torch.float32
    prompts = [tokenizer.encode(text) for text in ("def add(a, b):", "for i in range(", "import numpy as np\n",
                                                   "class Stack:\n    def")]
    greedy = [SamplingParams(max_new_tokens=32, ignore_eos=True, logprobs=2)] * 4
    sampled = [SamplingParams(max_new_tokens=12, ignore_eos=True, temperature=0.8, top_p=0.95, seed=100 + i)
               for i in range(ROWS - 4)]
    requests = [(prompts[i % 4], p) for i, p in enumerate(greedy + sampled)]

    def run(k):
        engine = build_engine(target, draft if k else None, tokenizer, num_draft_tokens=k, max_batch_size=ROWS,
                              max_model_len=128)
        out = engine.generate([Request(i, ids, p) for i, (ids, p) in enumerate(requests)])
        return out, sum(c.stats.num_accepted_draft_tokens for c in out)

    base, _ = run(None)
    spec, accepted = run(8)
    assert [c.token_ids for c in spec] == [c.token_ids for c in base]
    assert [c.logprobs for c in spec[:4]] == [c.logprobs for c in base[:4]]  # floats, compared exactly
    assert len({tuple(c.token_ids) for c in base[4:]}) > 1  # the seeds sample different texts
    assert accepted > 64  # the verifies' later positions are committed, not only their first (measured ~100)
