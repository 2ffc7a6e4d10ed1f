"""Ray overhead of the batch job: N prompts through `run_job` (local Ray cluster, one engine actor)
against the same engine called directly in one process on the same prompts and settings.

    .venv/bin/python benchmarks/bench_batch_job.py --sizes 1000 4000 [--target DIR --draft DIR]

Without --target/--draft it uses domino_ray/assets/demo when present, else a saved tiny random pair
(tests/tiny_models.save_tiny_pair) and says which. Both sides use the same number of torch threads
(`--threads`, = the actor's CPUs); the job also needs CPU for reading and writing, so the cluster gets
one CPU more (`--ray-address` joins a running cluster instead). Direct: a fresh Python process that
imports, loads the models, tokenizes and generates (its whole wall time). Job: `run_job` in a driver whose Ray cluster is already up (pre-flight, actor
start and model load, generation, writing, summary). Each size runs direct then job, `--repeat` times.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from common import token_digest

REPO = Path(__file__).resolve().parents[1]


def make_prompts(n: int, seed: int = 0) -> list[str]:
    import random

    sys.path.insert(0, str(REPO / "tests"))
    from tiny_models import CORPUS

    words = " ".join(CORPUS[:3]).split()
    rng = random.Random(seed)
    return [" ".join(rng.choice(words) for _ in range(rng.randint(4, 16))) for _ in range(n)]


def models(args, tmp: Path) -> tuple[str, str, str]:
    if args.target:
        return args.target, args.draft, "given"
    demo = REPO / "domino_ray" / "assets" / "demo"
    if (demo / "target").is_dir() and (demo / "draft").is_dir():
        return str(demo / "target"), str(demo / "draft"), "demo assets"
    sys.path.insert(0, str(REPO / "tests"))
    from tiny_models import save_tiny_pair

    target, draft = save_tiny_pair(tmp / "pair")
    return target, draft, "tiny random pair (tests/tiny_models.save_tiny_pair, float32)"


def shared_overrides(target_dir: str, draft_dir: str, args) -> list[str]:
    """The engine settings both sides use."""
    return [f"model.source={target_dir}", f"draft.source={draft_dir}",
            f"generation.max_new_tokens={args.max_new_tokens}", f"generation.max_batch_size={args.max_batch_size}"]


def direct_process(target_dir: str, draft_dir: str, n: int, args) -> dict:
    """`direct` in a fresh process; wall time from start to exit (imports included)."""
    import subprocess

    command = [sys.executable, __file__, "--direct-only", str(n), "--target", target_dir, "--draft", draft_dir,
               "--max-new-tokens", str(args.max_new_tokens), "--max-batch-size", str(args.max_batch_size),
               "--threads", str(args.threads)]
    start = time.perf_counter()
    out = subprocess.run(command, capture_output=True, text=True, check=True).stdout
    wall = time.perf_counter() - start
    return {**json.loads(out.strip().splitlines()[-1]), "wall_s": wall}


def direct(target_dir: str, draft_dir: str, prompts: list[str], args) -> dict:
    """The engine alone: load, tokenize, generate everything with continuous batching."""
    import torch

    from domino_ray.config import generation_defaults, load_config
    from domino_ray.engine.request import Request
    from domino_ray.llm import load_engine
    from domino_ray.target.loading import encode_prompt

    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    cfg = load_config(None, shared_overrides(target_dir, draft_dir, args))
    engine, tokenizer = load_engine(cfg.model, cfg.draft, cfg.generation)  # as each job actor loads it
    params = generation_defaults(cfg.generation)  # the job's per-row parameters, no overrides
    requests = [Request(i, encode_prompt(tokenizer, prompt=p, chat_template=False), params)
                for i, p in enumerate(prompts)]
    gen_start = time.perf_counter()
    completions = engine.generate(requests)
    end = time.perf_counter()
    tokens = sum(len(c.token_ids) for c in completions)
    return {"wall_s": end - start, "generate_s": end - gen_start, "tokens": tokens,
            "tokens_sha256": token_digest([c.token_ids for c in completions])}


def job(target_dir: str, draft_dir: str, prompts: list[str], tmp: Path, args) -> dict:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from domino_ray.batch.job import run_job
    from domino_ray.config import load_config

    n = len(prompts)
    inp, out = tmp / f"in-{n}", tmp / f"out-{n}"
    inp.mkdir(parents=True)
    pq.write_table(pa.table({"id": list(range(n)), "prompt": prompts}), inp / "prompts.parquet")
    cfg = load_config(None, [*shared_overrides(target_dir, draft_dir, args), f"input.path={inp}",
                             f"output.path={out}", f"runtime.cpus_per_actor={args.threads}",
                             f"runtime.batch_size={args.batch_size}", "runtime.max_concurrent_batches=2"])
    start, start_epoch = time.perf_counter(), time.time()
    summary = run_job(cfg, log=lambda *_: None)
    wall = time.perf_counter() - start
    actors = summary["run"]["actors"]
    first = min(a["first_batch_at"] for a in actors) - start_epoch
    last = max(a["last_batch_done_at"] for a in actors) - start_epoch
    rows = pq.read_table(out, columns=["id", "generated_tokens"]).sort_by("id")  # the prompts' order, as direct's
    return {"wall_s": wall, "pipeline_s": summary["run"]["wall_time_s"], "first_batch_s": first,
            "generate_s": last - first, "actor_load_s": max(a["load_s"] for a in actors),
            "tokens": summary["totals"]["num_generated_tokens"], "rows": summary["rows"]["total"],
            "tokens_sha256": token_digest(rows.column("generated_tokens").to_pylist())}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1000, 4000])
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--direct-only", type=int, help=argparse.SUPPRESS)  # internal: one direct run
    parser.add_argument("--target")
    parser.add_argument("--draft")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--max-batch-size", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--ray-address", default="local",
                        help="join this running cluster (the smoke test's) instead of starting one of --threads + 1 CPUs")
    args = parser.parse_args()
    if args.direct_only:
        print(json.dumps(direct(args.target, args.draft, make_prompts(args.direct_only), args)))
        return
    os.environ.setdefault("RAY_DATA_DISABLE_PROGRESS_BARS", "1")
    import ray

    results = []
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        target, draft, which = models(args, tmp)
        print(f"models: {which}: {target} {draft}", flush=True)
        start = time.perf_counter()
        if args.ray_address == "local":
            ray.init(address="local", num_cpus=args.threads + 1, object_store_memory=300 * 1024**2,
                     include_dashboard=False, logging_level="WARNING")
        else:
            ray.init(address=args.ray_address, logging_level="WARNING")
        print(f"ray.init: {time.perf_counter() - start:.1f} s", flush=True)
        for rep in range(args.repeat):
            for n in args.sizes:
                d = {"mode": "direct", "n": n, "rep": rep, **direct_process(target, draft, n, args)}
                print(json.dumps(d), flush=True)
                j = {"mode": "job", "n": n, "rep": rep, **job(target, draft, make_prompts(n), tmp / f"{rep}", args)}
                print(json.dumps(j), flush=True)
                results += [d, j]
        ray.shutdown()
    report(results, args.sizes)


def report(results: list[dict], sizes: list[int]):
    from statistics import median

    print(f"\n{'mode':<8}{'n':>6}{'rep':>4}{'wall s':>9}{'tokens':>9}{'tokens/s':>10}{'generate s':>12}{'gen tok/s':>11}")
    for r in results:
        print(f"{r['mode']:<8}{r['n']:>6}{r['rep']:>4}{r['wall_s']:>9.1f}{r['tokens']:>9}{r['tokens'] / r['wall_s']:>10.1f}"
              f"{r['generate_s']:>12.1f}{r['tokens'] / r['generate_s']:>11.1f}")
    med = {}
    for n in sizes:
        for mode in ("direct", "job"):
            runs = [r for r in results if r["mode"] == mode and r["n"] == n]
            med[mode, n] = {k: median(r[k] for r in runs) for k in ("wall_s", "generate_s")}
        ratios = [j["wall_s"] / d["wall_s"] for d, j in zip(*([r for r in results if r["mode"] == m and r["n"] == n]
                                                                for m in ("direct", "job")))]
        print(f"n={n}: job wall / direct wall per repeat = {', '.join(f'{x:.3f}' for x in ratios)}; "
              f"generation phase job / direct (medians) = {med['job', n]['generate_s'] / med['direct', n]['generate_s']:.3f}")
    if len(sizes) > 1:
        a, b = sizes[0], sizes[-1]
        print(f"job wall {b} / {a} (medians) = {med['job', b]['wall_s'] / med['job', a]['wall_s']:.2f} "
              f"for x{b / a:.0f} rows")


if __name__ == "__main__":
    main()
