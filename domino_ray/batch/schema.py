"""The batch rows: input parsing and validation, the explicit Arrow output schema, error rows.

n output rows per input row, always (DESIGN.md §5): its samples, `sample_index` 0..n-1, n from its
sampling parameters (`sample_count`: 1 when they are bad). The input columns are carried through (the id
first), then the generated columns below. A row that cannot run (bad prompt, bad messages, bad
per-row sampling overrides, too long for the model) becomes error rows: same schema, typed
defaults (zeros, empty strings and lists, `finish_reason = "error"`) and the reason in `error`.

The processor's stages (processor.py) each fill their own columns: the tokenize stage `sample_index`,
`prompt`, `prompt_token_ids` and `error` (a row becomes its samples there); the engine stage the token,
logprob and statistics columns (`error` for rows the engine refused); the detokenize stage `generated_text`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields, replace

import pyarrow as pa

from domino_ray.config import InputConfig
from domino_ray.target.loading import check_messages
from domino_ray.sample.params import SamplingParams, derive_seed

# Each generated token's logprob and the top N: [{token_id, logprob}, ...] with the generated token first.
TOKEN_LOGPROBS = pa.list_(pa.struct([("token_id", pa.int64()), ("logprob", pa.float32())]))
GENERATED_FIELDS = [
    pa.field("sample_index", pa.int32()),                 # 0..n-1: the row's samples; (id, sample_index) is the key
    pa.field("prompt", pa.string()),
    pa.field("generated_text", pa.string()),
    pa.field("generated_tokens", pa.list_(pa.int32())),
    pa.field("logprobs", pa.list_(TOKEN_LOGPROBS)),       # one per generated token; null unless logprobs was asked
    pa.field("num_input_tokens", pa.int32()),
    pa.field("num_generated_tokens", pa.int32()),
    pa.field("finish_reason", pa.string()),               # stop | length | error
    pa.field("num_spec_tokens", pa.int32()),              # K, draft tokens per step (0 = target only)
    pa.field("num_spec_steps", pa.int32()),
    pa.field("num_draft_tokens", pa.int32()),
    pa.field("num_accepted_draft_tokens", pa.int32()),
    pa.field("mean_acceptance_length", pa.float64()),     # 1 + accepted / steps (bonus included)
    pa.field("draft_acceptance_rate", pa.float64()),
    pa.field("acceptance_histogram", pa.list_(pa.int32())),  # [K+1]: steps that accepted exactly j drafts
    pa.field("verify_width_histogram", pa.list_(pa.int32())),  # [K+1]: steps that verified W = j drafts
    pa.field("near_ties", pa.int32()),                    # greedy tokens at 16-bit near-ties (verify.near_tie_mask)
    pa.field("num_forced_tokens", pa.int32()),            # accepted drafts a constraint forced (structured outputs)
    pa.field("time_to_first_token_s", pa.float64()),
    pa.field("time_taken_llm_s", pa.float64()),
    pa.field("error", pa.string()),                       # null on success
]
GENERATED_NAMES = [f.name for f in GENERATED_FIELDS]
# What the engine stage fills (error_row / ok_row); the text stages fill `sample_index`, `prompt` and `generated_text`.
ENGINE_NAMES = [n for n in GENERATED_NAMES if n not in ("sample_index", "prompt", "generated_text")]
# The tokenize stage's token ids: in the processor's output rows (as in Ray Data LLM's), not in the job's files.
PROMPT_IDS_FIELD = pa.field("prompt_token_ids", pa.list_(pa.int32()))
COLUMN_TYPES = {f.name: f.type for f in [*GENERATED_FIELDS, PROMPT_IDS_FIELD]}
OVERRIDE_KEYS = tuple(f.name for f in fields(SamplingParams))
# Ray Data LLM's (vLLM's) names for the same overrides; its top_k=-1 means off, our 0.
OVERRIDE_ALIASES = {"max_tokens": "max_new_tokens", "guided_decoding": "structured_outputs"}
# vLLM SamplingParams fields we do not have, with the value that asks for nothing (accepted; any other is an error
# naming the field): beam search, bad words, logits processors, prompt logprobs, detokenization options.
UNSUPPORTED_OVERRIDES = {"best_of": None, "use_beam_search": False, "length_penalty": 1.0, "early_stopping": False,
                         "min_p": 0.0, "bad_words": None, "logits_processors": None,
                         "prompt_logprobs": None, "truncate_prompt_tokens": None, "detokenize": True,
                         "skip_special_tokens": True, "spaces_between_special_tokens": True, "output_kind": None,
                         "extra_args": None}


class RowError(ValueError):
    """A row that cannot run; its message becomes the row's `error`."""


