"""Greedy speculative decoding is lossless: token for token what the target alone produces."""

import pytest
import torch

from domino_ray.engine.request import Request
from domino_ray.engine.core import SpecEngine
from domino_ray.spec_decode.proposer import DominoProposer
from domino_ray.sample.params import SamplingParams
from tiny_models import hf_greedy, ragged_prompts, tiny_draft, tiny_target

MAX_NEW = 12


@pytest.fixture(scope="module")
def qwen3():
    return tiny_target("qwen3")


@pytest.fixture(scope="module")
def prompts():
    return ragged_prompts(7, seed=3)


@pytest.fixture(scope="module")
def reference(qwen3, prompts):
    return [hf_greedy(qwen3, p, MAX_NEW) for p in prompts]


def run(target, proposer, prompts, max_rows=3, **params):
    engine = SpecEngine(target, proposer, max_rows=max_rows)
    params.setdefault("max_new_tokens", MAX_NEW)
    return engine.generate([Request(i, p, SamplingParams(**params)) for i, p in enumerate(prompts)])


def test_target_only_equals_hf_generate(qwen3, prompts, reference):
    out = run(qwen3, None, prompts)
    assert [c.token_ids for c in out] == reference
    assert all(c.finish_reason == "length" and c.stats.num_spec_tokens == 0 for c in out)


# Block size 1 without shift_label has no draft slot (K = 0): that case is the target-only mode.
DRAFT_LAYOUTS = [(b, shift, p) for b in (1, 2, 4, 8, 16) for shift in (True, False) for p in (0, 1)
                 if shift or b > 1]


@pytest.mark.parametrize("block_size,shift_label,num_uncorrected", DRAFT_LAYOUTS)
def test_domino_draft_equals_target(qwen3, prompts, reference, block_size, shift_label, num_uncorrected):
    draft = tiny_draft(qwen3, block_size=block_size, shift_label=shift_label, num_uncorrected=num_uncorrected)
    out = run(qwen3, DominoProposer(draft, qwen3), prompts)
    assert [c.token_ids for c in out] == reference
    k = block_size if shift_label else block_size - 1
    assert all(c.stats.num_spec_tokens == k for c in out)


@pytest.mark.parametrize("head", [True, False])
def test_pruned_draft_vocabulary_equals_target(qwen3, prompts, reference, head):
    draft = tiny_draft(qwen3, block_size=4, draft_vocab=40, head=head)
    out = run(qwen3, DominoProposer(draft, qwen3), prompts)
    assert [c.token_ids for c in out] == reference


def test_llama_target(prompts):
    llama = tiny_target("llama", seed=5)
    reference = [hf_greedy(llama, p, MAX_NEW) for p in prompts]
    assert [c.token_ids for c in run(llama, None, prompts)] == reference
    draft = tiny_draft(llama, block_size=4)
    assert [c.token_ids for c in run(llama, DominoProposer(draft, llama), prompts)] == reference


def test_fewer_draft_tokens_than_the_block(qwen3, prompts, reference):
    draft = tiny_draft(qwen3, block_size=8)
    out = run(qwen3, DominoProposer(draft, qwen3, num_spec_tokens=3), prompts)
    assert [c.token_ids for c in out] == reference
    assert out[0].stats.num_spec_tokens == 3


def test_max_new_tokens_hit_exactly(qwen3, prompts):
    draft = tiny_draft(qwen3, block_size=8)
    for n in (1, 2, 5, 9):
        out = run(qwen3, DominoProposer(draft, qwen3), prompts, max_new_tokens=n)
        assert all(len(c.token_ids) == n and c.finish_reason == "length" for c in out)


def test_model_max_length_caps_generation(qwen3):
    prompt = list(range(1, 20))
    engine = SpecEngine(qwen3, DominoProposer(tiny_draft(qwen3, block_size=4), qwen3), max_rows=2, max_model_len=25)
    (out,) = engine.generate([Request(0, prompt, SamplingParams(max_new_tokens=50))])
    assert len(out.token_ids) == 25 - len(prompt) and out.finish_reason == "length"
    assert out.token_ids == hf_greedy(qwen3, prompt, 25 - len(prompt))
    with pytest.raises(ValueError, match="limit is 25"):
        engine.add_request(Request(1, list(range(25)), SamplingParams()))


def test_draft_without_slots_is_refused(qwen3):
    with pytest.raises(ValueError, match="num_draft_tokens=0 is out of range"):
        DominoProposer(tiny_draft(qwen3, block_size=1, shift_label=False), qwen3)
