"""The processor's engine stage on Ray Data: one engine per actor, `pyarrow.Table` batches in and out.

`DominoPredictor` is the `map_batches` callable class (see `processor.py` for the stages around it);
`RunStats` is the run's small stats actor (per-actor throughput, engine crashes and their rows).
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import os
import socket
import threading
import time

import pyarrow as pa
import ray

from domino_ray.batch.pair_probe import cost_tables
from domino_ray.batch.schema import RowError, engine_columns, error_row, ok_row, row_params, with_columns
from domino_ray.config import JobConfig, generation_defaults
from domino_ray.engine.loop import EngineDead
from domino_ray.engine.request import Request
from domino_ray.frontend.requests import LengthError, prompt_requests


class RowCrashesEngine(RuntimeError):
    """A row that crashed an engine while it ran alone: the job stops instead of restarting actors forever."""


class DominoPredictor:
    """The engine stage, a map_batches callable class: one engine per actor; rows with `prompt_token_ids`
    (the tokenize stage's) in, the token and statistics columns of schema.GENERATED_FIELDS added. Rows that
    arrive with an `error` skip the engine; rows the engine refuses (e.g. too long) get theirs.

    Engine crashes (the engine thread died: every row in it is lost) are reported to the run's
    `RunStats` with the keys of the rows that were inside, then the actor exits and Ray restarts it and
    retries its batches. A restarted actor runs those suspect rows one at a time with the engine to
    themselves; a row that crashes the engine alone is named, and the next batch holding it fails the
    job (RowCrashesEngine) rather than looping through actor restarts.
    """

    def __init__(self, cfg: JobConfig, *, use_draft: bool = True, stats_sink=None):
        started = time.time()
        import torch

        from domino_ray.engine.loop import EngineLoop
        from domino_ray.llm import load_engine

        engine, self.tokenizer = load_engine(cfg.model, cfg.draft if use_draft else None, cfg.generation, cfg.runtime)
        if engine.device.type == "cpu":
            torch.set_num_threads(max(1, int(cfg.runtime.cpus_per_actor)))  # the CPUs Ray reserved for us
        gemm = engine.prefill_gemm_rows
        print(f"engine actor {socket.gethostname()}:{os.getpid()}: {engine.precision} on {engine.device}"
              + (f"; prefills on oneDNN's bf16 GEMM from {gemm} rows" if gemm else "")
              + (f"; {engine.slot_report}" if engine.slot_report else ""), flush=True)
        self.loop = EngineLoop(engine)
        self.num_spec_tokens = engine.num_spec_tokens
        self.cfg, self.base = cfg, generation_defaults(cfg.generation)
        self.request_ids = itertools.count()  # engine ids: input ids may repeat across concurrent batches
        self.stats_sink = stats_sink
        # Earlier engine crashes of this run (this actor may be a restart after one).
        crashes = ray.get(stats_sink.crashes.remote()) if stats_sink is not None else {"suspects": [], "culprits": {}}
        self._suspects, self._culprits = set(crashes["suspects"]), crashes["culprits"]
        self._in_engine: dict[int, object] = {}  # engine request id -> row key, for rows inside the engine now
        self._crash_rows: list | None = None      # the rows inside when the engine died
        self._alone = asyncio.Lock()              # held while a suspect row runs with the engine to itself
        self.name = f"{socket.gethostname()}:{os.getpid()}"
        self.node_id = ray.get_runtime_context().get_node_id()  # hosts can repeat (one machine, containers)
        self._lock = threading.Lock()
        self._admission: asyncio.Semaphore | None = None
        self._in_flight, self._busy_since, self._busy_s, self._rows, self._tokens = 0, 0.0, 0.0, 0, 0
        # The process's CPU time while busy too: what share of the machine the engine got (the target-only comparison's
        # two runs come one after the other, and a machine busy with other work gives each a different share)
        self._cpu_since, self._cpu_s = 0.0, 0.0
        self._key_positions, self._ok_rows = 0.0, 0  # for the mean key length the width's cost table is read at
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
        ic = self.cfg.input
        rows = batch.select([c for c in (ic.id_column, ic.sampling_column, "sample_index", "prompt_token_ids", "error")
                             if c in batch.column_names]).to_pylist()
        generated: list = [None] * len(rows)
        runnable = []
        for i, row in enumerate(rows):
            try:
                if row["error"] is not None:
                    raise RowError(row["error"])
                request = self._request(row)
            except RowError as exc:
                generated[i] = error_row(str(exc), num_spec_tokens=self.num_spec_tokens)
                continue
            key = row_key(row, ic.id_column)  # the row's samples share it: a crash names the input row
            if key in self._culprits:
                raise RowCrashesEngine(
                    f"input row {key_name(key, ic.id_column)} crashes the engine ({self._culprits[key]}); it did so "
                    "running alone, so the job stops here. Fix or remove the row and rerun: finished rows are kept.")
            runnable.append((i, key, request))
        self._busy(+1)
        done = await asyncio.gather(*(self._complete(key, request) for _, key, request in runnable),
                                    return_exceptions=True)
        for (i, *_), result in zip(runnable, done):
            if isinstance(result, EngineDead):
                self._die(result)
            if isinstance(result, BaseException):  # the engine refused the row (e.g. too long)
                generated[i] = error_row(str(result), num_spec_tokens=self.num_spec_tokens)
            else:
                generated[i] = ok_row(result)
        ok = [r for r in generated if r["finish_reason"] != "error"]
        self._busy(-1, rows=len(rows), tokens=sum(r["num_generated_tokens"] for r in generated), ok_rows=len(ok),
                   key_positions=sum(r["num_input_tokens"] + r["num_generated_tokens"] / 2 for r in ok))
        return with_columns(batch, engine_columns(generated))

    def _request(self, row: dict) -> Request:
        """The engine request for sample `sample_index` of the row: its parameters after the seed derivation
        (schema.row_params), then the front end (sample 0 is the n = 1 row; a rerun draws the same n samples; stop
        strings end the row inside the engine, as Serve's; the length rule caps max_new_tokens). RowError when the
        front end refuses it (a prompt that fills the model's length, stop strings without a tokenizer, ...)."""
        ic = self.cfg.input
        params = row_params(row.get(ic.sampling_column), self.base, self.cfg.generation.seed, row.get(ic.id_column))
        try:
            [request] = prompt_requests(next(self.request_ids), row["prompt_token_ids"], params,
                                        tokenizer=self.tokenizer, max_model_len=self.loop.engine.max_model_len,
                                        samples=[row.get("sample_index") or 0],
                                        eos_token_ids=sorted(self.loop.engine.eos_token_ids))
        except LengthError as exc:
            raise RowError(str(exc)) from None
        except ValueError as exc:  # stop strings without a tokenizer; a sample_index column outside the row's n
            raise RowError(f"sampling_params: {exc}") from None
        return request

    async def _complete(self, key, request: Request) -> object:
        if key in self._suspects:  # inside the engine when one crashed: run it alone to find the culprit
            async with self._alone:
                while self._in_engine:
                    await asyncio.sleep(0.01)
                return await self._run(key, request)
        while self._alone.locked():  # polls only while a suspect runs (after a crash)
            await asyncio.sleep(0.01)
        return await self._run(key, request)

    async def _run(self, key, request: Request):
        self._in_engine[request.request_id] = key
        try:
            return await self.loop.submit(request).completion()
        except EngineDead:
            if self._crash_rows is None:  # the first row to hear of it sees every row still inside
                self._crash_rows = list(self._in_engine.values())
            raise
        finally:
            del self._in_engine[request.request_id]

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

    def _busy(self, delta: int, rows: int = 0, tokens: int = 0, key_positions: float = 0.0, ok_rows: int = 0):
        """Track the union of intervals with a batch in flight (throughput while busy)."""
        now, cpu = time.perf_counter(), time.process_time()
        with self._lock:
            if self._in_flight == 0 and delta > 0:
                self._busy_since, self._cpu_since = now, cpu
            if delta > 0 and self._times["first_batch_at"] is None:
                self._times["first_batch_at"] = time.time()
            if delta < 0:
                self._times["last_batch_done_at"] = time.time()
            self._in_flight += delta
            self._peak_in_flight = max(self._peak_in_flight, self._in_flight)
            if self._in_flight == 0:
                self._busy_s += now - self._busy_since
                self._cpu_s += cpu - self._cpu_since
                self._busy_since, self._cpu_since = now, cpu
            busy = self._busy_s + (now - self._busy_since if self._in_flight else 0.0)
            cpu_s = self._cpu_s + (cpu - self._cpu_since if self._in_flight else 0.0)
            self._rows += rows
            self._tokens += tokens
            self._key_positions += key_positions
            self._ok_rows += ok_rows
            snapshot = {"actor": self.name, "node_id": self.node_id, "rows": self._rows, "generated_tokens": self._tokens,
                        "busy_s": busy, "cpu_s": cpu_s, "max_rows": self.loop.engine.max_rows,
                        "peak_batches_in_flight": self._peak_in_flight, "kv_cache": self.loop.engine.kv_cache_stats(),
                        "precision": self.loop.engine.precision,
                        "prefill_gemm_rows": self.loop.engine.prefill_gemm_rows,
                        **self._times}
        if self.stats_sink is not None and delta < 0:
            width = self.loop.engine.width
            if width is not None and self._ok_rows:  # what the adaptive width weighs its choices by
                snapshot["width_costs"] = cost_tables(width.costs, self._key_positions / self._ok_rows)
            self.stats_sink.record.remote(snapshot)


def row_key(row: dict, id_column: str):
    """What names a row across actor restarts (crash suspects): its id, or without an id column (a
    processor on any dataset) its token ids."""
    if row.get(id_column) is not None:
        return row[id_column]
    return "sha1:" + hashlib.sha1(str(row["prompt_token_ids"]).encode()).hexdigest()[:16]


def key_name(key, id_column: str) -> str:
    return f"with prompt tokens {key}" if isinstance(key, str) and key.startswith("sha1:") else f"{id_column}={key!r}"


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
