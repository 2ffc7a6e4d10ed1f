"""The benchmark scripts stay runnable (tiny sizes) and the figures they report obey their invariants:
the same token ids across modes (compared through each run's `tokens_sha256`, a hash of its outputs' ids:
equal counts would let a wrong token through), acceptance lengths within [1, K+1], ratios that match their
parts. Their real figures live in BENCHMARKS.md."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from batch_fixtures import ray_cluster  # noqa: F401

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"


def run_script(script: str, *args: str, env: dict | None = None, timeout: int = 300) -> str:
    result = subprocess.run([sys.executable, str(BENCH / script), *args], capture_output=True, text=True,
                            timeout=timeout, cwd=BENCH.parent, env={**os.environ, **(env or {})})
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def positive(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def check_acceptance(tau: float, per_position: list[float], k: int, decimals: int = 3):
    """tau = 1 + accepted/steps = 1 + the sum of per-position rates; a draft position is accepted only
    after the previous one was, so the rates never rise."""
    assert 1.0 <= tau <= k + 1, (tau, k)
    assert len(per_position) == k and all(0.0 <= x <= 1.0 for x in per_position)
    assert all(a >= b for a, b in zip(per_position, per_position[1:])), per_position
    assert tau == pytest.approx(1 + sum(per_position), abs=k * 10 ** -decimals)


def test_policy_benchmark_smoke(tmp_path):
    """bench_policy at a toy size: every configuration generated target-only's token ids (the script asserts it
    too), each ran every repeat, the medians and the ratios are those of the runs, and the paired ratio lies
    within the runs' own auto / target-only ratios.
    Fails if a configuration's tokens differ: checked by removing the script's own assert and making
    `greedy_accept`'s bonus after a rejected first draft the next position's choice at K >= 3."""
    out = tmp_path / "policy.json"
    run_script("bench_policy.py", "--threads", "1", "--repeats", "3", "--batch-sizes", "1", "--drafts", "random",
               "--max-new-tokens", "6", "--json", str(out))
    cell = json.loads(out.read_text())["results"]["random batch 1"]
    runs, median = cell["runs_tokens_per_s"], cell["tokens_per_s"]
    assert set(runs) == set(median) == set(cell["tokens_sha256"]) == {"target-only", "auto",
                                                                      *(f"K={k}" for k in range(1, 9))}
    assert set(cell["tokens_sha256"].values()) == {cell["tokens_sha256"]["target-only"]}
    for config, rates in runs.items():
        assert len(rates) == 3 and all(positive(x) for x in rates)
        assert median[config] == pytest.approx(sorted(rates)[1], abs=0.05)
    ratios = sorted(a / b for a, b in zip(runs["auto"], runs["target-only"]))
    assert ratios[0] - 1e-3 <= cell["auto_over_target_only_paired"] <= ratios[-1] + 1e-3
    assert cell["auto_over_target_only"] == pytest.approx(median["auto"] / median["target-only"], abs=2e-3)
    assert 2 <= sum(cell["auto_widths"]) <= 10  # two rows, their 5 tokens past the prefill's first in 1-5 steps each


def test_w0_step_benchmark_smoke(tmp_path):
    """bench_w0_step at a toy size: both engines gave the same tokens (the script asserts it), the adaptive one stayed
    at W = 0 past its trial with a random draft, and each ratio is its quantiles' ratio."""
    out = tmp_path / "w0.json"
    run_script("bench_w0_step.py", "--rows", "2", "--rounds", "2", "--max-new-tokens", "12", "--threads", "1",
               "--json", str(out))
    cell = json.loads(out.read_text())["results"]["rows 2"]
    for name in ("target-only", "adaptive"):
        # 12 tokens a row: 2 in the first step (the prefill's and a decode step's), 1 in the second, 9 steady steps
        assert cell[name]["steps"] == 2 * 9 and 0 < cell[name]["p10_ms"] <= cell[name]["p50_ms"]
    ratio = cell["adaptive_over_target_only"]
    assert ratio["p10"] == pytest.approx(cell["adaptive"]["p10_ms"] / cell["target-only"]["p10_ms"], abs=2e-3)
    assert ratio["p50"] == pytest.approx(cell["adaptive"]["p50_ms"] / cell["target-only"]["p50_ms"], abs=2e-3)
    widths = cell["adaptive_widths"]
    # 2 rounds x 2 rows x 11 verify steps (fewer where a probe's draft landed); a few probes: the draft's trial
    assert 2 * 2 * 11 - 6 <= sum(widths) <= 2 * 2 * 11 and sum(widths[1:]) <= 6


