"""The batch job through a real S3 endpoint: a moto server on 127.0.0.1, reached over HTTP by the
driver and the Ray workers via s3fs, for input and output. The input has no id column (generated ids).

The pair's draft is mostly accepted and K is fixed, so each row's steps are its own: every row, greedy or
sampled, equals the target alone and ran exactly the steps the same row runs in this process, where a stop
token is seen arriving as an accepted draft (`speculation.py`)."""

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batch_fixtures import (AWS_ENV, agreeing_pair, check_output_invariants, job_config, make_prompts,  # noqa: F401
                            ray_cluster, s3_endpoint)
from domino_ray.batch.io import read_json, resolve
from domino_ray.batch.job import run_job
from domino_ray.config import S3Config
from domino_ray.target.loading import load_tokenizer
from domino_ray.sample.params import SamplingParams
from speculation import check_speculated, speculate_in_process

K = 4
MAX_NEW = 12

pytestmark = pytest.mark.ray


def test_s3_in_and_out(ray_cluster, agreeing_pair, s3_endpoint, monkeypatch):
    for k, v in AWS_ENV.items():
        monkeypatch.setenv(k, v)
    import s3fs

    fs = s3fs.S3FileSystem(endpoint_url=s3_endpoint, skip_instance_cache=True)
    fs.mkdir("prompts-bucket")
    prompts = make_prompts(16, seed=3)
    # Odd rows sampled, each with its own seed; a JSON string is one of the forms the column takes.
    overrides = [None if i % 2 == 0 else f'{{"temperature": 0.8, "seed": {i}}}' for i in range(len(prompts))]
    for shard in range(2):
        part = slice(shard * 8, (shard + 1) * 8)
        with fs.open(f"prompts-bucket/in/part-{shard}.parquet", "wb") as f:
            pq.write_table(pa.table({"prompt": prompts[part], "sampling_params": overrides[part],
                                     "shard": [shard] * 8}), f)
    extra = {"input.s3.endpoint_url": s3_endpoint, "output.s3.endpoint_url": s3_endpoint,
             "draft.num_draft_tokens": K, "generation.max_new_tokens": MAX_NEW}
    cfg = job_config(agreeing_pair, "s3://prompts-bucket/in/", "s3://prompts-bucket/out", **extra)
    summary = run_job(cfg, log=lambda *_: None)

    out = resolve("s3://prompts-bucket/out", S3Config(endpoint_url=s3_endpoint))
    assert read_json(out, "_summary.json") == summary
    files = [p for p in fs.ls("prompts-bucket/out") if p.endswith(".parquet")]
    table = pa.concat_tables([pq.read_table(fs.open(p, "rb")) for p in files])
    ids = table.column("id").to_pylist()
    assert table.schema.field("id").type == pa.string() and all(len(i) == 16 for i in ids)
    check_output_invariants(table, summary, ids)
    assert sorted(table.column("prompt").to_pylist()) == sorted(prompts)
    assert summary["rows"]["failed"] == 0

    rows = sorted(table.to_pylist(), key=lambda r: prompts.index(r["prompt"]))
    tokenizer = load_tokenizer(agreeing_pair[0])
    params = [SamplingParams(max_new_tokens=MAX_NEW, temperature=0.8 if o else 0.0, seed=i if o else None)
              for i, o in enumerate(overrides)]
    here = speculate_in_process(*agreeing_pair, [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts],
                                params, K)
    for row, same in zip(rows, here):
        assert row["generated_tokens"] == same.token_ids == same.target_only, row["prompt"]
        assert row["acceptance_histogram"] == same.acceptance_histogram, row["prompt"]
    check_speculated([r["acceptance_histogram"] for r in rows], sum(r["num_generated_tokens"] for r in rows))
    assert any(same.stop_in_accepted_run for same in here)
    assert sum(r["num_accepted_draft_tokens"] for r in rows[1::2]) > 0  # sampled rows accepted drafts too

    logs = []
    assert run_job(cfg, log=logs.append) == summary  # finished: a rerun is a no-op that says so
    assert any("nothing to do" in line for line in logs)
    assert sorted(p for p in fs.ls("prompts-bucket/out") if p.endswith(".parquet")) == sorted(files)
