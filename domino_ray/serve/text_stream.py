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
from domino_ray.serve.openai_api import APIError, ParsedRequest
from domino_ray.spec.stats import RowStats


@dataclass
class Piece:
    text: str                  # new text for the client ('' while a stop string may be forming)
    finish_reason: str | None  # set on the last piece: "stop" | "length"
    completion: Completion | None  # set on the last piece; cut after a stop string (tokens and stats)
    num_tokens: int            # completion tokens so far, as usage counts them (the returned text's tokens)
    stats: RowStats            # the request's statistics for those tokens


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
