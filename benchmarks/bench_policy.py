"""The adaptive verify width against every static choice: target-only, each fixed K, and `auto`.

    python benchmarks/bench_policy.py --threads 2 --json /tmp/policy.json

Drafts: the shipped demo draft, a random draft (same shapes, accepts ~nothing) and a half-trained one
(the demo draft with its GRU head switched off: the backbone alone). Batch 1, 4, 16, 32; 128 new tokens
per row (`ignore_eos`), 2 x rows prompts per run (so every slot is reused once); greedy, every output
checked against target-only. Configurations run interleaved within each repeat, `auto` next to target-only (the
ratio the policy promises, measured side by side) and the order reversed every other repeat (no configuration
always runs first); tok/s is the median over repeats, and "paired" the median over repeats of auto / target-only
within a repeat (less of the machine's drift between the two). The adaptive engine's start-up (its cost table) is
timed separately, not in tok/s.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from domino_ray.config import DEMO_ASSETS
from domino_ray.engine.request import Request
from domino_ray.engine.core import SpecEngine
from domino_ray.spec_decode.draft import DominoDraft, resolve_num_spec_tokens
from domino_ray.spec_decode.proposer import DominoProposer
from domino_ray.sample.params import SamplingParams
from common import demo_pair, token_digest, write_results
from domino_ray.training.evaluation import backbone_only


def run(target, draft, k, prompts, rows, max_new_tokens):
    """(tokens/s, completions, engine start seconds); k None = target-only, "auto" = adaptive."""
    start = time.perf_counter()
    proposer, adaptive = None, False
    if k is not None:
        k, adaptive = resolve_num_spec_tokens(k, draft.config)
        proposer = DominoProposer(draft, target, k)
    engine = SpecEngine(target, proposer, max_rows=rows, adaptive=adaptive)
    started = time.perf_counter() - start
    params = SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    out = engine.generate([Request(i, p, params) for i, p in enumerate(prompts)])
    seconds = time.perf_counter() - t0
    return sum(len(c.token_ids) for c in out) / seconds, out, started


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--assets", type=Path, default=DEMO_ASSETS)
    p.add_argument("--batch-sizes", default="1,4,16,32")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--drafts", default="demo,random,half-trained")
    p.add_argument("--configs", default=None, help="e.g. target-only,auto (default: those and every fixed K)")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    if args.configs and not {"target-only", "auto"} <= set(args.configs.split(",")):
        p.error("--configs must include target-only and auto (what the ratios compare)")
    if args.threads:
        torch.set_num_threads(args.threads)
    target, demo, _, all_prompts = demo_pair(args.assets)
    torch.manual_seed(0)
    drafts = {"demo": demo, "random": DominoDraft(demo.config).to(target.dtype).eval(),
              "half-trained": backbone_only(demo)}
    drafts = {name: drafts[name] for name in args.drafts.split(",")}
    k_max = demo.config.max_draft_tokens
    results = {}
    for rows in (int(b) for b in args.batch_sizes.split(",")):
        prompts = all_prompts[:2 * rows]
        for name, draft in drafts.items():
            configs = {"target-only": None, "auto": "auto", **{f"K={k}": k for k in range(1, k_max + 1)}}
            if args.configs:
                unknown = set(args.configs.split(",")) - set(configs)
                if unknown:
                    p.error(f"--configs: unknown {sorted(unknown)}; choose from {list(configs)}")
                configs = {c: configs[c] for c in args.configs.split(",")}
            tps = {c: [] for c in configs}
            starts, digests = [], {}
            reference = None
            for repeat in range(args.repeats):
                for label, k in list(configs.items())[::-1 if repeat % 2 else 1]:
                    rate, out, started = run(target, draft if k is not None else None, k, prompts, rows,
                                             args.max_new_tokens)
                    tps[label].append(rate)
                    tokens = [c.token_ids for c in out]
                    digests.setdefault(label, token_digest(tokens))
                    reference = reference or (tokens if k is None else None)
                    if reference is not None:
                        assert tokens == reference, f"{name} {label} batch {rows}: output differs from target-only"
                    if k == "auto":
                        starts.append(started)
                        widths = [sum(col) for col in zip(*(c.stats.verify_width_histogram for c in out))]
            med = {c: statistics.median(v) for c, v in tps.items()}
            static = {c: v for c, v in med.items() if c != "auto"}
            best = max(static, key=static.get)
            paired = statistics.median(a / b for a, b in zip(tps["auto"], tps["target-only"]))
            cell = {"tokens_per_s": {c: round(v, 1) for c, v in med.items()}, "best_static": best,
                    "auto_over_best_static": round(med["auto"] / static[best], 3),
                    "auto_over_target_only": round(med["auto"] / med["target-only"], 3),
                    "auto_over_target_only_paired": round(paired, 3),
                    "runs_tokens_per_s": {c: [round(x, 1) for x in v] for c, v in tps.items()},
                    f"auto_over_K={k_max}": round(med["auto"] / med[f"K={k_max}"], 3) if f"K={k_max}" in med else None,
                    "auto_widths": widths, "auto_start_s": round(statistics.median(starts), 2),
                    "tokens_sha256": digests}
            results[f"{name} batch {rows}"] = cell
            print(f"{name:<13} batch {rows:>2}: auto {med['auto']:8.1f} tok/s | best static {best:<11} "
                  f"{static[best]:8.1f} | target-only {med['target-only']:8.1f} | "
                  + (f"K={k_max} {med[f'K={k_max}']:8.1f} | " if f"K={k_max}" in med else "")
                  + f"auto/best {cell['auto_over_best_static']:.3f} auto/target {cell['auto_over_target_only']:.3f} "
                  f"(paired {paired:.3f}) "
                  + (f"auto/K{k_max} {cell[f'auto_over_K={k_max}']:.3f} " if f"K={k_max}" in med else "")
                  + f"| widths {widths} | start {cell['auto_start_s']} s", flush=True)
    write_results(args.json, results, args)


if __name__ == "__main__":
    main()
