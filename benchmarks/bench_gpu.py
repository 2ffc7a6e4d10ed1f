"""One-GPU engine benchmark at production shapes, random weights, bf16 (one command, a few minutes).

A Qwen3-4B-shaped target and a Huang2020/Qwen3-4B-Domino-b16-shaped draft (5 layers, block 16, GRU
head, full 151936 vocabulary), random weights, so nothing is downloaded. Random drafts accept
nothing, so speculative throughput is measured at *forced* full acceptance: the real draft step runs
at full cost (captured with everything else) and its output is then replaced, on the device, by the
target's own continuation (`Forced`). Reports, at batch 1, 8 and 32, eager and with CUDA graphs:
  - target-only and speculative tokens/s (every timed path runs once before as its warm-up, in the
    same engine, so each bucket's graph is captured before timing),
  - the draft-step / verify-step time ratio (replaying the largest bucket's graphs),
  - losslessness in bf16: a block verify and a one-token decode can round differently, so exact token
    equality is the wrong gate. A row passes if it equals target-only output up to the first position
    where they differ and target-only's top-2 logits there are within `--tie-margin`; the report
    counts rows identical, rows that part at such a near-tie, and rows that part elsewhere (failures).

    python benchmarks/bench_gpu.py                  # on a CUDA machine; writes $OUT/bench_gpu.json if OUT is set
    python benchmarks/bench_gpu.py --smoke          # tiny shapes on CPU: checks the script runs
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # runs from a plain checkout, no install
from bench_engine_cpu import prompts_for  # noqa: E402
from domino_ray.checkpoint import parse_draft_config
from domino_ray.draft import DominoDraft
from domino_ray.engine import SpecEngine
from domino_ray.request import Request
from domino_ray.proposer import DominoProposer
from domino_ray.sampling_params import SamplingParams

QWEN3_4B = dict(vocab_size=151936, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                rope_theta=1000000, rms_norm_eps=1e-6, tie_word_embeddings=True)
HUANG2020_DRAFT = {  # reference/domino.md §3.1
    "block_size": 16, "num_target_layers": 36,
    "dflash_config": {"mask_token_id": 151669, "target_layer_ids": [1, 9, 17, 25, 33], "projector_type": "domino",
                      "pure_draft_prefix_len": 1, "emb_dim": 256, "gru_hidden_dim": 1024, "shift_label": True},
    "hidden_size": 2560, "intermediate_size": 9728, "num_hidden_layers": 5, "num_attention_heads": 32,
    "num_key_value_heads": 8, "head_dim": 128, "rms_norm_eps": 1e-06, "rope_theta": 1000000, "vocab_size": 151936,
}
SMOKE_TARGET = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=16, max_position_embeddings=2048, tie_word_embeddings=True)
SMOKE_DRAFT = {**HUANG2020_DRAFT, "dflash_config": {**HUANG2020_DRAFT["dflash_config"], "mask_token_id": 511,
                                                    "target_layer_ids": [0, 2], "gru_hidden_dim": 32, "emb_dim": 16},
               "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 4,
               "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 512}




class Forced:
    """The real draft's step, then its drafts replaced on the device by each slot's reference continuation
    (`refs[slot]`, filled before the run): forced full acceptance at the real drafting cost, capturable."""

    graph_safe = True

    def __init__(self, inner, max_rows: int, max_len: int, device):
        self.inner = inner
        self.num_spec_tokens, self.block_size = inner.num_spec_tokens, inner.block_size
        self.target_layer_ids = inner.target_layer_ids
        self.refs = torch.zeros(max_rows, max_len, dtype=torch.long, device=device)  # [R, L]
        self.ahead = torch.arange(1, self.num_spec_tokens + 1, device=device)        # [K]

    def allocate(self, *a):
        self.inner.allocate(*a)

    def append_context(self, *a):
        self.inner.append_context(*a)

    def move_row(self, *a):
        self.inner.move_row(*a)

    def propose(self, r, anchor, offsets, key_groups, width, *rest):
        self.inner.propose(r, anchor, offsets, key_groups, width)
        index = (offsets[:, None] + self.ahead[:width]).clamp(max=self.refs.shape[1] - 1)  # [r, W] after the anchor
        return self.refs[:r].gather(1, index)


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def generate(engine, prompts, max_new, device, references=None):
    """Run to completion; returns (seconds, completions). All rows are admitted in the first step, into
    slots in prompt-length order (the engine sorts an admitted batch that way), and never move: all of
    them finish in the same step. So slot s holds the s-th shortest prompt's reference throughout."""
    if references is not None:
        for slot, i in enumerate(sorted(range(len(prompts)), key=lambda i: len(prompts[i]))):
            engine.proposer.refs[slot, :len(references[i])].copy_(torch.tensor(references[i]))
    for i, p in enumerate(prompts):
        engine.add_request(Request(i, p, SamplingParams(max_new_tokens=max_new)))
    done = {}
    sync(device)
    start = time.perf_counter()
    while engine.has_unfinished():
        done.update((e.request_id, e.completion) for e in engine.step() if e.completion is not None)
    sync(device)
    return time.perf_counter() - start, [done[i] for i in range(len(prompts))]


