"""The OpenAI-compatible API, Ray-free: request parsing, one request's text stream, response bodies.

- `parse_request` turns the JSON body of `POST /v1/completions` or `/v1/chat/completions` into token
  ids, `SamplingParams` and stop strings, or raises `APIError` (a 4xx with an OpenAI-style body whose
  `param` names the field). Fields we do not implement are refused unless they hold their neutral
  value, so nothing a client asks for is silently ignored.
- `generate` submits the request to an `EngineLoop` and yields text `Piece`s as the engine commits
  tokens: incremental detokenization, stop strings matched on the text (the engine only knows stop
  token ids), and an engine abort when the text stops early or the consumer goes away.
- `response_body` / `chunk_body` build responses and stream chunks; both carry `usage` and the
  request's acceptance statistics in `speculative_decoding_stats` (DESIGN.md §5 names).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any, AsyncIterator

from domino_ray.engine import Completion, Request
from domino_ray.engine_loop import EngineDead, EngineLoop, QueueFull
from domino_ray.sampling_params import SAMPLING_CHECKS, SamplingParams, invalid_value, is_int
from domino_ray.stats import RowStats
from domino_ray.target import encode_prompt

MAX_STOP_STRINGS = 16
SSE_DONE = "data: [DONE]\n\n"

# Fields we accept only at a neutral value (OpenAI features this server does not implement).
NEUTRAL = {
    "presence_penalty": (0, None), "frequency_penalty": (0, None), "logit_bias": (None, {}),
    "logprobs": (None, False), "top_logprobs": (None, 0), "echo": (None, False), "suffix": (None,),
    "best_of": (None, 1), "tools": (None, []), "tool_choice": (None, "none"), "parallel_tool_calls": (None, True, False),
    "response_format": (None, {"type": "text"}), "user": None, "metadata": None, "store": (None, False),
}
COMMON = {"model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "n", "stream", "stream_options",
          "ignore_eos", "stop_token_ids"}
FIELDS = {"completion": COMMON | {"prompt"},
          "chat": COMMON | {"messages", "max_completion_tokens", "chat_template_kwargs"}}


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
    """What request parsing needs to know about the served model."""
    name: str                  # the id clients send as `model`
    tokenizer: Any
    vocab_size: int            # token ids in prompts must be below this
    max_model_len: int         # prompt + generated tokens
    defaults: SamplingParams = SamplingParams()  # for fields a request leaves out (config `generation:`)
    enable_thinking: bool = False  # chat template default (Qwen3 thinking off)
    parse_special_tokens: bool = False  # special-token strings in prompt/content text become control ids


@dataclass
class ParsedRequest:
    kind: str                  # "completion" | "chat"
    prompt_token_ids: list[int]
    params: SamplingParams
    stop: tuple[str, ...]      # stop strings, matched on the generated text
    stream: bool
    include_usage: bool = False  # stream_options.include_usage: usage in a last chunk with no choices


@dataclass
class Piece:
    text: str                  # new text for the client ('' while a stop string may be forming)
    finish_reason: str | None  # set on the last piece: "stop" | "length"
    completion: Completion | None  # set on the last piece; cut after a stop string (tokens and stats)
    num_tokens: int            # completion tokens so far, as usage counts them (the returned text's tokens)
    stats: RowStats            # the request's statistics for those tokens


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
    if body.get("n") not in (None, 1):
        raise APIError(400, f"n={body['n']!r}: only n=1 is supported", "n")
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
                         params=_sampling(body, model, len(ids), prompt_field, max_tokens_field),
                         stop=_stop_strings(body), stream=stream,
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


def _sampling(body: dict, model: ModelSpec, prompt_len: int, prompt_field: str, max_tokens_field: str
              ) -> SamplingParams:
    room = model.max_model_len - prompt_len
    if room < 1:
        raise APIError(400, f"{prompt_field} has {prompt_len} tokens; this model's limit is {model.max_model_len} "
                            f"tokens for prompt and completion together, so at most {model.max_model_len - 1} "
                            "prompt tokens fit", prompt_field, code="context_length_exceeded")
    max_tokens = _int(body, max_tokens_field, None, lo=1)
    if max_tokens is not None and max_tokens > room:
        raise APIError(400, f"{prompt_field} ({prompt_len} tokens) + {max_tokens_field} ({max_tokens}) exceeds this "
                            f"model's limit of {model.max_model_len} tokens: at most {room} completion tokens fit "
                            "after this prompt", max_tokens_field, code="context_length_exceeded")
    d = model.defaults
    stop_ids = body.get("stop_token_ids") or []
    if not isinstance(stop_ids, list) or not all(is_int(t) and 0 <= t < model.vocab_size for t in stop_ids):
        raise APIError(400, f"stop_token_ids must be a list of token ids in [0, {model.vocab_size})", "stop_token_ids")
    try:
        return SamplingParams(
            max_new_tokens=max_tokens if max_tokens is not None else min(d.max_new_tokens, room),
            temperature=float(_sampling_field(body, "temperature", d.temperature)),
            top_p=float(_sampling_field(body, "top_p", d.top_p)),
            top_k=max(_int(body, "top_k", d.top_k, lo=-1), 0),  # -1 (vLLM's "off") == 0
            seed=_sampling_field(body, "seed", None),
            stop_token_ids=tuple(dict.fromkeys([*d.stop_token_ids, *stop_ids])),
            ignore_eos=_bool(body, "ignore_eos", d.ignore_eos))
    except ValueError as exc:  # SamplingParams.validate: a backstop, the checks above come first
        raise APIError(400, str(exc)) from None


def _stop_strings(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    stop = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise APIError(400, "stop must be a non-empty string or a list of non-empty strings", "stop")
    if len(stop) > MAX_STOP_STRINGS:
        raise APIError(400, f"stop holds {len(stop)} strings; at most {MAX_STOP_STRINGS} are allowed", "stop")
    return tuple(stop)


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


# ---- one request's text ----------------------------------------------------------------------------

class TextStream:
    """Incremental detokenization with stop strings.

    The concatenated output equals `tokenizer.decode(all_ids, skip_special_tokens=True)` cut before the
    first stop string. Each push decodes only a short window (vLLM's prefix/read offsets), so the cost
    per step does not grow with the output. Text that could be the start of a stop string is held back
    until it cannot be.
    """

    def __init__(self, tokenizer, stop: tuple[str, ...] = ()):
        self.tokenizer, self.stop = tokenizer, stop
        self.ids: list[int] = []
        self.prefix_offset = self.read_offset = 0  # ids[prefix:read] decoded last time; ids[read:] are new
        self.text = ""
        self.sent = 0              # chars of `text` already returned
        self.stopped = False       # a stop string matched; `text` ends before it
        self.num_kept_ids = 0      # once stopped: the ids up to the one that completed the stop string

    def push(self, token_ids: list[int], final: bool = False) -> str:
        """Add tokens; return the text that can now be released (all of it when `final`)."""
        if self.stopped:
            return ""
        decoded_before = self.prefix_offset  # ids before this one are already part of `text`
        self.ids.extend(token_ids)
        new = self._decode_new(final)
        if new:
            start = max(0, len(self.text) - max(map(len, self.stop), default=0) + 1)
            self.text += new
            hits = [(i, s) for i, s in ((self.text.find(s, start), s) for s in self.stop) if i >= 0]
            if hits:
                at, stop = min(hits)
                self.num_kept_ids = self._ids_through(self.text[:at + len(stop)], decoded_before)
                self.text, self.stopped = self.text[:at], True
                return self._release(len(self.text))
        return self._release(len(self.text) - (0 if final else self._held()))

    def finish(self) -> str:
        """No more tokens: release what was held back (a trailing partial character included)."""
        return self.push([], final=True)

    def _decode_new(self, final: bool) -> str:
        decode = self.tokenizer.decode
        before = decode(self.ids[self.prefix_offset:self.read_offset], skip_special_tokens=True)
        after = decode(self.ids[self.prefix_offset:], skip_special_tokens=True)
        if len(after) <= len(before) or (after.endswith("\ufffd") and not final):  # maybe a partial UTF-8 char
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return after[len(before):]

    def _ids_through(self, text: str, lo: int) -> int:
        """The fewest ids whose decode starts with `text` (at least `lo + 1`): the stop string's last token."""
        for n in range(lo + 1, len(self.ids) + 1):
            if self.tokenizer.decode(self.ids[:n], skip_special_tokens=True).startswith(text):
                return n
        return len(self.ids)

    def _held(self) -> int:
        """Length of the longest end of `text` that is a proper prefix of a stop string."""
        return max((h for s in self.stop for h in range(min(len(s) - 1, len(self.text)), 0, -1)
                    if self.text.endswith(s[:h])), default=0)

    def _release(self, upto: int) -> str:
        upto = max(upto, self.sent)
        out, self.sent = self.text[self.sent:upto], upto
        return out


async def generate(loop: EngineLoop, request_id: str, parsed: ParsedRequest, tokenizer) -> AsyncIterator[Piece]:
    """Run one request on the engine loop, yielding a Piece per engine event; the last one finishes.

    Raises APIError: 429 when the loop's queue is full, 503 when the engine is dead. If the consumer
    stops early (client disconnect, cancellation) the request is aborted, which frees its slot.
    """
    try:
        stream = loop.submit(Request(request_id, parsed.prompt_token_ids, parsed.params))
    except QueueFull as exc:
        raise APIError(429, f"server is at capacity ({exc}); retry later", type="rate_limit_error",
                       code="queue_full") from None
    except EngineDead as exc:
        raise APIError(503, str(exc), type="server_error", code="engine_unavailable") from None
    text, finished = TextStream(tokenizer, parsed.stop), False
    counts, snapshots = [0], []  # after each engine event: tokens committed, statistics (one step per event)
    kept: tuple[int, RowStats] | None = None  # once a stop string matched: the tokens and stats usage counts
    try:
        async for update in stream.events():
            done = update.completion
            if kept is not None:  # the text already ended at a stop string; wait for the abort to land
                if done is not None:
                    finished = True
                    yield Piece("", "stop", _cut(done, *kept), *kept)
                    return
                continue
            if not snapshots:
                snapshots.append(RowStats(update.stats.num_spec_tokens))
            counts.append(counts[-1] + len(update.new_token_ids))
            snapshots.append(update.stats)
            ids = update.new_token_ids
            if done is not None and done.finish_reason == "stop":
                ids = ids[:-1]  # the stop token ends the row but is not text
            delta = text.push(ids, final=done is not None)
            if text.stopped:
                kept = text.num_kept_ids, stats_through(text.num_kept_ids, counts, snapshots)
                if done is None:
                    loop.abort(request_id)
                    yield Piece(delta, None, None, *kept)
                    continue
                done = _cut(done, *kept)
            if done is not None:
                finished = True
                yield Piece(delta, "stop" if text.stopped else done.finish_reason, done, len(done.token_ids),
                            done.stats)
                return
            yield Piece(delta, None, None, counts[-1], update.stats)
    except ValueError as exc:  # the engine refused the request (checks it makes beyond ours)
        raise APIError(400, str(exc)) from None
    except EngineDead as exc:
        raise APIError(503, str(exc), type="server_error", code="engine_unavailable") from None
    finally:
        if not finished:
            loop.abort(request_id)


def stats_through(num_tokens: int, counts: list[int], snapshots: list[RowStats]) -> RowStats:
    """The statistics of a request's first `num_tokens` tokens, from the running statistics after each
    engine event (`counts[i]` tokens, `snapshots[i]`; index 0 = nothing yet). The cut step counts as the
    engine counts a stop token inside an accepted block: the drafts before the cut are accepted, the cut
    token is the step's last, and the step's drafted count stays."""
    event = next(i for i in range(1, len(counts)) if counts[i] >= num_tokens)
    before, after = snapshots[event - 1], snapshots[event]
    stats = before.copy()
    if after.num_spec_steps > before.num_spec_steps:  # a verify step (the prefill's first token is not one)
        width = next(w for w, (a, b) in enumerate(zip(after.verify_width_histogram, before.verify_width_histogram))
                     if a > b)
        stats.observe_step(after.num_draft_tokens - before.num_draft_tokens, num_tokens - counts[event - 1] - 1,
                           width)
    return stats


def _cut(completion: Completion, num_tokens: int, stats: RowStats) -> Completion:
    return dataclasses.replace(completion, token_ids=completion.token_ids[:num_tokens], finish_reason="stop",
                               stats=stats)


# ---- responses -------------------------------------------------------------------------------------

def usage(completion: Completion) -> dict:
    prompt, generated = len(completion.prompt_token_ids), len(completion.token_ids)
    return {"prompt_tokens": prompt, "completion_tokens": generated, "total_tokens": prompt + generated}


def spec_stats(completion: Completion) -> dict:
    """The request's acceptance statistics and timings (DESIGN.md §5 names)."""
    return {**completion.stats.to_columns(), "time_to_first_token_s": completion.time_to_first_token_s,
            "time_taken_llm_s": completion.time_taken_s}


def response_body(parsed: ParsedRequest, response_id: str, created: int, model: str, text: str,
                  finish_reason: str, completion: Completion) -> dict:
    if parsed.kind == "completion":
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        obj = "text_completion"
    else:
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                  "finish_reason": finish_reason}
        obj = "chat.completion"
    return {"id": response_id, "object": obj, "created": created, "model": model, "choices": [choice],
            "usage": usage(completion), "speculative_decoding_stats": spec_stats(completion)}


