"""bench_peers without vLLM (`--ours-only`, toy sizes): our two modes generate the same greedy tokens, the
figures obey their invariants, the step profile adds up; and a missing vLLM venv is a clear error."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "bench_peers.py"


def run(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout,
                          cwd=SCRIPT.parent.parent, env=os.environ)


@pytest.mark.slow
def test_peers_ours_only_smoke(tmp_path):
    out = tmp_path / "peers.json"
    result = run("--ours-only", "--prompts", "4", "--max-new-tokens", "12", "--rows", "2", "--threads", "1",
                 "--profile", "--profile-steps", "4", "--json", str(out))
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(out.read_text())
    rows = {r["mode"]: r for r in report["results"]}
    assert set(rows) == {"ours-target-only", "ours-domino"} and report["vllm_errors"] == {}
    for r in rows.values():
        assert r["tokens"] == 4 * 12  # ignore_eos: every prompt gets its full budget
        assert r["greedy_agreement_with_ours"] == {"equal": 4, "total": 4, "mean_common_prefix": 12.0}
        assert all(math.isfinite(x) and x > 0 for x in r["tokens_per_s"]) and r["vs_vllm_target_only"] is None
    assert rows["ours-target-only"]["vs_ours_target_only"] == 1.0
    assert rows["ours-domino"]["vs_ours_target_only"] == pytest.approx(
        rows["ours-domino"]["median_tokens_per_s"] / rows["ours-target-only"]["median_tokens_per_s"], abs=0.01)
    assert rows["ours-target-only"]["mean_acceptance_length"] is None
    assert 1.0 < rows["ours-domino"]["mean_acceptance_length"] <= 8 + 1  # the demo draft: K = 8, and it accepts
    assert [p["speculative"] for p in report["profiles"]] == [False, True]
    for prof in report["profiles"]:
        parts = prof["self_cpu_ms_per_step"]
        assert prof["wall_ms_per_step"] > 0 and parts["gemm"] > 0 and all(v >= 0 for v in parts.values())
        assert prof["profiled_ms_per_step"] == pytest.approx(
            sum(parts.values()) + prof["python_and_dispatch_ms_per_step"], abs=0.05)
    assert "ours-domino" in result.stdout and "4/4 equal to ours" in result.stdout


def test_peers_without_vllm_venv_says_how_to_get_it(tmp_path):
    result = run("--vllm-python", str(tmp_path / "missing" / "python"))
    assert result.returncode != 0 and "make peers-venv" in result.stderr and "--ours-only" in result.stderr
    result = run("--vllm-modes", "vllm-eagle")
    assert result.returncode != 0 and "--vllm-modes: unknown ['vllm-eagle']" in result.stderr
