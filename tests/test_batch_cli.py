"""The CLI as users run it: `python jobs/generate.py ... key=value` as a subprocess (resume after the
driver is killed, a finished rerun is a no-op, bad config fails before any work) and through
`ray job submit` against a `ray start --head` cluster on 127.0.0.1."""

import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import pyarrow.parquet as pq
import pytest
import ray

from batch_fixtures import (REPO, job_overrides, make_prompts, ray_cluster, tiny_pair, until_accepted,  # noqa: F401
                            write_shards)

GENERATE = [sys.executable, str(REPO / "jobs" / "generate.py")]


def _complete_files(out):
    files = {}
    for p in sorted(out.glob("*.parquet")):
        try:
            files[p.name] = pq.read_table(p, columns=["id"]).column("id").to_pylist()
        except Exception:  # being written
            pass
    return files


def _wait_for_cpus(cpus: float, timeout=60):
    """A killed driver's actors and tasks are torn down by Ray shortly after; wait until `cpus` are free again
    (what was free before it started: another test of this session's cluster may hold some)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if ray.available_resources().get("CPU", 0) >= cpus:
            return
        time.sleep(0.5)
    raise AssertionError(f"cluster still busy: {ray.available_resources()}, {cpus} CPUs were free before")


def test_bad_config_fails_naming_the_key():
    run = subprocess.run([*GENERATE, "generation.temperature=-2", "input.path=/nowhere"], capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 2 and "generation.temperature=-2" in run.stderr, run.stderr
    run = subprocess.run([*GENERATE, "generation.tempreature=1"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "generation.tempreature" in run.stderr, run.stderr


@pytest.mark.ray
@pytest.mark.slow
def test_resume_after_killing_the_driver(ray_cluster, tiny_pair, tmp_path):
    n = 18  # output files hold 3-5 rows here: the driver dies after 2 files, with half the rows to redo
    ids = [f"row-{i:03d}" for i in range(n)]
    write_shards(tmp_path / "in", {"id": ids, "prompt": make_prompts(n, seed=5)}, shards=1)
    out = tmp_path / "out"
    command = [*GENERATE, *job_overrides(tiny_pair, tmp_path / "in", out, **{
        "runtime.ray_address": ray_cluster, "runtime.batch_size": 1, "runtime.max_concurrent_batches": 1,
        "generation.max_new_tokens": 64, "generation.max_batch_size": 1})]  # ~1 s per file: room to kill between
    free_cpus = ray.available_resources().get("CPU", 0)
    driver = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 180
    while len(_complete_files(out)) < 2 and time.time() < deadline and driver.poll() is None:
        time.sleep(0.2)
    driver.send_signal(signal.SIGKILL)  # the driver dies mid-job, with no chance to clean up
    driver.wait()
    _wait_for_cpus(free_cpus)
    before = _complete_files(out)
    assert not (out / "_summary.json").exists() and 3 <= sum(map(len, before.values())) < n, before

    # Pretend the newest file was cut short by the kill: its rows are lost and must be redone.
    newest = max(before, key=lambda name: (out / name).stat().st_mtime)
    (out / newest).write_bytes((out / newest).read_bytes()[:100])
    lost = before.pop(newest)
    kept = {name: (out / name).stat().st_mtime_ns for name in before}

    rerun = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stdout + rerun.stderr
    done = sum(map(len, before.values()))
    assert f"removed {out / newest}" in rerun.stdout and f"resuming: {done} of {n} rows" in rerun.stdout
    after = _complete_files(out)
    all_ids = [i for file_ids in after.values() for i in file_ids]
    assert sorted(all_ids) == ids  # every id exactly once
    assert {name: (out / name).stat().st_mtime_ns for name in before} == kept  # finished rows not rewritten
    new_ids = {i for name, file_ids in after.items() if name not in before for i in file_ids}
    assert set(lost) <= new_ids and len(new_ids) == n - done
    import json
    summary = json.loads((out / "_summary.json").read_text())
    assert summary["run"]["rows"] == n - done and summary["run"]["rows_already_done"] == done
    tokens = sum(pq.read_table(out, columns=["num_generated_tokens"]).column(0).to_pylist())
    assert summary["rows"]["total"] == n and summary["totals"]["num_generated_tokens"] == tokens
    # A finished job's rerun ("nothing to do", files unchanged): test_batch_s3 and test_multinode run it.


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.ray
@pytest.mark.slow
def test_ray_job_submit(tiny_pair, tmp_path):
    """deploy/submit.sh (`ray job submit --working-dir .`) to a separate `ray start --head --block`
    cluster on 127.0.0.1 (its own ports and temp dir), stopped through its process group."""
    bin_dir = os.path.dirname(sys.executable)
    dashboard = _free_port()
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_DATA_DISABLE_PROGRESS_BARS": "1",
           "PATH": f"{bin_dir}:{os.environ['PATH']}"}  # `ray` and the job's `python` from this venv
    env.pop("RAY_ADDRESS", None)
    temp_dir = f"/tmp/rb_{os.getpid()}"  # Ray's socket paths must stay short: not under pytest's tmp_path
    head = subprocess.Popen(
        ["ray", "start", "--head", "--block", "--node-ip-address=127.0.0.1", f"--port={_free_port()}",
         "--num-cpus=2", "--object-store-memory=100000000", "--include-dashboard=true",
         "--dashboard-host=127.0.0.1", f"--dashboard-port={dashboard}", f"--ray-client-server-port={_free_port()}",
         f"--dashboard-agent-listen-port={_free_port()}", f"--metrics-export-port={_free_port()}",
         f"--temp-dir={temp_dir}"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        write_shards(tmp_path / "in", {"prompt": make_prompts(6, seed=7)}, shards=1)
        out = tmp_path / "out"
        submit_env = {**env, "RAY_ADDRESS": f"http://127.0.0.1:{dashboard}", "CONFIG": "", "RUNTIME_ENV": ""}
        submit = [str(REPO / "deploy" / "submit.sh"), *job_overrides(tiny_pair, tmp_path / "in", out)]
        run = until_accepted(submit, submit_env, "submitted successfully", dashboard=submit_env["RAY_ADDRESS"])
        assert run.returncode == 0 and "succeeded" in run.stdout, run.stdout + run.stderr
        assert "6 rows (6 ok, 0 failed)" in run.stdout
        assert pq.read_table(out).num_rows == 6 and (out / "_summary.json").exists()
    finally:  # its processes share the session we started; a graceful stop takes ~30 s, so be brief
        os.killpg(head.pid, signal.SIGTERM)
        try:
            head.wait(timeout=5)
        except subprocess.TimeoutExpired:
            os.killpg(head.pid, signal.SIGKILL)
            head.wait(timeout=30)
        shutil.rmtree(temp_dir, ignore_errors=True)
