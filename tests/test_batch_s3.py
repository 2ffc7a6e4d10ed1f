"""The batch job through a real S3 endpoint: a moto server on 127.0.0.1, reached over HTTP by the
driver and the Ray workers via s3fs, for input and output. The input has no id column (generated ids)."""

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batch_fixtures import (AWS_ENV, check_output_invariants, job_config, make_prompts, ray_cluster,  # noqa: F401
                            s3_endpoint, tiny_pair)
from domino_ray.batch.io import read_json, resolve
from domino_ray.batch.job import run_job
from domino_ray.config import S3Config

pytestmark = pytest.mark.ray


def test_s3_in_and_out(ray_cluster, tiny_pair, s3_endpoint, monkeypatch):
    for k, v in AWS_ENV.items():
        monkeypatch.setenv(k, v)
    import s3fs

    fs = s3fs.S3FileSystem(endpoint_url=s3_endpoint, skip_instance_cache=True)
    fs.mkdir("prompts-bucket")
    prompts = make_prompts(10, seed=3)
    for shard in range(2):
        with fs.open(f"prompts-bucket/in/part-{shard}.parquet", "wb") as f:
            pq.write_table(pa.table({"prompt": prompts[shard * 5:(shard + 1) * 5], "shard": [shard] * 5}), f)
    extra = {"input.s3.endpoint_url": s3_endpoint, "output.s3.endpoint_url": s3_endpoint}
    cfg = job_config(tiny_pair, "s3://prompts-bucket/in/", "s3://prompts-bucket/out", **extra)
    summary = run_job(cfg, log=lambda *_: None)

    out = resolve("s3://prompts-bucket/out", S3Config(endpoint_url=s3_endpoint))
    assert read_json(out, "_summary.json") == summary
    files = [p for p in fs.ls("prompts-bucket/out") if p.endswith(".parquet")]
    table = pa.concat_tables([pq.read_table(fs.open(p, "rb")) for p in files])
    ids = table.column("id").to_pylist()
    assert table.schema.field("id").type == pa.string() and all(len(i) == 16 for i in ids)
    check_output_invariants(table, summary, ids)
    assert sorted(table.column("prompt").to_pylist()) == sorted(prompts)
    assert summary["rows"]["failed"] == 0 and summary["finish_reasons"]["length"] == 10

    logs = []
    assert run_job(cfg, log=logs.append) == summary  # finished: a rerun is a no-op that says so
    assert any("nothing to do" in line for line in logs)
    assert sorted(p for p in fs.ls("prompts-bucket/out") if p.endswith(".parquet")) == sorted(files)
