"""The engine's incremental draft context (per-row KV buffers, ragged appends, slot moves) gives the
same drafts as recomputing the draft from scratch on the committed prefix (the DFlash reference)."""

import pytest
import torch

from domino_ray.engine.request import Request
from domino_ray.engine.core import SpecEngine
from domino_ray.spec_decode.proposer import DominoProposer
from oracles import OracleProposer
from domino_ray.sample.params import SamplingParams
from tiny_models import Recorder, ragged_prompts, tiny_draft, tiny_target


def stateless_drafts(target, draft, sequence: list[int], committed: int, k: int,
                     slots: int | None = None) -> list[int]:
    """Draft tokens for a row whose first `committed` tokens are fixed, computed from scratch with a block of
    `slots` (None: the whole block)."""
    ids = torch.tensor([sequence[:committed - 1]])
    out = target.model(input_ids=ids, output_hidden_states=True)
    features = torch.cat([out.hidden_states[i + 1] for i in draft.config.target_layer_ids], -1)  # [1, T, F]
    embed = target.get_input_embeddings()
    b = slots or draft.config.block_size
    anchor = torch.tensor([sequence[committed - 1]])
    block = embed(torch.tensor([[sequence[committed - 1]] + [draft.config.mask_token_id] * (b - 1)]))
    positions = torch.arange(committed - 1, committed - 1 + b)[None]
    mask = torch.ones(1, 1, b, committed - 1 + b, dtype=torch.bool)
    hidden = draft.block_hidden(features, block, positions, mask)
    return draft.draft_tokens(hidden, anchor, k, embed, target.get_output_embeddings())[0].tolist()


@pytest.mark.parametrize("shift_label,draft_vocab,width", [(True, None, None), (False, None, None), (True, 40, None),
                                                             (True, None, 1), (False, None, 1)])
def test_incremental_context_matches_recompute(shift_label, draft_vocab, width):
    """Every step's drafts equal the stateless draft's on the committed prefix. At the full width the block is
    whole; at width 1 (a draft block of 5) a step runs 2 slots (3 without shift_label), and the oracle's block has
    them too."""
    target = tiny_target("qwen3", seed=2)
    draft = tiny_draft(target, block_size=5 if width else 4, shift_label=shift_label, draft_vocab=draft_vocab)
    prompts = ragged_prompts(5, seed=7, max_len=16)
    base = SpecEngine(target, None, max_rows=5).generate(
        [Request(i, p, SamplingParams(max_new_tokens=14)) for i, p in enumerate(prompts)])
    sequences = {i: p + c.token_ids for i, (p, c) in enumerate(zip(prompts, base))}
    k = width or draft.config.max_draft_tokens
    slots = (2 if shift_label else 3) if width else None  # counted here, not by block_slots
    # The oracle drives acceptance through every length 0..K, so context appends of 1..K+1 positions
    # happen; the real draft runs as its shadow and is recorded.
    recorder = Recorder(DominoProposer(draft, target, k))
    oracle = OracleProposer(sequences, k, target.config.vocab_size,
                            wrong_at={i: [(i + s) % (k + 1) for s in range(k + 1)] for i in sequences},
                            shadow=recorder)
    out = SpecEngine(target, oracle, max_rows=2).generate(  # 2 slots for 5 rows: slots are reused and moved
        [Request(i, p, SamplingParams(max_new_tokens=14)) for i, p in enumerate(prompts)])
    assert [c.token_ids for c in out] == [c.token_ids for c in base]
    assert len(recorder.records) > 10
    with torch.no_grad():
        for rid, committed, drafts in recorder.records:
            assert drafts == stateless_drafts(target, draft, sequences[rid], committed, k, slots), (rid, committed)


def test_a_draft_reading_layers_the_target_lacks_is_refused():
    """A draft built for a deeper target (context from layer 5 of a 4-layer one) fails when it meets the target,
    naming the ids, not deep inside the first step."""
    target = tiny_target("qwen3")
    draft = tiny_draft(target, layer_ids=(0, 5))
    with pytest.raises(ValueError, match=r"target_layer_ids \[0, 5\]: expected ids in \[0, 4\) .* found \[5\]"):
        DominoProposer(draft, target)
