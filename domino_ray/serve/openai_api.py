"""The OpenAI-compatible API's requests, Ray-free: `parse_request` turns the JSON body of `POST /v1/completions`
or `/v1/chat/completions` into token ids and `SamplingParams`, or raises `APIError` (a 4xx with an OpenAI-style
body whose `param` names the field). Values are judged by SamplingParams' own rules (SAMPLING_CHECKS); fields we
do not implement are refused unless they hold their neutral value, so nothing a client asks for is silently
ignored. Response bodies are responses.py's; one request's text stream, between the two, choices.py's.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from domino_ray.frontend.constraints import row_constraint
from domino_ray.frontend.requests import LengthError, check_length
from domino_ray.target.loading import encode_prompt
from domino_ray.sample.params import MAX_LOGPROBS, SAMPLING_CHECKS, SamplingParams, invalid_value, is_int

# Fields we accept only at a neutral value (OpenAI and vLLM features this server does not implement).
NEUTRAL = {
    "echo": (None, False), "suffix": (None,), "best_of": (None, 1), "tools": (None, []),
    "tool_choice": (None, "none"), "parallel_tool_calls": (None, True, False),
    "user": None, "metadata": None, "store": (None, False),
}
PENALTIES = ("presence_penalty", "frequency_penalty", "repetition_penalty")
# vLLM's earlier spellings of its structured_outputs kinds (guided_json: a schema, ...)
GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
COMMON = {"model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "n", "stream", "stream_options",
          "ignore_eos", "stop_token_ids", "include_stop_str_in_output", "min_tokens", "logprobs", *PENALTIES,
          "logit_bias", "allowed_token_ids", "response_format", "structured_outputs", *GUIDED}
FIELDS = {"completion": COMMON | {"prompt"},
          "chat": COMMON | {"messages", "max_completion_tokens", "chat_template_kwargs", "top_logprobs"}}


class APIError(Exception):
    """A request the server refuses; `body()` is the OpenAI error object."""

    def __init__(self, status: int, message: str, param: str | None = None, type: str = "invalid_request_error",
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


@dataclass(frozen=True)
class ModelSpec:
    """What request parsing and the text stream need to know about the served model."""
    name: str                  # the id clients send as `model`
    tokenizer: Any
    vocab_size: int            # token ids in prompts must be below this
    max_model_len: int         # prompt + generated tokens
    defaults: SamplingParams = SamplingParams()  # for fields a request leaves out (config `generation:`)
    enable_thinking: bool = False  # chat template default (Qwen3 thinking off)
    parse_special_tokens: bool = False  # special-token strings in prompt/content text become control ids
    eos_token_ids: tuple[int, ...] = ()  # the engine's: a generated one ends the row and is no text
    max_n: int | None = None   # choices a request may ask for (engine slots + waiting places); None = any


@dataclass
class ParsedRequest:
    kind: str                  # "completion" | "chat"
    prompt_token_ids: list[int]
    params: SamplingParams     # n choices, each run as params.for_sample(i)
    stream: bool
    include_usage: bool = False  # stream_options.include_usage: usage in a last chunk with no choices


# ---- parsing ---------------------------------------------------------------------------------------

def parse_request(kind: str, raw: bytes, model: ModelSpec) -> ParsedRequest:
    """Validate a request body; raises APIError naming the field."""
    try:
        body = json.loads(raw)
        # JSON may escape lone UTF-16 surrogates ("\\ud800"); they are not text a tokenizer can encode.
        json.dumps(body, ensure_ascii=False).encode("utf-8")
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise APIError(400, f"request body is not valid JSON: {exc}") from None
    except UnicodeEncodeError:
        raise APIError(400, "request body holds a lone UTF-16 surrogate escape (e.g. \\ud800): strings must "
                            "be valid Unicode") from None
    except RecursionError:
        raise APIError(400, "request body is nested too deeply") from None
    if not isinstance(body, dict):
        raise APIError(400, f"request body must be a JSON object, got {type(body).__name__}")
    for name, value in body.items():
        if name in FIELDS[kind]:
            continue
        if name not in NEUTRAL:
            raise APIError(400, f"unrecognized request argument: {name}", name)
        if NEUTRAL[name] is not None and value not in NEUTRAL[name]:
            raise APIError(400, f"{name}={value!r} is not supported by this server", name)
    requested = body.get("model")
    if requested is not None and not isinstance(requested, str):
        raise APIError(400, f"model must be a string, got {requested!r}", "model")
    if requested is not None and requested != model.name:
        raise APIError(404, f"model {requested!r} does not exist; this server serves {model.name!r}", "model",
                       code="model_not_found")
    if kind == "completion":
        ids, prompt_field = _completion_prompt(body, model), "prompt"
    else:
        ids, prompt_field = _chat_prompt(body, model), "messages"
    max_tokens_field = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    options = body.get("stream_options") or {}
    if not isinstance(options, dict) or set(options) - {"include_usage", "continuous_usage_stats"} or not all(
            isinstance(v, bool) for v in options.values()):
        raise APIError(400, "stream_options may hold include_usage and continuous_usage_stats (true or false); "
                            "usage and statistics come in the last chunk (include_usage: a chunk of its own)", "stream_options")
    stream = _bool(body, "stream", False)
    return ParsedRequest(kind=kind, prompt_token_ids=ids,
                         params=_sampling(body, kind, model, len(ids), prompt_field, max_tokens_field), stream=stream,
                         include_usage=stream and options.get("include_usage", False))


def _completion_prompt(body: dict, model: ModelSpec) -> list[int]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        if len(prompt) != 1:
            raise APIError(400, f"prompt holds {len(prompt)} prompts; send one prompt per request", "prompt")
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt.strip():
            raise APIError(400, "prompt is empty", "prompt")
        # The completions API continues the text as it is: no chat template.
        return _encode(model, "prompt", prompt=prompt, chat_template=False,
                       parse_special_tokens=model.parse_special_tokens)
    if isinstance(prompt, list) and prompt and all(is_int(t) for t in prompt):
        if not all(0 <= t < model.vocab_size for t in prompt):
            raise APIError(400, f"prompt token ids must be in [0, {model.vocab_size})", "prompt")
        return list(prompt)
    if prompt is None or prompt == [] or prompt == [[]]:
        raise APIError(400, "prompt is required and must not be empty", "prompt")
    raise APIError(400, "prompt must be a string or a list of token ids", "prompt")


def _chat_prompt(body: dict, model: ModelSpec) -> list[int]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise APIError(400, "messages is required: a non-empty list of {role, content}", "messages")
    messages = [_flatten_content(m, i) for i, m in enumerate(messages)]
    options = body.get("chat_template_kwargs") or {}
    if not isinstance(options, dict) or set(options) - {"enable_thinking"}:
        raise APIError(400, "chat_template_kwargs may only hold enable_thinking", "chat_template_kwargs")
    thinking = _bool(options, "enable_thinking", model.enable_thinking, "chat_template_kwargs.enable_thinking")
    return _encode(model, "messages", messages=messages, enable_thinking=thinking,
                   parse_special_tokens=model.parse_special_tokens)


def _flatten_content(message, index: int):
    """OpenAI content parts `[{type: text, text}]` -> one string; other part types are refused."""
    if not isinstance(message, dict) or not isinstance(message.get("content"), list):
        return message
    parts = message["content"]
    if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in parts):
        raise APIError(400, f"messages[{index}].content: only text parts are supported", "messages")
    return {**message, "content": "".join(p["text"] for p in parts)}


def _encode(model: ModelSpec, field: str, **kwargs) -> list[int]:
    try:
        return encode_prompt(model.tokenizer, **kwargs)
    except ValueError as exc:
        raise APIError(400, f"{field}: {exc}", field) from None


def _sampling(body: dict, kind: str, model: ModelSpec, prompt_len: int, prompt_field: str, max_tokens_field: str
              ) -> SamplingParams:
    """The request's SamplingParams; fields it leaves out take the config's `generation:` values, but for `n`
    and `logprobs`, which shape the response: those are the client's (1 and none unless asked)."""
    max_tokens = _int(body, max_tokens_field, None, lo=1)
    try:  # the length rule (frontend.requests): a server refuses what does not fit rather than stop short of it
        check_length(prompt_len, max_tokens or 1, model.max_model_len, over_length="refuse",
                     prompt_field=prompt_field, max_tokens_field=max_tokens_field)
    except LengthError as exc:
        raise APIError(400, str(exc), exc.field, code="context_length_exceeded") from None
    max_new_tokens = max_tokens if max_tokens is not None else min(model.defaults.max_new_tokens,
                                                                   model.max_model_len - prompt_len)
    d = model.defaults
    stop_ids = body.get("stop_token_ids") or []
    if not isinstance(stop_ids, list) or not all(is_int(t) and 0 <= t < model.vocab_size for t in stop_ids):
        raise APIError(400, f"stop_token_ids must be a list of token ids in [0, {model.vocab_size})", "stop_token_ids")
    n = _sampling_field(body, "n", 1)
    if model.max_n is not None and n > model.max_n:
        raise APIError(400, invalid_value("n", n, f"an int in [1, {model.max_n}] (the engine slots and waiting places "
                                                  "of a replica: its choices run at once)"), "n")
    min_tokens = _sampling_field(body, "min_tokens", d.min_tokens)
    if min_tokens > max_new_tokens:
        raise APIError(400, invalid_value("min_tokens", min_tokens, f"an int <= {max_tokens_field} ({max_new_tokens})"),
                       "min_tokens")
    try:
        return SamplingParams(
            max_new_tokens=max_new_tokens,
            temperature=float(_sampling_field(body, "temperature", d.temperature)),
            top_p=float(_sampling_field(body, "top_p", d.top_p)),
            top_k=max(_int(body, "top_k", d.top_k, lo=-1), 0),  # -1 (vLLM's "off") == 0
            seed=_sampling_field(body, "seed", None),
            stop_token_ids=tuple(dict.fromkeys([*d.stop_token_ids, *stop_ids])),
            ignore_eos=_bool(body, "ignore_eos", d.ignore_eos),
            stop=_stop_strings(body, d.stop),
            include_stop_str_in_output=_bool(body, "include_stop_str_in_output", d.include_stop_str_in_output),
            n=n, logprobs=_logprobs(body, kind), min_tokens=min_tokens,
            **{name: float(_sampling_field(body, name, getattr(d, name))) for name in PENALTIES},
            **_constraints(body, model))
    except ValueError as exc:  # SamplingParams.validate: a backstop, the checks above come first
        raise APIError(400, str(exc)) from None


