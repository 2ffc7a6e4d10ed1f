"""What `make demo` prints about the pair, and the comparisons behind it: the job's target-only comparison counts
like for like, the in-process probe (batch/pair_probe.py) measures the draft at full K and Domino against target-only on
the same prompts, and the printed lines say what those figures say (the widths' line follows the cost table it
quotes; the speed-up and the verdicts: test_demo_headline.py). Invariants, not snapshots: no timing is asserted. The
job runs the probe and prints these lines end to end in test_batch_job.py (test_baseline_comparison)."""

import pyarrow.parquet as pq
import pytest

from domino_ray.batch.pair_probe import measure_pair
from domino_ray.batch.summary import baseline_lines, side_by_side, throughput_ratio, width_line
from domino_ray.config import DEMO_ASSETS
from domino_ray.target.loading import encode_prompt
from domino_ray.sample.params import SamplingParams
from domino_ray.spec_decode.width_policy import DRAFTING_MARGIN
from tiny_models import load_demo_pair


def _actor(tokens: int, busy_s: float, cpu_s: float | None = None, **extra) -> dict:
    actor = {"actor": "a", "rows": 4, "generated_tokens": tokens, "busy_s": busy_s, **extra}
    if cpu_s is not None:
        actor["cpu_s"] = cpu_s
    return actor


def test_throughput_ratio_counts_tokens_per_busy_second_on_both_sides():
    same = [_actor(1000, 2.0, 1.8)]
    assert throughput_ratio(same, same)["two_run_ratio"] == 1.0
    spec, base = [_actor(600, 1.0, 0.9), _actor(400, 1.0, 0.9)], [_actor(1000, 4.0, 2.0)]
    forward, backward = throughput_ratio(spec, base), throughput_ratio(base, spec)
    assert forward["two_run_ratio"] == pytest.approx(2.0)
    assert forward["two_run_ratio"] * backward["two_run_ratio"] == pytest.approx(1.0)
    # how much CPU each run's actors got while busy: the machine's other load, kept beside the ratio
    assert forward["cpu_s_per_busy_s"] == {"speculative": pytest.approx(0.9), "target_only": pytest.approx(0.5)}
    assert "cpu_s_per_busy_s" not in throughput_ratio(spec, [_actor(1000, 4.0)])  # only where every actor reports it


def _summary(costs_ms: list[float], widths_run: list[int], *, rows: int = 16) -> dict:
    table = {"key_length": 100.0, "widths": list(range(len(costs_ms))),
             "by_rows": [{"rows": 1, "seconds": [c / 4e3 for c in costs_ms]},
                         {"rows": rows, "seconds": [c / 1e3 for c in costs_ms]}]}
    return {"run": {"actors": [_actor(1000, 1.0, width_costs=table)]}, "verify_width_histogram": widths_run}


def _probe(per_position: list[float], speedups: dict[int, float]) -> dict:
    return {"num_spec_tokens": len(per_position), "rows": max(speedups), "passes": 2,
            "mean_acceptance_length": 1 + sum(per_position), "per_position_acceptance": per_position, "identical": 16,
            "speedups": [{"rows": n, "prompts": 4 if n == 1 else n, "speedup": x, "per_pass": [x, x]}
                         for n, x in speedups.items()]}


