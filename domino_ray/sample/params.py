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

import hashlib
import json
from dataclasses import dataclass, field, replace
from typing import Any

MAX_TEMPERATURE = 2.0
MAX_LOGPROBS = 20        # vLLM's default `max_logprobs`: top alternatives per generated token
MAX_STOP_STRINGS = 16


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
    "stop": (lambda v: isinstance(v, (list, tuple)) and len(v) <= MAX_STOP_STRINGS
             and all(isinstance(s, str) and s for s in v), f"a list of at most {MAX_STOP_STRINGS} non-empty strings"),
    "include_stop_str_in_output": (lambda v: isinstance(v, bool), "true or false"),
    "n": (lambda v: is_int(v) and v >= 1, "an int >= 1"),
    "logprobs": (lambda v: v is None or (is_int(v) and 0 <= v <= MAX_LOGPROBS), f"null or an int in [0, {MAX_LOGPROBS}]"),
    "presence_penalty": (lambda v: _is_number(v) and -2.0 <= v <= 2.0, "a number in [-2, 2]"),
    "frequency_penalty": (lambda v: _is_number(v) and -2.0 <= v <= 2.0, "a number in [-2, 2]"),
    "repetition_penalty": (lambda v: _is_number(v) and 0.0 < v <= 2.0, "a number in (0, 2]"),
    "min_tokens": (lambda v: is_int(v) and v >= 0, "an int >= 0"),
}


# vLLM's StructuredOutputsParams kinds (one per request) -> what the value must be. `json` takes a schema (a dict or its
# JSON text), `json_object` true (any JSON object), `regex` a pattern, `choice` the strings to choose among, `grammar` an
# EBNF/GBNF or Lark grammar.
STRUCTURED_KINDS = {"json": "a JSON schema (an object or its JSON text)", "json_object": "true",
                    "regex": "a regular expression", "choice": "a non-empty list of strings",
                    "grammar": "an EBNF (GBNF) or Lark grammar"}
MAX_LOGIT_BIAS = 100.0  # OpenAI's range for a logit_bias value


def structured_output(value) -> tuple[str, str] | None:
    """A request's `structured_outputs` (vLLM's fields, one kind: `{"json": schema}`, `{"json_object": true}`,
    `{"regex": ...}`, `{"choice": [...]}`, `{"grammar": ...}`) -> (kind, text): the schema and the choices as JSON
    text (keys sorted: one text per schema, the grammar cache's key). None for None. ValueError naming the field."""
    if value is None or (isinstance(value, tuple) and len(value) == 2 and value[0] in STRUCTURED_KINDS):
        return value
    # vLLM's `backend` picks its grammar library: ours is llguidance whatever it names (the output is the same language)
    given = ({k: v for k, v in value.items() if v not in (None, False) and k != "backend"}
             if isinstance(value, dict) else None)
    if not given or len(given) != 1 or next(iter(given)) not in STRUCTURED_KINDS:
        raise ValueError("sampling parameter " + invalid_value(
            "structured_outputs", value, "an object with exactly one of " + ", ".join(STRUCTURED_KINDS)))
    kind, spec = next(iter(given.items()))
    ok = {"json": isinstance(spec, (dict, str)), "json_object": spec is True,
          "regex": isinstance(spec, str) and spec != "", "grammar": isinstance(spec, str) and spec.strip() != "",
          "choice": isinstance(spec, (list, tuple)) and bool(spec) and all(isinstance(s, str) for s in spec)}[kind]
    if not ok:
        raise ValueError("sampling parameter " + invalid_value(f"structured_outputs.{kind}", spec, STRUCTURED_KINDS[kind]))
    if kind == "json" and isinstance(spec, str):
        try:
            spec = json.loads(spec)
        except ValueError as exc:
            raise ValueError(f"sampling parameter structured_outputs.json is not valid JSON: {exc}") from None
    if kind in ("json", "choice"):
        return kind, json.dumps(list(spec) if kind == "choice" else spec, sort_keys=True)
    return kind, "" if kind == "json_object" else spec