def _constraints(body: dict, model: ModelSpec) -> dict:
    """SamplingParams' constraint fields from OpenAI's `response_format` (json_schema, json_object, text), vLLM's
    `structured_outputs` (or its `guided_*` fields), `logit_bias` and `allowed_token_ids`; checked here, the grammar
    compiled once (`frontend.constraints`, cached by its text), so a bad one is a 400 naming its field."""
    given = [name for name in ("response_format", "structured_outputs", *GUIDED) if body.get(name) is not None
             and body.get(name) != {"type": "text"}]
    if len(given) > 1:
        raise APIError(400, f"give one of {', '.join(given)}: each constrains the whole output", given[1])
    field, structured = (given[0] if given else None), None
    if field == "response_format":
        structured = _response_format(body[field])
    elif field == "structured_outputs":
        structured = body[field]
    elif field is not None:
        structured = {GUIDED[field]: body[field]}
    out = {"structured_outputs": structured, "logit_bias": body.get("logit_bias") or None,
           "allowed_token_ids": body.get("allowed_token_ids")}
    for name, value in out.items():  # each alone, so a 400 names the field at fault
        if value is None:
            continue
        try:
            params = SamplingParams(**{name: value})
            if name == "structured_outputs":
                row_constraint(params, model.tokenizer, model.eos_token_ids)
        except ValueError as exc:
            raise APIError(400, str(exc).removeprefix("sampling parameter "), field if name == "structured_outputs"
                           else name) from None
        if outside := params.outside_vocab(model.vocab_size):
            raise APIError(400, outside, name)
    return out


