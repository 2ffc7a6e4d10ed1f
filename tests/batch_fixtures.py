"""Shared pieces of the batch-job tests: one local Ray cluster per session, a saved tiny model pair,
input writers, and the output invariants every job must satisfy.

Test modules import the fixtures by name (`from batch_fixtures import ray_cluster, tiny_pair`).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from domino_ray.batch.schema import GENERATED_FIELDS
from domino_ray.config import load_config
from tiny_models import CORPUS, save_agreeing_pair, save_tiny_pair

REPO = Path(__file__).resolve().parents[1]
AWS_ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}
WORDS = " ".join(CORPUS[:3]).split()


@pytest.fixture(scope="session")
def ray_cluster():
    """A small local Ray cluster (2 CPUs, small object store); yields its GCS address for subprocess drivers."""
    import ray

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_DATA_DISABLE_PROGRESS_BARS", "1")
    # Lighter daemons for a test cluster (and the clusters tests start as subprocesses, which inherit this): the log
    # monitor lists the log directory every 0.5 s instead of every 0.1 s, the dashboard agent samples the node's
    # processes every 30 s instead of 5 s; on a 20 s job that halved both (0.22 -> 0.10 and 0.30 -> 0.20 CPU s)
    os.environ.setdefault("RAY_LOG_MONITOR_MANY_FILES_THRESHOLD", "0")
    os.environ.setdefault("REPORTER_UPDATE_INTERVAL_MS", "30000")
    if ray.is_initialized():  # another test module of this session started it
        yield ray.get_runtime_context().gcs_address
        return
    # Workers get fake AWS credentials for the moto S3 server (they read the standard AWS environment).
    ray.init(address="local", num_cpus=2, object_store_memory=150 * 1024**2, include_dashboard=False,
             runtime_env={"env_vars": AWS_ENV}, logging_level="WARNING")
    yield ray.get_runtime_context().gcs_address
    ray.shutdown()


@pytest.fixture(scope="module")
def s3_endpoint():
    """A moto S3 server on 127.0.0.1 (a free port), reached over real HTTP; yields its URL."""
    import socket

    from moto.server import ThreadedMotoServer

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    yield f"http://127.0.0.1:{port}"
    server.stop()


@pytest.fixture(scope="session")
def tiny_pair(tmp_path_factory):
    """(target_dir, draft_dir): tiny Qwen3 target + tokenizer and a Domino draft, float64 so greedy
    comparisons never flip on near-ties."""
    return save_tiny_pair(tmp_path_factory.mktemp("pair"), dtype=torch.float64)


@pytest.fixture(scope="session")
def agreeing_pair(tmp_path_factory):
    """(target_dir, draft_dir) of `save_agreeing_pair`: a draft the target mostly accepts, for the tests of
    the promise (speculative output == target-only) that must run accepted drafts to mean anything."""
    return save_agreeing_pair(tmp_path_factory.mktemp("agreeing_pair"))


def prompt_near_limit(target_dir, limit: int = 512, room: int = 6) -> str:
    """A plain prompt (no chat template) of at least `limit - room` and fewer than `limit` tokens: its
    max_new_tokens past `room` are capped by the length rule (frontend.requests)."""
    from domino_ray.target.loading import encode_prompt, load_tokenizer

    tokenizer = load_tokenizer(target_dir)
    text = " ".join(WORDS * (limit // len(WORDS) + 1))  # at least a token a word: over `limit` tokens

    def count(chars: int) -> int:
        return len(encode_prompt(tokenizer, prompt=text[:chars], chat_template=False))

    lo, hi = 1, len(text)  # the shortest prefix of `limit - room` tokens or more
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (mid + 1, hi) if count(mid) < limit - room else (lo, mid)
    assert limit - room <= count(lo) < limit, count(lo)
    return text[:lo]


def make_prompts(n: int, seed: int = 0) -> list[str]:
    g = torch.Generator().manual_seed(seed)
    return [" ".join(WORDS[j] for j in torch.randint(len(WORDS), (int(k),), generator=g).tolist())
            for k in torch.randint(2, 9, (n,), generator=g)]


def write_shards(directory: Path, columns: dict[str, list], shards: int = 2, schema: pa.Schema | None = None):
    """Split columns into `shards` Parquet files under `directory`."""
    directory.mkdir(parents=True, exist_ok=True)
    table = pa.table(columns, schema=schema)
    step = -(-table.num_rows // shards)
    for s in range(shards):
        pq.write_table(table.slice(s * step, step), directory / f"part-{s}.parquet")
    return directory


def job_overrides(pair, input_path, output_path, **extra) -> list[str]:
    target, draft = pair
    base = {"model.source": target, "draft.source": draft, "input.path": input_path, "output.path": output_path,
            "runtime.cpus_per_actor": 0.5, "runtime.batch_size": 4, "runtime.max_concurrent_batches": 2,
            "generation.max_new_tokens": 12, "generation.max_batch_size": 8}
    base.update(extra)
    return [f"{k}={v}" for k, v in base.items()]


def job_config(pair, input_path, output_path, **extra):
    return load_config(None, job_overrides(pair, input_path, output_path, **extra))


def check_output_invariants(table: pa.Table, summary: dict, input_ids: list, id_column: str = "id"):
    """Schema, one row per input id, per-row statistics, and summary totals == column sums."""
    for f in GENERATED_FIELDS:
        assert table.schema.field(f.name).type == f.type, f.name
    ids = table.column(id_column).to_pylist()
    assert len(ids) == len(set(ids)) and sorted(map(str, ids)) == sorted(map(str, input_ids))
    rows = table.to_pylist()
    for r in rows:
        assert r["num_generated_tokens"] == len(r["generated_tokens"])
        assert sum(r["acceptance_histogram"]) == r["num_spec_steps"] == sum(r["verify_width_histogram"])
        assert len(r["acceptance_histogram"]) == len(r["verify_width_histogram"]) == r["num_spec_tokens"] + 1
        assert r["num_draft_tokens"] <= sum(w * n for w, n in enumerate(r["verify_width_histogram"]))
        if r["finish_reason"] == "error":
            assert r["error"] and r["num_generated_tokens"] == 0
        else:
            assert r["error"] is None and r["finish_reason"] in ("stop", "length")
            assert r["num_generated_tokens"] == 1 + r["num_spec_steps"] + r["num_accepted_draft_tokens"]
    totals = summary["totals"]
    for name in totals:
        assert totals[name] == sum(r[name] for r in rows), name
    failed = sum(r["finish_reason"] == "error" for r in rows)
    assert summary["rows"] == {"total": len(rows), "ok": len(rows) - failed, "failed": failed,
                               "unique_ids": len(rows)}
    steps = totals["num_spec_steps"]
    hist = [sum(col) for col in zip(*(r["acceptance_histogram"] for r in rows))]
    assert summary["acceptance_histogram"] == hist and sum(hist) == steps
    widths = [sum(col) for col in zip(*(r["verify_width_histogram"] for r in rows))]
    assert summary["verify_width_histogram"] == widths and sum(widths) == steps
    if steps:
        assert summary["mean_acceptance_length"] == pytest.approx(1 + totals["num_accepted_draft_tokens"] / steps)


def python() -> str:
    return sys.executable


def until_accepted(command: list[str], env: dict, accepted: str, timeout: float = 120, run_timeout: float = 300,
                   dashboard: str | None = None) -> subprocess.CompletedProcess:
    """Run a `ray job submit` / `serve deploy` command again while the dashboard or its agent is still starting
    (the command says so and printed no `accepted` line: nothing was submitted); the first run that got through.
    `dashboard` (its http URL): first wait until it answers, a cheap poll (each early command is a ~2.5 s process)."""
    deadline = time.monotonic() + timeout
    while dashboard is not None and not _answers(f"{dashboard}/api/version"):
        if time.monotonic() > deadline:
            raise AssertionError(f"{dashboard} did not answer in {timeout} s")
        time.sleep(0.5)
    while True:
        run = subprocess.run(command, env=env, capture_output=True, text=True, timeout=run_timeout, cwd=REPO)
        out = run.stdout + run.stderr
        not_ready = accepted not in out and any(m in out for m in ("Connection", "No available agent", "503"))
        if not not_ready or time.monotonic() > deadline:
            return run
        time.sleep(1)


def _answers(url: str) -> bool:
    """Whether `url` answers 200 now."""
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status == 200
    except OSError:  # not listening yet
        return False
