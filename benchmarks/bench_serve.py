"""Load generator for the Serve app on loopback: speculative vs target-only on the same app config.

    python benchmarks/bench_serve.py [--config FILE] [--concurrency 1 8 32] [--requests 64]
                                     [--max-tokens 64] [--time-limit 60] [key=value ...]

For each mode (`spec`: the config as given; `target`: the same with `draft.source=null`) the app is
deployed on a local (or `runtime.ray_address`) Ray cluster, warmed up, then driven by closed-loop
clients at each concurrency: `--requests` streamed completions per level (at least one per client),
no new request after `--time-limit` seconds. Every request uses `ignore_eos` and greedy decoding, so both
modes generate exactly the same tokens. Reported per level: requests/s, output tokens/s, p50/p99
end-to-end latency and time to first token (client side), and the mean acceptance length the server
reported. `--tiny DIR` writes a tiny random target + draft to DIR and serves that (CPU smoke runs; a
random draft accepts nothing, so it measures the drafting overhead, not a speed-up). `--prompts FILE`
takes the prompts from a Parquet `prompt` column instead of the built-in dozen (the demo pair, trained on
Python source: `--prompts domino_ray/assets/demo/prompts.parquet`).
On a GPU box: `python benchmarks/bench_serve.py --config configs/qwen3_4b.yaml`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import sys
import time
from pathlib import Path

PROMPTS = [
    "The quick brown fox", "def fibonacci(n):", "Ray runs actors on many machines;",
    "Speculative decoding drafts tokens and", "import numpy as np\n", "Once upon a time, in a small village,",
    "The capital of France is", "SELECT name, count(*) FROM", "class Stack:\n    def __init__(self):",
    "Parquet stores columns", "A batch of prompts becomes", "for i in range(10):",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def one_request(http, body: dict) -> dict:
    start, first, final = time.perf_counter(), None, None
    async with http.stream("POST", "/v1/completions", json=body) as response:
        if response.status_code != 200:
            return {"status": response.status_code}
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if first is None:
                first = time.perf_counter()
            if chunk["choices"][0]["finish_reason"] is not None:
                final = chunk
    end = time.perf_counter()
    return {"status": 200, "ttft": first - start, "latency": end - start,
            "tokens": final["usage"]["completion_tokens"],
            "mean_acceptance_length": final["speculative_decoding_stats"]["mean_acceptance_length"]}


async def run_level(url: str, model: str, prompts: list[str], concurrency: int, requests: int, max_tokens: int,
                    time_limit: float):
    import httpx

    todo = iter(range(max(requests, concurrency)))
    results: list[dict] = []
    deadline = time.perf_counter() + time_limit

    async def client(http):
        for i in todo:
            if time.perf_counter() > deadline:
                return
            body = {"model": model, "prompt": prompts[i % len(prompts)], "max_tokens": max_tokens,
                    "temperature": 0, "ignore_eos": True, "stream": True}
            results.append(await one_request(http, body))

    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as http:
        start = time.perf_counter()
        await asyncio.gather(*(client(http) for _ in range(concurrency)))
        wall = time.perf_counter() - start
    ok = [r for r in results if r["status"] == 200]
    if not ok:
        return {"concurrency": concurrency, "requests": len(results), "failed": len(results)}
    pct = lambda xs, q: statistics.quantiles(xs, n=100, method="inclusive")[q - 1] if len(xs) > 1 else xs[0]
    lat, ttft = [r["latency"] for r in ok], [r["ttft"] for r in ok]
    return {"concurrency": concurrency, "requests": len(ok), "failed": len(results) - len(ok),
            "wall_s": wall, "req_per_s": len(ok) / wall, "output_tokens": sum(r["tokens"] for r in ok),
            "output_tok_per_s": sum(r["tokens"] for r in ok) / wall,
            "latency_p50_s": pct(lat, 50), "latency_p99_s": pct(lat, 99),
            "ttft_p50_s": pct(ttft, 50), "ttft_p99_s": pct(ttft, 99),
            "mean_acceptance_length": statistics.fmean(r["mean_acceptance_length"] for r in ok)}


def bench_mode(cfg, mode: str, prompts: list[str], args) -> list[dict]:
    from ray import serve

    from domino_ray.serve.app import build_app

    serve.run(build_app(cfg), name=f"bench-{mode}", route_prefix="/")
    url = f"http://127.0.0.1:{cfg.serve.port}"
    try:
        asyncio.run(run_level(url, cfg.serve.model_name, prompts, 1, 2, 8, args.time_limit))  # warm-up
        rows = []
        for c in args.concurrency:
            row = {"mode": mode, **asyncio.run(run_level(url, cfg.serve.model_name, prompts, c, args.requests,
                                                         args.max_tokens, args.time_limit))}
            print(json.dumps(row), flush=True)
            rows.append(row)
        return rows
    finally:
        serve.delete(f"bench-{mode}")


def table(rows: list[dict]) -> str:
    head = ("| mode | conc. | requests | req/s | output tok/s | p50 latency s | p99 latency s | p50 TTFT s | "
            "p99 TTFT s | mean acc. len |\n|---|---|---|---|---|---|---|---|---|---|")
    lines = [head]
    for r in rows:
        lines.append(f"| {r['mode']} | {r['concurrency']} | {r['requests']} | {r['req_per_s']:.2f} | "
                     f"{r['output_tok_per_s']:.1f} | {r['latency_p50_s']:.3f} | {r['latency_p99_s']:.3f} | "
                     f"{r['ttft_p50_s']:.3f} | {r['ttft_p99_s']:.3f} | {r['mean_acceptance_length']:.2f} |")
    by = {(r["mode"], r["concurrency"]): r for r in rows}
    ratios = [f"c={c}: {by['spec', c]['output_tok_per_s'] / by['target', c]['output_tok_per_s']:.2f}x"
              for c in sorted({r["concurrency"] for r in rows}) if ("spec", c) in by and ("target", c) in by]
    if ratios:
        lines.append("\nspec / target-only output tokens/s: " + ", ".join(ratios))
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", help="JobConfig YAML (default: the built-in CPU demo config)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--requests", type=int, default=64, help="requests per concurrency level")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--time-limit", type=float, default=60.0, help="seconds per level before no new requests")
    parser.add_argument("--modes", nargs="+", default=["spec", "target"], choices=["spec", "target"])
    parser.add_argument("--tiny", help="write a tiny random target + draft here and serve it (CPU smoke runs)")
    parser.add_argument("--prompts", help="Parquet file whose `prompt` column replaces the built-in prompts")
    parser.add_argument("--json", help="also write the rows to this file")
    parser.add_argument("overrides", nargs="*", help="key=value config overrides")
    args = parser.parse_args(argv)

    import ray
    from ray import serve

    from domino_ray.config import load_config

    overrides = list(args.overrides)
    if args.tiny:
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
        from tiny_models import save_tiny_pair

        target, draft = save_tiny_pair(args.tiny)
        overrides = [f"model.source={target}", f"draft.source={draft}", *overrides]
    prompts = PROMPTS
    if args.prompts:
        import pyarrow.parquet as pq

        prompts = [p for p in pq.read_table(args.prompts, columns=["prompt"]).column("prompt").to_pylist() if p]
        prompts = prompts[:max(args.requests, 1)]
    port = free_port()
    base = load_config(args.config, [f"serve.port={port}", *overrides])
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(address=base.runtime.ray_address, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    rows = []
    try:
        for mode in args.modes:
            cfg = base if mode == "spec" else load_config(args.config, [f"serve.port={port}", *overrides,
                                                                        "draft.source=null"])
            rows += bench_mode(cfg, mode, prompts, args)
    finally:
        serve.shutdown()
        ray.shutdown()
    print(table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
