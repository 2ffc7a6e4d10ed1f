"""The batch job on Ray Data: Parquet (local or s3://) in, the processor, Parquet + `_summary.json` out.

    read_parquet -> _prepare (ids; drop rows already in the output) -> Processor (processor.py: tokenize,
    engine actors, detokenize) -> Ray Data's Parquet sink (explicit schema; a retried write keeps its finished files)

Each engine actor loads the target and draft once and runs one `SpecEngine` on a background thread
(`EngineLoop`). Ray hands an actor several batches at once (`max_concurrent_calls_per_actor`, async
`__call__`), so rows of the next batch fill engine slots as rows of the previous one finish:
continuous batching across batches. Resume: the output directory is the checkpoint (see `io.py`).
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import ray
from ray.data._internal.datasource.parquet_datasink import ParquetDatasink  # no public name in Ray 2.60
from ray.data._internal.planner.plan_write_op import WRITE_UUID_KWARG_NAME
from ray.data.block import BlockAccessor
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from domino_ray.batch.io import (SETTINGS_NAME, SUMMARY_NAME, Location, delete_if_exists, list_parquet_files, read_json,
                                 read_keys, rows_in_complete_parts, scan_output, write_json_atomic)
from domino_ray.batch.pair_probe import probe_pair
from domino_ray.batch.predictor import DominoPredictor, RowCrashesEngine, RunStats, key_name
from domino_ray.batch.preflight import (InputPlan, check_input, check_models, check_output, check_settings,
                                        output_settings)
from domino_ray.batch.processor import LIGHT_CPUS, Processor, engine_resources, light_concurrency
from domino_ray.batch.schema import generated_ids, output_schema, row_params, sample_count
from domino_ray.batch.summary import (STATS_COLUMNS, busy_throughput, human_summary, run_stats, side_by_side,
                                      summarize, throughput_ratio)
from domino_ray.batch.text_stages import SAMPLES_TO_DO, tokenize_batch
from domino_ray.config import ConfigError, JobConfig, generation_defaults, to_dict
from domino_ray.frontend.requests import prompt_requests


def _prepare(table: pa.Table, done_keys, cfg: JobConfig, generated_id: bool) -> pa.Table:
    """Give every row its id; a row with samples already in the output (resume) keeps only the ones still to do
    (text_stages.SAMPLES_TO_DO), a row with none left is dropped: a resumed job neither repeats nor loses a sample."""
    ic = cfg.input
    if generated_id:
        table = table.append_column(ic.id_column, generated_ids(table.column("row_hash"))).drop_columns(["row_hash"])
    done = ray.get(done_keys)  # Ray Data passes fn_args through unresolved; the object store caches it
    if not len(done):  # nothing written yet: every row gets all its samples (no SAMPLES_TO_DO column in any block)
        return table
    ids = table.column(ic.id_column)
    done_ids = done.column(ic.id_column)
    done_ids = done_ids.cast(ids.type) if done_ids.type != ids.type else done_ids
    mine = pc.is_in(done_ids, value_set=ids, skip_nulls=False)
    have: dict = {}
    indices = pc.filter(done.column("sample_index"), mine).to_pylist()
    for row_id, index in zip(pc.filter(done_ids, mine).to_pylist(), indices):
        have.setdefault(row_id, set()).add(index)
    overrides = (table.column(ic.sampling_column).to_pylist() if ic.sampling_column in table.column_names
                 else [None] * table.num_rows)
    base = generation_defaults(cfg.generation)
    todo = [None if row_id not in have else [i for i in range(sample_count(o, base)) if i not in have[row_id]]
            for row_id, o in zip(ids.to_pylist(), overrides)]
    table = table.append_column(SAMPLES_TO_DO, pa.array(todo, pa.list_(pa.int32())))
    return table.filter(pa.array([t is None or len(t) > 0 for t in todo]))


def read_inputs(cfg: JobConfig, plan: InputPlan, done_keys_ref) -> ray.data.Dataset:
    """Input rows with their ids, minus the rows already in the output."""
    # Reading prompts is light: a fraction of a CPU leaves room for the engine and text stages on a small machine.
    light = {"num_cpus": LIGHT_CPUS, "concurrency": light_concurrency(cfg.runtime)}
    ds = ray.data.read_parquet(plan.files, filesystem=plan.location.fs, include_row_hash=plan.generated_id, **light)
    if cfg.input.limit is not None:
        ds = ds.limit(cfg.input.limit)
    return ds.map_batches(_prepare, batch_format="pyarrow", fn_args=(done_keys_ref, cfg),
                          fn_kwargs={"generated_id": plan.generated_id}, **light)


def build_dataset(cfg: JobConfig, plan: InputPlan, schema: pa.Schema, done_keys_ref, *, use_draft: bool = True,
                  stats_sink=None, predictor: type = DominoPredictor) -> ray.data.Dataset:
    """Input rows -> the processor with `predictor` as its engine stage (DominoPredictor, or a subclass of it:
    the fault tests pass one) -> rows of the job's output `schema`."""
    processor = Processor(cfg, use_draft=use_draft, stats_sink=stats_sink, predictor=predictor, schema=schema)
    return processor(read_inputs(cfg, plan, done_keys_ref))


