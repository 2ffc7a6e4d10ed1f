"""Engine throughput on CPU with small random models, every mode side by side in one run.

Modes (tokens/s = generated tokens / wall time, ragged prompts, greedy, no EOS):
  hf_generate   HF `generate` of the target alone (left-padded batch)
  target_only   our engine without a draft (block size 1)
  spec_oracle   our engine, a proposer that knows the continuation (full acceptance): the ceiling
  spec_random   our engine with a random Domino draft (accepts ~nothing): the floor, draft cost included

    python benchmarks/bench_engine_cpu.py                 # batches 1, 8, 32
    python benchmarks/bench_engine_cpu.py --smoke         # seconds, for CI
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import sys
from pathlib import Path

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from domino_ray.engine.request import Request
from domino_ray.engine.core import SpecEngine
from domino_ray.spec_decode.draft import DominoDraft, DraftConfig
from domino_ray.spec_decode.proposer import DominoProposer
from domino_ray.sample.params import SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from oracles import OracleProposer  # noqa: E402  (test support, kept out of the core)


def build(hidden: int, layers: int, vocab: int, block: int, seed: int = 0):
    torch.manual_seed(seed)
    cfg = Qwen3Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 3, num_hidden_layers=layers,
                      num_attention_heads=hidden // 32, num_key_value_heads=max(1, hidden // 64), head_dim=32,
                      max_position_embeddings=1024, eos_token_id=None, bos_token_id=None)
    target = Qwen3ForCausalLM(cfg).eval()
    target.generation_config.eos_token_id = None
    dcfg = DraftConfig(hidden_size=hidden, intermediate_size=hidden * 3, num_hidden_layers=1,
                       num_attention_heads=hidden // 32, num_key_value_heads=max(1, hidden // 64), head_dim=32,
                       vocab_size=vocab, block_size=block, target_layer_ids=(0, layers // 2, layers - 2),
                       mask_token_id=vocab - 1, shift_label=True, num_uncorrected=1, emb_dim=64, gru_hidden_dim=128)
    return target, DominoDraft(dcfg).eval()


def prompts_for(batch: int, vocab: int, seed: int, shortest: int = 8, longest: int = 64) -> list[list[int]]:
    """Ragged random prompts (ids below vocab - 1, the mask id of our drafts)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(shortest, longest + 1, (batch,), generator=g).tolist()
    return [torch.randint(0, vocab - 1, (m,), generator=g).tolist() for m in lengths]


def run_engine(target, proposer, prompts, max_new):
    engine = SpecEngine(target, proposer, max_rows=len(prompts), max_model_len=max(map(len, prompts)) + max_new + 1)
    start = time.perf_counter()
    out = engine.generate([Request(i, p, SamplingParams(max_new_tokens=max_new)) for i, p in enumerate(prompts)])
    return time.perf_counter() - start, out


def run_hf(target, prompts, max_new):
    width = max(map(len, prompts))
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):  # left padding, as HF generate expects for decoder-only models
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    start = time.perf_counter()
    with torch.inference_mode():
        out = target.generate(ids, attention_mask=mask, max_new_tokens=max_new, min_new_tokens=max_new,
                              do_sample=False, pad_token_id=0)
    return time.perf_counter() - start, out[:, width:].tolist()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--block", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=3, help="best of N per cell (runs interleaved)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, one repeat: checks the script runs")
    ap.add_argument("--json", help="also write results here")
    args = ap.parse_args()
    if args.smoke:
        args.batches, args.max_new_tokens, args.hidden, args.layers, args.vocab, args.repeats = "1,4", 12, 64, 2, 256, 1
    torch.set_num_threads(args.threads)
    target, draft = build(args.hidden, args.layers, args.vocab, args.block)
    k = draft.config.max_draft_tokens
    print(f"# target {sum(p.numel() for p in target.parameters()) / 1e6:.1f}M params, draft "
          f"{sum(p.numel() for p in draft.parameters()) / 1e6:.1f}M, K={k}, threads={args.threads}, "
          f"torch {torch.__version__}, {platform.processor() or platform.machine()}")
    results = {}
    for batch in (int(b) for b in args.batches.split(",")):
        prompts = prompts_for(batch, args.vocab, seed=batch)
        times: dict[str, list[float]] = {m: [] for m in ("hf_generate", "target_only", "spec_oracle", "spec_random")}
        _, base = run_engine(target, None, prompts, args.max_new_tokens)
        hf_time, hf_tokens = run_hf(target, prompts, args.max_new_tokens)
        assert hf_tokens == [c.token_ids for c in base], "our target-only output differs from HF generate"
        references = {i: p + c.token_ids for i, (p, c) in enumerate(zip(prompts, base))}
        for _ in range(args.repeats):
            times["hf_generate"].append(run_hf(target, prompts, args.max_new_tokens)[0])
            times["target_only"].append(run_engine(target, None, prompts, args.max_new_tokens)[0])
            t, out = run_engine(target, OracleProposer(references, k, args.vocab), prompts, args.max_new_tokens)
            assert [c.token_ids for c in out] == [c.token_ids for c in base]
            times["spec_oracle"].append(t)
            t, out = run_engine(target, DominoProposer(draft, target), prompts, args.max_new_tokens)
            assert [c.token_ids for c in out] == [c.token_ids for c in base]
            times["spec_random"].append(t)
        tokens = batch * args.max_new_tokens
        row = {m: tokens / min(ts) for m, ts in times.items()}
        row["spread"] = {m: (max(ts) - min(ts)) / statistics.mean(ts) for m, ts in times.items()}
        results[batch] = row
        print(f"batch {batch:>3}: " + "  ".join(f"{m} {row[m]:8.1f} tok/s" for m in times))
    b1, bn = min(results), max(results)
    summary = {
        "target_only / hf_generate @1": results[b1]["target_only"] / results[b1]["hf_generate"],
        f"target_only / hf_generate @{bn}": results[bn]["target_only"] / results[bn]["hf_generate"],
        "spec_oracle / target_only @1": results[b1]["spec_oracle"] / results[b1]["target_only"],
        f"spec_oracle @{bn} / spec_oracle @1": results[bn]["spec_oracle"] / results[b1]["spec_oracle"],
        "spec_random / target_only @1": results[b1]["spec_random"] / results[b1]["target_only"],
    }
    for name, value in summary.items():
        print(f"{name:>36}: {value:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results, "ratios": summary}, f, indent=2)


if __name__ == "__main__":
    main()
