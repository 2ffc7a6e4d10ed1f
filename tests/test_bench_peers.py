"""bench_peers without vLLM (`--ours-only`, toy sizes), on the demo pair and on the SmolLM2 pair: our modes
generate the same greedy tokens, the figures obey their invariants, the step profile adds up; and a missing
vLLM venv or SmolLM2 conversion is a clear error."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from domino_ray.backend.library import has_avx512

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "bench_peers.py"


def run(*args: str, timeout: int = 300, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout,
                          cwd=SCRIPT.parent.parent, env={**os.environ, **(env or {})})


@pytest.mark.slow
def test_peers_ours_only_smoke(tmp_path):
    """The demo pair at two batch sizes, with the adaptive mode beside today's two (`--domino-widths auto,max`)."""
    out = tmp_path / "peers.json"
    result = run("--ours-only", "--prompts", "4", "--max-new-tokens", "12", "--rows", "1,2", "--threads", "1",
                 "--domino-widths", "auto,max", "--profile", "--profile-steps", "4", "--json", str(out))
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(out.read_text())
    modes = ("ours-target-only", "ours-domino-auto", "ours-domino-k8")  # the demo draft: K = 8
    entries = {(r["batch_size"], r["mode"]): r for r in report["results"]}
    assert set(entries) == {(rows, mode) for rows in (1, 2) for mode in modes} and report["vllm_errors"] == []
    for (rows, mode), r in entries.items():
        assert r["tokens"] == 4 * 12  # ignore_eos: every prompt gets its full budget
        assert r["greedy_agreement_with_ours"] == {"equal": 4, "total": 4, "mean_common_prefix": 12.0}
        assert all(math.isfinite(x) and x > 0 for x in r["tokens_per_s"]) and r["vs_vllm_target_only"] is None
        assert r["vs_ours_target_only"] == pytest.approx(
            r["median_tokens_per_s"] / entries[rows, "ours-target-only"]["median_tokens_per_s"], abs=0.01)
        if mode == "ours-target-only":
            assert r["mean_acceptance_length"] is None and r["vs_ours_target_only"] == 1.0
        elif mode == "ours-domino-k8":
            assert 1.0 < r["mean_acceptance_length"] <= 8 + 1  # and the demo draft accepts
        else:  # the adaptive width may keep to W = 0 in a 12-token run (one unlucky first drafting step at 2 rows)
            assert 1.0 <= r["mean_acceptance_length"] <= 8 + 1
    assert [(p["mode"], p["rows"], p["speculative"]) for p in report["profiles"]] == [
        ("ours-target-only", 2, False), ("ours-domino-auto", 2, True), ("ours-domino-k8", 2, True)]
    for prof in report["profiles"]:
        parts = prof["self_cpu_ms_per_step"]
        assert prof["wall_ms_per_step"] > 0 and parts["gemm"] > 0 and all(v >= 0 for v in parts.values())
        assert prof["profiled_ms_per_step"] == pytest.approx(
            sum(parts.values()) + prof["python_and_dispatch_ms_per_step"], abs=0.05)
    assert "ours-domino-auto" in result.stdout and result.stdout.count("4/4 equal to ours") == 6


@pytest.mark.slow
@pytest.mark.skipif(not has_avx512(), reason="for AVX-512 machines")
def test_peers_isa_avx2_runs_ours_within_avx2(tmp_path):
    """`--isa avx2`: torch's kernels capped at AVX2 and ours built for haswell, in the run that reports them."""
    out = tmp_path / "peers.json"
    result = run("--isa", "avx2", "--ours-only", "--prompts", "2", "--max-new-tokens", "8", "--rows", "1",
                 "--threads", "1", "--domino-widths", "max", "--json", str(out))
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["meta"]["aten_capability"] == "AVX2" and "-march=haswell" in report["meta"]["our_kernel_flags"]
    assert all(r["greedy_agreement_with_ours"]["equal"] == 2 for r in report["results"])


@pytest.mark.slow
def test_peers_smollm2_ours_only_smoke(tmp_path):
    """`--pair smollm2`: chat prompts stopping at EOS, every batch size of `--rows` for every mode, our
    target-only and fixed-K modes token for token equal. The adaptive mode is left to the demo smoke: at
    start-up it times every step width, a minute of SmolLM2 steps here."""
    from domino_ray.target.smollm2 import cache_dir, is_converted

    if not is_converted():
        pytest.skip(f"SmolLM2 is not converted at {cache_dir()}: run `make smollm2` (`make test` does)")
    out = tmp_path / "peers.json"
    result = run("--ours-only", "--pair", "smollm2", "--prompts", "2", "--max-new-tokens", "8", "--rows", "1,2",
                 "--domino-widths", "max", "--threads", "1", "--json", str(out))
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["vllm_errors"] == [] and report["meta"]["vllm_ld_preload"] is None
    assert report["meta"]["args"]["ignore_eos"] == "False"
    entries = {(r["batch_size"], r["mode"]): r for r in report["results"]}
    modes = ("ours-target-only", "ours-domino-k8")  # the draft proposes at most K = 8
    assert set(entries) == {(rows, mode) for rows in (1, 2) for mode in modes}
    for (rows, mode), r in entries.items():
        assert r["tokens"] <= 2 * 8 and r["tokens"] == entries[rows, "ours-target-only"]["tokens"]
        assert r["greedy_agreement_with_ours"]["equal"] == r["greedy_agreement_with_ours"]["total"] == 2
        assert r["startup_s"] >= 0 and all(math.isfinite(x) and x > 0 for x in r["tokens_per_s"])
        if mode == "ours-target-only":
            assert r["mean_acceptance_length"] is None and r["vs_ours_target_only"] == 1.0
        else:
            assert 1.0 <= r["mean_acceptance_length"] <= 8 + 1
    assert result.stdout.count("stopping at EOS") == 2


