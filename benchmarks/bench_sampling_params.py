"""What penalties and logprobs cost: tokens/s of the demo pair with plain greedy rows, with penalties, and with
`logprobs: 5`, side by side in one run.

    python benchmarks/bench_sampling_params.py --threads 1 --prompts 16 --max-new-tokens 128 --repeats 3

Every mode runs the Domino draft at the default (adaptive) width over the same prompts at each batch size, in
interleaved repeats (this machine is shared and noisy); tokens/s is the median over repeats and `vs plain` the
median of per-repeat ratios. Checks, untimed: logprobs leave the tokens as they are (plain's), and the penalised
speculative tokens equal target-only's with the same penalties.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from domino_ray.engine.request import Request
from domino_ray.llm import build_engine
from domino_ray.sample.params import SamplingParams
from domino_ray.spec_decode.stats import total_stats

from common import load_pair, token_digest

PENALTIES = dict(repetition_penalty=1.1, frequency_penalty=0.2, presence_penalty=0.2)  # common chat settings
MODES = {"plain": {}, "penalties": PENALTIES, "logprobs 5": {"logprobs": 5}}


def run(target, tokenizer, draft, prompts, *, rows, max_new_tokens, mode, max_model_len) -> dict:
    engine = build_engine(target, draft, tokenizer, max_batch_size=rows, max_model_len=max_model_len)
    params = SamplingParams(max_new_tokens=max_new_tokens, **MODES[mode])
    start = time.perf_counter()
    out = engine.generate([Request(i, p, params) for i, p in enumerate(prompts)])
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "tokens": sum(len(c.token_ids) for c in out), "token_ids": [c.token_ids for c in out],
            "mean_acceptance_length": total_stats(c.stats for c in out).mean_acceptance_length}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", type=int, default=16, help="held-out prompts of the demo pair (0: all)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--batch-sizes", default="1,16")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    target, draft, tokenizer, prompts = load_pair("demo", None, args.prompts)[:4]
    max_model_len = max(len(p) for p in prompts) + args.max_new_tokens  # the KV cache: what these prompts need
    sizes = dict(max_new_tokens=args.max_new_tokens, max_model_len=max_model_len)
    results = {}
    for rows in [int(b) for b in args.batch_sizes.split(",")]:
        for mode in MODES:  # warm-up: first-call costs (hooks, allocator) stay out of the timing
            run(target, tokenizer, draft, prompts[:rows], rows=rows, mode=mode, max_new_tokens=8,
                max_model_len=max_model_len)
        runs = {mode: [] for mode in MODES}
        for _ in range(args.repeats):  # interleaved: every mode sees the same machine state
            for mode in MODES:
                runs[mode].append(run(target, tokenizer, draft, prompts, rows=rows, mode=mode, **sizes))
        alone = run(target, tokenizer, None, prompts, rows=rows, mode="penalties", **sizes)
        assert all(r["token_ids"] == runs["plain"][0]["token_ids"] for r in runs["plain"] + runs["logprobs 5"]), \
            "logprobs changed the tokens"
        assert all(r["token_ids"] == alone["token_ids"] for r in runs["penalties"]), \
            "penalised speculative tokens differ from target-only's"
        table = {}
        for mode, rs in runs.items():
            table[mode] = {
                "tok_s": round(statistics.median(r["tokens"] / r["seconds"] for r in rs), 2),
                "vs_plain": round(statistics.median(p["seconds"] / r["seconds"] for p, r in zip(runs["plain"], rs)), 3),
                "mean_acceptance_length": round(rs[0]["mean_acceptance_length"], 3), "tokens": rs[0]["tokens"],
                "tokens_sha256": token_digest(rs[0]["token_ids"])}
        results[f"batch {rows}"] = table
        print(f"\nbatch {rows}: {len(prompts)} prompts x {args.max_new_tokens} new tokens, {args.repeats} repeats")
        print(f"{'mode':<12} {'tok/s':>9} {'vs plain':>9} {'tau':>6} {'tokens':>7}")
        for mode, row in table.items():
            print(f"{mode:<12} {row['tok_s']:>9.1f} {row['vs_plain']:>8.3f}x {row['mean_acceptance_length']:>6.2f} "
                  f"{row['tokens']:>7}", flush=True)
    if args.json:
        args.json.write_text(json.dumps({"machine": platform.processor() or platform.machine(),
                                         "threads": torch.get_num_threads(), "penalties": PENALTIES,
                                         "args": {k: str(v) for k, v in vars(args).items()}, "results": results},
                                        indent=2))


if __name__ == "__main__":
    main()
