"""Per-step cost of the engine: tokens/s and torch calls per steady-state decode step.

    python benchmarks/bench_step.py --threads 2 --baseline-ref b0a8359 --json /tmp/step.json

Pairs: the shipped demo pair, and a random pair of the same shapes (demo target and draft configs,
random weights: acceptance ~ nothing, so the step's fixed cost shows). Batch 1 and 16, 128 new
tokens per row (`ignore_eos`), target-only and speculative, interleaved repeats in one process.
"Torch calls" counts every torch function and tensor method the step dispatches from Python (a
`TorchFunctionMode`), i.e. the Python-side work a GPU would otherwise wait for.

`--ragged`: 1 row in 8 with a long prompt (a demo prompt repeated up to the demo target's 256 positions
less the new tokens), the others 8-24 tokens, as many prompts as rows; also reports the keys each layer's
attention reads per decode step: the paged engine reads what each row holds (its own blocks); engines with key
groups (`SpecEngine.key_reads`) read their groups' buckets, beside what one key bucket, the longest row's, reads on
the same steps (what engines before key groups read). For the 64- and 128-row figures:

    python benchmarks/bench_step.py --ragged --batch-sizes 16,64,128 --max-new-tokens 64 --threads 2 \
        --baseline-ref BASE --json /tmp/ragged.json

`--baseline-ref REF` also runs the engine as of git commit REF (its `domino_ray` extracted to a
temporary directory and imported under another name), interleaved with this one in the same process:
before/after figures measured side by side.
"""

from __future__ import annotations

import argparse
import importlib
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode

from domino_ray.config import DEMO_ASSETS
from domino_ray.engine.request import Request
from domino_ray.engine.core import SpecEngine
from domino_ray.spec_decode.draft import DominoDraft
from domino_ray.spec_decode.proposer import DominoProposer
from domino_ray.sample.params import SamplingParams
from common import demo_pair, write_results


