"""`_summary.json`: job totals computed from the output rows themselves, so they always reconcile.

The totals and acceptance statistics cover every row in the output directory (all runs of a resumed
job); `run` describes this invocation only (wall time, throughput overall and per actor), and so does
`kv_cache` (the paged KV cache of this invocation's engines: not in the rows, so not carried across runs).
"""

from __future__ import annotations

from collections import Counter

import pyarrow as pa
import pyarrow.compute as pc

from domino_ray.spec_decode.stats import RowStats, merge_histograms, per_position_acceptance
from domino_ray.spec_decode.width_policy import DRAFTING_MARGIN, best_width

STATS_COLUMNS = ["finish_reason", "error", "num_input_tokens", "num_generated_tokens", "num_spec_tokens",
                 "num_spec_steps", "num_draft_tokens", "num_accepted_draft_tokens", "acceptance_histogram",
                 "verify_width_histogram", "near_ties", "num_forced_tokens", "time_to_first_token_s"]
KV_CACHE_SUMS = ("blocks", "peak_blocks_used", "peak_rows", "preemptions", "prefix_hit_tokens")
MAX_ERROR_REASONS = 20  # in _summary.json; the printed summary shows 5
TOTALS = ["num_input_tokens", "num_generated_tokens", "num_spec_steps", "num_draft_tokens",
          "num_accepted_draft_tokens", "near_ties", "num_forced_tokens"]


def summarize(rows: pa.Table, id_column: str, *, run: dict, config: dict, output_uri: str) -> dict:
    """Summary of the output `rows` (at least `STATS_COLUMNS` and the id column)."""
    n = rows.num_rows
    reasons = Counter(rows.column("finish_reason").to_pylist())
    failed = reasons.get("error", 0)
    totals = {name: int(pc.sum(rows.column(name)).as_py() or 0) if name in rows.column_names else 0  # older outputs
              for name in TOTALS}
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
                 "unique_ids": _unique_keys(rows, id_column)},
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
        "kv_cache": kv_cache_totals(run["actors"]),
        "run": run,
        "config": config,
    }


def kv_cache_totals(actors: list[dict]) -> dict | None:
    """The paged KV cache of the run's engine actors (`run_stats`' `actors`; each reports its engine's
    `kv_cache_stats()` as of its last finished batch, a restarted actor as one more engine); None when no
    engine ran. Blocks, preemptions and prefix hits are summed; peak_blocks_used and peak_rows are too, each
    actor's peak added: an upper bound of the simultaneous figure (the actors' peaks need not coincide)."""
    caches = [a["kv_cache"] for a in actors if a.get("kv_cache")]
    if not caches:
        return None
    return {"block_size": caches[0]["block_size"], **{k: sum(c[k] for c in caches) for k in KV_CACHE_SUMS},
            "actors": len(caches)}


def _unique_keys(rows: pa.Table, id_column: str) -> int:
    """Distinct (id, sample_index) keys: the rows' ids when each input row has one sample."""
    if "sample_index" not in rows.column_names:
        return len(pc.unique(rows.column(id_column)))
    return rows.select([id_column, "sample_index"]).group_by([id_column, "sample_index"]).aggregate([]).num_rows


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
        lines.append(f"  WARNING: {r['total'] - r['unique_ids']} duplicate (id, sample_index) keys in the output "
                     "(input ids not unique?)")
    lines.append(f"  this run: {run['rows']} rows, {run['generated_tokens']} tokens in {run['wall_time_s']:.1f} s "
                 f"({run['tokens_per_s']:.1f} tokens/s); {run['rows_already_done']} rows were already done")
    for a in run["actors"]:
        precision = f" ({a['precision']})" if a.get("precision") else ""
        lines.append(f"    actor {a['actor']}: {a['rows']} rows, {a['tokens_per_s']:.1f} tokens/s while busy{precision}")
    if s["totals"]["num_spec_steps"]:
        adaptive = s.get("config", {}).get("draft", {}).get("num_draft_tokens") == "auto"
        lines.append(f"  mean acceptance length {s['mean_acceptance_length']:.2f} (K={s['num_spec_tokens']}), "
                     f"draft acceptance rate {s['draft_acceptance_rate']:.3f}"
                     + (" over the job's steps, W = 0 ones included (they verify no draft)" if adaptive else ""))
        if s["per_position_acceptance"]:
            lines.append("  per-position acceptance: " + " ".join(f"{p:.2f}" for p in s["per_position_acceptance"]))
        if s.get("verify_width_histogram"):
            lines.append("  steps by verify width W=0..K: " + " ".join(str(n) for n in s["verify_width_histogram"]))
    if s["totals"].get("near_ties"):
        lines.append(f"  {s['totals']['near_ties']} greedy tokens at near-ties of the target's top two logits (16-bit "
                     "rounding: where speculative may differ from target-only)")
    if s["totals"].get("num_forced_tokens"):
        lines.append(f"  {s['totals']['num_forced_tokens']} accepted drafts were forced by the rows' constraints "
                     "(structured outputs: the grammar's only continuation)")
    kv = s.get("kv_cache")
    if kv:
        lines.append(f"  KV cache ({kv['actors']} engine{'s' if kv['actors'] > 1 else ''}): {kv['blocks']} blocks x "
                     f"{kv['block_size']} positions, peak {kv['peak_blocks_used']} blocks and {kv['peak_rows']} rows in "
                     f"use, {kv['preemptions']} preemptions, {kv['prefix_hit_tokens']} prompt tokens shared")
    base = run.get("baseline")
    if base:
        lines += baseline_lines(s, base)
    shown = list(s["errors"].items())[:5]
    for reason, count in shown:
        lines.append(f"  error x{count}: {reason}")
    more_reasons = len(s["errors"]) - len(shown) + s.get("errors_not_listed", {}).get("reasons", 0)
    if more_reasons:
        more_rows = r["failed"] - sum(count for _, count in shown)
        lines.append(f"  ... and {more_reasons} more error reasons ({more_rows} rows): see `errors` in "
                     f"_summary.json and the `error` column")
    return "\n".join(lines)


