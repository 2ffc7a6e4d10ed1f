"""Cheap driver-side checks before any Ray work: a job that cannot run fails at once, saying why.

Model checks read configs, the tokenizer and the draft checkpoint, through the same ordered checks as
`load_draft` (`checkpoint.check_draft`: config.json, the safetensors headers and the small `d2t` map,
from a local directory or the hub), never the weights. Every error names the config key it came from.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from domino_ray.batch.io import Location, list_parquet_files, overlap, resolve
from domino_ray.batch.schema import GENERATED_NAMES, OVERRIDE_KEYS, sample_count
from domino_ray.config import ConfigError, InputConfig, JobConfig, generation_defaults, to_dict
from domino_ray.spec_decode.checkpoint import check_draft
from domino_ray.spec_decode.checkpoint_sources import CheckpointError, open_draft
from domino_ray.spec_decode.draft import resolve_num_spec_tokens


# Per-row columns users name like OpenAI / vLLM fields; only `input.sampling_column` overrides sampling.
FLAT_SAMPLING_COLUMNS = ("temperature", "top_p", "top_k", "min_p", "seed", "max_tokens", "max_new_tokens",
                         "stop", "stop_token_ids", "ignore_eos", "presence_penalty", "frequency_penalty",
                         "repetition_penalty", "min_tokens", "logprobs")


@dataclass
class InputPlan:
    location: Location
    files: list[str]
    schema: pa.Schema        # of the first file; every file has the same columns (checked)
    generated_id: bool       # the input has no id column: ids come from (file path, row position)
    file_rows: dict[str, int] = field(default_factory=dict)  # rows per file, from the footers
    num_rows: int = 0        # rows the job reads (input.limit applied)
    ids: pa.Array | None = None  # their ids, unique and non-null (None for generated ids)
    samples: pa.Array | None = None  # output rows of each of them: its n (schema.sample_count), in read order
    num_samples: int = 0     # output rows the job writes: their sum
    warnings: list[str] = field(default_factory=list)


def check_input(cfg: JobConfig) -> InputPlan:
    """Every file's footer and schema, the configured columns, and unique ids; raises ConfigError naming
    the key and the file. Reads footers and the id column only (the same code for local and s3://)."""
    ic = cfg.input
    try:
        loc = resolve(ic.path, ic.s3)
        files = list_parquet_files(loc)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"config key input.path={ic.path!r}: {exc}") from None
    schema, file_rows = None, {}
    for path in files:
        file_schema, file_rows[path] = _read_footer(loc, path, ic.path)
        if schema is None:
            schema = file_schema
        elif file_schema.names != schema.names or not _unifies(schema, file_schema):
            raise ConfigError(f"config key input.path={ic.path!r}: {path} does not match {files[0]}: columns "
                              f"{_describe(file_schema)} vs {_describe(schema)}; every input file needs the same "
                              "columns and types")
    _check_columns(ic, schema, files[0])
    plan = InputPlan(loc, files, schema, generated_id=ic.id_column not in schema.names, file_rows=file_rows)
    total = sum(file_rows.values())
    plan.num_rows = total if ic.limit is None else min(total, ic.limit)
    if not plan.generated_id:
        plan.ids = _unique_ids(loc, files, ic.id_column, plan.num_rows, ic.path)
    plan.samples = _sample_counts(loc, files, ic.sampling_column, plan.num_rows, generation_defaults(cfg.generation))
    plan.num_samples = int(pc.sum(plan.samples).as_py() or 0)
    flat = [c for c in schema.names if c in FLAT_SAMPLING_COLUMNS and c != ic.sampling_column]
    if flat:
        plan.warnings.append(
            f"warning: input columns {flat} look like per-row sampling parameters but are only carried through: "
            f"per-row overrides go in the {ic.sampling_column!r} column (input.sampling_column), a struct or JSON "
            f"object with keys {list(OVERRIDE_KEYS)}")
    return plan


