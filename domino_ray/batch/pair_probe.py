"""A short measurement of a target + draft pair on a few of a job's prompts, in one process: what the batch job's
target-only comparison (`runtime.compare_baseline`) prints as the job's speed-up (README "Reading what `make demo`
prints").

The job's target-only run, one after the job, checks its greedy outputs; its throughput, measured minutes apart on
a machine shared with other work, is no speed-up. This measures one, and says what the draft is worth and where
speculation pays on the machine it runs on:
- the draft at its full K (every step verifying K drafts) on `rows` of the job's prompts run together, as the job
  runs them: its acceptance, apart from the width policy's choices;
- Domino at K, and with an adaptive job Domino at the adaptive width (the job's own setting), against target-only
  at one row and at `rows` rows, on the same prompts, timed prompt by prompt in interleaved passes (the engines'
  order alternates): every engine sees the machine as it is in the same seconds. Each pass gives its own ratio, so
  the passes' spread says how far a ratio is from noise.

Token ids in, figures out: no Ray (batch/job.py runs it as a task with an engine actor's resources).
"""

from __future__ import annotations

import time
from typing import Sequence

from domino_ray.batch.summary import ratio
from domino_ray.frontend.requests import id_requests
from domino_ray.llm import build_engine, engine_settings, load_draft_for
from domino_ray.target.loading import load_target, load_tokenizer
from domino_ray.spec_decode.draft import resolve_num_spec_tokens
from domino_ray.sample.params import SamplingParams
from domino_ray.spec_decode.stats import per_position_acceptance, total_stats

ONE_ROW_PROMPTS = 4  # prompts timed one at a time: a few seconds of target-only decoding on the demo pair
PASSES = 2           # interleaved passes (the engines' order alternates): a ratio per pass, so a spread


def measure_pair(target, draft, tokenizer, prompts: Sequence[tuple[list[int], SamplingParams]], *, rows: int,
                 num_spec_tokens: int, adaptive: bool = False, one_row_prompts: int = ONE_ROW_PROMPTS,
                 passes: int = PASSES, **engine_settings) -> dict:
    """The draft at fixed K = `num_spec_tokens`, with `adaptive` also at the adaptive width, and target-only, each with
    `rows` slots, on `prompts` (prompt ids, sampling parameters; those the model's length limit refuses are skipped):
    the first `rows` run together, the first `one_row_prompts` of them one at a time.
    `engine_settings` go to `build_engine` (max_model_len, seed, ...)."""
    engines = {"target_only": build_engine(target, None, tokenizer, max_batch_size=rows, **engine_settings),
               "domino": build_engine(target, draft, tokenizer, num_draft_tokens=num_spec_tokens, max_batch_size=rows,
                                      **engine_settings)}
    if adaptive:  # times its step widths here, as the job's engine actors did at their start
        engines["auto"] = build_engine(target, draft, tokenizer, num_draft_tokens="auto", max_batch_size=rows,
                                       **engine_settings)
    limit = engines["domino"].max_model_len
    sample = [(ids, params) for ids, params in prompts if len(ids) < limit][:rows]  # the engine refuses longer ones
    if not sample:
        raise ValueError(f"none of the {len(prompts)} prompts fits the model's limit of {limit} tokens")
    workloads = {1: [sample[i:i + 1] for i in range(min(one_row_prompts, len(sample)))], len(sample): [sample]}
    for engine in engines.values():  # first-call costs (the first prefill's allocations) stay out of the timing
        _run(engine, [(ids, SamplingParams(max_new_tokens=2)) for ids, _ in sample])
    seconds = {(name, n, p): 0.0 for name in engines for n in workloads for p in range(passes)}
    outputs: dict = {}
    for p in range(passes):
        for n, groups in workloads.items():
            for group in groups:
                for name in (list(engines) if p % 2 == 0 else list(engines)[::-1]):
                    start = time.perf_counter()
                    completions = _run(engines[name], group)  # each step reads its tokens: the device is done
                    seconds[name, n, p] += time.perf_counter() - start
                    if p == 0:
                        outputs.setdefault((name, n), []).extend(completions)
    stats = total_stats(c.stats for c in outputs["domino", len(sample)])
    same = sum(a.token_ids == b.token_ids for a, b in zip(outputs["domino", len(sample)],
                                                         outputs["target_only", len(sample)]))
    return {
        "num_spec_tokens": num_spec_tokens, "rows": len(sample), "passes": passes,
        "mean_acceptance_length": stats.mean_acceptance_length,  # pooled over the `rows` prompts, every step at K
        "per_position_acceptance": per_position_acceptance(stats.acceptance_histogram),
        "identical": same,
        "speedups": _cells(seconds, workloads, "domino", passes),  # Domino at K
        # Domino at the adaptive width: the job's own setting
        **({"auto_speedups": _cells(seconds, workloads, "auto", passes)} if adaptive else {}),
    }


def _cells(seconds: dict, workloads: dict, name: str, passes: int) -> list[dict]:
    """Engine `name` over target-only at each row count of `workloads`, from `seconds[engine, rows, pass]`: over
    all passes (`speedup`) and pass by pass (`per_pass`, whose spread is the measurement's)."""
    cells = []
    for n, groups in workloads.items():
        base, spec = ([seconds[side, n, p] for p in range(passes)] for side in ("target_only", name))
        cells.append({"rows": n, "prompts": sum(len(g) for g in groups), "speedup": ratio(sum(base), sum(spec)),
                      "per_pass": [ratio(b, s) for b, s in zip(base, spec)]})
    return cells


def _run(engine, prompts):
    return engine.generate(id_requests([ids for ids, _ in prompts], [params for _, params in prompts]))


def cost_tables(costs, key_length: float) -> dict:
    """The adaptive width's step costs (`spec_decode.width_costs.StepCosts`) at its fewest and most rows, at `key_length` keys:
    `{"widths": [W...], "by_rows": [{"rows": r, "seconds": [...]}]}` (JSON-ready). Read from another thread than the
    engine's: only the figures of the measured row buckets (fixed keys) are read, nothing is cached."""
    buckets = sorted({costs.measured[0], costs.measured[-1]})
    tables = [(r, costs.table(r, key_length)) for r in buckets]
    widths = sorted(tables[0][1])
    return {"key_length": key_length, "widths": widths,
            "by_rows": [{"rows": r, "seconds": [table[w] for w in widths]} for r, table in tables]}


def probe_pair(model, draft, generation, runtime, prompts: Sequence[tuple[list[int], SamplingParams]],
               rows: int) -> dict:
    """`measure_pair` from the config sections `llm.load_engine` takes: the target and draft loaded as an engine actor
    loads them, on as many threads, at the K that `draft.num_draft_tokens` resolves to (auto: the most, and the
    adaptive width beside it)."""
    import torch

    target = load_target(model.source, dtype=model.dtype, device=model.device)
    if next(target.parameters()).device.type == "cpu":
        torch.set_num_threads(max(1, int(runtime.cpus_per_actor)))  # as DominoPredictor
    draft_model = load_draft_for(target, draft.source)
    k, adaptive = resolve_num_spec_tokens(draft.num_draft_tokens, draft_model.config)
    settings = engine_settings(model, None, generation, runtime)
    del settings["num_draft_tokens"], settings["max_batch_size"]
    return measure_pair(target, draft_model, load_tokenizer(model.tokenizer or model.source), prompts, rows=rows,
                        num_spec_tokens=k, adaptive=adaptive, **settings)