def chunk_body(parsed: ParsedRequest, response_id: str, created: int, model: str, text: str, *,
               first: bool = False, finish_reason: str | None = None, completion: Completion | None = None) -> dict:
    """One stream chunk; given `completion` (the finishing chunk, unless include_usage) it also carries usage
    and statistics."""
    if parsed.kind == "completion":
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        obj = "text_completion"
    else:
        delta = {"role": "assistant", "content": text} if first else ({"content": text} if text else {})
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        obj = "chat.completion.chunk"
    chunk = {"id": response_id, "object": obj, "created": created, "model": model, "choices": [choice]}
    if completion is not None:
        chunk["usage"] = usage(completion)
        chunk["speculative_decoding_stats"] = spec_stats(completion)
    return chunk


def usage_chunk_body(parsed: ParsedRequest, response_id: str, created: int, model: str,
                     completion: Completion) -> dict:
    """The extra last chunk of `stream_options.include_usage`: no choices, usage and statistics (as OpenAI)."""
    obj = "text_completion" if parsed.kind == "completion" else "chat.completion.chunk"
    return {"id": response_id, "object": obj, "created": created, "model": model, "choices": [],
            "usage": usage(completion), "speculative_decoding_stats": spec_stats(completion)}


def sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


def models_body(model: ModelSpec, created: int) -> dict:
    return {"object": "list", "data": [{"id": model.name, "object": "model", "created": created,
                                        "owned_by": "domino-ray", "max_model_len": model.max_model_len}]}
