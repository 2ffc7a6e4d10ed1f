"""One request's text, Ray-free: `generate` submits a parsed request (openai_api.py) to an `EngineLoop`
and yields text `Piece`s as the engine commits tokens: incremental detokenization (`TextStream`), stop
strings matched on the text (the engine only knows stop token ids), and an engine abort when the text
stops early or the consumer goes away.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import AsyncIterator

from domino_ray.engine.loop import EngineDead, EngineLoop, QueueFull
from domino_ray.engine.request import Completion, Request
from domino_ray.model.text_stream import TextStream
from domino_ray.serve.openai_api import APIError, ParsedRequest
from domino_ray.spec.stats import RowStats


@dataclass
class Piece:
    text: str                  # new text for the client ('' while a stop string may be forming)
    finish_reason: str | None  # set on the last piece: "stop" | "length"
    completion: Completion | None  # set on the last piece; cut after a stop string (tokens and stats)
    num_tokens: int            # completion tokens so far, as usage counts them (the returned text's tokens)
    stats: RowStats            # the request's statistics for those tokens


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
