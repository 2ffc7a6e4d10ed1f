"""The speed-up `make demo` prints (issue 50, item 6): measured side by side in one process (batch/pair_probe.py), never
the ratio of the job's run and the target-only run one after it; none where the job never drafted; "pays" only
beyond the spread of the probe's passes. Synthetic summaries (plain dicts, no Ray), and the probe on the demo pair.
Invariants, not snapshots: no timing is asserted."""

import re

import pyarrow.parquet as pq
import pytest

from domino_ray.batch.pair_probe import measure_pair
from domino_ray.batch.summary import baseline_lines, pays_line, side_by_side, speedup_verdict
from domino_ray.config import DEMO_ASSETS
from domino_ray.sample.params import SamplingParams
from domino_ray.target.loading import encode_prompt
from tiny_models import load_demo_pair

TWO_RUNS = 0.4321  # the two runs' ratio: a figure no printed line may carry
CELL = re.compile(r"(\d+) rows? ([\d.]+)x \(([\d.]+)-([\d.]+): (speculation pays|it does not pay|within this "
                  r"machine's noise)\)")
RATIO = re.compile(r"\d+\.\d\dx")


def _cells(by_rows: dict[int, list[float]]) -> list[dict]:
    return [{"rows": n, "prompts": 4 if n == 1 else n, "speedup": sum(p) / len(p), "per_pass": p}
            for n, p in by_rows.items()]


def _probe(fixed: dict[int, list[float]], auto: dict[int, list[float]] | None = None) -> dict:
    probe = {"num_spec_tokens": 2, "rows": max(fixed), "passes": len(fixed[1]), "mean_acceptance_length": 2.7,
             "per_position_acceptance": [0.9, 0.8], "identical": 16, "speedups": _cells(fixed)}
    return {**probe, "auto_speedups": _cells(auto)} if auto else probe


def _job(widths: list[int], probe: dict | None) -> tuple[dict, dict]:
    """(summary, baseline) as the job writes them, the baseline's keys from `side_by_side`."""
    table = {"key_length": 100.0, "widths": [0, 1, 2],
             "by_rows": [{"rows": 1, "seconds": [2.5e-4, 5e-4, 7e-4]}, {"rows": 16, "seconds": [1e-3, 3e-3, 5e-3]}]}
    summary = {"run": {"actors": [{"actor": "a", "rows": 16, "generated_tokens": 900, "busy_s": 1.0,
                                   "width_costs": table}]}, "verify_width_histogram": widths}
    base = {"tokens_per_s": 812.3, "two_run_ratio": TWO_RUNS, "identical": 300, "compared": 300,
            **({"probe": probe, **side_by_side(probe)} if probe else {})}
    return summary, base


def test_verdict_counts_a_gain_only_beyond_the_passes_spread():
    """Fails against a verdict read from the pooled ratio (>= 1.0 "pays"), or from its passes' mean."""
    noise = "within this machine's noise"
    assert speedup_verdict([2.30, 2.38]) == "speculation pays"
    assert speedup_verdict([0.64, 0.69]) == "it does not pay"
    assert speedup_verdict([0.97, 1.01]) == speedup_verdict([0.98, 1.60]) == noise  # mean 1.29: not a gain
    assert speedup_verdict([1.0, 1.2]) == speedup_verdict([0.8, 1.0]) == noise  # a pass at exactly 1.0x
    assert speedup_verdict([1.05]) == "speculation pays" and speedup_verdict([0.95]) == "it does not pay"  # one pass


def test_the_job_speed_up_is_domino_auto_side_by_side_never_the_two_runs_ratio():
    """Fails against a headline (or the widths' line) that prints the two runs' ratio, against a job speed-up taken
    from fixed K where the job ran the adaptive width, and against one taken at 1 row instead of the job's rows."""
    adaptive = _probe({1: [2.30, 2.38], 16: [0.64, 0.69]}, auto={1: [2.05, 2.16], 16: [1.02, 1.08]})
    summary, base = _job([600, 100, 300], adaptive)
    assert base["speedup"] == pytest.approx(1.05) and base["speedup_per_pass"] == [1.02, 1.08]
    assert base["speedup_of"] == {"engine": "auto", "rows": 16, "passes": 2}
    assert side_by_side(_probe({1: [2.30, 2.38], 16: [0.64, 0.69]}))["speedup_of"]["engine"] == "K=2"  # a fixed-K job
    assert side_by_side({"error": "ValueError: no prompt fits"}) == {"speedup": None}
    lines = baseline_lines(summary, base)
    assert lines[0] == ("  target only on the same rows (a second run): 812.3 tokens/s while busy; greedy outputs "
                        "identical: 300/300")
    assert lines[1].startswith("  this job's speed-up 1.05x: Domino auto over target only at 16 rows, measured side "
                               "by side in one process (2 interleaved passes: 1.02x to 1.08x, speculation pays)")
    text = "\n".join(lines)
    assert f"{TWO_RUNS:.2f}" not in text and "two runs" not in text
    # a summary written before the side-by-side speed-up: its `speedup` was the two runs' ratio, not printed
    old = {k: v for k, v in base.items() if not k.startswith("speedup")}
    assert "speed-up" not in "\n".join(baseline_lines(summary, {**old, "speedup": TWO_RUNS}))


