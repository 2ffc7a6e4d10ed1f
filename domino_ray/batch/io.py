"""Where the batch job reads and writes: local paths or `s3://`, one pyarrow FileSystem for both.

The output directory doubles as the job's checkpoint. A Parquet file is trusted only when its footer
reads (the footer is written last, so a file cut short by a killed writer has none); such a partial
file holds no finished rows and is removed when the job resumes. `_summary.json` is written last,
atomically, and only when every input row has an output row.
"""

from __future__ import annotations

import fnmatch
import itertools
import json
import os
import uuid
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from domino_ray.config import S3Config

SUMMARY_NAME = "_summary.json"
SETTINGS_NAME = "_settings.json"  # the settings that determine the rows in this output (resume checks them)
GLOB_CHARS = "*?["


@dataclass
class Location:
    fs: pafs.FileSystem
    path: str    # path inside `fs`: absolute for local files, `bucket/key` for S3
    uri: str     # as the user wrote it, for messages


@dataclass
class OutputScan:
    files: list[str]          # complete Parquet files already in the output directory
    done: pa.Table            # (id, sample_index) of their rows, the resume key (duplicates if ids were not unique)
    removed: list[str]        # partial files from an interrupted write, deleted


def resolve(uri: str, s3: S3Config) -> Location:
    """A `Location` for a local path or an `s3://bucket/key` URI (s3fs with endpoint/region from config,
    credentials from the standard AWS environment of each node)."""
    if uri.startswith("s3://") or uri.startswith("s3a://"):
        import s3fs

        client_kwargs = {"region_name": s3.region} if s3.region else {}
        # No listing cache: the job lists the output directory again after Ray wrote to it.
        fs = s3fs.S3FileSystem(anon=s3.anonymous, endpoint_url=s3.endpoint_url, client_kwargs=client_kwargs,
                               use_listings_cache=False, skip_instance_cache=True)
        return Location(pafs.PyFileSystem(pafs.FSSpecHandler(fs)), uri.split("://", 1)[1].rstrip("/"), uri)
    if "://" in uri and not uri.startswith("file://"):
        raise ValueError(f"{uri!r}: only local paths and s3:// URIs are supported")
    return Location(pafs.LocalFileSystem(), os.path.abspath(uri.removeprefix("file://")), uri)


def _visible(path: str) -> bool:
    """Spark/Hive convention: names starting with `_` or `.` are metadata, not data."""
    return not any(part.startswith(("_", ".")) for part in path.split("/") if part)


def _glob_match(path: str, pattern: str) -> bool:
    """Shell-style: a wildcard matches within one path segment only."""
    parts, pattern_parts = path.split("/"), pattern.split("/")
    return len(parts) == len(pattern_parts) and all(fnmatch.fnmatchcase(a, b) for a, b in zip(parts, pattern_parts))


def _glob_base(path: str) -> str:
    """The directory part of a path before its first wildcard (the path itself without one)."""
    if not any(c in path for c in GLOB_CHARS):
        return path
    return path[:min(path.find(c) for c in GLOB_CHARS if c in path)].rsplit("/", 1)[0]


def overlap(inp: Location, out: Location) -> str | None:
    """Why writing to `out` would mix with reading `inp` (same filesystem, one path inside the other), or None.

    Output inside the input: the job's own parts would be read as input. Input inside the output: the
    resume scan would take the input files for finished parts."""
    if isinstance(inp.fs, pafs.LocalFileSystem) != isinstance(out.fs, pafs.LocalFileSystem):
        return None
    base = _glob_base(inp.path).rstrip("/")
    if out.path == base or out.path == inp.path:
        return "output.path is the input path"
    if out.path.startswith(base + "/") and (base == inp.path or _glob_match(f"{out.path}/part.parquet", inp.path)):
        return "output.path is inside input.path (the job's own output files would become input)"
    if base.startswith(out.path + "/"):
        return "input.path is inside output.path (the input files would be taken for finished output)"
    return None


