"""A shipped pair in our engine: acceptance, the GRU head's effect, speed-up over target-only.

    python benchmarks/bench_demo_pair.py --threads 1 --prompts 32 --max-new-tokens 128 --repeats 3
    python benchmarks/bench_demo_pair.py --pair smollm2 --threads 1 --prompts 16 --batch-sizes 1,4,16
    python benchmarks/bench_demo_pair.py --pair smollm2 --prompts 0 --batch-sizes 16 --acceptance-only

`--pair demo` (default): the small stdlib-trained pair of domino_ray/assets/demo, plain prompts.
`--pair smollm2`: SmolLM2-135M-Instruct (converted by `make smollm2`) with the draft and held-out chat
prompts (`messages`, chat template) of domino_ray/assets/smollm2.

Everything runs in one process, side by side, in interleaved repeats (this machine is shared and
noisy): per batch size, target-only (`draft=None`, same engine), the Domino draft, and the same draft
with its GRU head removed (base logits only: the head ablation at equal backbone); optional extra
drafts (`--extra name=path`, e.g. a separately trained DFlash-only draft) and extra draft lengths
(`--num-draft-tokens`). Speed-ups are the median over repeats of per-repeat ratios. Every speculative
output is checked token for token against target-only greedy output.
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
from domino_ray.engine.core import SpecEngine
from domino_ray.target.loading import stop_token_ids
from domino_ray.spec_decode.checkpoint import load_draft
from domino_ray.spec_decode.draft import resolve_num_spec_tokens
from domino_ray.spec_decode.proposer import DominoProposer
from domino_ray.sample.params import SamplingParams
from domino_ray.spec_decode.stats import per_position_acceptance, total_stats
from domino_ray.training.evaluation import backbone_only

from common import load_pair, token_digest


def run(target, draft, prompts, *, rows, max_new_tokens, eos, num_draft_tokens=None, max_model_len=None):
    proposer, adaptive = None, False
    if draft is not None:
        k, adaptive = resolve_num_spec_tokens(num_draft_tokens, draft.config)
        proposer = DominoProposer(draft, target, k)
    engine = SpecEngine(target, proposer, max_rows=rows, eos_token_ids=eos, max_model_len=max_model_len,
                        adaptive=adaptive)
    params = SamplingParams(max_new_tokens=max_new_tokens)
    start = time.perf_counter()
    out = engine.generate([Request(i, p, params) for i, p in enumerate(prompts)])
    seconds = time.perf_counter() - start
    total = total_stats(c.stats for c in out)
    return {"seconds": seconds, "tokens": sum(len(c.token_ids) for c in out),
            "token_ids": [c.token_ids for c in out], "num_spec_tokens": engine.num_spec_tokens,
            "mean_acceptance_length": total.mean_acceptance_length if proposer else None,
            "histogram": total.acceptance_histogram if proposer else None, "row_stats": [c.stats for c in out]}


def repeated_fraction(rows: list[list[int]], n: int = 4) -> float:
    """Share of generated n-grams that already occurred earlier in the same row: how repetitive (and so how
    easy to draft) the target's greedy output is."""
    repeated = total = 0
    for ids in rows:
        seen = set()
        for i in range(len(ids) - n + 1):
            gram = tuple(ids[i:i + n])
            repeated += gram in seen
            total += 1
            seen.add(gram)
    return repeated / max(total, 1)


