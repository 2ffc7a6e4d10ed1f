"""The OpenAI-compatible API's response bodies and stream chunks, Ray-free.

A request of `n` choices ran as n engine requests (`SamplingParams.for_sample`): a body holds their choices
(index 0..n-1), `usage` (the prompt once, the choices' generated tokens summed) and the acceptance statistics in
`speculative_decoding_stats` (DESIGN.md §5 names; summed over the choices when n > 1).

Log-probabilities come from the engine as `TokenLogprobs` per generated token (the token's (id, logprob), then
the top N) and leave in OpenAI's shapes: chat `{"content": [{token, logprob, bytes, top_logprobs: [...]}]}`,
completions `{tokens, token_logprobs, top_logprobs: [{token: logprob}], text_offset}`. A token's string is the
tokenizer's decode of its id alone (vLLM's choice), so a special token shows as itself and a token holding part
of a UTF-8 character as U+FFFD; `text_offset` adds up those strings' lengths (vLLM's too).
"""

from __future__ import annotations

import json

from domino_ray.engine.request import Completion, TokenLogprobs
from domino_ray.serve.openai_api import ModelSpec, ParsedRequest
from domino_ray.spec_decode.stats import total_stats

SSE_DONE = "data: [DONE]\n\n"
MIN_LOGPROB = -9999.0  # what -inf becomes (vLLM's floor): JSON has no infinity


def usage(completions: list[Completion]) -> dict:
    prompt, generated = len(completions[0].prompt_token_ids), sum(len(c.token_ids) for c in completions)
    return {"prompt_tokens": prompt, "completion_tokens": generated, "total_tokens": prompt + generated}


def spec_stats(completions: list[Completion]) -> dict:
    """The request's acceptance statistics and timings: its one row's, or the sum of its choices' rows with the
    first choice's first token and the last choice's end."""
    stats = completions[0].stats if len(completions) == 1 else total_stats(c.stats for c in completions)
    return {**stats.to_columns(), "time_to_first_token_s": min(c.time_to_first_token_s for c in completions),
            "time_taken_llm_s": max(c.time_taken_s for c in completions)}


def response_body(parsed: ParsedRequest, response_id: str, created: int, model: ModelSpec, texts: list[str],
                  finish_reasons: list[str], completions: list[Completion]) -> dict:
    choices = []
    for index, (text, finish_reason, completion) in enumerate(zip(texts, finish_reasons, completions)):
        logprobs = logprobs_body(parsed.kind, model.tokenizer, completion.logprobs)
        if parsed.kind == "completion":
            choices.append({"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason})
        else:
            choices.append({"index": index, "message": {"role": "assistant", "content": text}, "logprobs": logprobs,
                            "finish_reason": finish_reason})
    obj = "text_completion" if parsed.kind == "completion" else "chat.completion"
    return {"id": response_id, "object": obj, "created": created, "model": model.name, "choices": choices,
            "usage": usage(completions), "speculative_decoding_stats": spec_stats(completions)}


def chunk_body(parsed: ParsedRequest, response_id: str, created: int, model: str, index: int, text: str, *,
               first: bool = False, finish_reason: str | None = None, logprobs: dict | None = None,
               completions: list[Completion] | None = None) -> dict:
    """One stream chunk of choice `index` (`first`: the choice's first, which names the chat role); given
    `completions` (the last finishing chunk, unless include_usage) it also carries usage and statistics."""
    if parsed.kind == "completion":
        choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
        obj = "text_completion"
    else:
        delta = {"role": "assistant", "content": text} if first else ({"content": text} if text else {})
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        obj = "chat.completion.chunk"
    chunk = {"id": response_id, "object": obj, "created": created, "model": model, "choices": [choice]}
    if completions is not None:
        chunk["usage"] = usage(completions)
        chunk["speculative_decoding_stats"] = spec_stats(completions)
    return chunk


def usage_chunk_body(parsed: ParsedRequest, response_id: str, created: int, model: str,
                     completions: list[Completion]) -> dict:
    """The extra last chunk of `stream_options.include_usage`: no choices, usage and statistics (as OpenAI)."""
    obj = "text_completion" if parsed.kind == "completion" else "chat.completion.chunk"
    return {"id": response_id, "object": obj, "created": created, "model": model, "choices": [],
            "usage": usage(completions), "speculative_decoding_stats": spec_stats(completions)}


def logprobs_body(kind: str, tokenizer, entries: list[TokenLogprobs] | None, text_offset: int = 0) -> dict | None:
    """`choices[i].logprobs` for these tokens (None when the request asked for none); `text_offset`: where the
    first token starts (a stream's chunk continues its choice's earlier chunks)."""
    if entries is None:
        return None
    strings = token_strings(tokenizer, [t for entry in entries for t, _ in entry])
    if kind == "chat":
        def item(token_id, logprob):
            s = strings[token_id]
            return {"token": s, "logprob": max(logprob, MIN_LOGPROB), "bytes": list(s.encode("utf-8"))}
        return {"content": [{**item(*entry[0]), "top_logprobs": [item(*top) for top in entry[1:]]}
                            for entry in entries]}
    tokens = [strings[entry[0][0]] for entry in entries]
    offsets = []
    for s in tokens:
        offsets.append(text_offset)
        text_offset += len(s)
    # OpenAI's legacy shape: the N most likely plus the sampled token (up to N + 1 keys).
    top = [{strings[t]: max(lp, MIN_LOGPROB) for t, lp in [*entry[1:], entry[0]]} for entry in entries]
    return {"tokens": tokens, "token_logprobs": [max(entry[0][1], MIN_LOGPROB) for entry in entries],
            "top_logprobs": top, "text_offset": offsets}


def token_strings(tokenizer, ids: list[int]) -> dict[int, str]:
    unique = list(dict.fromkeys(ids))
    return dict(zip(unique, tokenizer.batch_decode([[t] for t in unique])))


def sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


def models_body(model: ModelSpec, created: int) -> dict:
    return {"object": "list", "data": [{"id": model.name, "object": "model", "created": created,
                                        "owned_by": "domino-ray", "max_model_len": model.max_model_len}]}
