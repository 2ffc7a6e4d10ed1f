"""Sampling parameters and their one set of rules; no torch, so config.py and request parsing use them too.

The same checks judge a job's `generation.*` keys (config.py, reported as `generation.temperature`),
a batch row's `sampling_params` overrides, a Serve request's fields (serve/openai_api.py, a 400 naming the
field) and `SamplingParams` built in Python; the message format is `invalid_value`'s everywhere.

Temperature is a number in [0, 2] (`MAX_TEMPERATURE`) everywhere: the range OpenAI's API documents,
so a client written for it behaves the same here, and a row override that runs in the batch job also
runs as a Serve request. The engine only divides the logits and would run hotter, but beyond 2 the
text is mostly noise: no use worth a second limit.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

MAX_TEMPERATURE = 2.0


def is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)  # a bool is an int in Python, never a valid one here


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x == x  # x == x: not NaN


# Per field: (check, what it expects). `SamplingParams.validate` reports them as `temperature`, the
# config as `generation.temperature`, Serve with `param: temperature`.
SAMPLING_CHECKS: dict[str, tuple[Any, str]] = {
    "max_new_tokens": (lambda v: is_int(v) and v >= 1, "an int >= 1"),
    "temperature": (lambda v: _is_number(v) and 0.0 <= v <= MAX_TEMPERATURE,
                    f"a number in [0, {MAX_TEMPERATURE:g}]"),
    "top_p": (lambda v: _is_number(v) and 0.0 < v <= 1.0, "a number in (0, 1]"),
    "top_k": (lambda v: is_int(v) and v >= 0, "an int >= 0"),
    "seed": (lambda v: v is None or (is_int(v) and 0 <= v < 2**63), "null or an int in [0, 2**63)"),
    "stop_token_ids": (lambda v: isinstance(v, (list, tuple)) and all(is_int(t) and t >= 0 for t in v),
                       "a list of ints >= 0"),
    "ignore_eos": (lambda v: isinstance(v, bool), "true or false"),
}


def invalid_value(name: str, value, expected: str) -> str:
    """The one message format for a bad value: `<name>=<value> is invalid: expected <what>`."""
    return f"{name}={value!r} is invalid: expected {expected}"


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 256                # generated tokens at most (the stop token counts)
    temperature: float = 0.0                 # 0 = greedy; at most MAX_TEMPERATURE
    top_p: float = 1.0                       # nucleus mass kept, (0, 1]
    top_k: int = 0                           # keep the k most likely tokens; 0 = all
    seed: int | None = None                  # per-request seed (sampled decoding only)
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)  # besides the model's EOS ids
    ignore_eos: bool = False                 # do not stop at the model's EOS ids

    def __post_init__(self):
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        self.validate()

    def validate(self):
        """Raise ValueError naming the field for a bad value (the checks config.validate uses too)."""
        for name, (ok, expected) in SAMPLING_CHECKS.items():
            value = getattr(self, name)
            if not ok(value):
                raise ValueError("sampling parameter " + invalid_value(name, value, expected))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def stop_ids(self, eos_token_ids) -> frozenset[int]:
        """The ids that end this request: its own stop ids plus the model's EOS ids unless `ignore_eos`."""
        return frozenset(self.stop_token_ids) | (frozenset() if self.ignore_eos else frozenset(eos_token_ids))