def busy_throughput(actors: list[dict]) -> float:
    """Generated tokens per second while a batch was in flight, over the actors (`run_stats`' `actors`)."""
    busy = sum(a["busy_s"] for a in actors)
    return sum(a["generated_tokens"] for a in actors) / busy if busy else 0.0


def throughput_ratio(spec_actors: list[dict], base_actors: list[dict]) -> dict:
    """Speculative over target-only tokens per busy second of the two runs' engine actors (`two_run_ratio`), and how
    much CPU each run's actors got per busy second (`cpu_s_per_busy_s`, where they report it). The runs come one after
    the other, so a machine whose other load changed in between moves the ratio (the CPU shares show it): kept in
    _summary.json, printed nowhere; the speed-up printed is measured side by side (`side_by_side`)."""
    out = {"two_run_ratio": ratio(busy_throughput(spec_actors), busy_throughput(base_actors))}
    sides = {"speculative": spec_actors, "target_only": base_actors}
    if all(side and all("cpu_s" in a for a in side) for side in sides.values()):
        out["cpu_s_per_busy_s"] = {name: ratio(sum(a["cpu_s"] for a in side), sum(a["busy_s"] for a in side))
                                   for name, side in sides.items()}
    return out


def ratio(a: float, b: float) -> float:
    """a / b, 0.0 where b is 0 (a run that measured nothing)."""
    return a / b if b else 0.0


def side_by_side(probe: dict) -> dict:
    """The job's speed-up from the probe (`pair_probe.measure_pair`): its own setting (the adaptive width where the
    probe ran it, else K) over target-only at the job's rows, timed in one process: `speedup`, `speedup_per_pass`
    and `speedup_of` (which engine, rows, passes). `speedup` None where the probe failed."""
    if "error" in probe:
        return {"speedup": None}
    engine, key = ("auto", "auto_speedups") if "auto_speedups" in probe else (f"K={probe['num_spec_tokens']}",
                                                                              "speedups")
    cell = next(c for c in probe[key] if c["rows"] == probe["rows"])
    return {"speedup": cell["speedup"], "speedup_per_pass": cell["per_pass"],
            "speedup_of": {"engine": engine, "rows": cell["rows"], "passes": probe["passes"]}}


def speedup_verdict(per_pass: list[float]) -> str:
    """A side-by-side ratio read against its spread over the passes: a gain or a loss counts only when every pass
    shows it."""
    if min(per_pass) > 1.0:
        return "speculation pays"
    if max(per_pass) < 1.0:
        return "it does not pay"
    return "within this machine's noise"


def _rows(n: int) -> str:
    return f"{n} row{'s' if n > 1 else ''}"


def _cell(c: dict) -> str:
    passes = c.get("per_pass")  # not in a summary written before the probe kept its passes
    spread = f"{min(passes):.2f}-{max(passes):.2f}: " if passes else ""
    return f"{_rows(c['rows'])} {c['speedup']:.2f}x ({spread}{speedup_verdict(passes or [c['speedup']])})"


