"""The batch job's Parquet sink when Ray runs a write task again (its node lost after the files landed,
before the driver heard back): finished files stay as they are, partial or missing ones are written again,
and the rows come out exactly once. The task is called directly, twice, as Ray's retry calls it."""

import os
import time

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
from ray.data._internal.execution.interfaces.task_context import TaskContext

from batch_fixtures import s3_endpoint  # noqa: F401
from domino_ray.batch.job import ParquetSinkKeepingFinishedFiles

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


def test_a_retried_write_on_s3_keeps_its_finished_objects(s3_endpoint, monkeypatch):
    """The same through s3fs against a real S3 endpoint (moto on 127.0.0.1), as the job writes to `s3://`:
    an object stays (its LastModified too) and a missing one is written again."""
    import s3fs

    from batch_fixtures import AWS_ENV
    from domino_ray.batch.io import resolve
    from domino_ray.config import S3Config

    for key, value in AWS_ENV.items():
        monkeypatch.setenv(key, value)
    client = s3fs.S3FileSystem(endpoint_url=s3_endpoint, skip_instance_cache=True)
    client.mkdir("retry-bucket")
    out = resolve("s3://retry-bucket/out", S3Config(endpoint_url=s3_endpoint))
    sink = ParquetSinkKeepingFinishedFiles(out.path, filesystem=out.fs, arrow_parquet_args={"schema": SCHEMA},
                                           max_rows_per_file=3)
    rows = [block(range(5))]
    sink.write(rows, task(1))
    objects = lambda: {p: client.info(p)["LastModified"] for p in sorted(client.ls("retry-bucket/out", refresh=True))}
    first = objects()
    assert len(first) == 2
    time.sleep(1.1)  # LastModified has one-second resolution
    sink.write(rows, task(1))
    assert objects() == first
    client.rm(sorted(first)[1])
    sink.write(rows, task(1))
    assert sorted(objects()) == sorted(first)
    assert sorted(pq.read_table("retry-bucket/out", filesystem=out.fs).column("id").to_pylist()) == list(range(5))
