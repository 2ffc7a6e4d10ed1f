"""The longest decode-step stall while a long prompt is admitted: the whole prompt prefilled in one step (what the
engine did before chunked prefill) against chunks of `--chunk` tokens per step (issue 43).

    python benchmarks/bench_prefill_stall.py --threads 2 --json /tmp/stall.json

SmolLM2-135M (`make smollm2`), target-only, float32: `--rows` rows decode short chat prompts; once they are going, one
prompt of `--long` tokens (a held-out prompt repeated) arrives. Each step's wall time is recorded: the stall is the
longest step while the long prompt is being prefilled (the decoding rows get no token before it ends), beside the
median decode step, and the long row's time to its first token. `max_prefill_tokens` = the prompt's length (one
step) and `--chunk`, alternating, `--rounds` times, in one process.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # runs from a plain checkout, no install
from common import load_pair, write_results  # noqa: E402
from domino_ray.engine.request import Request  # noqa: E402
from domino_ray.engine.core import SpecEngine  # noqa: E402
from domino_ray.sample.params import SamplingParams  # noqa: E402


def one_run(target, prompts, long_prompt, rows: int, budget: int, max_model_len: int) -> dict:
    engine = SpecEngine(target, None, max_rows=rows + 1, max_model_len=max_model_len, max_prefill_tokens=budget)
    params = SamplingParams(max_new_tokens=100_000, ignore_eos=True)  # they decode all along
    for i, p in enumerate(prompts[:rows]):
        engine.add_request(Request(i, p, params))
    for _ in range(3):  # admitted, decoding
        engine.step()
    decode = []
    for _ in range(5):
        started = time.perf_counter()
        engine.step()
        decode.append(time.perf_counter() - started)
    engine.add_request(Request("long", long_prompt, SamplingParams(max_new_tokens=4, ignore_eos=True)))
    steps, arrived = [], time.perf_counter()
    while True:
        started = time.perf_counter()
        events = engine.step()
        steps.append(time.perf_counter() - started)
        if any(e.request_id == "long" for e in events):
            break
    return {"stall_ms": max(steps) * 1e3, "steps_to_first_token": len(steps),
            "time_to_first_token_s": time.perf_counter() - arrived, "decode_step_ms": statistics.median(decode) * 1e3}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--long", type=int, default=4096, help="tokens of the long prompt")
    p.add_argument("--chunk", type=int, default=512)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    pair = load_pair("smollm2")
    base = [t for p in pair.prompts for t in p]
    long_prompt = (base * (args.long // len(base) + 1))[:args.long]
    max_model_len = args.long + 64
    runs = {"whole": [], "chunked": []}
    for _ in range(args.rounds):
        for name, budget in (("whole", args.long), ("chunked", args.chunk)):
            runs[name].append(one_run(pair.target, pair.prompts, long_prompt, args.rows, budget, max_model_len))
            r = runs[name][-1]
            print(f"{name:8} budget {budget:5}: longest step {r['stall_ms']:8.0f} ms (decode step "
                  f"{r['decode_step_ms']:.1f} ms), long row's first token after {r['steps_to_first_token']} steps, "
                  f"{r['time_to_first_token_s']:.2f} s", flush=True)
    results = {name: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for name, rs in runs.items()}
    results["stall_ratio"] = results["whole"]["stall_ms"] / results["chunked"]["stall_ms"]
    print(f"median of {args.rounds}: stall {results['whole']['stall_ms']:.0f} ms whole vs "
          f"{results['chunked']['stall_ms']:.0f} ms in chunks of {args.chunk} ({results['stall_ratio']:.1f}x shorter); "
          f"first token of the long row {results['whole']['time_to_first_token_s']:.2f} s vs "
          f"{results['chunked']['time_to_first_token_s']:.2f} s")
    write_results(args.json, results, args)


if __name__ == "__main__":
    main()