def list_parquet_files(loc: Location, *, missing_ok: bool = False) -> list[str]:
    """Parquet files of a file, a directory (recursively) or a glob, sorted."""
    if any(c in loc.path for c in GLOB_CHARS):
        base = _glob_base(loc.path)
        infos = loc.fs.get_file_info(pafs.FileSelector(base, recursive=True, allow_not_found=True))
        files = [i.path for i in infos if i.type == pafs.FileType.File and _glob_match(i.path, loc.path)
                 and _visible(i.path[len(base):])]
    else:
        info = loc.fs.get_file_info(loc.path)
        if info.type == pafs.FileType.File:
            return [loc.path]
        if info.type == pafs.FileType.NotFound:
            if missing_ok:
                return []
            raise FileNotFoundError(f"{loc.uri} does not exist")
        infos = loc.fs.get_file_info(pafs.FileSelector(loc.path, recursive=True))
        files = [i.path for i in infos if i.type == pafs.FileType.File
                 and _visible(i.path[len(loc.path):]) and i.path.endswith(".parquet")]
    if not files and not missing_ok:
        raise FileNotFoundError(f"{loc.uri} holds no .parquet files")
    return sorted(files)


def scan_output(loc: Location, id_column: str) -> OutputScan:
    """The keys already written to the output directory; deletes partial files left by an interrupted run.

    Only a file whose footer does not read is partial; a complete file without the id column is not
    ours and stops the job (ValueError) rather than being touched.
    """
    files, keys, removed = [], [], []
    for path in list_parquet_files(loc, missing_ok=True):
        with loc.fs.open_input_file(path) as f:
            try:
                parquet = pq.ParquetFile(f)
            except (pa.ArrowInvalid, OSError):  # no footer: the writer was killed mid-file
                parquet = None
            if parquet is not None:
                if id_column not in parquet.schema_arrow.names:
                    raise ValueError(f"{path} has no {id_column!r} column: it is not this job's output")
                keys.append(_keys(parquet, id_column))
        if parquet is None:
            loc.fs.delete_file(path)
            removed.append(path)
        else:
            files.append(path)
    return OutputScan(files=files, done=concat_keys(keys, id_column), removed=removed)


def read_keys(loc: Location, files: list[str], id_column: str) -> pa.Table:
    """(id, sample_index) of the rows of these output files."""
    keys = []
    for path in files:
        with loc.fs.open_input_file(path) as f:
            keys.append(_keys(pq.ParquetFile(f), id_column))
    return concat_keys(keys, id_column)


def _keys(parquet: pq.ParquetFile, id_column: str) -> pa.Table:
    """A file's (id, sample_index); a file written before `sample_index` existed holds sample 0 of its rows."""
    if "sample_index" in parquet.schema_arrow.names:
        return parquet.read(columns=[id_column, "sample_index"]).combine_chunks()
    ids = parquet.read(columns=[id_column]).column(id_column).combine_chunks()
    return pa.table({id_column: ids, "sample_index": pa.array([0] * len(ids), pa.int32())})


def concat_keys(keys: list[pa.Table], id_column: str) -> pa.Table:
    if not keys:
        return pa.table({id_column: pa.array([], pa.null()), "sample_index": pa.array([], pa.int32())})
    return pa.concat_tables(keys, promote_options="permissive").combine_chunks()


def rows_in_complete_parts(fs: pafs.FileSystem, directory: str, name_template: str) -> int | None:
    """Rows in the files `name_template.format(i=0)`, `...(i=1)`, ... up to the first missing one, or None
    when one of them is partial (no footer). 0 when there are none."""
    rows = 0
    for i in itertools.count():
        path = f"{directory}/{name_template.format(i=i)}"
        if fs.get_file_info(path).type != pafs.FileType.File:
            return rows
        try:
            rows += pq.read_metadata(path, filesystem=fs).num_rows
        except (pa.ArrowInvalid, OSError):
            return None


def write_json_atomic(loc: Location, name: str, obj: dict):
    """Write `name` in the directory `loc`: a temporary file renamed into place (an S3 PUT is atomic)."""
    path = f"{loc.path}/{name}"
    data = (json.dumps(obj, indent=2, sort_keys=False, default=str) + "\n").encode()
    loc.fs.create_dir(loc.path, recursive=True)
    if isinstance(loc.fs, pafs.LocalFileSystem):
        tmp = f"{loc.path}/.{name}.{uuid.uuid4().hex}.tmp"
        with loc.fs.open_output_stream(tmp) as f:
            f.write(data)
        loc.fs.move(tmp, path)
    else:
        with loc.fs.open_output_stream(path) as f:
            f.write(data)


def read_json(loc: Location, name: str) -> dict | None:
    path = f"{loc.path}/{name}"
    if loc.fs.get_file_info(path).type != pafs.FileType.File:
        return None
    with loc.fs.open_input_stream(path) as f:
        return json.loads(f.read())


def delete_if_exists(loc: Location, name: str):
    path = f"{loc.path}/{name}"
    if loc.fs.get_file_info(path).type == pafs.FileType.File:
        loc.fs.delete_file(path)
