"""The layout sweep of test_engine_greedy.py with drafts that accept: every (block size, shift_label, P)
layout, saved in a published checkpoint format and read back by `load_draft`, proposes drafts the
target accepts (mean acceptance length well above 1, full blocks included), and greedy output stays
token for token the target's own."""

import itertools

import pytest

from checkpoint_layouts import write_dflash, write_speculators, write_speculators_domino
from domino_ray.engine.request import Request
from domino_ray.engine.core import SpecEngine
from domino_ray.spec_decode.checkpoint import load_draft
from domino_ray.spec_decode.proposer import DominoProposer
from domino_ray.sample.params import SamplingParams
from domino_ray.spec_decode.stats import total_stats
from tiny_models import ragged_prompts, successor_draft, successor_target

MAX_NEW = 24

FORMATS = {
    "dflash": lambda draft, target, path: write_dflash(draft, path),
    "dflash-legacy-logit_head": lambda draft, target, path: write_dflash(draft, path, legacy_head=True),
    "dflash-model-prefix": lambda draft, target, path: write_dflash(draft, path, model_prefix=True),
    "speculators-domino": lambda draft, target, path: write_speculators_domino(draft, path),
    "speculators": lambda draft, target, path: write_speculators(draft, target, path),  # shift_label, P >= 1 only
}

# test_engine_greedy.DRAFT_LAYOUTS, each with a checkpoint format: speculators for every layout it can
# hold (its P counts from slot 1, the riskiest to read), the other formats taking turns over the rest.
DRAFT_LAYOUTS = [(b, shift, p) for b in (1, 2, 4, 8, 16) for shift in (True, False) for p in (0, 1)
                 if shift or b > 1]
_others = itertools.cycle([f for f in FORMATS if f != "speculators"])
CASES = [(b, shift, p, "speculators" if shift and p >= 1 else next(_others)) for b, shift, p in DRAFT_LAYOUTS]


@pytest.fixture(scope="module")
def setup():
    target, vectors, predecessor = successor_target()
    prompts = ragged_prompts(7, seed=3)
    reference = SpecEngine(target, None, max_rows=3).generate(
        [Request(i, p, SamplingParams(max_new_tokens=MAX_NEW)) for i, p in enumerate(prompts)])
    return target, vectors, predecessor, prompts, [c.token_ids for c in reference]


def test_the_target_depends_on_its_context(setup):
    """Otherwise equal output would prove little about the KV and context bookkeeping of accepted steps."""
    _, _, _, prompts, reference = setup
    followers: dict[int, set[int]] = {}
    for prompt, generated in zip(prompts, reference):
        seq = prompt[-1:] + generated
        for current, following in zip(seq, seq[1:]):
            followers.setdefault(current, set()).add(following)
    assert any(len(f) > 1 for f in followers.values())


def test_every_layout_and_format_is_swept():
    assert len(CASES) == 18 and {f for *_, f in CASES} == set(FORMATS)


@pytest.mark.parametrize("block_size,shift_label,num_uncorrected,fmt", CASES)
def test_accepting_draft_equals_target(setup, tmp_path, block_size, shift_label, num_uncorrected, fmt):
    target, vectors, predecessor, prompts, reference = setup
    draft = successor_draft(target, vectors, predecessor, block_size=block_size, shift_label=shift_label,
                            num_uncorrected=num_uncorrected)
    FORMATS[fmt](draft, target, tmp_path)
    loaded = load_draft(tmp_path, target_config=target.config, dtype=target.dtype)
    assert (loaded.config.block_size, loaded.config.shift_label, loaded.config.num_uncorrected) == \
        (block_size, shift_label, num_uncorrected)
    out = SpecEngine(target, DominoProposer(loaded, target), max_rows=3).generate(
        [Request(i, p, SamplingParams(max_new_tokens=MAX_NEW)) for i, p in enumerate(prompts)])
    assert [c.token_ids for c in out] == reference
    k = block_size if shift_label else block_size - 1
    total = total_stats(c.stats for c in out)
    assert total.num_spec_tokens == k
    assert total.mean_acceptance_length > 1 + 0.6 * min(k, 3)  # > 1.6 at K = 1, > 2.8 from K = 3
    assert total.acceptance_histogram[k] > 0  # whole blocks accepted, then the bonus token
    for c in out:
        assert len(c.token_ids) == 1 + c.stats.num_spec_steps + c.stats.num_accepted_draft_tokens
