"""What goes into the engine and what comes out: a request, its completion, and a step's events for it; and
the engine's host-side state of a request while it runs (`Row`)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Hashable, Protocol

import torch

from domino_ray.sample.params import SamplingParams
from domino_ray.spec_decode.stats import RowStats


class StopMatcher(Protocol):
    """Stop strings as the engine sees them (text is the front end's: `frontend/detokenizer.StopStrings`)."""

    def push(self, new_ids: list[int]) -> int | None:
        """A step's committed ids -> None, or the count of generated ids to keep once a stop string completed."""


class Constraint(Protocol):
    """A row's constraint as the engine sees it (a grammar, logit_bias, allowed_token_ids: the front end's
    `frontend/constraints.RowConstraint`): the tokens it allows at a step's positions, what it adds to the target's
    logits, the tokens it forces next, and the tokens the row committed."""

    def allowed_bits(self, drafts: list[int], out: torch.Tensor):
        """Write into `out [len(drafts) + 1, ceil(V / 32)]` int32 (all bits set on entry) the tokens allowed after
        the committed tokens and after each of `drafts` in turn, as bit masks (token t: bit t % 32 of word t // 32).
        Positions after a draft it refuses are never used (the verify rejects that draft)."""

    def bias(self, vocab_size: int) -> torch.Tensor | None:
        """`[vocab_size]` float32 added to the target's logits at every position (logit_bias; -inf outside
        allowed_token_ids), or None."""

    def forced(self) -> list[int]:
        """Tokens the constraint leaves no choice about, next: drafts for free (the verify still checks them)."""

    def commit(self, tokens: list[int]):
        """The row's tokens kept in a step (its state moves past them)."""


# One generated token's log-probabilities: (its id, its logprob), then the `logprobs` most likely (id, logprob)
# by descending logprob; the log-softmax of the target's raw logits at its position.
TokenLogprobs = list[tuple[int, float]]


@dataclass
class Request:
    request_id: Hashable
    prompt_token_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)  # n == 1 here: the edges expand n
    stop_strings: StopMatcher | None = None  # for params.stop; the row ends on the step its string completes
    constraint: Constraint | None = None     # for params.constrained: the logits masked and biased at every position


@dataclass
class Completion:
    request_id: Hashable
    prompt_token_ids: list[int]
    token_ids: list[int]             # generated tokens, the stop token included when one ended the row
    finish_reason: str               # "stop" | "length" | "abort"
    stats: RowStats
    time_to_first_token_s: float     # from add_request to the first token on the host
    time_taken_s: float              # from add_request to the last token
    logprobs: list[TokenLogprobs] | None = None  # one per token of token_ids when params.logprobs is set


@dataclass
class StepEvent:
    request_id: Hashable
    new_token_ids: list[int]         # tokens committed for this request in this step (for streaming)
    completion: Completion | None    # set when the request finished in this step
    new_logprobs: list[TokenLogprobs] | None = None  # for new_token_ids, when params.logprobs is set


def check_prompt(ids, vocab_size: int, max_model_len: int):
    """Raises ValueError naming the field for prompt token ids the engine cannot run."""
    if not isinstance(ids, (list, tuple)) or not ids:
        raise ValueError("prompt_token_ids must be a non-empty list of token ids")
    if not all(isinstance(t, int) and 0 <= t < vocab_size for t in ids):
        raise ValueError(f"prompt_token_ids must be ints in [0, {vocab_size})")
    if len(ids) >= max_model_len:
        raise ValueError(f"prompt has {len(ids)} tokens; the model's limit is {max_model_len} "
                         "tokens including at least one generated token")


@dataclass
class Row:
    """A running request on the host: its tokens so far, stop rules, statistics (its steps' tokens come in through
    `commit.commit`)."""
    request: Request
    max_new: int                     # generated tokens allowed (max_new_tokens capped by the model length)
    stop_ids: frozenset
    seed: int                        # per-row randomness for sampled decoding (rng.counter_uniforms)
    stats: RowStats
    arrival: float
    tokens: list[int] = field(default_factory=list)
    first_token_time: float = 0.0
    finish_reason: str | None = None
    logprobs: list[TokenLogprobs] | None = None  # per token of `tokens`, when params.logprobs is set
    # Paged KV (`kv/blocks.py`): the row's block table, how much of `context_ids` its keys hold, how many leading
    # blocks it published for sharing, and its admission order (a preemption takes the latest admitted).
    blocks: list[int] = field(default_factory=list)
    prefilled: int = 0
    published: int = 0
    order: int = 0

    def __post_init__(self):
        if self.request.params.logprobs is not None and self.logprobs is None:
            self.logprobs = []

    @property
    def committed(self) -> int:
        return len(self.request.prompt_token_ids) + len(self.tokens)

    @property
    def draft_budget(self) -> int:
        """Drafts a step may verify for this row within its token budget (the bonus token always comes)."""
        return self.max_new - len(self.tokens) - 1

    def context_ids(self) -> list[int]:
        """What a prefill writes into the KV: the prompt, and for a preempted row also its generated tokens but the
        last (the anchor: the next step's first input, never in the KV before it)."""
        return self.request.prompt_token_ids + self.tokens[:-1]

    def completion(self, now: float) -> Completion:
        return Completion(request_id=self.request.request_id, prompt_token_ids=self.request.prompt_token_ids,
                          token_ids=list(self.tokens), finish_reason=self.finish_reason, stats=self.stats,
                          time_to_first_token_s=(self.first_token_time or now) - self.arrival,
                          time_taken_s=now - self.arrival,
                          logprobs=list(self.logprobs) if self.logprobs is not None else None)


def new_row(request: Request, *, vocab_size: int, max_model_len: int, eos_token_ids: frozenset, num_spec_tokens: int,
            rng: torch.Generator) -> Row:
    """A request as the engine runs it, checked (ValueError naming the field); a sampled request without a seed gets
    one from `rng`."""
    ids, params = request.prompt_token_ids, request.params
    check_prompt(ids, vocab_size, max_model_len)
    params.validate()
    if params.n != 1:
        raise ValueError(f"n={params.n}: the engine runs one sample per request; the front end expands n "
                         "(frontend.requests.prompt_requests)")
    seed = 0
    if not params.greedy:
        seed = params.seed if params.seed is not None else int(torch.randint(2**62, (1,), generator=rng))
    outside = params.outside_vocab(vocab_size)
    if outside:
        raise ValueError(outside)
    if params.constrained and request.constraint is None:
        raise ValueError("params.structured_outputs, logit_bias and allowed_token_ids need a constraint: build requests "
                         "with frontend.requests.prompt_requests")
    if params.stop and request.stop_strings is None:
        raise ValueError("params.stop needs a stop matcher: build requests with frontend.requests.prompt_requests "
                         "and a tokenizer")
    return Row(request=replace(request, prompt_token_ids=list(ids)),  # the caller's list may change under us
               max_new=min(params.max_new_tokens, max_model_len - len(ids)),
               stop_ids=frozenset(params.stop_ids(eos_token_ids)), seed=int(seed), stats=RowStats(num_spec_tokens),
               arrival=time.perf_counter())