def baseline_lines(s: dict, base: dict) -> list[str]:
    """The target-only run (throughput and the greedy check), the job's speed-up measured side by side (none where
    the job did not draft), then with a probe the draft at full K, Domino against target-only at one row and at the
    job's rows, where Domino pays, and why the adaptive width chose as it did."""
    lines = [f"  target only on the same rows (a second run): {base['tokens_per_s']:.1f} tokens/s while busy; greedy "
             f"outputs identical: {base['identical']}/{base['compared']}"]
    widths = s.get("verify_width_histogram")
    probe = base.get("probe")
    # A draft (K >= 1) that the job never used: the engine did target-only's work, and no ratio says more.
    if widths and len(widths) > 1 and widths[0] >= 0.99 * sum(widths) > 0:
        at = _rows(probe["rows"]) if probe and "rows" in probe else "this batch size"
        lines.append(f"  this job's speed-up: none: speculation did not pay at {at} on this machine, so the engine ran "
                     f"W = 0 (no drafting) in {widths[0] / sum(widths):.0%} of its row-steps, target-only's work")
    elif base.get("speedup_of"):  # not in summaries written before it was measured side by side
        of, passes = base["speedup_of"], base["speedup_per_pass"]
        lines.append(f"  this job's speed-up {base['speedup']:.2f}x: Domino {of['engine']} over target only at "
                     f"{_rows(of['rows'])}, measured side by side in one process ({of['passes']} interleaved passes: "
                     f"{min(passes):.2f}x to {max(passes):.2f}x, {speedup_verdict(passes)})")
    if not probe:
        return lines
    if "error" in probe:
        return lines + [f"  the in-process measurement of the pair failed: {probe['error']}"]
    k, rows = probe["num_spec_tokens"], probe["rows"]
    lines.append(f"  the draft at K={k} (every step verifying {k} drafts; the first {rows} rows, run together): mean "
                 f"acceptance length {probe['mean_acceptance_length']:.2f}, per position "
                 + " ".join(f"{p:.2f}" for p in probe["per_position_acceptance"]))
    settings = {f"K={k}": probe["speedups"], **({"auto": probe["auto_speedups"]} if "auto_speedups" in probe else {})}
    lines.append(f"  Domino over target only, side by side (one process, the same prompts, {probe['passes']} "
                 "interleaved passes; each ratio with the passes' range):")
    lines += [f"    {name}: " + "; ".join(_cell(c) for c in cells) for name, cells in settings.items()]
    lines.append(pays_line(settings))
    why = width_line(s, probe)
    return lines + ([why] if why else [])


def pays_line(settings: dict[str, list[dict]]) -> str:
    """Where Domino pays beyond the passes' spread (`speedup_verdict`), at any of the measured `settings`
    ({name: cells}): the best such ratio at each row count."""
    best: dict[int, tuple[float, str]] = {}
    for name, cells in settings.items():
        for c in cells:
            if speedup_verdict(c.get("per_pass") or [c["speedup"]]) == "speculation pays":
                best[c["rows"]] = max(best.get(c["rows"], (0.0, "")), (c["speedup"], name))
    if not best:
        counts = sorted({c["rows"] for cells in settings.values() for c in cells})
        return ("  Domino pays on this machine at none of the measured row counts ("
                + ", ".join(map(str, counts)) + ")")
    return "  Domino pays on this machine at: " + ", ".join(f"{_rows(n)} ({x:.2f}x at {name})"
                                                            for n, (x, name) in sorted(best.items()))


def width_line(s: dict, probe: dict) -> str | None:
    """Why the adaptive width chose as it did at the job's most rows: its cost table (the engine actor's at the end of
    the run, at the rows' mean key length) against the tokens a step commits at each width, from the draft's
    acceptance at full K; then what a step at K cost against a plain one in the probe, a check of that table."""
    tables = [a["width_costs"] for a in s["run"]["actors"] if a.get("width_costs")]
    widths = s.get("verify_width_histogram")
    if not tables or not widths or not sum(widths):
        return None
    rows = tables[0]["by_rows"][-1]
    costs = dict(zip(tables[0]["widths"], rows["seconds"]))
    drafting = sorted(w for w in costs if w)
    if 0 not in costs or not drafting:
        return None
    plain, per_position = costs[0], probe["per_position_acceptance"]
    tokens = {w: 1 + sum(per_position[:w]) for w in costs}  # committed tokens a row in a step at width W
    rate = {w: tokens[w] * plain / costs[w] for w in costs}  # ... per second, over a plain step's
    best = best_width(rate)
    lo, hi = drafting[0], drafting[-1]
    need = {w: costs[w] / plain * (1 + DRAFTING_MARGIN) for w in (lo, hi)}
    top = max(drafting, key=rate.get)
    verdict = (f"W={best} pays best ({rate[best]:.2f}x a plain step's tokens per second)" if best else
               f"no width pays enough (best W={top}: {rate[top]:.2f}x a plain step's tokens per second), so W=0")
    line = (f"  why these widths: at {rows['rows']} rows the width policy's cost table puts a plain step at "
            f"{plain * 1e3:.1f} ms and one verifying W drafts at {costs[lo] * 1e3:.1f} ms (W={lo}) to "
            f"{costs[hi] * 1e3:.1f} ms (W={hi}): drafting pays only where a step commits over {need[lo]:.2f} to "
            f"{need[hi]:.2f} tokens a row (with the policy's {DRAFTING_MARGIN:.0%} margin), and this draft commits "
            f"{tokens[lo]:.2f} to {tokens[hi]:.2f}: {verdict}; the job ran W={best} in "
            f"{widths[best] / sum(widths):.0%} of its row-steps")
    measured = next((c["speedup"] for c in probe["speedups"] if c["rows"] == rows["rows"]), None)
    if measured and hi == probe["num_spec_tokens"]:  # a probe step at K costs tau / speed-up plain steps
        actual, table = probe["mean_acceptance_length"] / measured, costs[hi] / plain
        line += f". Measured in the probe a step at W={hi} cost {actual:.1f}x a plain one, the table says {table:.1f}x"
        if abs(actual - table) > 0.2 * actual:
            line += f": the policy took drafting for {'cheaper' if table < actual else 'dearer'} than it is"
    return line