def _not_the_stale_cpu_warning(record: logging.LogRecord) -> bool:
    # Ray Data's write_parquet materializes the written dataset and checks for free CPUs again right after
    # the pipeline ran, while its finished actors still hold their CPUs (they are released asynchronously):
    # "does not have any available CPUs ... will hang" at the end of every run, about nothing that runs.
    return "does not have any available CPUs" not in record.getMessage()


def init_ray(cfg: JobConfig):
    if not ray.is_initialized():
        ray.init(address=cfg.runtime.ray_address)
    dataset_logger = logging.getLogger("ray.data.dataset")
    if _not_the_stale_cpu_warning not in dataset_logger.filters:
        dataset_logger.addFilter(_not_the_stale_cpu_warning)
    ctx = ray.data.DataContext.get_current()
    ctx.max_consecutive_actor_init_deaths = 0  # a model that does not load fails the job at once
    # The V2 Parquet reader starts a pool of 32 footer-reading actors for every read: seconds of startup
    # that dominate small jobs and crowd small clusters. Prompt files are small next to inference; the
    # V1 reader (footers read by the driver) is enough and supports the same row hashes.
    ctx.use_datasource_v2 = False
    if cfg.input.limit is not None:
        ctx.execution_options.preserve_order = True  # the same first rows on every run (resume)


def read_output(out: Location, columns: list[str], files: list[str] | None = None) -> pa.Table:
    """These columns of the output files; a column a file lacks (`sample_index` of an output written before it) is
    null there."""
    tables = []
    for path in list_parquet_files(out, missing_ok=True) if files is None else files:
        with out.fs.open_input_file(path) as f:
            parquet = pq.ParquetFile(f)
            tables.append(parquet.read(columns=[c for c in columns if c in parquet.schema_arrow.names]))
    if not tables:
        return pa.table({c: [] for c in columns})
    return pa.concat_tables(tables, promote_options="permissive")


def _missing_keys(plan: InputPlan, done: pa.Table) -> pa.Table:
    """(id, sample_index) of the input's samples with no output row yet (explicit ids only)."""
    counts = plan.samples.to_numpy()
    starts = np.repeat(np.cumsum(counts) - counts, counts)
    expected = pa.table({"id": plan.ids.take(pa.array(np.repeat(np.arange(len(counts)), counts))),
                         "sample_index": pa.array(np.arange(len(starts)) - starts, pa.int32())})
    if not len(done):
        return expected
    ids = done.column(0)
    done = pa.table({"id": ids.cast(plan.ids.type) if ids.type != plan.ids.type else ids,
                     "sample_index": done.column("sample_index").cast(pa.int32())})
    return expected.join(done, keys=["id", "sample_index"], join_type="left anti")


def rows_to_do(plan: InputPlan, done: pa.Table, previous_summary: dict | None) -> int | None:
    """Output rows (samples of input rows) not written yet; None when only the pipeline can tell (generated ids)."""
    if not plan.generated_id:
        return _missing_keys(plan, done).num_rows
    # Generated ids exist only inside Ray (row hashes of file path and position): counts compare only
    # for the very input files the output was made from.
    same_files = previous_summary is not None and previous_summary.get("input", {}).get("files") == plan.file_rows
    return max(0, plan.num_samples - len(done)) if same_files else None