def time_steps(engine, steps, repeats=20) -> dict:
    """ms per call of each step (its graph's replay when captured, else the eager function). Every slot
    is free by now, so the calls change nothing."""
    out = {}
    for name, key, fn in steps:
        graph = engine.graphs.graphs.get(key) if engine.graphs else None
        call = graph.replay if graph is not None else fn
        call()
        sync(engine.device)
        start = time.perf_counter()
        for _ in range(repeats):
            call()
        sync(engine.device)
        out[name] = 1e3 * (time.perf_counter() - start) / repeats
    return out


def tie_check(target, prompts, base, spec, margin: float) -> dict:
    """Rows identical / parting at a near-tie of target-only's top-2 logits / parting elsewhere."""
    counts = {"identical": 0, "near_tie": 0, "differ": 0}
    for prompt, b, s in zip(prompts, base, spec):
        part = next((i for i, (x, y) in enumerate(zip(b.token_ids, s.token_ids)) if x != y), None)
        if part is None:
            counts["identical"] += 1
            continue
        with torch.no_grad():
            ids = torch.tensor([prompt + b.token_ids[:part]], device=target.device)
            top2 = target(input_ids=ids).logits[0, -1].float().topk(2).values
        counts["near_tie" if float(top2[0] - top2[1]) <= margin else "differ"] += 1
    return counts


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--tie-margin", type=float, default=0.125, help="top-2 logit gap counted as a near-tie (bf16)")
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args()
    device = torch.device("cpu" if args.smoke else "cuda")
    dtype = torch.float32 if args.smoke else torch.bfloat16
    if args.smoke:
        args.batches, args.max_new_tokens = "1,4", 20
        torch.set_num_threads(1)
    torch.manual_seed(0)
    with torch.device(device):
        target = Qwen3ForCausalLM(Qwen3Config(**(SMOKE_TARGET if args.smoke else QWEN3_4B))).to(dtype).eval()
        draft = DominoDraft(parse_draft_config(SMOKE_DRAFT if args.smoke else HUANG2020_DRAFT, {}, "dflash"))
        draft = draft.to(dtype).eval()
    target.generation_config.eos_token_id = None
    vocab, k = target.config.vocab_size, draft.config.max_draft_tokens
    info = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", "dtype": str(dtype),
            "target_params_B": sum(p.numel() for p in target.parameters()) / 1e9,
            "draft_params_B": sum(p.numel() for p in draft.parameters()) / 1e9, "K": k,
            "max_new_tokens": args.max_new_tokens, "torch": torch.__version__, "date": time.strftime("%Y-%m-%d")}
    print(json.dumps(info), flush=True)
    modes = ("off", "on") if device.type == "cuda" else ("off",)
    results = {}
    for batch in (int(b) for b in args.batches.split(",")):
        prompts = prompts_for(batch, vocab, seed=batch, shortest=128, longest=512)
        max_len = max(map(len, prompts)) + args.max_new_tokens + 2
        for graphs in modes:
            base_engine = SpecEngine(target, None, max_rows=batch, max_model_len=max_len, cuda_graphs=graphs)
            generate(base_engine, prompts, args.max_new_tokens, device)  # warm-up (and captures)
            t_base, base = generate(base_engine, prompts, args.max_new_tokens, device)
            references = {i: p + c.token_ids for i, (p, c) in enumerate(zip(prompts, base))}
            forced = Forced(DominoProposer(draft, target), batch, max_len + k + 1, device)
            engine = SpecEngine(target, forced, max_rows=batch, max_model_len=max_len, cuda_graphs=graphs)
            generate(engine, prompts, args.max_new_tokens, device, references)
            t_spec, spec = generate(engine, prompts, args.max_new_tokens, device, references)
            r, g = engine.row_buckets[-1], ((engine.row_buckets[-1], engine.capacity),)  # one key group, all keys
            steps = time_steps(engine, [
                ("draft_step_ms", ("draft", r, g, k), lambda: engine._draft_step(r, g, k)),
                ("verify_step_ms", ("verify", r, g, k, False, False, True),
                 lambda: engine._verify_step(r, g, k, False, False))])
            spec_tokens = sum(len(c.token_ids) for c in spec)
            row = results[f"batch {batch} cuda_graphs={graphs}"] = {
                "target_only_tok_s": batch * args.max_new_tokens / t_base,
                "spec_forced_tok_s": spec_tokens / t_spec,
                "speedup": (spec_tokens / t_spec) / (batch * args.max_new_tokens / t_base),
                "mean_acceptance_length": sum(c.stats.mean_acceptance_length for c in spec) / batch,
                "steps": max(c.stats.num_spec_steps for c in spec),
                **steps, "draft_over_verify": steps["draft_step_ms"] / steps["verify_step_ms"],
                "graphs_captured": len(engine.graphs.graphs) if engine.graphs else 0,
                "lossless_check": tie_check(target, prompts, base, spec, args.tie_margin),
            }
            print(f"batch {batch} cuda_graphs={graphs}: " + json.dumps(
                {key: round(v, 3) if isinstance(v, float) else v for key, v in row.items()}), flush=True)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "bench_gpu.json"), "w") as f:
            json.dump({"info": info, "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
