"""What goes into the engine and what comes out: a request, its completion, and a step's events for it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Hashable

from domino_ray.sampling_params import SamplingParams
from domino_ray.stats import RowStats


@dataclass
class Request:
    request_id: Hashable
    prompt_token_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)


@dataclass
class Completion:
    request_id: Hashable
    prompt_token_ids: list[int]
    token_ids: list[int]             # generated tokens, the stop token included when one ended the row
    finish_reason: str               # "stop" | "length" | "abort"
    stats: RowStats
    time_to_first_token_s: float     # from add_request to the first token on the host
    time_taken_s: float              # from add_request to the last token


@dataclass
class StepEvent:
    request_id: Hashable
    new_token_ids: list[int]         # tokens committed for this request in this step (for streaming)
    completion: Completion | None    # set when the request finished in this step
