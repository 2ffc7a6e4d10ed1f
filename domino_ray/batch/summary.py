"""`_summary.json`: job totals computed from the output rows themselves, so they always reconcile.

The totals and acceptance statistics cover every row in the output directory (all runs of a resumed
job); `run` describes this invocation only (wall time, throughput overall and per actor).
"""

from __future__ import annotations

from collections import Counter

import pyarrow as pa
import pyarrow.compute as pc

from domino_ray.spec.stats import RowStats, merge_histograms, per_position_acceptance

STATS_COLUMNS = ["finish_reason", "error", "num_input_tokens", "num_generated_tokens", "num_spec_tokens",
                 "num_spec_steps", "num_draft_tokens", "num_accepted_draft_tokens", "acceptance_histogram",
                 "verify_width_histogram", "time_to_first_token_s"]
MAX_ERROR_REASONS = 20  # in _summary.json; the printed summary shows 5
TOTALS = ["num_input_tokens", "num_generated_tokens", "num_spec_steps", "num_draft_tokens",
          "num_accepted_draft_tokens"]


def summarize(rows: pa.Table, id_column: str, *, run: dict, config: dict, output_uri: str) -> dict:
    """Summary of the output `rows` (at least `STATS_COLUMNS` and the id column)."""
    n = rows.num_rows
    reasons = Counter(rows.column("finish_reason").to_pylist())
    failed = reasons.get("error", 0)
    totals = {name: int(pc.sum(rows.column(name)).as_py() or 0) for name in TOTALS}
    # Pooled over rows (1 + all accepted / all steps, not a mean of ratios); K is not used by the ratios.
    pooled = RowStats(0, totals["num_spec_steps"], totals["num_draft_tokens"], totals["num_accepted_draft_tokens"])
    ks = sorted(set(rows.column("num_spec_tokens").to_pylist()))
    try:
        histogram = merge_histograms(rows.column("acceptance_histogram").to_pylist())
        widths = merge_histograms(rows.column("verify_width_histogram").to_pylist())
        per_position = per_position_acceptance(histogram) if histogram else []
    except ValueError:  # rows written with different K (the config changed between runs)
        histogram, widths, per_position = None, None, None
    ok = pc.not_equal(rows.column("finish_reason"), "error")
    ttft = pc.mean(pc.filter(rows.column("time_to_first_token_s"), ok)).as_py() if n - failed else None
    errors = Counter(e for e in rows.column("error").to_pylist() if e is not None)
    listed = errors.most_common(MAX_ERROR_REASONS)  # reasons may embed numbers: bound the list, count the rest
    return {
        "output": output_uri,
        "rows": {"total": n, "ok": n - failed, "failed": failed,
                 "unique_ids": len(pc.unique(rows.column(id_column)))},
        "finish_reasons": {k: reasons.get(k, 0) for k in ("stop", "length", "error")},
        "num_spec_tokens": ks[0] if len(ks) == 1 else ks,
        "totals": totals,
        "mean_acceptance_length": pooled.mean_acceptance_length,  # pooled over rows: 1 + all accepted / all steps
        "draft_acceptance_rate": pooled.draft_acceptance_rate,
        "acceptance_histogram": histogram,
        "verify_width_histogram": widths,  # steps run at each verify width W = 0..K (the adaptive policy's choices)
        "per_position_acceptance": per_position,
        "mean_time_to_first_token_s": ttft,
        "errors": dict(listed),
        "errors_not_listed": {"reasons": len(errors) - len(listed), "rows": failed - sum(c for _, c in listed)},
        "run": run,
        "config": config,
    }


def run_stats(wall_time_s: float, rows_done_before: int, actors: list[dict],
              written: tuple[int, int] | None = None) -> dict:
    """This invocation: `actors` holds one {actor, rows, generated_tokens, busy_s} per engine actor (work
    done, retried batches included); `written` is (rows, generated tokens) in the files this run wrote,
    the run's `rows` and `generated_tokens` (default: the actors' sums)."""
    rows, tokens = written or (sum(a["rows"] for a in actors), sum(a["generated_tokens"] for a in actors))
    for a in actors:
        a["tokens_per_s"] = a["generated_tokens"] / a["busy_s"] if a["busy_s"] else 0.0
    return {"wall_time_s": wall_time_s, "rows": rows, "rows_already_done": rows_done_before,
            "generated_tokens": tokens, "tokens_per_s": tokens / wall_time_s if wall_time_s else 0.0,
            "actors": actors}


def human_summary(s: dict) -> str:
    r, run = s["rows"], s["run"]
    lines = [f"domino-ray batch job: {r['total']} rows ({r['ok']} ok, {r['failed']} failed) -> {s['output']}"]
    if r["unique_ids"] != r["total"]:
        lines.append(f"  WARNING: {r['total'] - r['unique_ids']} duplicate ids in the output (input ids not unique?)")
    lines.append(f"  this run: {run['rows']} rows, {run['generated_tokens']} tokens in {run['wall_time_s']:.1f} s "
                 f"({run['tokens_per_s']:.1f} tokens/s); {run['rows_already_done']} rows were already done")
    for a in run["actors"]:
        lines.append(f"    actor {a['actor']}: {a['rows']} rows, {a['tokens_per_s']:.1f} tokens/s while busy")
    if s["totals"]["num_spec_steps"]:
        lines.append(f"  mean acceptance length {s['mean_acceptance_length']:.2f} (K={s['num_spec_tokens']}), "
                     f"draft acceptance rate {s['draft_acceptance_rate']:.3f}")
        if s["per_position_acceptance"]:
            lines.append("  per-position acceptance: " + " ".join(f"{p:.2f}" for p in s["per_position_acceptance"]))
        if s.get("verify_width_histogram"):
            lines.append("  steps by verify width W=0..K: " + " ".join(str(n) for n in s["verify_width_histogram"]))
    base = run.get("baseline")
    if base:
        lines.append(f"  target only: {base['tokens_per_s']:.1f} tokens/s while busy -> speed-up "
                     f"{base['speedup']:.2f}x; greedy outputs identical: {base['identical']}/{base['compared']}")
    shown = list(s["errors"].items())[:5]
    for reason, count in shown:
        lines.append(f"  error x{count}: {reason}")
    more_reasons = len(s["errors"]) - len(shown) + s.get("errors_not_listed", {}).get("reasons", 0)
    if more_reasons:
        more_rows = r["failed"] - sum(count for _, count in shown)
        lines.append(f"  ... and {more_reasons} more error reasons ({more_rows} rows): see `errors` in "
                     f"_summary.json and the `error` column")
    return "\n".join(lines)
