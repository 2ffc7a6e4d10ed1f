"""The step's typed hand-offs on the host alone (no model): the scheduler's `StepPlan` names the prompt segments a step
prefills, the rows it preempts and the blocks it grants; `update_from_output` applies a `StepOutput` under each row's
stop and length rules."""

import torch

from domino_ray.engine.commit import update_from_output
from domino_ray.engine.request import Request, new_row
from domino_ray.engine.scheduler import Scheduler
from domino_ray.engine.step_types import BlockGrant, PrefillSegment, StepOutput
from domino_ray.kv.blocks import BlockPool
from domino_ray.sample.params import SamplingParams


def row(request_id, prompt_len: int, **params):
    return new_row(Request(request_id, list(range(1, prompt_len + 1)), SamplingParams(**params)), vocab_size=96,
                   max_model_len=512, eos_token_ids=frozenset(), num_spec_tokens=3, rng=torch.Generator())


def admitted(blocks: int):
    """Rows a and b, 5-token prompts, admitted and prefilled into a pool of `blocks` blocks of 16 (one block each:
    positions up to the prompt and a step's `span` of 2), then c queued behind them."""
    scheduler = Scheduler(BlockPool(blocks + 1, 16), max_rows=4, span=2, max_prefill_tokens=100)
    a, b, c = row("a", 5, max_new_tokens=100), row("b", 5, max_new_tokens=100), row("c", 5, max_new_tokens=100)
    scheduler.pending.extend([a, b])
    plan = scheduler.schedule([])
    assert plan.prefill == [PrefillSegment(a, a.context_ids(), 0, 5), PrefillSegment(b, b.context_ids(), 0, 5)]
    assert plan.prefill[1].ids == [1, 2, 3, 4, 5] and not plan.preempt and not plan.grants
    assert scheduler.finish_segments(plan.prefill) == ([a, b], [4, 9])
    assert (a.blocks, b.blocks) == ([1], [2])
    scheduler.pending.append(c)
    return scheduler, a, b, c


def test_a_plan_for_a_full_pool_names_the_preempted_row_and_the_blocks_granted():
    """a's next step needs 4 more blocks, b's 2, with 4 free: b (the latest admitted) gives its block back and waits
    first in the queue, and a is granted blocks 2..5 from its table's entry 1 on."""
    scheduler, a, b, c = admitted(blocks=6)
    a.tokens, b.tokens = [7] * 60, [7] * 40  # their next steps reach positions 66 and 46: 5 and 3 blocks
    plan = scheduler.make_room(scheduler.schedule([a, b]), [a, b])  # c: no room for its headroom beside them
    assert plan.prefill == [] and len(plan.preempt) == 1 and plan.preempt[0] is b
    assert plan.grants == [BlockGrant(a, 1, [2, 3, 4, 5])] and plan.grants[0].row is a
    assert a.blocks == [1, 2, 3, 4, 5] and b.blocks == [] and list(scheduler.pending) == [b, c]
    assert scheduler.blocks.free_count == 1 and scheduler.blocks.stats.preemptions == 1


def test_a_row_being_prefilled_is_preempted_before_an_active_one():
    """c, admitted last and still being prefilled (3 of its 5 tokens in), is the victim: named in the plan, its block
    back though it holds no slot; the active rows keep theirs and grow into what it held."""
    scheduler, a, b, c = admitted(blocks=12)
    scheduler.max_prefill_tokens = 3
    plan = scheduler.schedule([a, b])
    assert plan.prefill == [PrefillSegment(c, c.context_ids(), 0, 3)] and c.blocks == [3]
    assert scheduler.finish_segments(plan.prefill) == ([], []) and scheduler.holders() == [c]
    a.tokens, b.tokens = [7] * 84, [7] * 84  # next steps up to position 90: 5 more blocks each, 9 free
    plan = scheduler.make_room(plan, [a, b])
    assert len(plan.preempt) == 1 and plan.preempt[0] is c and c.blocks == [] and c.prefilled == 0
    assert [(g.row.request.request_id, g.index, g.blocks) for g in plan.grants] == [("a", 1, [3, 4, 5, 6, 7]),
                                                                                   ("b", 1, [8, 9, 10, 11, 12])]
    assert plan.prefill[0].row is c  # the plan keeps its prefill part


def test_update_from_output_cuts_at_a_stop_id_and_counts_only_the_tokens_kept():
    """Row 0 accepts all 3 drafts but the second token is a stop id: it keeps 2 tokens, finishes "stop", and its
    statistics and near-ties count those 2; row 1 reaches its length limit with its 2 tokens."""
    stopping, short = row(0, 4, max_new_tokens=50, stop_token_ids=[9]), row(1, 4, max_new_tokens=3)
    stopping.tokens, short.tokens = [5], [5]
    output = StepOutput(width=3, accepted=[3, 1], tokens=[[4, 9, 8, 6], [4, 8, 6, 6]], near_ties=[0b1110, 0b0011])
    events = update_from_output([stopping, short], output, now=1.0)
    assert [e.new_token_ids for e in events] == [[4, 9], [4, 8]]
    assert stopping.finish_reason == "stop" and short.finish_reason == "length"
    assert events[0].completion.token_ids == [5, 4, 9] and events[1].completion.token_ids == [5, 4, 8]
    assert (stopping.stats.num_draft_tokens, stopping.stats.num_accepted_draft_tokens) == (3, 1)
    assert (short.stats.num_draft_tokens, short.stats.num_accepted_draft_tokens) == (1, 1)  # its budget: 1 draft
    assert (stopping.stats.near_ties, short.stats.near_ties) == (1, 2)
