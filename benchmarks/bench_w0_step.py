"""What a W = 0 step of the adaptive engine costs over the target-only engine's (issue 50: at most 2% more).

The demo target with a random draft (same shapes as the demo draft, accepts ~nothing): after its trial the adaptive
width stays at W = 0, so its steps are plain decode steps plus what the adaptive engine adds to them (the width's
bookkeeping, the draft's taps kept for later). Both engines decode the same prompts, `--rounds` times, interleaved
and in alternating order, in one process; every steady step (after the prefill and the first step) is timed alone.
Whole runs on this machine vary by +-20% from one to the next; the lower quantiles of thousands of single steps do
not, so the ratio is read there (p10 and p50).

    python benchmarks/bench_w0_step.py [--rows 1,4,16,64] [--rounds 4] [--max-new-tokens 150] [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from common import demo_pair, write_results
from domino_ray.config import DEMO_ASSETS
from domino_ray.engine.core import SpecEngine
from domino_ray.engine.request import Request
from domino_ray.sample.params import SamplingParams
from domino_ray.spec_decode.draft import DominoDraft
from domino_ray.spec_decode.proposer import DominoProposer


def step_times(engine: SpecEngine, prompts: list[list[int]], params: SamplingParams) -> tuple[list[float], list]:
    """Seconds of each steady step of one run of `prompts` (all admitted at once), and the completions."""
    for i, prompt in enumerate(prompts):
        engine.add_request(Request(i, prompt, params))
    events = engine.step() + engine.step()  # the prefill and the first step: not steady steps
    times = []
    while engine.has_unfinished():
        start = time.perf_counter()
        step_events = engine.step()
        times.append(time.perf_counter() - start)
        events += step_events
    done = {e.request_id: e.completion for e in events if e.completion is not None}
    return times, [done[i] for i in range(len(prompts))]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default="1,4,16,64")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=150)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    target, demo, _, prompts = demo_pair(DEMO_ASSETS)
    draft = DominoDraft(demo.config).to(target.dtype).eval()  # the module's default init: random weights
    params = SamplingParams(max_new_tokens=args.max_new_tokens, ignore_eos=True)
    results = {}
    for rows in (int(r) for r in args.rows.split(",")):
        engines = {"target-only": SpecEngine(target, None, max_rows=rows),
                   "adaptive": SpecEngine(target, DominoProposer(draft, target, demo.config.max_draft_tokens),
                                          max_rows=rows, adaptive=True)}
        steps = {name: [] for name in engines}
        widths = [0] * (engines["adaptive"].num_spec_tokens + 1)
        for r in range(args.rounds):
            batch = prompts[(r * rows) % len(prompts):][:rows]
            outputs = {}
            for name in list(engines)[::-1 if r % 2 else 1]:
                times, outputs[name] = step_times(engines[name], batch, params)
                steps[name] += times
            assert [c.token_ids for c in outputs["adaptive"]] == [c.token_ids for c in outputs["target-only"]]
            for c in outputs["adaptive"]:
                widths = [a + b for a, b in zip(widths, c.stats.verify_width_histogram)]
        q = {name: statistics.quantiles(v, n=10) for name, v in steps.items()}
        cell = {name: {"steps": len(steps[name]), "p10_ms": round(q[name][0] * 1e3, 3),
                       "p50_ms": round(q[name][4] * 1e3, 3)} for name in engines}
        cell["adaptive_over_target_only"] = {"p10": round(q["adaptive"][0] / q["target-only"][0], 3),
                                             "p50": round(q["adaptive"][4] / q["target-only"][4], 3)}
        cell["adaptive_widths"] = widths
        results[f"rows {rows}"] = cell
        ratio = cell["adaptive_over_target_only"]
        print(f"{rows:>3} rows: step ms p10 / p50  target-only {cell['target-only']['p10_ms']:.3f} / "
              f"{cell['target-only']['p50_ms']:.3f}  adaptive {cell['adaptive']['p10_ms']:.3f} / "
              f"{cell['adaptive']['p50_ms']:.3f}  adaptive / target-only {ratio['p10']:.3f} / {ratio['p50']:.3f}  "
              f"(widths {widths})", flush=True)
    write_results(args.json, results, args)


if __name__ == "__main__":
    main()