def test_widths_line_follows_the_cost_table():
    accept = [0.9, 0.8, 0.7, 0.6]  # a step at W commits 1.9, 2.7, 3.4, 4.0 tokens a row
    dear = width_line(_summary([1.0, 2.5, 3.5, 4.5, 5.5], [90, 4, 3, 2, 1]), _probe(accept, {1: 2.0, 16: 0.6}))
    assert "at 16 rows" in dear and "1.0 ms" in dear and "5.5 ms (W=4)" in dear
    assert f"over {2.5 * (1 + DRAFTING_MARGIN):.2f} to {5.5 * (1 + DRAFTING_MARGIN):.2f} tokens a row" in dear
    assert "commits 1.90 to 4.00" in dear and "so W=0" in dear and "the job ran W=0 in 90% of its row-steps" in dear
    assert "target-only's work" not in dear  # it drafted in 10% of its row-steps
    never = _summary([1.0, 2.5, 3.5, 4.5, 5.5], [995, 5, 0, 0, 0])
    never["run"]["baseline"] = {"two_run_ratio": 0.93}  # the headline says it did not draft; no two runs' ratio here
    assert "0.93" not in width_line(never, _probe(accept, {1: 2.0, 16: 0.6}))
    cheap = width_line(_summary([1.0, 1.1, 1.2, 1.3, 1.4], [5, 5, 10, 20, 60]), _probe(accept, {1: 3.0, 16: 2.5}))
    assert "W=4 pays best (2.86x" in cheap and "the job ran W=4 in 60%" in cheap
    # the probe's step at K against the table's: 4.0 tokens at 2.5x -> 1.6 plain steps; the table says 1.4
    assert "a step at W=4 cost 1.6x a plain one, the table says 1.4x" in cheap and "took drafting" not in cheap
    stale = width_line(_summary([2.0, 2.5, 3.0, 3.5, 4.0], [50, 0, 0, 0, 50]), _probe(accept, {1: 2.0, 16: 0.5}))
    assert "cost 8.0x a plain one, the table says 2.0x: the policy took drafting for cheaper than it is" in stale
    fixed = {"run": {"actors": [_actor(10, 1.0)]}, "verify_width_histogram": [5, 0]}
    assert width_line(fixed, _probe(accept, {1: 1.0})) is None  # a fixed-K job's actors have no cost table


def test_probe_lines_follow_the_probe_and_report_its_failure():
    """The draft's line quotes the probe's acceptance, the widths' line closes the block; a failed probe is one line,
    after the target-only run's (whose greedy check stands either way)."""
    probe = _probe([0.9, 0.8], {1: 2.4, 16: 0.7})
    base = {"tokens_per_s": 100.0, "two_run_ratio": 0.97, "identical": 16, "compared": 16,
            "cpu_s_per_busy_s": {"speculative": 0.95, "target_only": 0.6}, "probe": probe, **side_by_side(probe)}
    lines = baseline_lines(_summary([1.0, 3.0, 5.0], [95, 5, 0]), base)
    assert "greedy outputs identical: 16/16" in lines[0] and "0.97" not in "\n".join(lines)
    assert "the draft at K=2" in lines[2] and "mean acceptance length 2.70, per position 0.90 0.80" in lines[2]
    assert lines[-1].startswith("  why these widths: at 16 rows")
    error = {"error": "ValueError: no prompt fits"}
    failed = {k: v for k, v in base.items() if not k.startswith("speedup")} | {"probe": error, **side_by_side(error)}
    assert baseline_lines({}, failed)[1:] == [f"  the in-process measurement of the pair failed: {error['error']}"]


@pytest.fixture(scope="module")
def demo_pair():
    return load_demo_pair()


def test_measure_pair_runs_the_draft_at_k_beside_target_only(demo_pair):
    target, tokenizer, draft = demo_pair
    texts = pq.read_table(DEMO_ASSETS / "prompts.parquet").column("prompt").to_pylist()[:5]
    params = SamplingParams(max_new_tokens=24)
    too_long = (list(range(1, 300)), params)  # over the demo target's 256 positions: skipped, not a failure
    prompts = [too_long] + [(encode_prompt(tokenizer, prompt=p, chat_template=False), params) for p in texts]
    out = measure_pair(target, draft, tokenizer, prompts, rows=4, num_spec_tokens=8, one_row_prompts=2, passes=1)
    assert out["rows"] == 4 and out["identical"] == 4  # the first 4 that fit; speculative == target-only greedy
    per_position = out["per_position_acceptance"]
    assert len(per_position) == 8 and all(a >= b for a, b in zip(per_position, per_position[1:]))
    assert out["mean_acceptance_length"] == pytest.approx(1 + sum(per_position))  # every step verified K drafts
    assert out["mean_acceptance_length"] > 2.0  # the trained draft
    assert [(c["rows"], c["prompts"]) for c in out["speedups"]] == [(1, 2), (4, 4)]
    assert all(c["speedup"] > 0 for c in out["speedups"])
