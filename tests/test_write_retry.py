"""The batch job's Parquet sink when Ray runs a write task again (its node lost after the files landed,
before the driver heard back): finished files stay as they are, partial or missing ones are written again,
and the rows come out exactly once. The task is called directly, twice, as Ray's retry calls it."""

import os

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
from ray.data._internal.execution.interfaces.task_context import TaskContext

from domino_ray.ray_batch import ParquetSinkKeepingFinishedFiles

SCHEMA = pa.schema([("id", pa.int64()), ("text", pa.string())])


def block(ids) -> pa.Table:
    return pa.table({"id": list(ids), "text": [f"row {i}" for i in ids]}, schema=SCHEMA)


def task(index: int) -> TaskContext:
    return TaskContext(task_idx=index, op_name="Write", kwargs={"write_uuid": "w0"})


def files(directory) -> dict[str, tuple[int, int]]:
    """name -> (inode, mtime_ns): a rewrite in place changes the mtime, a rename the inode."""
    return {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in sorted(directory.glob("*.parquet"))}


def ids_in(directory) -> list[int]:
    return sorted(pq.read_table(directory).column("id").to_pylist())


def test_a_retried_write_keeps_finished_files_and_redoes_partial_ones(tmp_path):
    sink = ParquetSinkKeepingFinishedFiles(str(tmp_path), filesystem=pafs.LocalFileSystem(),
                                           arrow_parquet_args={"schema": SCHEMA}, max_rows_per_file=3)
    rows = [block(range(0, 4)), block(range(4, 5))]  # two blocks, 5 rows: files of 3 and 2 rows
    sink.write(rows, task(1))
    first = files(tmp_path)
    assert len(first) == 2 and ids_in(tmp_path) == list(range(5))

    os.utime(next(iter(tmp_path.glob("*-0.parquet"))), ns=(1, 1))  # a rewrite would be visible even in the same ns
    first = files(tmp_path)
    sink.write(rows, task(1))  # Ray's retry: same task, same rows
    assert files(tmp_path) == first

    sink.write([block(range(10, 12))], task(2))  # another task writes its own file
    assert len(files(tmp_path)) == 3 and ids_in(tmp_path) == [*range(5), 10, 11]

    second = next(iter(tmp_path.glob("*w0_000001-1.parquet")))
    second.write_bytes(second.read_bytes()[:-20])  # the first attempt died inside its second file
    sink.write(rows, task(1))
    assert pq.read_metadata(second).num_rows == 2 and ids_in(tmp_path) == [*range(5), 10, 11]

    second.unlink()  # ... or before it
    sink.write(rows, task(1))
    assert ids_in(tmp_path) == [*range(5), 10, 11]