def _read_footer(loc: Location, path: str, uri: str) -> tuple[pa.Schema, int]:
    try:
        if loc.fs.get_file_info(path).size == 0:
            raise ValueError("the file is empty (0 bytes)")
        with loc.fs.open_input_file(path) as f:
            parquet = pq.ParquetFile(f)
            return parquet.schema_arrow, parquet.metadata.num_rows
    except (OSError, ValueError, pa.ArrowException) as exc:
        raise ConfigError(f"config key input.path={uri!r}: {path} is not a readable Parquet file ({exc}); "
                          "fix or remove it") from None


def _unifies(a: pa.Schema, b: pa.Schema) -> bool:
    try:
        pa.unify_schemas([a, b], promote_options="permissive")
    except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError):
        return False
    return True


def _describe(schema: pa.Schema) -> str:
    return "[" + ", ".join(f"{f.name}: {f.type}" for f in schema) + "]"


def _check_columns(ic, schema: pa.Schema, first_file: str):
    names = schema.names
    defaults = InputConfig()
    for key in ("prompt_column", "messages_column", "id_column", "sampling_column"):
        column = getattr(ic, key)
        if column != getattr(defaults, key) and column not in names:  # the default names are optional
            raise ConfigError(f"config key input.{key}={column!r}: {first_file} has no such column "
                              f"(columns: {names})")
    if ic.prompt_column not in names and ic.messages_column not in names:
        raise ConfigError(f"config key input.prompt_column / input.messages_column: {first_file} has neither a "
                          f"{ic.prompt_column!r} nor a {ic.messages_column!r} column (columns: {names})")
    # The output's generated columns would silently replace these; the input prompt column is the one
    # exception, it becomes the output `prompt`.
    clash = [c for c in names if c in GENERATED_NAMES and not (c == "prompt" == ic.prompt_column)]
    if clash:
        raise ConfigError(f"config key input.path: input columns {clash} have the names of output columns and "
                          f"would be overwritten; rename them in the input (e.g. input_{clash[0]})")


def _unique_ids(loc: Location, files: list[str], id_column: str, num_rows: int, uri: str) -> pa.Array:
    """The ids of the first `num_rows` rows; raises ConfigError naming duplicated ids and their files."""
    chunks, per_file, left = [], [], num_rows
    for path in files:
        if left <= 0:
            break
        with loc.fs.open_input_file(path) as f:
            ids = pq.read_table(f, columns=[id_column]).column(id_column).combine_chunks()[:left]
        if chunks and ids.type != chunks[0].type:
            ids = ids.cast(chunks[0].type)
        chunks.append(ids)
        per_file.append((path, ids))
        left -= len(ids)
    ids = pa.chunked_array(chunks, chunks[0].type).combine_chunks() if chunks else pa.array([])
    counts = pc.value_counts(pc.drop_null(ids))
    repeated = pc.filter(counts.field("values"), pc.greater(counts.field("counts"), 1))
    if len(repeated):
        examples = []
        for value in repeated[:3].to_pylist():
            where = [p for p, file_ids in per_file if pc.any(pc.equal(file_ids, value)).as_py()]
            examples.append(f"{value!r} in {where}")
        raise ConfigError(
            f"config key input.id_column={id_column!r}: {len(repeated)} ids appear more than once in {uri}, e.g. "
            f"{'; '.join(examples)}. A resumed job skips every row whose id is done, so rows sharing an id can "
            f"never all be written: make the ids unique, or drop the {id_column!r} column to have ids generated "
            "from (file path, row position)")
    return ids


def _sample_counts(loc: Location, files: list[str], column: str, num_rows: int, base) -> pa.Array:
    """n of each of the first `num_rows` rows (schema.sample_count of its overrides)."""
    counts, cache = [], {}
    for path in files:
        if len(counts) >= num_rows:
            break
        with loc.fs.open_input_file(path) as f:
            parquet = pq.ParquetFile(f)
            if column not in parquet.schema_arrow.names:
                counts += [base.n] * min(parquet.metadata.num_rows, num_rows - len(counts))
                continue
            overrides = parquet.read(columns=[column]).column(column).to_pylist()[:num_rows - len(counts)]
        for o in overrides:  # rows mostly share a few overrides: count each once
            key = repr(o)
            if key not in cache:
                cache[key] = sample_count(o, base)
            counts.append(cache[key])
    return pa.array(counts, pa.int64())