def test_a_job_that_never_drafted_prints_no_speed_up():
    """W = 0 in at least 99% of the row-steps: the engine did target-only's work, and the headline says so with no
    ratio. Fails against a threshold on steps other than the histogram's W = 0 share, or a ratio printed anyway."""
    probe = _probe({1: [2.30, 2.38], 16: [0.92, 1.01]}, auto={1: [2.05, 2.16], 16: [0.93, 1.04]})
    for widths in ([995, 5, 0], [1000, 0, 0]):
        headline = baseline_lines(*_job(widths, probe))[1]
        assert headline.startswith("  this job's speed-up: none: speculation did not pay at 16 rows on this machine")
        assert "target-only's work" in headline and not RATIO.search(headline)
    assert RATIO.search(baseline_lines(*_job([980, 20, 0], probe))[1])  # it drafted in 2%: measured, with a ratio
    no_probe = baseline_lines(*_job([1000, 0, 0], None))
    assert "did not pay at this batch size on this machine" in no_probe[1] and len(no_probe) == 2
    assert len(baseline_lines(*_job([1000], None))) == 1  # a job without a draft (K = 0): nothing to say of drafting


def test_each_printed_cell_says_what_its_passes_say_and_where_domino_pays():
    """Every cell's verdict follows its printed range, and the pays line lists exactly the row counts with a cell
    that pays, at its best ratio. Fails against cells judged by the pooled ratio, and against a pays line that
    counts a gain within the noise."""
    probe = _probe({1: [2.30, 2.38], 16: [0.98, 1.20]}, auto={1: [2.40, 2.60], 16: [0.90, 0.97]})
    lines = baseline_lines(*_job([600, 100, 300], probe))
    assert lines[4] == "    K=2: 1 row 2.34x (2.30-2.38: speculation pays); 16 rows 1.09x (0.98-1.20: within this " \
                       "machine's noise)"
    cells = CELL.findall("\n".join(lines[4:6]))
    assert [int(n) for n, *_ in cells] == [1, 16, 1, 16]
    for _, x, lo, hi, said in cells:
        assert float(lo) <= float(x) <= float(hi)
        assert said == ("speculation pays" if float(lo) > 1.0 else "it does not pay" if float(hi) < 1.0
                        else "within this machine's noise")
    assert lines[6] == "  Domino pays on this machine at: 1 row (2.50x at auto)"
    nowhere = {"K=2": _cells({1: [0.95, 1.10], 16: [0.60, 0.70]})}
    assert pays_line(nowhere) == "  Domino pays on this machine at none of the measured row counts (1, 16)"


@pytest.fixture(scope="module")
def demo_pair():
    return load_demo_pair()


def test_measure_pair_times_the_adaptive_width_beside_k_pass_by_pass(demo_pair):
    """An adaptive job's probe runs its own setting beside K and target-only, and keeps each pass's ratio: the
    pooled ratio lies within them (it is their mediant). Fails against a probe without the adaptive engine, or with
    per-pass ratios that are not each pass's own."""
    target, tokenizer, draft = demo_pair
    texts = pq.read_table(DEMO_ASSETS / "prompts.parquet").column("prompt").to_pylist()[:4]
    params = SamplingParams(max_new_tokens=16)
    prompts = [(encode_prompt(tokenizer, prompt=p, chat_template=False), params) for p in texts]
    out = measure_pair(target, draft, tokenizer, prompts, rows=4, num_spec_tokens=8, adaptive=True,
                       one_row_prompts=1, passes=2)
    assert out["identical"] == 4 and out["passes"] == 2
    for key in ("speedups", "auto_speedups"):
        assert [(c["rows"], c["prompts"]) for c in out[key]] == [(1, 1), (4, 4)]
        for c in out[key]:
            assert len(c["per_pass"]) == 2 and all(x > 0 for x in c["per_pass"])
            assert min(c["per_pass"]) - 1e-9 <= c["speedup"] <= max(c["per_pass"]) + 1e-9
    assert side_by_side(out)["speedup_of"] == {"engine": "auto", "rows": 4, "passes": 2}
    assert "auto_speedups" not in measure_pair(target, draft, tokenizer, prompts, rows=2, num_spec_tokens=8,
                                               one_row_prompts=1, passes=1)