def output_schema(input_schema: pa.Schema, id_column: str, generated_id: bool) -> pa.Schema:
    """Carried input columns (id first) + the generated columns. Input columns named like a generated
    column are replaced by it (a plain-text `prompt` column stays as the output `prompt`)."""
    carried = [f for f in input_schema if f.name not in GENERATED_NAMES and f.name != id_column]
    id_field = pa.field(id_column, pa.string()) if generated_id else input_schema.field(id_column)
    return pa.schema([id_field, *carried, *GENERATED_FIELDS])


def generated_ids(row_hashes: pa.Array) -> pa.Array:
    """Ids for inputs without an id column: Ray's per-row hash of (file path, row position), as hex."""
    return pa.array([f"{h:016x}" for h in row_hashes.to_pylist()], pa.string())


# ---- input rows ------------------------------------------------------------------------------------

@dataclass
class RowInput:
    prompt: str | None = None        # plain text, when the row has a prompt
    messages: list | None = None     # chat turns, when the row has messages


def read_row(row: dict, cfg: InputConfig) -> RowInput:
    """The prompt or the chat of one input row; raises RowError saying what is wrong with it."""
    messages = row.get(cfg.messages_column)
    if not is_null(messages):
        messages = _plain_messages(messages)
        try:
            check_messages(messages)
        except ValueError as exc:
            raise RowError(f"{cfg.messages_column}: {exc}") from None
        return RowInput(messages=messages)
    if cfg.prompt_column not in row:
        raise RowError(f"{cfg.messages_column} is null and there is no {cfg.prompt_column!r} column")
    prompt = row[cfg.prompt_column]
    if is_null(prompt):
        raise RowError(f"{cfg.prompt_column} is null")
    if isinstance(prompt, (bytes, bytearray)):
        try:
            prompt = bytes(prompt).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise RowError(f"{cfg.prompt_column} is not valid UTF-8 ({exc.reason} at byte {exc.start})") from None
    if not isinstance(prompt, str):
        raise RowError(f"{cfg.prompt_column} must be a string, got {type(prompt).__name__}")
    if not prompt.strip():
        raise RowError(f"{cfg.prompt_column} is empty")
    return RowInput(prompt=prompt)


def is_null(value) -> bool:
    """None, or the NaN pandas puts in a missing cell (a float NaN reaches us from pandas-built datasets)."""
    return value is None or (isinstance(value, float) and value != value)


def _plain_messages(messages):
    """Arrow gives chats as lists of dicts (structs) or, from a JSON string column, as text."""
    if isinstance(messages, str):
        try:
            messages = json.loads(messages)
        except json.JSONDecodeError as exc:
            raise RowError(f"messages is not valid JSON: {exc.msg}") from None
    if isinstance(messages, list):  # Arrow structs carry every field; absent ones come back as None
        return [{k: v for k, v in m.items() if v is not None} if isinstance(m, dict) else m for m in messages]
    return messages


def row_params(overrides, base: SamplingParams, base_seed: int | None, row_id) -> SamplingParams:
    """The job's sampling parameters with a row's overrides (a struct/dict or a JSON object string;
    Ray Data LLM's `max_tokens` and `top_k=-1` accepted).

    A sampled row without its own seed gets one derived from (generation.seed, id), so its output
    does not depend on which batch or actor it landed in. A row without an id (a processor on a dataset
    with no id column) takes the engine's generator: two copies of a prompt still sample independently.
    """
    if isinstance(overrides, str):
        try:
            overrides = json.loads(overrides)
        except json.JSONDecodeError as exc:
            raise RowError(f"sampling_params is not valid JSON: {exc.msg}") from None
    if is_null(overrides):
        overrides = {}
    if not isinstance(overrides, dict):
        raise RowError(f"sampling_params must be an object, got {type(overrides).__name__}")
    overrides = {k: v for k, v in overrides.items() if v is not None}
    for alias, name in OVERRIDE_ALIASES.items():
        if alias in overrides:
            if name in overrides:
                raise RowError(f"sampling_params gives both {alias} and {name} (the same setting): give one")
            overrides[name] = overrides.pop(alias)
    if overrides.get("top_k") == -1:
        overrides["top_k"] = 0
    for name in sorted(set(overrides) & set(UNSUPPORTED_OVERRIDES)):
        value, neutral = overrides.pop(name), UNSUPPORTED_OVERRIDES[name]
        if value != neutral and not (neutral is None and value in ([], {})):
            raise RowError(f"sampling_params.{name} is not supported" if neutral is None else
                           f"sampling_params.{name}={value!r} is not supported (only {neutral!r})")
    unknown = sorted(set(overrides) - set(OVERRIDE_KEYS))
    if unknown:
        raise RowError(f"sampling_params has unknown keys {unknown}; allowed: {list(OVERRIDE_KEYS)} "
                       f"(and {list(OVERRIDE_ALIASES)})")
    for name in ("stop_token_ids", "stop", "allowed_token_ids"):
        if isinstance(overrides.get(name), list):
            overrides[name] = tuple(overrides[name])
    if overrides.get("seed") is None and base_seed is not None and row_id is not None:
        overrides["seed"] = derive_seed(base_seed, row_id)
    try:
        return replace(base, **overrides)
    except (TypeError, ValueError) as exc:
        raise RowError(f"sampling_params: {exc}") from None


