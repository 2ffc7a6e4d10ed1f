"""Rows that break things: a per-request failure of any type is that row's error row, and a row that
crashes the engine itself fails the job naming the row instead of restarting actors forever."""

import asyncio

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batch_fixtures import job_config, ray_cluster, REPO, tiny_pair  # noqa: F401
from domino_ray.batch.job import run_job
from domino_ray.batch.predictor import RowCrashesEngine
from domino_ray.engine.loop import EngineLoop
from domino_ray.engine.request import Request
from domino_ray.engine.core import SpecEngine
from domino_ray.sample.params import SamplingParams
from faulty_predictor import faulty_predictor
from tiny_models import tiny_target


def test_any_error_adding_a_request_fails_only_that_request():
    """EngineLoop._add: a non-ValueError from add_request (here an AttributeError) fails the request
    alone; the loop stays alive and serves the next request."""
    loop = EngineLoop(SpecEngine(tiny_target("qwen3", seed=3), None, max_rows=2))

    async def main():
        bad = loop.submit(Request("bad", [1, 2, 3], None))
        with pytest.raises(AttributeError):
            await bad.completion()
        return await loop.submit(Request("good", [1, 2, 3], SamplingParams(max_new_tokens=3))).completion()

    try:
        assert len(asyncio.run(main()).token_ids) == 3 and loop.alive
    finally:
        loop.stop()


JOB = {"generation.max_new_tokens": 4, "runtime.batch_size": 2}


@pytest.mark.ray
def test_row_that_crashes_the_engine_fails_the_job_naming_it(ray_cluster, tiny_pair, tmp_path):
    """A fatal engine error on one row (test fault: the engine thread raises admitting it): the first
    crash makes its rows suspects, a restarted actor runs them alone, the poison row crashes alone, and
    the job fails naming it; it does not loop through actor restarts. (The job runs in this process:
    the faulty actor class is an argument of run_job, which the CLI does not take.)"""
    ids = [f"r{i}" for i in range(6)]
    pq.write_table(pa.table({"id": ids, "prompt": ["the quick brown fox"] * 6}), tmp_path / "in.parquet")
    cfg = job_config(tiny_pair, str(tmp_path / "in.parquet"), str(tmp_path / "out"), **JOB)
    with pytest.raises(RowCrashesEngine) as failure:
        run_job(cfg, log=lambda *_: None, predictor=faulty_predictor(crash_engine_on_row="r3"))
    assert "input row id='r3' crashes the engine" in str(failure.value) and "test fault" in str(failure.value)
    assert not (tmp_path / "out" / "_summary.json").exists()


def test_cli_exits_1_naming_a_row_that_crashes_the_engine(monkeypatch, capsys):
    """jobs/generate.py turns RowCrashesEngine into exit status 1 and a one-line error (the job above
    runs through run_job itself)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("generate_job", REPO / "jobs" / "generate.py")
    generate = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(generate)

    def crashes(cfg):
        raise RowCrashesEngine("input row id='r3' crashes the engine (engine loop failed: test fault)")
    monkeypatch.setattr("domino_ray.batch.job.run_job", crashes)
    assert generate.main([]) == 1
    assert "error: input row id='r3' crashes the engine" in capsys.readouterr().err