def run_job(cfg: JobConfig, log=print, *, predictor: type = DominoPredictor) -> dict:
    """Run (or resume, or confirm finished) the batch job; returns the summary. `predictor`: the actor
    class that generates the rows (see build_dataset)."""
    plan, out, _ = check_input(cfg), check_output(cfg), check_models(cfg)
    for warning in plan.warnings:
        log(warning)
    id_column = cfg.input.id_column
    try:
        scan = scan_output(out, id_column)
    except ValueError as exc:
        raise ConfigError(f"config key output.path={cfg.output.path!r}: {exc}") from None
    for path in scan.removed:
        log(f"removed {path}: a partial file from an interrupted run (its rows will be redone)")
    settings = output_settings(cfg)
    recorded = read_json(out, SETTINGS_NAME)
    differ = check_settings(recorded and recorded["settings"], settings, cfg.output.path,
                            cfg.output.allow_mixed_settings)
    # Output rows: each input row's samples (n of them; 1 each unless `n` is set).
    output_rows, previous = plan.num_samples, read_json(out, SUMMARY_NAME)
    todo = rows_to_do(plan, scan.done, previous)
    if previous is not None and not scan.removed and todo == 0:
        log(f"nothing to do: all {output_rows} rows are already in {cfg.output.path}; its {SUMMARY_NAME}:")
        log(human_summary(previous))
        return previous
    if recorded is None or differ:
        if differ:
            log(f"warning: output.allow_mixed_settings=true: {cfg.output.path} now mixes settings ({differ})")
        earlier = (recorded or {}).get("earlier", []) + ([recorded["settings"]] if recorded else [])
        write_json_atomic(out, SETTINGS_NAME, {"settings": settings, "earlier": earlier})
    delete_if_exists(out, SUMMARY_NAME)  # written again once every row is done
    done_rows = min(len(scan.done), output_rows) if todo is None else output_rows - todo
    if done_rows:
        log(f"resuming: {done_rows} of {output_rows} rows are already in {cfg.output.path}")
    run = run_stats(0.0, done_rows, [])
    if todo != 0:  # else every row was written before the summary: only the summary is missing
        run = generate_missing(cfg, plan, out, scan, done_rows, predictor)
    rows = read_output(out, [id_column, "sample_index", *STATS_COLUMNS])
    if plan.generated_id:
        missing = output_rows - rows.num_rows
    else:
        missing = _missing_keys(plan, read_keys(out, list_parquet_files(out, missing_ok=True), id_column)).num_rows
    if missing > 0:
        raise RuntimeError(f"{missing} output rows (samples of input rows) are not in {cfg.output.path}: rerun to "
                           "complete them")
    summary = summarize(rows, id_column, run=run, config=to_dict(cfg), output_uri=cfg.output.path)
    summary["input"] = {"path": cfg.input.path, "rows": plan.num_rows, "files": plan.file_rows}
    write_json_atomic(out, SUMMARY_NAME, summary)
    log(human_summary(summary))
    return summary


def generate_missing(cfg: JobConfig, plan: InputPlan, out: Location, scan, done_rows: int,
                     predictor: type = DominoPredictor) -> dict:
    """Run the rows not yet in the output through the engine actors and write them; returns run stats."""
    init_ray(cfg)
    schema = output_schema(plan.schema, cfg.input.id_column, plan.generated_id)
    done_ref = ray.put(scan.done)
    sink = _run_stats_actor()
    parquet = ParquetSinkKeepingFinishedFiles(out.path, filesystem=out.fs, arrow_parquet_args={"schema": schema},
                                              min_rows_per_file=cfg.output.min_rows_per_file,
                                              max_rows_per_file=cfg.output.max_rows_per_file)
    start = time.perf_counter()
    try:
        build_dataset(cfg, plan, schema, done_ref, stats_sink=sink, predictor=predictor).write_datasink(
            parquet, ray_remote_args={"num_cpus": LIGHT_CPUS},  # light, like the read: fits beside the engine actor
            concurrency=light_concurrency(cfg.runtime))
    except Exception as exc:
        culprits = ray.get(sink.crashes.remote())["culprits"]
        if not culprits:
            raise
        key, error = next(iter(culprits.items()))
        raise RowCrashesEngine(f"input row {key_name(key, cfg.input.id_column)} crashes the engine ({error}): it did so "
                               "running alone on a fresh actor, so the job stopped. Fix or remove the row and rerun "
                               "the same command: finished rows are kept.") from exc
    # This run's rows and tokens are counted from the files it wrote: the actors' own counters also
    # count the rows of batches Ray retried after an actor died.
    new_files = sorted(set(list_parquet_files(out, missing_ok=True)) - set(scan.files))
    written = read_output(out, ["num_generated_tokens"], new_files).column("num_generated_tokens")
    run = run_stats(time.perf_counter() - start, done_rows, ray.get(sink.snapshot.remote()),
                    written=(len(written), int(pc.sum(written).as_py() or 0)))
    if cfg.runtime.compare_baseline and run["rows"]:
        run["baseline"] = compare_baseline(cfg, plan, schema, done_ref, out, new_files, run, predictor)
    return run