def sample_count(overrides, base: SamplingParams) -> int:
    """Output rows of an input row: its `n`, or 1 when its sampling_params are bad (n unknown: one error row,
    sample_index 0). A bad prompt with a good n gives n error rows: the count depends on the overrides alone, so
    the driver (resume) and the stages agree on it."""
    try:
        return row_params(overrides, base, None, None).n
    except RowError:
        return 1


# ---- output rows -----------------------------------------------------------------------------------

def error_row(reason: str, *, num_spec_tokens: int) -> dict:
    """The engine stage's columns of a row that did not run: zeros everywhere, `num_input_tokens` too (an
    800k-token prompt that was refused processed nothing; the reason says how long it was), so job totals
    count only work done."""
    return {
        "generated_tokens": [], "logprobs": None, "num_input_tokens": 0,
        "num_generated_tokens": 0, "finish_reason": "error", "num_spec_tokens": num_spec_tokens,
        "num_spec_steps": 0, "num_draft_tokens": 0, "num_accepted_draft_tokens": 0,
        "mean_acceptance_length": 0.0, "draft_acceptance_rate": 0.0,
        "acceptance_histogram": [0] * (num_spec_tokens + 1), "verify_width_histogram": [0] * (num_spec_tokens + 1),
        "near_ties": 0, "num_forced_tokens": 0, "time_to_first_token_s": 0.0,
        "time_taken_llm_s": 0.0, "error": reason,
    }


def ok_row(completion) -> dict:
    """The engine stage's columns of a finished `request.Completion`."""
    return {
        "generated_tokens": completion.token_ids, "logprobs": logprob_column(completion.logprobs),
        "num_input_tokens": len(completion.prompt_token_ids), "num_generated_tokens": len(completion.token_ids),
        "finish_reason": completion.finish_reason, **completion.stats.to_columns(),
        "time_to_first_token_s": completion.time_to_first_token_s, "time_taken_llm_s": completion.time_taken_s,
        "error": None,
    }


def logprob_column(logprobs) -> list | None:
    """`Completion.logprobs` ([(id, logprob), ...] per token, the generated one first) as the `logprobs` cell."""
    if logprobs is None:
        return None
    return [[{"token_id": t, "logprob": lp} for t, lp in token] for token in logprobs]


def engine_columns(rows: list[dict]) -> dict[str, list]:
    """error_row / ok_row dicts as the engine stage's columns (all of them, for an empty batch too)."""
    return {name: [row[name] for row in rows] for name in ENGINE_NAMES}


def with_columns(table: pa.Table, columns: dict[str, list]) -> pa.Table:
    """`table` with these generated columns (typed as the output schema says) added or replaced."""
    for name, values in columns.items():
        array = pa.array(values, COLUMN_TYPES[name])
        i = table.schema.get_field_index(name)
        table = table.set_column(i, name, array) if i >= 0 else table.append_column(name, array)
    return table


def output_table(table: pa.Table, schema: pa.Schema | None = None) -> pa.Table:
    """Carried input columns first, then the generated ones in their documented order, then
    `prompt_token_ids`; with `schema` (the job's) exactly its columns, cast to it."""
    if schema is not None:
        return table.select(schema.names).cast(schema)
    tail = [n for n in [*GENERATED_NAMES, PROMPT_IDS_FIELD.name] if n in table.column_names]
    return table.select([n for n in table.column_names if n not in tail] + tail)
