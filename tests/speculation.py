"""Proof that an end-to-end run speculated, not only that its output is right.

A run whose draft is never accepted is plain decoding: it would pass every output check even with a broken
acceptance or KV path. The end-to-end tests therefore run `save_agreeing_pair`'s pair, whose draft the
target mostly accepts, and check with the functions here that the run exercised what can break:

- `check_speculated`: accepted drafts are a large share of the tokens, steps that accepted some but not
  all of their drafts and steps that accepted all of them both occurred.
- `speculate_in_process`: the same rows through the real proposer in this process, recording every
  step's drafts, so a test can also show that a stop token arrived as an accepted draft (the drafts after
  it dropped). With a fixed K a row's steps depend on the row alone (`test_batch_invariance.py`), so an
  end-to-end row whose acceptance histogram equals the in-process row's ran the same steps.
"""

from __future__ import annotations

from dataclasses import dataclass

from domino_ray.engine.request import Request
from domino_ray.engine.core import SpecEngine
from domino_ray.llm import load_draft_for
from domino_ray.target.loading import load_target, load_tokenizer, stop_token_ids
from domino_ray.frontend.detokenizer import stop_matcher
from domino_ray.spec_decode.proposer import DominoProposer
from domino_ray.spec_decode.width_costs import StepCosts
from tiny_models import Recorder

MIN_ACCEPTED_SHARE = 0.3  # of all generated tokens; the agreeing pair gives ~0.65 greedy at K = 4, ~0.4 sampled


class FixedCosts(StepCosts):
    """A cost table real steps leave as it is: the widths a test expects then follow from the policy and the
    acceptance alone, not from how busy this machine was while the engine timed its steps (an adaptive engine
    in a loaded suite has measured drafting as too dear to pay and hardly drafted)."""

    def observe(self, r, w, t, seconds):
        pass


@dataclass
class SpeculatedRow:
    token_ids: list[int]
    target_only: list[int]             # the same row without a draft
    acceptance_histogram: list[int]
    steps: list[tuple[int, int]]       # (draft tokens verified W, accepted a) per step
    stop_in_accepted_run: bool         # the stop token was itself an accepted draft


def check_speculated(histograms, num_tokens: int, *, min_share: float = MIN_ACCEPTED_SHARE):
    """`histograms`: the rows' acceptance histograms (each [K+1]); `num_tokens`: tokens the rows generated."""
    total = [sum(column) for column in zip(*histograms)]
    k = len(total) - 1
    accepted = sum(a * n for a, n in enumerate(total))
    assert accepted >= min_share * num_tokens, (accepted, num_tokens, total)
    assert sum(total[1:k]) > 0, f"no step accepted some but not all of its drafts: {total}"
    assert total[k] > 0, f"no step accepted all K drafts: {total}"


def speculate_in_process(target_dir: str, draft_dir: str, prompts: list[list[int]], params: list,
                         num_spec_tokens: int, max_rows: int = 8) -> list[SpeculatedRow]:
    """Each row generated speculatively at a fixed K (drafts recorded) and by the target alone."""
    target, tokenizer = load_target(target_dir), load_tokenizer(target_dir, required=False)
    stops = stop_token_ids(target, tokenizer)
    recorder = Recorder(DominoProposer(load_draft_for(target, draft_dir), target, num_spec_tokens))

    def requests():  # a stop-string matcher holds its row's text: one per run
        return [Request(i, p, sp, stop_matcher(tokenizer, sp))
                for i, (p, sp) in enumerate(zip(prompts, params))]
    spec = SpecEngine(target, recorder, max_rows=max_rows, eos_token_ids=stops).generate(requests())
    alone = SpecEngine(target, None, max_rows=max_rows, eos_token_ids=stops).generate(requests())
    drafts_by_row: dict[int, list[tuple[int, list[int]]]] = {}
    for rid, committed, drafts in recorder.records:
        drafts_by_row.setdefault(rid, []).append((committed, drafts))
    rows = []
    for c, base, sp in zip(spec, alone, params):
        generated, start = c.token_ids, len(c.prompt_token_ids)
        steps, stop_in_run = [], False
        for committed, drafts in drafts_by_row.get(c.request_id, []):
            step_tokens = generated[committed - start:]
            accepted = 0
            while accepted < len(drafts) and accepted < len(step_tokens) and drafts[accepted] == step_tokens[accepted]:
                accepted += 1
            steps.append((len(drafts), accepted))
            # The row's last step, cut at a stop token that matched its draft within the drafts the row's budget
            # lets it accept (all but the bonus): the stop token was accepted and the drafts after it dropped.
            done = committed - start
            if c.finish_reason == "stop" and done + accepted == len(generated) and accepted < sp.max_new_tokens - done:
                stop_in_run = True
        rows.append(SpeculatedRow(generated, base.token_ids, list(c.stats.acceptance_histogram), steps, stop_in_run))
    return rows