def _response_format(value) -> dict | None:
    """OpenAI's response_format -> structured_outputs: {"type": "json_schema", "json_schema": {"schema": ...}},
    {"type": "json_object"} or {"type": "text"} (none)."""
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema" and isinstance(value.get("json_schema"), dict) and "schema" in value["json_schema"]:
        return {"json": value["json_schema"]["schema"]}
    raise APIError(400, f"response_format={value!r} is invalid: expected {{\"type\": \"json_schema\", \"json_schema\": "
                        "{\"name\": ..., \"schema\": {...}}}, {\"type\": \"json_object\"} or {\"type\": \"text\"}",
                   "response_format")


def _stop_strings(body: dict, defaults: tuple[str, ...]) -> tuple[str, ...]:
    """The config's stop strings and the request's (as stop_token_ids merge), one rule for both."""
    stop = body.get("stop")
    stop = [] if stop is None else [stop] if isinstance(stop, str) else stop
    merged = stop if not isinstance(stop, list) else list(dict.fromkeys([*defaults, *stop]))
    ok, expected = SAMPLING_CHECKS["stop"]
    if not ok(merged):
        raise APIError(400, invalid_value("stop", body.get("stop"), "a string or " + expected
                                          + (f" (with the config's {len(defaults)})" if defaults else "")), "stop")
    return tuple(merged)


def _logprobs(body: dict, kind: str) -> int | None:
    """SamplingParams.logprobs: completions' `logprobs` N (vLLM's range), or chat's `logprobs` (true or false)
    with `top_logprobs` N."""
    if kind == "completion":
        return _sampling_field(body, "logprobs", None)
    wanted, top = _bool(body, "logprobs", False), body.get("top_logprobs")
    if top is not None and not (is_int(top) and 0 <= top <= MAX_LOGPROBS):
        raise APIError(400, invalid_value("top_logprobs", top, f"null or an int in [0, {MAX_LOGPROBS}]"),
                       "top_logprobs")
    if top and not wanted:
        raise APIError(400, "top_logprobs needs logprobs: true", "top_logprobs")
    return (top or 0) if wanted else None


def _int(body: dict, name: str, default, *, lo: int):
    x = body.get(name)
    if x is None:
        return default
    if not is_int(x) or x < lo:
        raise APIError(400, f"{name} must be an integer >= {lo}, got {x!r}", name)
    return x


def _sampling_field(body: dict, name: str, default):
    """A field whose rule is SamplingParams' own (sampling_params.SAMPLING_CHECKS), as in the config."""
    x = body.get(name)
    if x is None:
        return default
    ok, expected = SAMPLING_CHECKS[name]
    if not ok(x):
        raise APIError(400, invalid_value(name, x, expected), name)
    return x


def _bool(body: dict, name: str, default: bool, param: str | None = None) -> bool:
    x = body.get(name)
    if x is None:
        return default
    if not isinstance(x, bool):
        raise APIError(400, f"{param or name} must be true or false, got {x!r}", param or name)
    return x
