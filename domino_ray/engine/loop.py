"""Run one SpecEngine continuously on a background thread; submit requests from anywhere.

The engine is not thread-safe, so exactly one thread (this loop) touches it. Callers (a Ray Data
actor's concurrent batches, a Serve replica's concurrent HTTP requests) hand requests and aborts
over a queue and receive each request's events on an asyncio queue of their own event loop. New
requests join the running batch as slots free up: continuous batching across callers.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from dataclasses import dataclass
from typing import AsyncIterator, Hashable

from domino_ray.engine.request import Completion, Request, StepEvent
from domino_ray.engine.core import SpecEngine
from domino_ray.spec_decode.stats import RowStats


class QueueFull(RuntimeError):
    """More requests are waiting than the loop was configured to hold."""


class EngineDead(RuntimeError):
    """The engine loop stopped after an error; the process should be replaced."""


@dataclass(frozen=True)
class Update:
    """One engine event of a request plus a copy of its statistics right after that step: the engine keeps
    counting, and a consumer that cuts the output short (a stop string) must count only what it keeps."""
    request_id: Hashable
    new_token_ids: list[int]
    completion: Completion | None
    stats: RowStats
    new_logprobs: list | None = None  # StepEvent.new_logprobs: for new_token_ids, when the request asks


class RequestStream:
    """Events of one request, delivered on the event loop that submitted it."""

    def __init__(self, request_id: Hashable, loop: asyncio.AbstractEventLoop):
        self.request_id = request_id
        self._loop = loop
        self._queue: asyncio.Queue = asyncio.Queue()

    def _put(self, item):  # called on the engine thread
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)
        except RuntimeError:  # the caller's event loop is closed: it wants nothing more
            pass

    async def events(self) -> AsyncIterator[Update]:
        """Yield events until the request finishes; raises what the engine raised for it."""
        while True:
            item = await self._queue.get()
            if isinstance(item, BaseException):
                raise item
            yield item
            if item.completion is not None:
                return

    async def completion(self) -> Completion:
        async for event in self.events():
            if event.completion is not None:
                return event.completion
        raise EngineDead(f"request {self.request_id!r} ended without a completion")


class EngineLoop:
    def __init__(self, engine: SpecEngine, *, max_waiting: int | None = None, idle_wait_s: float = 0.05):
        self.engine = engine
        self.max_waiting = max_waiting        # requests submitted but not yet running; None = unbounded
        self.idle_wait_s = idle_wait_s
        self.error: BaseException | None = None
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[Hashable, RequestStream] = {}
        self._lock = threading.Lock()         # guards _streams, touched by callers and the loop
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="domino-engine-loop", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    def num_waiting(self) -> int:
        # Requests beyond the engine's slots. Not `len(engine.rows)`: the engine admits only at its next
        # step, so a burst into free slots would count as waiting (and be refused) for a moment.
        return max(0, len(self._streams) - self.engine.max_rows)

    def submit(self, request: Request, loop: asyncio.AbstractEventLoop | None = None) -> RequestStream:
        """Queue a request; raises EngineDead, QueueFull, or ValueError for a duplicate id."""
        if not self.alive:
            raise EngineDead(f"engine loop is not running: {self.error!r}")
        stream = RequestStream(request.request_id, loop or asyncio.get_running_loop())
        with self._lock:
            if request.request_id in self._streams:
                raise ValueError(f"request_id {request.request_id!r} is already running")
            if self.max_waiting is not None and self.num_waiting() >= self.max_waiting:
                raise QueueFull(f"{self.num_waiting()} requests are already waiting (limit {self.max_waiting})")
            self._streams[request.request_id] = stream
        self._inbox.put(("add", request))
        return stream

    def abort(self, request_id: Hashable):
        """Stop a request (a client went away); its slot is freed at the next step."""
        self._inbox.put(("abort", request_id))

    def stop(self, timeout: float = 10.0):
        self._stopped.set()
        self._inbox.put(("stop", None))
        self._thread.join(timeout)

    # ---- the engine thread ----------------------------------------------------------------------

    def _run(self):
        try:
            while not self._stopped.is_set():
                self._drain_inbox(block=not self.engine.has_unfinished())
                if self.engine.has_unfinished():
                    events = self.engine.step()
                    for event, stats in zip(events, self._stats_per_event(events)):
                        self._deliver(event, stats)
        except BaseException as exc:  # the engine is in an unknown state: fail every request, stop
            self.error = exc
            with self._lock:
                streams, self._streams = list(self._streams.values()), {}
            for stream in streams:
                stream._put(EngineDead(f"engine loop failed: {exc!r}"))

    def _drain_inbox(self, block: bool):
        try:
            item = self._inbox.get(timeout=self.idle_wait_s) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            kind, payload = item
            if kind == "add":
                self._add(payload)
            elif kind == "abort":
                self._abort(payload)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _add(self, request: Request):
        try:
            self.engine.add_request(request)
        except Exception as exc:  # noqa: BLE001
            # add_request only checks the request and queues it, so whatever it raises (a ValueError, or
            # e.g. torch's RuntimeError for a seed it refuses) is this request's fault: it fails alone and
            # the engine goes on. Errors inside engine.step() stay fatal (_run).
            with self._lock:
                stream = self._streams.pop(request.request_id, None)
            if stream:
                stream._put(exc)

    def _abort(self, request_id: Hashable):
        if self.engine.abort(request_id) and not any(r.request.request_id == request_id for r in self.engine.rows):
            with self._lock:  # it was still pending: no completion event will come from the engine
                stream = self._streams.pop(request_id, None)
            if stream:
                stream._put(asyncio.CancelledError(f"request {request_id!r} aborted"))

    def _stats_per_event(self, events: list[StepEvent]) -> list[RowStats]:
        """Each event's statistics (copies). A request's last event of the step has its statistics after the
        step; an earlier one in the same step can only be its prefill token, before any verify step."""
        live = {row.request.request_id: row.stats for row in self.engine.rows}
        last = {e.request_id: e for e in events}
        after = {rid: e.completion.stats if e.completion is not None else live[rid] for rid, e in last.items()}
        return [after[e.request_id].copy() if last[e.request_id] is e else RowStats(after[e.request_id].num_spec_tokens)
                for e in events]

    def _deliver(self, event: StepEvent, stats: RowStats):
        with self._lock:
            stream = self._streams.get(event.request_id)
            if stream is not None and event.completion is not None:
                del self._streams[event.request_id]
        if stream is not None:
            stream._put(Update(event.request_id, event.new_token_ids, event.completion, stats, event.new_logprobs))
