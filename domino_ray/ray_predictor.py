"""The batch job's Ray Data actor: one engine per actor, `pyarrow.Table` batches in, output rows out.

`DominoPredictor` is the `map_batches` callable class (see `ray_batch.py` for the pipeline around it);
`RunStats` is the run's small stats actor (per-actor throughput, engine crashes and their rows).
"""

from __future__ import annotations

import asyncio
import itertools
import os
import socket
import threading
import time

import pyarrow as pa
import ray

from domino_ray.config import JobConfig
from domino_ray.request import Request
from domino_ray.engine_loop import EngineDead
from domino_ray.sampling_params import generation_defaults
from domino_ray.schema import RowError, error_row, ok_row, output_table, read_row, row_params

class RowCrashesEngine(RuntimeError):
    """A row that crashed an engine while it ran alone: the job stops instead of restarting actors forever."""


class DominoPredictor:
    """map_batches callable class: one engine per actor; `pyarrow.Table` in, output rows out.

    Engine crashes (the engine thread died: every row in it is lost) are reported to the run's
    `RunStats` with the ids of the rows that were inside, then the actor exits and Ray restarts it and
    retries its batches. A restarted actor runs those suspect rows one at a time with the engine to
    themselves; a row that crashes the engine alone is named, and the next batch holding it fails the
    job (RowCrashesEngine) rather than looping through actor restarts.
    """

    def __init__(self, cfg: JobConfig, schema: pa.Schema, *, use_draft: bool = True, stats_sink=None):
        started = time.time()
        import torch

        from domino_ray.engine_loop import EngineLoop
        from domino_ray.llm import load_engine

        engine, self.tokenizer = load_engine(cfg.model, cfg.draft if use_draft else None, cfg.generation,
                                             cfg.runtime)
        if engine.device.type == "cpu":
            torch.set_num_threads(max(1, int(cfg.runtime.cpus_per_actor)))  # the CPUs Ray reserved for us
        if engine.slot_report:
            print(f"engine actor {socket.gethostname()}:{os.getpid()}: {engine.slot_report}", flush=True)
        self.loop = EngineLoop(engine)
        self.num_spec_tokens, self.eos_ids = engine.num_spec_tokens, engine.eos_token_ids
        self.cfg, self.schema, self.base = cfg, schema, generation_defaults(cfg.generation)
        self.request_ids = itertools.count()  # engine ids: input ids may repeat across concurrent batches
        self.stats_sink = stats_sink
        # Earlier engine crashes of this run (this actor may be a restart after one).
        crashes = ray.get(stats_sink.crashes.remote()) if stats_sink is not None else {"suspects": [], "culprits": {}}
        self._suspects, self._culprits = set(crashes["suspects"]), crashes["culprits"]
        self._in_engine: dict[int, object] = {}  # engine request id -> row id, for rows inside the engine now
        self._crash_rows: list | None = None      # the rows inside when the engine died
        self._alone = asyncio.Lock()              # held while a suspect row runs with the engine to itself
        self.name = f"{socket.gethostname()}:{os.getpid()}"
        self._lock = threading.Lock()
        self._admission: asyncio.Semaphore | None = None
        self._in_flight, self._busy_since, self._busy_s, self._rows, self._tokens = 0, 0.0, 0.0, 0, 0
        self._peak_in_flight = 0  # > 1 means batches overlapped in the engine (continuous batching across them)
        self._times = {"started_at": started, "load_s": time.time() - started, "first_batch_at": None,
                       "last_batch_done_at": None}

    async def __call__(self, batch: pa.Table):
        # Ray may run several batches of one task at once besides several tasks: admit exactly
        # `max_concurrent_batches` batches into the engine (memory and latency stay bounded).
        if self._admission is None:  # created on the event loop Ray runs us on
            self._admission = asyncio.Semaphore(self.cfg.runtime.max_concurrent_batches)
        async with self._admission:
            table = await self._generate(batch)
        yield table

    async def _generate(self, batch: pa.Table) -> pa.Table:
        rows = batch.to_pylist()
        row_ids = [row.get(self.cfg.input.id_column) for row in rows]
        prepared = [self._prepare(row) for row in rows]
        runnable = [i for i, item in enumerate(prepared) if not isinstance(item, dict)]
        for i in runnable:
            if row_ids[i] in self._culprits:
                raise RowCrashesEngine(
                    f"input row {self.cfg.input.id_column}={row_ids[i]!r} crashes the engine "
                    f"({self._culprits[row_ids[i]]}); it did so running alone, so the job stops here. "
                    "Fix or remove the row and rerun: finished rows are kept.")
        self._busy(+1)
        done = await asyncio.gather(*(self._complete(row_ids[i], *prepared[i][1:]) for i in runnable),
                                    return_exceptions=True)
        for i, result in zip(runnable, done):
            prompt, ids, params = prepared[i]
            if isinstance(result, EngineDead):
                self._die(result)
            if isinstance(result, BaseException):  # the engine refused the row (e.g. too long)
                prepared[i] = error_row(str(result), prompt=prompt, num_spec_tokens=self.num_spec_tokens)
                continue
            text = self._decode(result.token_ids, params.stop_ids(self.eos_ids))
            prepared[i] = ok_row(prompt=prompt, text=text, completion=result)
        self._busy(-1, rows=len(rows), tokens=sum(r["num_generated_tokens"] for r in prepared))
        return output_table(batch, prepared, self.schema)

    def _prepare(self, row: dict):
        """(prompt text, token ids, sampling params), or an error row for a row that cannot run."""
        from domino_ray.target import encode_prompt

        ic, m = self.cfg.input, self.cfg.model
        prompt = None
        try:
            if row.get(ic.id_column) is None:
                raise RowError(f"{ic.id_column} is null (ids must be unique and non-null)")
            parsed = read_row(row, ic)
            prompt = parsed.prompt
            params = row_params(row.get(ic.sampling_column), self.base, self.cfg.generation.seed, row[ic.id_column])
            if parsed.messages is not None:
                ids = encode_prompt(self.tokenizer, messages=parsed.messages, enable_thinking=m.enable_thinking,
                                    parse_special_tokens=m.parse_special_tokens)
                prompt = self.tokenizer.decode(ids)
            else:
                ids = encode_prompt(self.tokenizer, prompt=prompt, chat_template=m.chat_template,
                                    enable_thinking=m.enable_thinking, parse_special_tokens=m.parse_special_tokens)
        except RowError as exc:
            return error_row(str(exc), prompt=prompt, num_spec_tokens=self.num_spec_tokens)
        except Exception as exc:  # tokenizer/template failures on odd input: the row fails, the job goes on
            return error_row(f"cannot encode the prompt: {type(exc).__name__}: {exc}", prompt=prompt,
                             num_spec_tokens=self.num_spec_tokens)
        return prompt, ids, params

    async def _complete(self, row_id, ids: list[int], params) -> object:
        request = Request(next(self.request_ids), ids, params)
        if row_id in self._suspects:  # inside the engine when one crashed: run it alone to find the culprit
            async with self._alone:
                while self._in_engine:
                    await asyncio.sleep(0.01)
                return await self._run(row_id, request)
        while self._alone.locked():  # polls only while a suspect runs (after a crash)
            await asyncio.sleep(0.01)
        return await self._run(row_id, request)

    async def _run(self, row_id, request: Request):
        self._in_engine[request.request_id] = row_id
        try:
            return await self.loop.submit(request).completion()
        except EngineDead:
            if self._crash_rows is None:  # the first row to hear of it sees every row still inside
                self._crash_rows = list(self._in_engine.values())
            raise
        finally:
            del self._in_engine[request.request_id]

    def _decode(self, token_ids, stop_ids) -> str:
        from domino_ray.target import decode

        return decode(self.tokenizer, token_ids, stop_ids)

    def _die(self, exc: EngineDead):
        # The engine thread is dead (e.g. a CUDA error): this actor can never finish a row again.
        # Raising would send Ray's retries back to this same actor; exiting the process is a system
        # error, so Ray restarts the actor (max_restarts=-1) and retries its batches on a fresh engine.
        # The run's RunStats learns which rows were inside, so restarted actors run them alone.
        if self.stats_sink is not None:
            try:
                ray.get(self.stats_sink.record_crash.remote(str(exc), self._crash_rows or []), timeout=30)
            except Exception:  # noqa: BLE001 (exiting regardless: a lost report only costs another crash)
                pass
        os._exit(1)

    def _busy(self, delta: int, rows: int = 0, tokens: int = 0):
        """Track the union of intervals with a batch in flight (throughput while busy)."""
        now = time.perf_counter()
        with self._lock:
            if self._in_flight == 0 and delta > 0:
                self._busy_since = now
            if delta > 0 and self._times["first_batch_at"] is None:
                self._times["first_batch_at"] = time.time()
            if delta < 0:
                self._times["last_batch_done_at"] = time.time()
            self._in_flight += delta
            self._peak_in_flight = max(self._peak_in_flight, self._in_flight)
            if self._in_flight == 0:
                self._busy_s += now - self._busy_since
                self._busy_since = now
            busy = self._busy_s + (now - self._busy_since if self._in_flight else 0.0)
            self._rows += rows
            self._tokens += tokens
            snapshot = {"actor": self.name, "rows": self._rows, "generated_tokens": self._tokens, "busy_s": busy,
                        "peak_batches_in_flight": self._peak_in_flight, **self._times}
        if self.stats_sink is not None and delta < 0:
            self.stats_sink.record.remote(snapshot)


@ray.remote(num_cpus=0)
class RunStats:
    """Latest counters of every engine actor of this run (for the per-actor throughput)."""

    def __init__(self):
        self.actors: dict[str, dict] = {}
        self.crash_rows: list[list] = []   # per engine crash: ids of the rows inside the engine
        self.culprits: dict = {}            # row id -> error, for rows that crashed an engine alone

    def record(self, snapshot: dict):
        self.actors[snapshot["actor"]] = snapshot

    def record_crash(self, error: str, row_ids: list):
        self.crash_rows.append(row_ids)
        if len(row_ids) == 1:
            self.culprits.setdefault(row_ids[0], error)

    def crashes(self) -> dict:
        return {"suspects": sorted({i for ids in self.crash_rows for i in ids}, key=repr), "culprits": self.culprits}

    def snapshot(self) -> list[dict]:
        return sorted(self.actors.values(), key=lambda a: a["actor"])