class CallCounter(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.calls += 1
        return func(*args, **(kwargs or {}))


CURRENT = {"SpecEngine": SpecEngine, "Request": Request, "DominoProposer": DominoProposer,
           "SamplingParams": SamplingParams}


def baseline_engine(ref: str) -> dict:
    """The engine classes of git commit `ref`, importable beside today's (package renamed)."""
    root = Path(tempfile.mkdtemp(prefix="domino_baseline_"))
    repo = Path(__file__).resolve().parent.parent
    names = subprocess.run(["git", "-C", str(repo), "ls-tree", "-r", "--name-only", ref, "domino_ray/"], check=True,
                           capture_output=True, text=True).stdout.split()
    for name in names:  # the Python modules, in their packages (the flat layout and the subpackages alike)
        if name.endswith(".py"):
            text = subprocess.run(["git", "-C", str(repo), "show", f"{ref}:{name}"], check=True, capture_output=True,
                                  text=True).stdout
            path = root / "domino_ray_baseline" / Path(name).relative_to("domino_ray")
            path.parent.mkdir(parents=True, exist_ok=True)
            # `domino_ray.x` and `from domino_ray import x`, not `torch.ops.domino_ray`
            path.write_text(re.sub(r"(?<![\w.])domino_ray(?=[.\s])", "domino_ray_baseline", text))
    sys.path.insert(0, str(root))

    def first(name: str, *modules: str):  # names moved between modules over the project's history
        for module in modules:
            found = getattr(importlib.import_module(f"domino_ray_baseline.{module}"), name, None) \
                if (root / "domino_ray_baseline" / f"{module.replace('.', '/')}.py").exists() else None
            if found is not None:
                return found
        raise ImportError(f"{name} not found in {modules} at {ref}")

    return {"SpecEngine": first("SpecEngine", "engine.core", "engine.spec_engine", "engine"),
            "Request": first("Request", "engine.request", "request", "engine"),
            "DominoProposer": first("DominoProposer", "spec_decode.proposer", "spec.proposer", "proposer"),
            "SamplingParams": first("SamplingParams", "sample.params", "spec.sampling_params", "sampling_params",
                                    "engine", "sampling")}


def run(target, draft, prompts, rows, max_new_tokens, count_calls=False, api=CURRENT):
    """All rows admitted in the first step, so every later step is a pure decode step."""
    proposer = api["DominoProposer"](draft, target) if draft is not None else None
    engine = api["SpecEngine"](target, proposer, max_rows=rows)
    params = api["SamplingParams"](max_new_tokens=max_new_tokens, ignore_eos=True)
    for i, p in enumerate(prompts[:rows]):
        engine.add_request(api["Request"](i, p, params))
    engine.step()  # admission + the first decode step
    counter, steps, tokens, held = CallCounter(), 0, 0, 0
    paged = hasattr(engine, "kv_cache_stats")  # attention reads each row's own keys: what the rows hold
    start = time.perf_counter()
    while engine.has_unfinished():
        if paged:  # host-side lengths, no sync: before the step, as the key groups count theirs
            held += sum(row.committed - 1 + engine.span for row in engine.rows)
        if count_calls:
            with counter:
                events = engine.step()
        else:
            events = engine.step()
        steps += 1
        tokens += sum(len(e.new_token_ids) for e in events)
    seconds = time.perf_counter() - start
    out = {"tokens_per_s": tokens / seconds, "steps": steps, "calls_per_step": counter.calls / max(steps, 1)}
    reads = getattr(engine, "key_reads", None)  # key groups' engines count keys read per layer and step
    if reads is not None:
        out.update({f"{k}_per_step": v for k, v in reads.per_step().items()})
    elif paged:
        out.update(keys_per_step=held / max(steps, 1), held_per_step=held / max(steps, 1))
    return out


def ragged_prompts(prompts: list[list[int]], rows: int, long_len: int, seed: int = 0) -> list[list[int]]:
    """`rows` prompts from `prompts`: every eighth one long (its tokens repeated to `long_len`), the others
    their first 8-24 tokens."""
    rng = random.Random(seed)
    out = []
    for i in range(rows):
        p = prompts[i % len(prompts)]
        out.append((p * (long_len // len(p) + 1))[:long_len] if i % 8 == 0 else p[:rng.randint(8, 24)])
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--assets", type=Path, default=DEMO_ASSETS)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--batch-sizes", default="1,16")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--baseline-ref", default=None, help="also time the engine of this git commit, interleaved")
    p.add_argument("--ragged", action="store_true", help="ragged prompts, one per row, and keys read per step")
    args = p.parse_args(argv)
    engines = {"now": CURRENT}
    if args.baseline_ref:
        engines = {"before": baseline_engine(args.baseline_ref), "now": CURRENT}
    if args.threads:
        torch.set_num_threads(args.threads)
    target, demo_draft, _, prompts = demo_pair(args.assets)
    all_prompts, prompts = prompts, prompts[:32]
    torch.manual_seed(0)
    random_target = type(target)(target.config).to(target.dtype).eval()
    random_draft = DominoDraft(demo_draft.config).to(target.dtype).eval()
    pairs = {"demo": (target, demo_draft), "random": (random_target, random_draft)}

    results = {}
    for rows in (int(b) for b in args.batch_sizes.split(",")):
        if args.ragged:
            long_len = target.config.max_position_embeddings - args.max_new_tokens - 1
            prompts = ragged_prompts(all_prompts, rows, long_len)
        for pair, (tgt, drf) in pairs.items():
            for mode, d in (("target-only", None), ("spec", drf)):
                calls, tps = {}, {name: [] for name in engines}
                for name, api in engines.items():
                    run(tgt, d, prompts, rows, 8, api=api)  # warm-up
                    calls[name] = run(tgt, d, prompts, rows, 16, count_calls=True, api=api)["calls_per_step"]
                last = {}
                for _ in range(args.repeats):  # interleaved: both engines see the same machine state
                    for name, api in engines.items():
                        last[name] = run(tgt, d, prompts, rows, args.max_new_tokens, api=api)
                        tps[name].append(last[name]["tokens_per_s"])
                for name in engines:
                    key = f"{pair} batch {rows} {mode} {name}"
                    results[key] = {"tokens_per_s": round(statistics.median(tps[name]), 1),
                                    "calls_per_step": round(calls[name], 1)}
                    keys = ""
                    if "keys_per_step" in last[name]:
                        results[key].update({k: round(v, 1) for k, v in last[name].items() if k.endswith("_per_step")
                                             and k != "calls_per_step"})
                        figures = last[name]
                        bucket = f"one bucket {figures['one_bucket_per_step']:.0f}, " \
                            if "one_bucket_per_step" in figures else "paged, "
                        keys = (f" {figures['keys_per_step']:>9.0f} keys/step ({bucket}rows hold "
                                f"{figures['held_per_step']:.0f})")
                    print(f"{key:<38} {results[key]['tokens_per_s']:>9.1f} tok/s {calls[name]:>8.1f} torch calls/step"
                          + keys, flush=True)
    write_results(args.json, results, args)


if __name__ == "__main__":
    main()