@pytest.mark.slow
def test_engine_cpu_benchmark_smoke(tmp_path):
    """Every mode is timed at every batch size (the script itself asserts equal tokens across modes),
    and each reported ratio is the ratio of the reported throughputs."""
    out = tmp_path / "cpu.json"
    stdout = run_script("bench_engine_cpu.py", "--smoke", "--json", str(out))
    report = json.loads(out.read_text())
    modes = ("hf_generate", "target_only", "spec_oracle", "spec_random")
    assert set(report["results"]) == {"1", "4"}
    for batch, row in report["results"].items():
        assert all(positive(row[m]) for m in modes), row
        assert all(row["spread"][m] >= 0 for m in modes)
        assert f"batch {int(batch):>3}:" in stdout
    r1, r4 = report["results"]["1"], report["results"]["4"]
    ratios = report["ratios"]
    assert ratios["spec_oracle / target_only @1"] == pytest.approx(r1["spec_oracle"] / r1["target_only"])
    assert ratios["target_only / hf_generate @4"] == pytest.approx(r4["target_only"] / r4["hf_generate"])
    assert ratios["spec_oracle @4 / spec_oracle @1"] == pytest.approx(r4["spec_oracle"] / r1["spec_oracle"])


@pytest.mark.slow
def test_gpu_check_smoke_on_cpu(tmp_path):
    """bench_gpu --smoke (CPU): forced full acceptance holds for every row (budgets ragged, so rows finish apart and
    later rows move slots: their references must follow them), the forced, the adaptive and the real draft's output
    pass the lossless check against target-only (fp32 here: no row may part away from a near-tie); the decode-only
    table reads what the configs say (weights, and each row's keys x KV bytes per token of target and, when drafting,
    draft), rows held at 1k/2k/4k are the pool's tokens over the mean capped by the rows, and the figures are
    consistent with their parts.
    Fails if `follow_rows` stops following slot moves or admissions (rows_at_full_acceptance), if a drafting step's
    bytes leave out the draft's KV, or if rows held are not capped: each checked by making that change."""
    run_script("bench_gpu.py", "--smoke", env={"OUT": str(tmp_path)})
    report = json.loads((tmp_path / "bench_gpu.json").read_text())
    assert "error" not in report
    info, engine, kv_cache = report["info"], report["engine"], report["kv_cache"]
    k, slots, weights = info["K"], engine["max_rows"], info["weights_bytes"]
    assert set(report["results"]) == {"1", "4", str(slots)} and k >= 1 and slots > 4
    assert info["forced_auto_slots"] == slots  # tiny shapes: the host's 8 per thread either way
    for n, row in report["results"].items():
        for check in (row["lossless_forced"], row["adaptive_lossless"]):
            assert check["differ"] == 0 and check["identical"] + check["near_tie"] == int(n)
        assert row["rows_at_full_acceptance"] == int(n)
        assert all(positive(row[key]) for key in ("target_only_tok_s", "spec_forced_tok_s", "speedup", "adaptive_tok_s"))
        assert row["speedup"] == pytest.approx(row["spec_forced_tok_s"] / row["target_only_tok_s"])
        assert row["adaptive_vs_target_only"] == pytest.approx(row["adaptive_tok_s"] / row["target_only_tok_s"])
    checks = report["checks"]
    assert checks["graphs_on_vs_off"] is None  # no CUDA here: nothing to compare
    assert checks["real_draft_lossless"]["differ"] == 0 and sum(checks["real_draft_lossless"].values()) == checks["rows"]
    assert all(g == {"at_start": 0, "capture_s": 0.0, "lazily": 0} for g in report["graphs"].values())
    assert engine["graphs"] == 0
    steps = report["steps_at_max_bucket"]
    assert report["draft_over_verify"] == pytest.approx(steps["draft_step_ms"] / steps["verify_step_ms"])

    # The pool and the rows it holds; the engine's kv_cache stats after its runs (the largest admitted all at once).
    assert engine["pool_tokens"] == (engine["kv_blocks"] - 1) * engine["block_size"]
    assert engine["rows_held"] == {str(m): min(slots, engine["pool_tokens"] // m) for m in (1024, 2048, 4096)}
    assert engine["pool_GiB"] == pytest.approx(engine["plan_GiB"]["kv_pool"])
    assert sum(engine["plan_GiB"].values()) == pytest.approx(engine["plan_total_GiB"])
    assert set(kv_cache) == {"block_size", "blocks", "peak_blocks_used", "peak_rows", "preemptions", "prefix_hit_tokens"}
    assert (kv_cache["block_size"], kv_cache["blocks"]) == (engine["block_size"], engine["kv_blocks"] - 1)
    assert kv_cache["peak_rows"] == slots and 0 < kv_cache["peak_blocks_used"] <= kv_cache["blocks"]

    # Decode-only steps: bytes from the smoke configs (fp32), W = 0 and K at 1, 4 and all rows (the pool holds them).
    target_cfg, draft_cfg = _smoke_configs()
    kv_target = 2 * target_cfg["num_hidden_layers"] * target_cfg["num_key_value_heads"] * target_cfg["head_dim"] * 4
    kv_draft = 2 * draft_cfg["num_hidden_layers"] * draft_cfg["num_key_value_heads"] * draft_cfg["head_dim"] * 4
    assert info["kv_bytes_per_token"] == {"target": kv_target, "draft": kv_draft}
    assert weights["target"] == round(info["target_params_B"] * 1e9) * 4
    assert weights["draft"] == round(info["draft_params_B"] * 1e9) * 4
    decode = report["decode"]
    assert {(d["rows"], d["width"]) for d in decode} == {(n, w) for n in (1, 4, slots) for w in (0, k)}
    for d in decode:
        drafting = d["width"] > 0
        if d["attention"] == "paged":
            assert d["keys_read"] == round(d["mean_length"] * d["rows"])
        else:  # the gather fallback: every slot of the step reads the longest row's keys
            assert d["keys_read"] == d["bucket"] * d["key_len"] and d["key_len"] > d["mean_length"]
        assert d["kv_bytes"] == d["keys_read"] * (kv_target + (kv_draft if drafting else 0))
        assert d["weights_bytes"] == weights["target"] + (weights["draft"] + weights["draft_head"] if drafting else 0)
        assert d["bytes_per_step"] == d["weights_bytes"] + d["kv_bytes"]
        assert positive(d["ms_per_step"]) and d["TB_per_s"] == pytest.approx(d["bytes_per_step"] / d["ms_per_step"] / 1e9)
        assert d["bandwidth_fraction"] is None and not d["replay"]  # CPU: no peak known, no graphs
        assert 72 <= d["mean_length"] <= 120  # --row-length 96 in the smoke: ragged within [0.75, 1.25] x 96


def _smoke_configs() -> tuple[dict, dict]:
    """bench_gpu's smoke target and draft configs (its module imported from benchmarks/)."""
    sys.path.insert(0, str(BENCH))
    try:
        import bench_gpu
    finally:
        sys.path.remove(str(BENCH))
    return bench_gpu.SMOKE_TARGET, bench_gpu.SMOKE_DRAFT


DEMO_PAIR_RUN = ["--prompts", "3", "--max-new-tokens", "12", "--batch-sizes", "2", "--threads", "1",
                 "--num-draft-tokens", "3"]


@pytest.fixture(scope="module")
def demo_pair_timed(tmp_path_factory) -> dict:
    """One timed bench_demo_pair run for both tests below (each run is a fresh process loading the pair)."""
    out = tmp_path_factory.mktemp("demo_bench") / "demo.json"
    run_script("bench_demo_pair.py", *DEMO_PAIR_RUN, "--repeats", "2", "--json", str(out))
    return json.loads(out.read_text())["results"]["batch 2"]


@pytest.mark.slow
def test_demo_pair_benchmark_smoke(demo_pair_timed):
    """bench_demo_pair on the shipped pair at toy sizes: every draft variant generates the token ids
    target-only does, its acceptance figures are consistent, and the trained draft accepts.
    Fails if a draft's tokens differ: checked by removing the script's own asserts and making `greedy_accept`
    commit one token too many after a partial acceptance (equal counts, 36 each; different digests)."""
    results = demo_pair_timed
    drafts = results["drafts"]
    assert set(drafts) == {"target-only", "domino", "domino-base-only", "domino-K3"}
    assert {d["tokens_sha256"] for d in drafts.values()} == {drafts["target-only"]["tokens_sha256"]}
    assert drafts["target-only"]["tokens"] > 0 and drafts["target-only"]["num_spec_tokens"] == 0
    assert "mean_acceptance_length" not in drafts["target-only"]
    assert drafts["target-only"]["speedups"] == [1.0, 1.0]  # each repeat against itself
    assert drafts["domino-K3"]["num_spec_tokens"] == 3
    assert drafts["domino"]["num_spec_tokens"] == drafts["domino-base-only"]["num_spec_tokens"] >= 3
    for name, d in drafts.items():
        assert positive(d["tokens_per_s"]) and positive(d["speedup"]) and len(d["speedups"]) == 2
        if name != "target-only":
            check_acceptance(d["mean_acceptance_length"], d["per_position_acceptance"], d["num_spec_tokens"])
    assert drafts["domino"]["mean_acceptance_length"] > 1.0
    assert 0.0 <= results["repeated_4gram_fraction"] <= 1.0


def test_demo_pair_benchmark_acceptance_only(tmp_path, demo_pair_timed):
    """`--acceptance-only`: each fixed-K draft's tau without timing, the same figures and token ids the timed run
    gives; auto and target-only have no draft acceptance of their own and are left out.
    Fails if a draft's tokens differ: checked as test_demo_pair_benchmark_smoke (the same mutation)."""
    out = tmp_path / "acc.json"
    run_script("bench_demo_pair.py", *DEMO_PAIR_RUN[:-1], "auto,3", "--acceptance-only", "--json", str(out))
    acceptance = json.loads(out.read_text())["results"]["acceptance"]
    assert set(acceptance) == {"domino", "domino-base-only", "domino-K3"}
    drafts = demo_pair_timed["drafts"]
    for name in acceptance:
        assert acceptance[name]["mean_acceptance_length"] == drafts[name]["mean_acceptance_length"], name
        assert acceptance[name]["tokens_sha256"] == drafts["target-only"]["tokens_sha256"], name


@pytest.mark.slow
def test_demo_pair_benchmark_takes_the_smollm2_pair(tmp_path):
    """`--pair smollm2`: the converted SmolLM2 target, the shipped draft and held-out chat prompts; every draft
    generates target-only's token ids. Fails if they differ: checked as test_demo_pair_benchmark_smoke."""
    from domino_ray.target.smollm2 import cache_dir, is_converted

    if not is_converted() or not (BENCH.parent / "domino_ray" / "assets" / "smollm2" / "draft").is_dir():
        pytest.skip(f"SmolLM2 is not converted at {cache_dir()} (run `make smollm2`) or no draft is shipped")
    out = tmp_path / "smol.json"
    run_script("bench_demo_pair.py", "--pair", "smollm2", "--prompts", "1", "--max-new-tokens", "6",
               "--batch-sizes", "1", "--repeats", "1", "--threads", "1", "--json", str(out))
    drafts = json.loads(out.read_text())["results"]["batch 1"]["drafts"]
    assert set(drafts) == {"target-only", "domino", "domino-base-only"}
    assert {d["tokens_sha256"] for d in drafts.values()} == {drafts["target-only"]["tokens_sha256"]}
    assert drafts["domino"]["num_spec_tokens"] == 8
    check_acceptance(drafts["domino"]["mean_acceptance_length"], drafts["domino"]["per_position_acceptance"], 8)


@pytest.mark.slow
@pytest.mark.ray
def test_batch_job_benchmark_smoke(ray_cluster):
    """bench_batch_job at a toy size: the job and the direct engine generate the same token ids (same engine
    settings, greedy; a row's output does not depend on its batch) and the job writes every row. It joins the
    session's cluster: a cluster start-up of its own is most of a toy run's time and proves nothing about the
    benchmark. Fails if the job's tokens differ: checked by making the job's predictor write each row's
    generated_tokens reversed (same counts)."""
    stdout = run_script("bench_batch_job.py", "--sizes", "6", "--max-new-tokens", "6", "--max-batch-size", "4",
                        "--batch-size", "3", "--threads", "1", "--ray-address", ray_cluster,
                        env={"RAY_AUTH_MODE": "disabled"}, timeout=600)
    runs = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
    direct = next(r for r in runs if r["mode"] == "direct")
    job = next(r for r in runs if r["mode"] == "job")
    assert direct["tokens_sha256"] == job["tokens_sha256"] and direct["tokens"] == job["tokens"] > 0
    assert job["rows"] == 6
    assert direct["generate_s"] <= direct["wall_s"] and job["pipeline_s"] <= job["wall_s"]
    assert 0 < job["generate_s"] <= job["wall_s"] and job["actor_load_s"] > 0


@pytest.mark.slow
@pytest.mark.ray
def test_serve_benchmark_smoke(ray_cluster, tmp_path):
    """bench_serve on a tiny pair: every request answered with max_tokens tokens (ignore_eos), percentiles
    ordered, and the speculative mode's acceptance within [1, K+1]. One mode: the target-only mode is the
    same deployment without a draft, and each mode costs a Serve start-up. On the session's cluster
    (`runtime.ray_address`), as on a user's running cluster: no cluster start-up of its own."""
    out = tmp_path / "serve.json"
    run_script("bench_serve.py", "--tiny", str(tmp_path / "pair"), "--concurrency", "2", "--requests", "4",
               "--max-tokens", "6", "--time-limit", "120", "--modes", "spec", "--json", str(out),
               f"runtime.ray_address={ray_cluster}", env={"RAY_AUTH_MODE": "disabled"}, timeout=600)
    rows = {r["mode"]: r for r in json.loads(out.read_text())}
    assert set(rows) == {"spec"}
    for r in rows.values():
        assert r["failed"] == 0 and r["requests"] == 4 and r["output_tokens"] == 4 * 6
        assert r["output_tok_per_s"] == pytest.approx(r["output_tokens"] / r["wall_s"])
        assert r["latency_p50_s"] <= r["latency_p99_s"] and r["ttft_p50_s"] <= r["ttft_p99_s"]
        assert 0 < r["ttft_p50_s"] <= r["latency_p99_s"]
    assert 1.0 <= rows["spec"]["mean_acceptance_length"] <= 4 + 1  # save_tiny_pair: block size 4, K = 4


def test_linear_benchmark_smoke():
    """`bench_linear.py`: the sweep times every kernel at every row count; `--engine` alternates ours, MKL's packed
    GEMM and plain `F.linear` in an engine's steps (the demo pair's here: the SmolLM2 pair's path, a smaller model)."""
    out = run_script("bench_linear.py", "--rows", "1,4", "--layers", "1")
    table = {line[:16].strip(): line[16:].split() for line in out.splitlines()[1:]}
    kernels = ("F.linear", "MKL packed", "ours", "ours bf16")
    assert table["rows per call"] == ["1", "4"] and set(table) == {"rows per call", *kernels}
    assert all(positive(float(x)) for kind in kernels for x in table[kind])
    out = run_script("bench_linear.py", "--engine", "2", "--rounds", "1", "--pair", "demo")
    times = [line.split(":") for line in out.splitlines() if line.startswith("  ")]
    assert [name.strip() for name, _ in times] == ["ours", "MKL packed", "plain"]
    assert all(positive(float(t.split()[0])) for _, t in times)


def test_attention_benchmark_smoke():
    """`bench_attention.py`: the sweep times SDPA and our kernel at every key length and query count, its speed-up
    their ratio; `--engine` alternates our kernel and SDPA in an engine's steps (the demo pair's here)."""
    out = run_script("bench_attention.py", "--rows", "2", "--keys", "40,64", "--positions", "1,3")
    rows = [line.replace("(", " ").replace(")", " ").replace("x", " ").split() for line in out.splitlines()[2:]]
    assert [(int(r[0]), int(r[1])) for r in rows] == [(40, 1), (40, 3), (64, 1), (64, 3)]
    for _, _, sdpa_ms, sdpa_rate, ours_ms, ours_rate, speed_up in rows:
        assert all(positive(float(x)) for x in (sdpa_ms, sdpa_rate, ours_ms, ours_rate))
        # the same bytes in both: the speed-up is the ratio of the rates, each printed to three significant digits
        # (+-0.5%) and the speed-up to two decimals: the tolerance is the rounding's
        rounding = 0.005 / float(speed_up) + 0.005 + 0.005
        assert float(speed_up) == pytest.approx(float(ours_rate) / float(sdpa_rate), rel=rounding)
    out = run_script("bench_attention.py", "--engine", "2", "--rounds", "1", "--pair", "demo")
    times = [line.split(":") for line in out.splitlines() if line.startswith("  ")]
    assert [name.strip() for name, _ in times] == ["our kernel", "SDPA + mask"]
    assert all(positive(float(t.split()[0])) for _, t in times)


def test_sampling_params_benchmark_smoke(tmp_path):
    """bench_sampling_params at toy sizes: every mode at every batch size, logprobs' tokens plain's (the script
    also asserts penalised speculative == target-only), ratios against plain. Fails if the logprobs mode
    changed the tokens: checked by removing the script's assert and sampling the logprobs mode (temperature 1)."""
    out = tmp_path / "sampling.json"
    stdout = run_script("bench_sampling_params.py", "--prompts", "2", "--max-new-tokens", "8", "--batch-sizes", "1,2",
                        "--repeats", "1", "--threads", "1", "--json", str(out))
    results = json.loads(out.read_text())["results"]
    assert set(results) == {"batch 1", "batch 2"} and "vs plain" in stdout
    for table in results.values():
        assert set(table) == {"plain", "penalties", "logprobs 5"}
        assert table["logprobs 5"]["tokens_sha256"] == table["plain"]["tokens_sha256"]
        assert table["plain"]["vs_plain"] == 1.0
        for row in table.values():
            assert positive(row["tok_s"]) and positive(row["vs_plain"]) and row["tokens"] > 0
            assert 1.0 <= row["mean_acceptance_length"]
