"""The benchmark scripts stay runnable (tiny sizes); their figures live in BENCHMARKS.md."""

import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"


@pytest.mark.slow
@pytest.mark.parametrize("script", ["bench_engine_cpu.py", "bench_gpu.py"])
def test_benchmark_smoke(script):
    result = subprocess.run([sys.executable, str(BENCH / script), "--smoke"], capture_output=True, text=True,
                            timeout=300, cwd=BENCH.parent)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "batch" in result.stdout and "tok" in result.stdout


@pytest.mark.slow
def test_demo_pair_benchmark_smoke(tmp_path):
    """bench_demo_pair on the shipped pair at toy sizes: it runs, checks its outputs against target-only, and
    writes its JSON with a speed-up and an acceptance length for every draft variant."""
    import json

    out = tmp_path / "demo.json"
    result = subprocess.run([sys.executable, str(BENCH / "bench_demo_pair.py"), "--prompts", "3", "--max-new-tokens",
                             "12", "--batch-sizes", "2", "--repeats", "1", "--threads", "1", "--json", str(out)],
                            capture_output=True, text=True, timeout=300, cwd=BENCH.parent)
    assert result.returncode == 0, result.stderr[-3000:]
    drafts = json.loads(out.read_text())["results"]["batch 2"]["drafts"]
    assert set(drafts) == {"target-only", "domino", "domino-base-only"}
    assert all(d["speedup"] > 0 for d in drafts.values())
    assert drafts["domino"]["mean_acceptance_length"] > 1.0
