"""The one way in: a prompt's token ids and its `SamplingParams` -> the engine's requests.

Every edge goes through here (the Python API, the batch predictor and its pair probe, Serve's choices; benchmarks and
draft training through `id_requests`), so the n fan-out, each sample's seed, the stop matcher and the length rule
are decided once:

- **n samples**: sample i runs as `params.for_sample(i)` (sample 0 keeps the seed, so it equals the n = 1 request;
  the others derive theirs from it), under the request id `(request_id, i)`.
- **Stop strings** need a tokenizer: the engine ends a row on the step its string completes (`StopStrings`).
- **The length rule** (`check_length`), as the anchors do: a prompt that leaves no room for one generated token is
  an error for that prompt (an error row, a 400, a `ValueError` naming it); a prompt whose `max_new_tokens` does not
  fit is capped, ending with `finish_reason: "length"`, in the batch job and the Python API (vLLM's offline `LLM`:
  one long row must not fail the rest), and refused in Serve (vLLM's server answers 400).
"""

from __future__ import annotations

from typing import Hashable, Literal, Sequence

from domino_ray.engine.request import Request
from domino_ray.frontend.constraints import row_constraint
from domino_ray.frontend.detokenizer import stop_matcher
from domino_ray.sample.params import SamplingParams

OverLength = Literal["cap", "refuse"]


class LengthError(ValueError):
    """The length rule refused a prompt; `field` names what to change (the prompt, or its max tokens)."""

    def __init__(self, message: str, field: str):
        super().__init__(message)
        self.field = field


def check_length(prompt_len: int, max_new_tokens: int, max_model_len: int, *, over_length: OverLength,
                 prompt_field: str = "prompt", max_tokens_field: str = "max_new_tokens") -> int:
    """The generated tokens a prompt of `prompt_len` tokens may have: `max_new_tokens`, or with `over_length="cap"`
    as many as fit. Raises LengthError when the prompt alone fills the model's length, or with `"refuse"` when
    `max_new_tokens` does not fit after it. The field names are the caller's (Serve's `max_tokens`, say)."""
    room = max_model_len - prompt_len
    if room < 1:
        raise LengthError(f"{prompt_field} has {prompt_len} tokens; the model's limit is {max_model_len} tokens for "
                          f"prompt and generated tokens together, so at most {max_model_len - 1} prompt tokens fit",
                          prompt_field)
    if max_new_tokens > room and over_length == "refuse":
        raise LengthError(f"{prompt_field} ({prompt_len} tokens) + {max_tokens_field} ({max_new_tokens}) exceeds the "
                          f"model's limit of {max_model_len} tokens: at most {room} new tokens fit after this prompt",
                          max_tokens_field)
    return min(max_new_tokens, room)


def prompt_requests(request_id: Hashable, prompt_token_ids: Sequence[int], params: SamplingParams, *,
                    tokenizer=None, max_model_len: int | None, over_length: OverLength = "cap",
                    samples: Sequence[int] | None = None, prompt_field: str = "prompt",
                    eos_token_ids: Sequence[int] = ()) -> list[Request]:
    """One prompt's engine requests, one per sample in `samples` (default: all of `params.n`), with ids
    `(request_id, i)`. Raises ValueError naming the problem: stop strings without a tokenizer, a sample index
    outside n, the length rule (LengthError), a grammar that does not compile. `max_model_len` None: the engine's
    length is not known here, and the engine applies the same rule (it caps, and refuses a prompt that fills its
    length). A constrained request (`structured_outputs`, `logit_bias`, `allowed_token_ids`) gets its constraint
    (`frontend/constraints.py`); `eos_token_ids`: the engine's, which a finished grammar allows."""
    if params.stop and tokenizer is None:
        raise ValueError(f"stop={list(params.stop)!r} needs a tokenizer to match text, and there is none; use "
                         "stop_token_ids instead")
    if max_model_len is not None:
        check_length(len(prompt_token_ids), params.max_new_tokens, max_model_len, over_length=over_length,
                     prompt_field=prompt_field)
    ids = list(prompt_token_ids)
    out = []
    for i in range(params.n) if samples is None else samples:
        sample = params.for_sample(i)
        out.append(Request((request_id, i), ids, sample, stop_matcher(tokenizer, sample),
                           row_constraint(sample, tokenizer, tuple(eos_token_ids))))
    return out


def id_requests(prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams], *,
                request_ids: Sequence[Hashable] | None = None) -> list[Request]:
    """Token-id prompts run as they are, one request each, with id = its index (or `request_ids`): what benchmarks,
    draft training and the pair probe drive the engine with. n must be 1 and there are no stop strings (no tokenizer); the engine caps
    `max_new_tokens` at the model's length and refuses a prompt that fills it."""
    if isinstance(params, SamplingParams):
        params = [params] * len(prompts)
    if len(params) != len(prompts):
        raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling parameters")
    for p in params:
        if p.n != 1 or p.stop or p.constrained:
            raise ValueError("id_requests runs one sample per prompt without stop strings or constraints; use "
                             "prompt_requests for the rest")
    request_ids = range(len(prompts)) if request_ids is None else request_ids
    return [Request(rid, list(ids), p) for rid, ids, p in zip(request_ids, prompts, params, strict=True)]