def logit_bias_pairs(value) -> tuple[tuple[int, float], ...] | None:
    """OpenAI's `logit_bias` ({token id (an int or its string): bias in [-100, 100]}) -> sorted (id, bias) pairs."""
    if value is None or isinstance(value, tuple) or value == {}:  # {}: OpenAI's "no bias"
        return value or None
    expected = f"an object of token ids to numbers in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]"
    if not isinstance(value, dict):
        raise ValueError("sampling parameter " + invalid_value("logit_bias", value, expected))
    pairs = []
    for key, bias in value.items():
        token = int(key) if isinstance(key, str) and key.isdigit() else key
        if not is_int(token) or token < 0 or not _is_number(bias) or abs(bias) > MAX_LOGIT_BIAS:
            raise ValueError("sampling parameter " + invalid_value("logit_bias", value, expected))
        pairs.append((token, float(bias)))
    return tuple(sorted(pairs))


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
    stop: tuple[str, ...] = field(default_factory=tuple)  # stop strings: the text ends before the first one
    include_stop_str_in_output: bool = False  # keep the matched stop string at the end of the text
    n: int = 1                               # samples of the prompt (expanded at the edges: `for_sample`)
    logprobs: int | None = None              # per generated token: its logprob and the N most likely
    presence_penalty: float = 0.0            # OpenAI: minus this for every token already generated
    frequency_penalty: float = 0.0           # OpenAI: minus this times the token's count in the generated tokens
    repetition_penalty: float = 1.0          # HF/vLLM: logit / p (> 0) or * p (< 0) for prompt and generated tokens
    min_tokens: int = 0                      # EOS and stop ids suppressed until this many tokens are generated
    # Constraints (the target's distribution masked at every position): vLLM's `structured_outputs` (a dict of one
    # kind, kept as (kind, text): `structured_output`), OpenAI's `logit_bias` (kept as sorted (id, bias) pairs) and
    # vLLM's `allowed_token_ids`
    structured_outputs: Any = None
    logit_bias: Any = None
    allowed_token_ids: tuple[int, ...] | None = None

    def __post_init__(self):
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        object.__setattr__(self, "stop", (self.stop,) if isinstance(self.stop, str) else tuple(self.stop))
        object.__setattr__(self, "structured_outputs", structured_output(self.structured_outputs))
        object.__setattr__(self, "logit_bias", logit_bias_pairs(self.logit_bias))
        if isinstance(self.allowed_token_ids, list):
            object.__setattr__(self, "allowed_token_ids", tuple(self.allowed_token_ids))
        self.validate()

    def validate(self):
        """Raise ValueError naming the field for a bad value (the checks config.validate uses too)."""
        for name, (ok, expected) in SAMPLING_CHECKS.items():
            value = getattr(self, name)
            if not ok(value):
                raise ValueError("sampling parameter " + invalid_value(name, value, expected))
        allowed = self.allowed_token_ids
        if allowed is not None and not (allowed and all(is_int(t) and t >= 0 for t in allowed)):
            raise ValueError("sampling parameter " + invalid_value("allowed_token_ids", allowed,
                                                                   "null or a non-empty list of ints >= 0"))
        if self.min_tokens > self.max_new_tokens:
            raise ValueError("sampling parameter " + invalid_value(
                "min_tokens", self.min_tokens, f"an int <= max_new_tokens ({self.max_new_tokens})"))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        """Whether the verify step must adjust this row's logits (penalties, min_tokens): host-known."""
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0
                or self.min_tokens > 0)

    @property
    def constrained(self) -> bool:
        """Whether this row's logits are masked or biased at every position (a grammar, logit_bias,
        allowed_token_ids): host-known, so rows without pay nothing."""
        return self.structured_outputs is not None or bool(self.logit_bias) or self.allowed_token_ids is not None

    def outside_vocab(self, vocab_size: int) -> str | None:
        """The message naming the first `logit_bias` / `allowed_token_ids` token id at or past `vocab_size`, or None:
        the engine's check and Serve's (a 400 naming the field) are this one."""
        for name, ids in (("logit_bias", [t for t, _ in self.logit_bias or ()]),
                          ("allowed_token_ids", self.allowed_token_ids or ())):
            bad = next((t for t in ids if t >= vocab_size), None)
            if bad is not None:
                return f"{name}: token id {bad} is outside the vocabulary [0, {vocab_size})"
        return None

    def for_sample(self, index: int) -> "SamplingParams":
        """The parameters of sample `index` of `n` (n = 1): sample 0 keeps the seed, so it equals the n = 1
        request; sample i > 0 gets a seed derived from (seed, i), so a rerun gives the same n samples.
        Without a seed every sample draws its own."""
        if not 0 <= index < self.n:
            raise ValueError(f"sample index {index} is outside n={self.n}")
        seed = self.seed if self.seed is None or index == 0 else derive_seed(self.seed, index)
        return replace(self, n=1, seed=seed)

    def stop_ids(self, eos_token_ids) -> frozenset[int]:
        """The ids that end this request: its own stop ids plus the model's EOS ids unless `ignore_eos`."""
        return frozenset(self.stop_token_ids) | (frozenset() if self.ignore_eos else frozenset(eos_token_ids))


def derive_seed(seed: int, index) -> int:
    """A seed in [0, 2**63) from (seed, index), independent of everything else (a row's id, a sample's index)."""
    digest = hashlib.sha256(f"{seed}:{index}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1