def check_output(cfg: JobConfig) -> Location:
    try:
        loc = resolve(cfg.output.path, cfg.output.s3)
        inp = resolve(cfg.input.path, cfg.input.s3)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"config key output.path={cfg.output.path!r}: {exc}") from None
    same_endpoint = cfg.input.s3.endpoint_url == cfg.output.s3.endpoint_url
    reason = overlap(inp, loc) if same_endpoint or isinstance(loc.fs, pafs.LocalFileSystem) else None
    if reason:
        raise ConfigError(f"config key output.path={cfg.output.path!r}: {reason} ({cfg.input.path!r}); "
                          "write the output to a directory of its own")
    try:
        loc.fs.create_dir(loc.path, recursive=True)
    except OSError as exc:
        raise ConfigError(f"config key output.path={cfg.output.path!r}: {exc}") from None
    return loc


# Keys that do not change what a row's output is (only speed, placement or where files go).
NOT_OUTPUT_SETTINGS = {"model.device", "generation.max_batch_size", "generation.max_prefill_tokens",
                       "generation.kv_block_size", "generation.kv_cache_tokens"}


def output_settings(cfg: JobConfig) -> dict:
    """The config keys (dotted) that determine the output rows: model, draft, generation (the seed
    included) and the input column mapping. Recorded in the output (`_settings.json`); resume compares them."""
    d = to_dict(cfg)
    sections = {"model": d["model"], "draft": d["draft"], "generation": d["generation"],
                "input": {k: d["input"][k] for k in ("prompt_column", "messages_column", "id_column",
                                                     "sampling_column")}}
    flat = {f"{section}.{k}": v for section, values in sections.items() for k, v in values.items()}
    return {k: v for k, v in flat.items() if k not in NOT_OUTPUT_SETTINGS}


def check_settings(recorded: dict | None, current: dict, output_uri: str, allow_mixed: bool) -> list[str]:
    """The keys whose recorded and current values differ; raises ConfigError unless `allow_mixed`."""
    if recorded is None:
        return []
    differ = sorted(k for k in set(recorded) | set(current) if recorded.get(k) != current.get(k))
    if differ and not allow_mixed:
        details = "; ".join(f"{k}: {recorded.get(k)!r} in the output, {current.get(k)!r} now" for k in differ)
        raise ConfigError(f"config key output.path={output_uri!r} holds rows generated with other settings "
                          f"({details}). Use the same settings to resume, a new output.path for new settings, or "
                          "output.allow_mixed_settings=true to add rows made with these settings to that output")
    return differ


def check_models(cfg: JobConfig) -> int:
    """Target config, tokenizer and the draft checkpoint (`load_draft`'s checks, no weights read); returns K
    (draft tokens per step, 0 = target only)."""
    from transformers import AutoConfig

    from domino_ray.target.loading import load_tokenizer

    try:
        target_config = AutoConfig.from_pretrained(cfg.model.source)
    except Exception as exc:  # transformers raises OSError/ValueError/KeyError depending on what is wrong
        raise ConfigError(f"config key model.source={cfg.model.source!r}: cannot read the target config: "
                          f"{exc}") from None
    tokenizer_key = "model.tokenizer" if cfg.model.tokenizer else "model.source"
    try:
        load_tokenizer(cfg.model.tokenizer or cfg.model.source)
    except Exception as exc:
        raise ConfigError(f"config key {tokenizer_key}: cannot load the tokenizer: {exc}") from None
    if cfg.draft.source is None:
        return 0
    try:
        draft_cfg, _ = check_draft(open_draft(cfg.draft.source), target_config)
    except (CheckpointError, OSError, ValueError, KeyError) as exc:
        raise ConfigError(f"config key draft.source={cfg.draft.source!r}: {exc}") from None
    try:
        return resolve_num_spec_tokens(cfg.draft.num_draft_tokens, draft_cfg)[0]
    except ValueError as exc:
        raise ConfigError(f"config key draft.{exc}") from None

