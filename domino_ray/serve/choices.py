"""One request's n choices, Ray-free: `generate` submits a parsed request (openai_api.py) to an `EngineLoop` as n
engine requests, one per choice (built by `frontend.requests`), and yields text `Piece`s of all of them as the
engine commits tokens: incremental detokenization (`TextStream`), the text held back while a stop string may be
forming, and an engine abort of every unfinished choice when the consumer goes away.

Stop strings end a row inside the engine (the request carries a `StopStrings` matcher): on the step its string
completes, later tokens of that step dropped, so the tokens, statistics and log-probabilities the engine reports
are already those of the returned text, and the row frees its slot at once.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import AsyncIterator

from domino_ray.engine.loop import EngineDead, EngineLoop, QueueFull, RequestStream
from domino_ray.engine.request import Completion, Request, TokenLogprobs
from domino_ray.frontend.detokenizer import TextStream
from domino_ray.frontend.requests import prompt_requests
from domino_ray.serve.openai_api import APIError, ModelSpec, ParsedRequest
from domino_ray.sample.params import SamplingParams
from domino_ray.spec_decode.stats import RowStats


@dataclass
class Piece:
    index: int                 # the choice, 0..n-1
    text: str                  # new text for the client ('' while a stop string may be forming)
    finish_reason: str | None  # set on the choice's last piece: "stop" | "length"
    completion: Completion | None  # set on the choice's last piece
    num_tokens: int            # the choice's completion tokens so far, as usage counts them
    stats: RowStats            # the choice's statistics for those tokens
    logprobs: list[TokenLogprobs] | None = None  # of the tokens whose text this piece releases (when asked)


async def generate(loop: EngineLoop, response_id: str, parsed: ParsedRequest, model: ModelSpec
                   ) -> AsyncIterator[Piece]:
    """Run the request's n choices on the engine loop at once, yielding their Pieces as they come; it ends once
    every choice has its last piece.

    Raises APIError: 429 when the loop's queue cannot hold the n requests, 503 when the engine is dead, 400 when
    the engine refuses one. If the consumer stops early (client disconnect, cancellation) or a choice fails, the
    unfinished choices are aborted, which frees their slots.
    """
    try:  # parse_request applied the same rules (naming the client's fields): this refuses nothing it let through
        requests = prompt_requests(response_id, parsed.prompt_token_ids, parsed.params, tokenizer=model.tokenizer,
                                   max_model_len=model.max_model_len, over_length="refuse",
                                   eos_token_ids=model.eos_token_ids)
    except ValueError as exc:
        raise APIError(400, str(exc)) from None
    n = len(requests)
    finished: set[int] = set()
    streams: list[RequestStream] = []
    pumps: list[asyncio.Task] = []
    try:
        for request in requests:  # all before the first await: a full queue refuses them all
            streams.append(_submit(loop, request))
        queue: asyncio.Queue = asyncio.Queue()
        pumps = [asyncio.create_task(_pump(_choice(i, stream, requests[i].params, model), queue))
                 for i, stream in enumerate(streams)]
        while len(finished) < n:
            item = await queue.get()
            if isinstance(item, BaseException):
                raise item
            if item.completion is not None:
                finished.add(item.index)
            yield item
    finally:
        for i in range(len(streams)):
            if i not in finished:
                loop.abort(requests[i].request_id)
        for task in pumps:
            task.cancel()
        await asyncio.gather(*pumps, return_exceptions=True)


def _submit(loop: EngineLoop, request: Request) -> RequestStream:
    try:
        return loop.submit(request)
    except QueueFull as exc:
        raise APIError(429, f"server is at capacity ({exc}); retry later", type="rate_limit_error",
                       code="queue_full") from None
    except EngineDead as exc:
        raise APIError(503, str(exc), type="server_error", code="engine_unavailable") from None


async def _pump(pieces: AsyncIterator[Piece], queue: asyncio.Queue):
    try:
        async for piece in pieces:
            queue.put_nowait(piece)
    except BaseException as exc:  # the consumer raises it (a cancelled pump's is nobody's concern)
        queue.put_nowait(exc)
        raise


async def _choice(index: int, stream: RequestStream, params: SamplingParams, model: ModelSpec
                  ) -> AsyncIterator[Piece]:
    """One choice's Pieces, one per engine event. Log-probabilities travel with the text: those of tokens whose
    text is held back (a stop string may be forming) wait for the next piece that releases text, or the last."""
    text, stop_ids = TextStream(model.tokenizer, params.stop, params.min_tokens), params.stop_ids(model.eos_token_ids)
    count, held = 0, []
    try:
        async for update in stream.events():
            done, ids = update.completion, update.new_token_ids
            count += len(ids)
            if params.logprobs is not None:
                held += update.new_logprobs
            if done is not None and done.finish_reason == "stop" and ids and ids[-1] in stop_ids:
                ids = ids[:-1]  # the stop token ends the row but is not text
            delta = text.push(ids, final=done is not None)
            if done is not None and text.stopped and params.include_stop_str_in_output:
                delta += text.matched
            logprobs = None
            if params.logprobs is not None and (delta or done is not None):
                logprobs, held = held, []
            yield Piece(index, delta, None if done is None else done.finish_reason, done, count, update.stats,
                        logprobs)
    except ValueError as exc:  # the engine refused the request (checks it makes beyond ours)
        raise APIError(400, str(exc)) from None
    except EngineDead as exc:
        raise APIError(503, str(exc), type="server_error", code="engine_unavailable") from None