class ParquetSinkKeepingFinishedFiles(ParquetDatasink):
    """Ray Data's Parquet sink (what `write_parquet` runs), except that a write task finding its own files
    already complete leaves them alone. Ray runs a write task again when the node that ran it is lost after
    its files landed but before the driver heard back (its input, if lost with the node, is computed again
    first). Without this the retry rewrites finished files in place: same rows, but a resume scan or reader
    in between sees a partial file (docs/batch.md "Resume guarantee": finished files are never rewritten)."""

    def write(self, blocks, ctx):
        blocks = list(blocks)
        rows = sum(BlockAccessor.for_block(block).num_rows() for block in blocks)
        write_uuid = ctx.kwargs[WRITE_UUID_KWARG_NAME]
        # The names are a function of (write, task) only: the retry's names are the first attempt's.
        template = self._get_basename_template(self.filename_provider.get_filename_for_task(write_uuid, ctx.task_idx),
                                               write_uuid)
        if rows and rows_in_complete_parts(self.filesystem, self.path, template) == rows:
            return
        super().write(blocks, ctx)


def _run_stats_actor():
    # On the driver's node: the run's bookkeeping lives and dies with the driver, never with a worker
    # node that may be lost (a restarted engine actor asks it for crash suspects in __init__).
    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    return RunStats.options(scheduling_strategy=here).remote()


def compare_baseline(cfg: JobConfig, plan: InputPlan, schema: pa.Schema, done_ref, out: Location,
                     new_files: list[str], run: dict, predictor: type = DominoPredictor) -> dict:
    """The same rows through the same engine without the draft: greedy equality, and the two runs' throughput ratio
    (`summary.throughput_ratio`: kept, not printed); with a draft also `run_probe`, the pair measured in one process
    on a few of the rows, which gives the job's speed-up (`summary.side_by_side`)."""
    id_column = cfg.input.id_column
    sink = _run_stats_actor()
    start = time.perf_counter()
    ds = build_dataset(cfg, plan, schema, done_ref, use_draft=False, stats_sink=sink, predictor=predictor)
    columns = [id_column, "sample_index", "generated_tokens", "finish_reason"]
    base = ds.select_columns(columns).to_arrow_refs()
    base = pa.concat_tables(ray.get(base)).to_pydict() if base else {c: [] for c in columns}
    wall = time.perf_counter() - start
    ours = read_output(out, columns[:3], new_files).to_pydict()
    ours = dict(zip(zip(ours[id_column], ours["sample_index"]), ours["generated_tokens"]))
    compared = [(key, tokens) for *key, tokens, reason in zip(*(base[c] for c in columns)) if reason != "error"]
    base_actors = ray.get(sink.snapshot.remote())
    result = {"wall_time_s": wall, "tokens_per_s": busy_throughput(base_actors),
              **throughput_ratio(run["actors"], base_actors), "wall_time_ratio": wall / run["wall_time_s"],
              "compared": len(compared), "identical": sum(ours.get(tuple(key)) == tokens for key, tokens in compared)}
    if cfg.draft.source:
        result["probe"] = run_probe(cfg, plan, max(a.get("max_rows", 1) for a in run["actors"]))
        result.update(side_by_side(result["probe"]))
    return result


def run_probe(cfg: JobConfig, plan: InputPlan, rows: int) -> dict:
    """`pair_probe.probe_pair` on the first input rows (up to `rows` that run), as a Ray task with an engine actor's
    resources, after the job and its target-only run have let theirs go. A failure is reported, not raised: the job's
    rows are written by then, and only this extra measurement is missing (`{"error": ...}`)."""
    try:
        with plan.location.fs.open_input_file(plan.files[0]) as f:
            first = next(pq.ParquetFile(f).iter_batches(batch_size=2 * rows))  # spare rows for any that fail
        return ray.get(_probe_task.options(**engine_resources(cfg.runtime)).remote(cfg, pa.Table.from_batches([first]),
                                                                                   rows))
    except Exception as exc:  # noqa: BLE001 (see the docstring)
        return {"error": f"{type(exc).__name__}: {exc}"}


@ray.remote
def _probe_task(cfg: JobConfig, first_rows: pa.Table, rows: int) -> dict:
    ic, base = cfg.input, generation_defaults(cfg.generation)
    # Token ids only: the measurement runs without stop strings or constraints (a row ends at a stop id or its budget).
    prompts = []
    for row in tokenize_batch(first_rows, cfg).to_pylist():
        if row["error"] is None:
            params = replace(row_params(row.get(ic.sampling_column), base, cfg.generation.seed, row.get(ic.id_column)),
                             stop=(), structured_outputs=None, logit_bias=None, allowed_token_ids=None)
            # the probe's engines skip prompts longer than their length (`measure_pair`)
            [request] = prompt_requests(len(prompts), row["prompt_token_ids"], params, max_model_len=None,
                                        samples=[row["sample_index"]])
            prompts.append((request.prompt_token_ids, request.params))
    return probe_pair(cfg.model, cfg.draft, cfg.generation, cfg.runtime, prompts, rows)
