"""The paged KV pool: rows hold the blocks they fill, share whole prompt blocks, are prefilled in chunks and preempted
when the pool runs out, and none of it changes a token (greedy speculative == target-only == HF; sampled rows per
seed), nor lets a row read a key it did not write."""

import pytest
import torch

from domino_ray.kv.blocks import BlockPool
from domino_ray.engine.request import Request
from domino_ray.engine.core import SpecEngine
from domino_ray.spec_decode.proposer import DominoProposer
from domino_ray.sample.params import SamplingParams
from tiny_models import hf_greedy, ragged_prompts, tiny_draft, tiny_target

NEW = 20


@pytest.fixture(scope="module")
def target():
    return tiny_target("qwen3")


@pytest.fixture(scope="module")
def draft(target):
    return tiny_draft(target, block_size=4)


@pytest.fixture(scope="module")
def shared_prompts():
    """Prompts behind a common 40-token system prompt (two whole blocks of 16 and more), and identical ones (n samples
    of one prompt; one pair exactly two blocks long: its last block is not shared, its prefill writes it), among plain
    ones."""
    system = ragged_prompts(1, seed=5, min_len=40, max_len=40)[0]
    return [system + p for p in ragged_prompts(6, seed=6, max_len=20)] + [system[:33]] * 2 + [system[:32]] * 2 \
        + ragged_prompts(3, seed=7)


def run(target, proposer, prompts, params=None, **engine):
    """(token ids per prompt, the engine) for one engine over `prompts`."""
    engine = SpecEngine(target, proposer, max_rows=engine.pop("max_rows", 4), max_model_len=128, **engine)
    params = params or [SamplingParams(max_new_tokens=NEW, ignore_eos=True)] * len(prompts)
    out = engine.generate([Request(i, p, q) for i, (p, q) in enumerate(zip(prompts, params))])
    return [c.token_ids for c in out], engine


def assert_all_blocks_back(engine):
    assert engine.blocks.free_count == engine.kv_blocks - 1 and not engine.blocks.published
    assert not any(engine.blocks.refs)


# ---- the book of blocks ---------------------------------------------------------------------------------------


def test_blocks_are_held_by_reference_and_free_when_the_last_holder_lets_go():
    pool = BlockPool(6, 4)
    a = pool.take(3)
    assert 0 not in a and pool.free_count == 2 and pool.stats.peak_blocks_used == 3
    tokens = list(range(12))
    pool.publish(tokens, a, 0, 3)
    shared = pool.share_prefix(tokens + [99], 3)
    assert shared == a and pool.refs[a[0]] == 2
    pool.release(a)
    assert pool.free_count == 2 and pool.share_prefix(tokens, 3) == a  # still held by the sharer: still published
    pool.release(a)
    pool.release(shared)
    assert pool.free_count == 5 and not pool.published and not pool.key_of
    with pytest.raises(RuntimeError, match="6 blocks asked, 5 free"):
        pool.take(6)


def test_a_prefix_matches_only_whole_blocks_of_the_same_tokens_after_the_same_blocks():
    pool = BlockPool(10, 4)
    first = pool.take(3)
    pool.publish(list(range(12)), first, 0, 3)
    assert pool.share_prefix(list(range(12)), 2) == first[:2]                       # at most `most`
    assert pool.share_prefix([0, 1, 2, 3, 4, 5, 6, 99, 8], 3) == first[:1]          # stops at the first difference
    assert pool.share_prefix([9, 1, 2, 3, 4, 5, 6, 7], 2) == []
    # the same second block after another first block is another prefix: no match through it
    other = pool.take(2)
    pool.publish([7, 7, 7, 7, 4, 5, 6, 7], other, 0, 2)
    assert pool.share_prefix([7, 7, 7, 7, 4, 5, 6, 7], 2) == other
    assert pool.share_prefix([0, 1, 2, 3, 4, 5, 6, 7], 2) == first[:2]
    # a block published under a key already taken stays its row's own
    again = pool.take(1)
    pool.publish([0, 1, 2, 3], again, 0, 1)
    assert pool.key_of.get(again[0]) is None


# ---- the engine ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("speculative", [False, True])
def test_a_tiny_pool_preempts_and_a_small_budget_chunks_without_changing_a_token(target, draft, speculative):
    """Greedy output equals HF's with a pool that cannot hold every row (rows preempted and prefilled again from their
    prompt and generated tokens), prompts prefilled 7 tokens a step, blocks of 8; every block comes back."""
    prompts = ragged_prompts(10, seed=3, min_len=20, max_len=40)
    proposer = DominoProposer(draft, target) if speculative else None
    params = [SamplingParams(max_new_tokens=60, ignore_eos=True)] * len(prompts)  # rows outgrow the headroom
    tokens, engine = run(target, proposer, prompts, params, kv_cache_tokens=200, kv_block_size=8, max_prefill_tokens=7)
    assert tokens == [hf_greedy(target, p, 60) for p in prompts]
    stats = engine.kv_cache_stats()
    assert stats["preemptions"] > 0 and stats["blocks"] == 25 and stats["peak_blocks_used"] == 25
    assert_all_blocks_back(engine)


def test_rows_share_their_prompts_whole_blocks_and_prefill_them_once(target, draft, shared_prompts):
    """Rows behind one system prompt share its whole blocks (the target's keys and the draft's context): reported as
    prefix hits, the tokens HF's, and the blocks used below what the same rows take unshared."""
    proposer = DominoProposer(draft, target)
    tokens, engine = run(target, proposer, shared_prompts)
    assert tokens == [hf_greedy(target, p, NEW) for p in shared_prompts]
    hits = engine.kv_cache_stats()["prefix_hit_tokens"]
    assert hits >= 6 * 32  # at least two blocks of 16 for most rows: admitted together or after the first
    _, plain = run(target, proposer, [[(p[0] + i + 1) % 96] + p[1:] for i, p in enumerate(shared_prompts)])  # none
    assert plain.kv_cache_stats()["prefix_hit_tokens"] < hits
    assert engine.kv_cache_stats()["peak_blocks_used"] < plain.kv_cache_stats()["peak_blocks_used"]
    assert_all_blocks_back(engine)