def test_peers_without_vllm_venv_or_smollm2_says_how_to_get_it(tmp_path):
    result = run("--vllm-python", str(tmp_path / "missing" / "python"))
    assert result.returncode != 0 and "make peers-venv" in result.stderr and "--ours-only" in result.stderr
    result = run("--vllm-modes", "vllm-eagle")
    assert result.returncode != 0 and "--vllm-modes: ['vllm-eagle'] cannot run --pair demo" in result.stderr
    result = run("--pair", "smollm2", "--vllm-modes", "vllm-dflash")  # its draft's pruned vocabulary
    assert result.returncode != 0 and "['vllm-dflash'] cannot run --pair smollm2" in result.stderr
    result = run("--pair", "smollm2", "--ours-only", env={"DOMINO_RAY_SMOLLM2_DIR": str(tmp_path / "none")})
    assert result.returncode != 0 and "run `make smollm2` first" in result.stderr


def test_step_profiles_sort_ours_and_vllms_ops_into_the_same_kinds():
    """Both engines' step profiles (ours: aten ops; vLLM's: its own CPU ops and the compiled graph that runs its
    fused elementwise kernels) add up to their profiled time, kind by kind."""
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        from bench_peers import step_profile
    finally:
        sys.path.remove(str(SCRIPT.parent))
    events = [("_C::onednn_mm", 8000.0, 484), ("_C::cpu_attention_with_kv_cache", 2000.0, 120),
              ("## Call CompiledFxGraph abc ##", 600.0, 4), ("aten::mm", 400.0, 4), ("aten::slice", 100.0, 900)]
    prof = step_profile("vllm-target-only", 16, 4, wall_ms=3.0, profiled_ms=3.1, events=events)
    assert prof["self_cpu_ms_per_step"] == {"gemm": 2.1, "attention": 0.5, "fused elementwise (compiled)": 0.15,
                                            "other ops": 0.03}
    ours = [("domino_ray::linear", 4000.0, 400), ("mkl::_mkl_linear", 400.0, 4), ("domino_ray::decode_attention",
            800.0, 120), ("domino_ray::rms_norm", 200.0, 240), ("domino_ray::rotary", 40.0, 120)]
    assert step_profile("ours-target-only", 16, 4, wall_ms=2.0, profiled_ms=1.5, events=ours)[
        "self_cpu_ms_per_step"] == {"gemm": 1.1, "attention": 0.2, "norms and rotary (ours)": 0.06}
    assert prof["python_and_dispatch_ms_per_step"] == pytest.approx(3.1 - 2.775, abs=0.01)
    assert prof["op_calls_per_step"] == 378.0 and prof["top_ops"][0] == {
        "op": "_C::onednn_mm", "ms_per_step": 2.0, "calls_per_step": 121.0}


def test_cpu_kind_names_the_widest_isa_class_of_the_flags():
    """Each figure carries the CPU's model and ISA class: the widest class whose flag the CPU has. Fails against a
    parser that stops at the first class it finds in narrow-to-wide order (an AMX Xeon also lists avx2 and
    avx512f), or that calls a CPU without a flags line "below AVX2"."""
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        from bench_peers import cpu_kind
    finally:
        sys.path.remove(str(SCRIPT.parent))

    def cpuinfo(model: str, flags: str) -> str:  # two processors, as /proc/cpuinfo lists them
        return "".join(f"processor\t: {i}\nmodel name\t: {model}\nflags\t\t: {flags}\n\n" for i in range(2))

    base = "fpu sse sse2 ssse3 fma sse4_1 sse4_2 avx"
    cases = {"AVX2": f"{base} avx2 bmi2", "AVX-512": f"{base} avx2 avx512f avx512bw avx512_vnni",
             "AVX512_BF16": f"{base} avx2 avx512f avx512_bf16",
             "AMX": f"{base} avx2 avx512f avx512_bf16 amx_bf16 amx_tile", "below AVX2": base}
    for isa, flags in cases.items():
        kind = cpu_kind(cpuinfo("AMD EPYC 9R14", flags))
        assert kind["isa"] == isa and kind["model"] == "AMD EPYC 9R14" and kind["label"] == f"AMD EPYC 9R14 ({isa})"
        named = {"avx2", "avx512f", "avx512_bf16", "amx_bf16"} & set(flags.split())
        assert set(kind["isa_flags"]) == named
    assert cpu_kind("")["isa"] == "unknown"  # no flags line (not Linux): not claimed to be below AVX2
