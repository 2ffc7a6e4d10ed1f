"""Rows in flight at a fixed KV budget, dense per-row reservations against the paged pool, and the memory plan's rows
held for Qwen3-4B + Domino-b16 on an H100 and an H200 (issue 43).

    python benchmarks/bench_kv_rows.py --json /tmp/kv_rows.json

A dense layout reserves every row `max_model_len + span` positions, so a budget of B tokens holds B // that rows
whatever they hold; the paged pool (`kv/pools.py`) holds what the rows hold. For each workload the engine runs
with `kv_cache_tokens` = the budget and a high row cap, and the rows in flight are counted at every step (mean and
peak), with its preemptions and prefix hits. Target-only and greedy: the counts depend on the lengths, not on the
weights, so the "mix" workload runs a tiny random Qwen3 at max_model_len 4096.

- demo: the demo pair's prompts (domino_ray/assets/demo), 128 new tokens, its EOS; max_model_len 256.
- mix: a realistic length mix, log-normal prompts (median 400 tokens) and outputs (median 250), 1 in 4 rows behind a
  shared 200-token system prompt; max_model_len 4096.

The plan's rows are `memory.size_engine` over the production config's shapes (no GPU needed: pure functions).
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # runs from a plain checkout, no install
from bench_gpu import HUANG2020_DRAFT, QWEN3_4B as PRODUCTION_TARGET  # noqa: E402
from common import load_pair, write_results  # noqa: E402
from domino_ray.engine.memory import kv_bytes_per_token, memory_plan, size_engine  # noqa: E402
from domino_ray.engine.request import Request  # noqa: E402
from domino_ray.engine.core import SpecEngine  # noqa: E402
from domino_ray.engine.step_graphs import verify_positions  # noqa: E402
from domino_ray.spec_decode.checkpoint_layouts import parse_draft_config  # noqa: E402
from domino_ray.sample.params import SamplingParams  # noqa: E402

QWEN3_4B = Qwen3Config(**PRODUCTION_TARGET)
DOMINO_B16 = parse_draft_config(HUANG2020_DRAFT, {}, "dflash")
WEIGHTS = int((4.02e9 + 0.55e9) * 2)  # bf16 target + draft, bytes
GiB = 2**30


def rows_in_flight(target, prompts: list[list[int]], max_new: list[int], budget_tokens: int, max_model_len: int,
                   eos: bool) -> dict:
    """Run every prompt through a target-only engine whose pool holds `budget_tokens`; rows in flight per step."""
    engine = SpecEngine(target, None, max_rows=1024, max_model_len=max_model_len, kv_cache_tokens=budget_tokens,
                        max_prefill_tokens=4096, eos_token_ids=[target.config.eos_token_id] if eos else ())
    for i, (p, n) in enumerate(zip(prompts, max_new)):
        engine.add_request(Request(i, p, SamplingParams(max_new_tokens=n, ignore_eos=not eos)))
    counts, started = [], time.perf_counter()
    while engine.has_unfinished():
        engine.step()
        counts.append(len(engine.rows))
    busy = counts[:max(1, int(0.8 * len(counts)))]  # before the queue drains: the tail holds whatever is left
    dense = budget_tokens // engine.capacity
    stats = engine.kv_cache_stats()
    return {"budget_tokens": budget_tokens, "dense_rows": dense, "paged_mean_rows": sum(busy) / len(busy),
            "paged_peak_rows": stats["peak_rows"], "ratio_mean": sum(busy) / len(busy) / dense,
            "steps": len(counts), "seconds": time.perf_counter() - started, **stats}


def length_mix(n: int, vocab: int, max_model_len: int, seed: int = 0) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(seed)
    system = [rng.randrange(vocab) for _ in range(200)]
    prompts, outputs = [], []
    for i in range(n):
        m = min(max(16, int(rng.lognormvariate(6.0, 0.8))), 3000)   # median ~400
        out = min(max(16, int(rng.lognormvariate(5.5, 0.8))), max_model_len - m - 1)  # median ~250
        body = [rng.randrange(vocab) for _ in range(m)]
        prompts.append(system + body[200:] if i % 4 == 0 and m > 200 else body)
        outputs.append(out)
    return prompts, outputs


def plan_rows() -> dict:
    capacity = 4096 + 16
    plan_for = lambda rows, blocks: memory_plan(  # noqa: E731
        QWEN3_4B, DOMINO_B16, max_rows=rows, num_spec_tokens=16, capacity=capacity, kv_blocks=blocks, block_size=16,
        max_prefill_tokens=16384, itemsize=2, cuda_graphs=True, paged_kernel=True,
        verify_positions=verify_positions(rows, 16, adaptive=True, graphs=True))
    per_row = kv_bytes_per_token(QWEN3_4B, DOMINO_B16, 2) * capacity
    out = {}
    for name, gib in (("H100 80GB", 80), ("H200 141GB", 141)):
        budget = int(0.9 * (gib * GiB - WEIGHTS))
        rows, blocks, _ = size_engine(budget, name, 1024, "auto", "auto", plan_for, 16, capacity, dense_cap=False)
        tokens = (blocks - 1) * 16
        dense = max(r for r in range(1, 1025) if sum(plan_for(r, 0).values()) + r * per_row <= budget)
        out[name] = {"rows_cap": rows, "pool_tokens": tokens, "pool_GiB": plan_for(rows, blocks)["kv_pool"] / GiB,
                     "dense_rows_at_max_model_len": dense,
                     **{f"rows_at_{m // 1024}k": min(rows, tokens // m) for m in (1024, 2048, 4096)}}
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mix-rows", type=int, default=400, help="requests of the length mix")
    p.add_argument("--dense-rows", type=int, default=16, help="the budget: this many rows at max_model_len")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    results = {"plan": plan_rows()}
    for name, row in results["plan"].items():
        print(f"{name}: rows cap {row['rows_cap']}, pool {row['pool_tokens']} tokens ({row['pool_GiB']:.1f} GiB); "
              f"rows held at 1k/2k/4k mean length {row['rows_at_1k']}/{row['rows_at_2k']}/{row['rows_at_4k']}; "
              f"dense at max_model_len {row['dense_rows_at_max_model_len']}")
    pair = load_pair("demo")
    demo_len = pair.target.config.max_position_embeddings
    budget = args.dense_rows * (demo_len + 16)
    results["demo"] = rows_in_flight(pair.target, pair.prompts * 4, [128] * 4 * len(pair.prompts), budget, demo_len,
                                     eos=True)
    torch.manual_seed(0)
    tiny = Qwen3ForCausalLM(Qwen3Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                        max_position_embeddings=4096, eos_token_id=0)).eval().requires_grad_(False)
    prompts, outputs = length_mix(args.mix_rows, 512, 4096)
    results["mix"] = rows_in_flight(tiny, prompts, outputs, args.dense_rows * (4096 + 16), 4096, eos=False)
    for name in ("demo", "mix"):
        r = results[name]
        print(f"{name}: budget {r['budget_tokens']} tokens: dense {r['dense_rows']} rows, paged {r['paged_mean_rows']:.1f} "
              f"mean / {r['paged_peak_rows']} peak rows in flight ({r['ratio_mean']:.2f}x), {r['preemptions']} "
              f"preemptions, {r['prefix_hit_tokens']} prefix-hit tokens, {r['steps']} steps in {r['seconds']:.0f} s")
    write_results(args.json, results, args)


if __name__ == "__main__":
    main()