def acceptance_only(target, drafts, prompts, args, eos, max_model_len, rows, groups) -> dict:
    """Each draft's tau over all prompts and per group of prompts (held out by source / by sample)."""
    results, reference = {}, None
    for name, (draft, k) in drafts.items():
        if draft is None or k == "auto":  # target-only has no acceptance; auto's tau is the policy's, not the draft's
            continue
        r = run(target, draft, prompts, rows=rows, max_new_tokens=args.max_new_tokens, eos=eos, num_draft_tokens=k,
                max_model_len=max_model_len)
        reference = reference or r["token_ids"]
        assert r["token_ids"] == reference, f"{name}: output differs from the other drafts' (all must be the target's)"
        results[name] = {"mean_acceptance_length": round(r["mean_acceptance_length"], 3), "tokens": r["tokens"],
                         "tokens_sha256": token_digest(r["token_ids"]),
                         "per_position_acceptance": [round(x, 3) for x in per_position_acceptance(r["histogram"])]}
        print(f"{name:<18} tau {r['mean_acceptance_length']:.3f} over {len(prompts)} prompts, {r['tokens']} tokens; "
              f"per position {' '.join(f'{x:.2f}' for x in results[name]['per_position_acceptance'])}", flush=True)
        if len(set(groups)) > 1:
            results[name]["by_group"] = {}
            for group in sorted(set(groups)):
                stats = total_stats(s for s, g in zip(r["row_stats"], groups) if g == group)
                results[name]["by_group"][group] = {"prompts": groups.count(group),
                                                    "mean_acceptance_length": round(stats.mean_acceptance_length, 3)}
                print(f"{'':<18}   held out by {group:<22} {groups.count(group):>4} prompts  "
                      f"tau {stats.mean_acceptance_length:.3f}", flush=True)
    return {"acceptance": results}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pair", choices=("demo", "smollm2"), default="demo")
    p.add_argument("--assets", type=Path, default=None, help="draft + prompts directory (default: the pair's)")
    p.add_argument("--prompts", type=int, default=32, help="held-out prompts per run (0: all)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--batch-sizes", default="1,16")
    p.add_argument("--num-draft-tokens", default="",
                   help="extra draft lengths for the Domino draft, e.g. auto,4 (auto: the adaptive verify width)")
    p.add_argument("--extra", action="append", default=[], help="name=path of another draft to compare")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--acceptance-only", action="store_true",
                   help="only each draft's acceptance at its K (no timing: tau does not depend on it), at the "
                        "largest batch size; for many prompts")
    p.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    pair = load_pair(args.pair, args.assets, args.prompts)
    target, domino, tokenizer, prompts = pair[:4]
    eos = stop_token_ids(target, tokenizer)
    # the KV cache is reserved for rows x max_model_len: bound it by what these prompts need
    max_model_len = max(len(p) for p in prompts) + args.max_new_tokens
    drafts = {"target-only": (None, None), "domino": (domino, None), "domino-base-only": (backbone_only(domino), None)}
    for k in filter(None, args.num_draft_tokens.split(",")):
        drafts[f"domino-{k}" if k == "auto" else f"domino-K{k}"] = (domino, k if k == "auto" else int(k))
    for item in args.extra:
        name, path = item.split("=", 1)
        drafts[name] = (load_draft(path, target_config=target.config, dtype=target.dtype), None)

    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    results = acceptance_only(target, drafts, prompts, args, eos, max_model_len, max(batch_sizes), pair.groups) \
        if args.acceptance_only else {}
    for rows in ([] if args.acceptance_only else batch_sizes):
        for name, (draft, k) in drafts.items():  # warm-up: first-call costs (hooks, allocator) stay out of timing
            run(target, draft, prompts[:rows], rows=rows, max_new_tokens=8, eos=eos, num_draft_tokens=k,
                max_model_len=max_model_len)
        runs = {name: [] for name in drafts}
        for _ in range(args.repeats):  # interleaved: every configuration sees the same machine state
            for name, (draft, k) in drafts.items():
                runs[name].append(run(target, draft, prompts, rows=rows, max_new_tokens=args.max_new_tokens,
                                      eos=eos, num_draft_tokens=k, max_model_len=max_model_len))
        reference = runs["target-only"][0]["token_ids"]
        table = {}
        for name, rs in runs.items():
            assert all(r["token_ids"] == reference for r in rs), f"{name}: output differs from target-only greedy"
            tps = [r["tokens"] / r["seconds"] for r in rs]
            ratios = [r0["seconds"] / r["seconds"] for r0, r in zip(runs["target-only"], rs)]
            entry = {"tokens_per_s": round(statistics.median(tps), 1), "speedup": round(statistics.median(ratios), 2),
                     "speedups": [round(x, 2) for x in ratios], "tokens": rs[0]["tokens"],
                     "tokens_sha256": token_digest(rs[0]["token_ids"]),
                     "num_spec_tokens": rs[0]["num_spec_tokens"]}
            if rs[0]["histogram"] is not None:
                entry["mean_acceptance_length"] = round(rs[0]["mean_acceptance_length"], 3)
                entry["per_position_acceptance"] = [round(x, 3) for x in per_position_acceptance(rs[0]["histogram"])]
            table[name] = entry
        repeated = repeated_fraction(reference)
        results[f"batch {rows}"] = {"drafts": table, "repeated_4gram_fraction": round(repeated, 3)}
        if domino.config.has_d2t:  # a pruned vocabulary bounds acceptance: drafts can only be its ids
            vocab = set(domino.to_target_ids(torch.arange(domino.config.draft_vocab_size)).tolist())
            generated = [t for row in reference for t in row]
            coverage = sum(t in vocab for t in generated) / max(len(generated), 1)
            results[f"batch {rows}"]["draft_vocab_coverage"] = round(coverage, 4)
            print(f"draft vocabulary ({len(vocab)} ids) covers {coverage:.2%} of the target's generated tokens")
        print(f"\nbatch {rows}: {len(prompts)} held-out prompts x {args.max_new_tokens} new tokens, greedy, "
              f"{args.repeats} interleaved repeats (outputs equal target-only token for token; "
              f"{repeated:.0%} of generated 4-grams repeat an earlier one in their row)")
        print(f"{'':<18} {'tok/s':>8} {'speed-up':>9} {'tau':>6}  per-position acceptance")
        for name, e in table.items():
            tau = f"{e['mean_acceptance_length']:.2f}" if "mean_acceptance_length" in e else "-"
            pos = " ".join(f"{x:.2f}" for x in e.get("per_position_acceptance", []))
            print(f"{name:<18} {e['tokens_per_s']:>8.1f} {e['speedup']:>8.2f}x {tau:>6}  {pos}")
    meta = {"machine": f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} torch threads",
            "torch": torch.__version__, "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "args": vars(args)}
    if args.json:
        args.json.write_text(json.dumps({"meta": meta, "results": results}, indent=1, default=str) + "\n")


if __name__ == "__main__":
    main()