def test_shared_prefixes_survive_chunks_and_preemption(target, draft, shared_prompts):
    """Sharing, chunked prefill and preemption at once (a prompt's later chunk sharing an earlier row's blocks; a
    preempted row sharing blocks again when it comes back): still HF's tokens."""
    params = [SamplingParams(max_new_tokens=60, ignore_eos=True)] * len(shared_prompts)  # rows outgrow the headroom
    tokens, engine = run(target, DominoProposer(draft, target), shared_prompts, params, kv_cache_tokens=200,
                         kv_block_size=8, max_prefill_tokens=24)
    assert tokens == [hf_greedy(target, p, 60) for p in shared_prompts]
    stats = engine.kv_cache_stats()
    assert stats["preemptions"] > 0 and stats["prefix_hit_tokens"] > 0
    assert_all_blocks_back(engine)


def test_sampled_rows_are_the_same_per_seed_whatever_the_pool(target, draft):
    """Per-seed sampling (temperature, top-p, penalties) gives the same tokens with a pool that preempts rows and one
    that holds them all: a preempted row's sampling state (its generated counts) comes back with it."""
    prompts = ragged_prompts(8, seed=11, min_len=20, max_len=40)
    params = [SamplingParams(max_new_tokens=80, temperature=0.9, top_p=0.95, seed=100 + i, ignore_eos=True,
                             frequency_penalty=0.5 if i % 2 else 0.0, repetition_penalty=1.2 if i % 3 else 1.0)
              for i in range(len(prompts))]
    roomy, _ = run(target, DominoProposer(draft, target), prompts, params)
    tight, engine = run(target, DominoProposer(draft, target), prompts, params, kv_cache_tokens=150, kv_block_size=8)
    assert engine.kv_cache_stats()["preemptions"] > 0
    assert tight == roomy


def test_a_row_reads_only_the_keys_it_wrote(target, draft):
    """Every block poisoned with huge keys and values before the rows come: a row that read a position it did not
    write (another row's block, a stale one, a shared block past the prefix) would move off HF's tokens."""
    prompts = ragged_prompts(9, seed=12, max_len=40)
    engine = SpecEngine(target, DominoProposer(draft, target), max_rows=4, max_model_len=128, kv_cache_tokens=300)
    for pool in (engine.runner.kv, engine.proposer.kv):
        pool.all_keys.fill_(1e4)
        pool.all_values.fill_(-1e4)
    out = engine.generate([Request(i, p, SamplingParams(max_new_tokens=NEW, ignore_eos=True))
                           for i, p in enumerate(prompts)])
    assert [c.token_ids for c in out] == [hf_greedy(target, p, NEW) for p in prompts]


def test_a_long_prompt_is_prefilled_in_chunks_while_the_other_rows_decode(target):
    """A 100-token prompt arriving beside a decoding row, 16 prompt tokens a step: the decoding row gets a token every
    step meanwhile (no step is all prefill), the long one starts after ceil(100 / 16) = 7 steps, both HF's tokens."""
    short, long = ragged_prompts(1, seed=2, min_len=5, max_len=5)[0], ragged_prompts(1, seed=3, min_len=100,
                                                                                    max_len=100)[0]
    engine = SpecEngine(target, None, max_rows=4, max_model_len=160, max_prefill_tokens=16)
    params = SamplingParams(max_new_tokens=30, ignore_eos=True)
    engine.add_request(Request("short", short, params))
    tokens = {"short": [t for e in engine.step() for t in e.new_token_ids], "long": []}
    engine.add_request(Request("long", long, params))
    steps_until_first = 0
    while not tokens["long"]:
        events = engine.step()
        steps_until_first += 1
        assert any(e.request_id == "short" and e.new_token_ids for e in events)  # the decoding row advanced too
        for e in events:
            tokens[e.request_id] += e.new_token_ids
    assert steps_until_first == 7
    while engine.has_unfinished():
        for e in engine.step():
            tokens[e.request_id] += e.new_token_ids
    assert tokens == {"short": hf_greedy(target, short, 30), "long": hf_greedy(target, long, 30)}
    assert engine.kv_cache_stats()["peak_rows"] == 2


def test_a_pending_row_holding_blocks_gives_them_back_when_aborted(target):
    engine = SpecEngine(target, None, max_rows=4, max_model_len=160, max_prefill_tokens=16)
    engine.add_request(Request("long", ragged_prompts(1, seed=3, min_len=100, max_len=100)[0],
                               SamplingParams(max_new_tokens=5)))
    engine.step()
    assert engine.blocks.used > 0 and engine.pending[0].blocks
    assert engine.abort("long")
    assert_all_blocks_back(engine)
    assert not engine.has_unfinished()


def test_a_pool_that_cannot_hold_one_row_is_refused_naming_the_key(target):
    with pytest.raises(ValueError, match="generation.kv_cache_tokens: the KV pool holds 64 tokens but one row at "
                                         "model.max_model_len needs 144"):
        SpecEngine(target, None, max_rows=4, max_model_len=128, kv_cache_tokens=64)
    with pytest.raises(ValueError, match="kv_block_size=12 must be a power of two"):
        SpecEngine(target, None, max_rows=4, max_model_len=128, kv_block_size=12)
