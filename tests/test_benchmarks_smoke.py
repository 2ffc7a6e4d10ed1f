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
