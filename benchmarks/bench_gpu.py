"""One-GPU engine benchmark at production shapes, random weights, bf16 (one command, a few minutes).

A Qwen3-4B-shaped target and a Huang2020/Qwen3-4B-Domino-b16-shaped draft (5 layers, block 16, GRU
head, full 151936 vocabulary), random weights, so nothing is downloaded. Random drafts accept
nothing, so speculative throughput is measured at *forced* full acceptance: the proposer returns
the target's own continuation while the real draft runs alongside at full cost (OracleProposer with
a shadow). Reports, at batch 1, 8 and 32:
  - target-only tokens/s (our engine, no draft),
  - the cost of one draft block (context append + backbone + GRU loop) relative to one verify step,
  - speculative tokens/s at forced full acceptance, and the acceptance actually reached (bf16
    verification of a block may round differently from one-token decoding, so it can be < K).

    python benchmarks/bench_gpu.py                  # on a CUDA machine; writes $OUT/bench_gpu.json if OUT is set
    python benchmarks/bench_gpu.py --smoke          # tiny shapes on CPU: checks the script runs
"""

from __future__ import annotations

import argparse
import json
import os
import time

import sys
from pathlib import Path

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from bench_engine_cpu import prompts_for
from domino_ray.checkpoint import parse_draft_config
from domino_ray.draft import DominoDraft
from domino_ray.engine import Request, SpecEngine
from domino_ray.proposer import DominoProposer
from domino_ray.sampling import SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from oracles import OracleProposer  # noqa: E402  (test support, kept out of the core)

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


class Timed:
    """Wraps a proposer and measures its device time per call (synchronising around it)."""

    def __init__(self, inner, device):
        self.inner, self.device, self.seconds, self.calls = inner, device, 0.0, 0
        self.num_draft_tokens, self.target_layer_ids = inner.num_draft_tokens, inner.target_layer_ids

    def _timed(self, fn, *args):
        sync(self.device)
        start = time.perf_counter()
        out = fn(*args)
        sync(self.device)
        self.seconds += time.perf_counter() - start
        return out

    def reset(self):
        self.seconds, self.calls = 0.0, 0

    def allocate(self, *a):
        self.inner.allocate(*a)

    def append_context(self, *a):
        self._timed(self.inner.append_context, *a)

    def propose(self, *a):
        self.calls += 1
        return self._timed(self.inner.propose, *a)

    def move_row(self, *a):
        self.inner.move_row(*a)


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def generate(target, proposer, prompts, max_new, device):
    """Run to completion; returns (total seconds, seconds after the first step, completions).

    All rows are admitted (prefilled) in the first step, so later steps are pure decode steps."""
    engine = SpecEngine(target, proposer, max_rows=len(prompts), max_model_len=max(map(len, prompts)) + max_new + 2)
    for i, p in enumerate(prompts):
        engine.add_request(Request(i, p, SamplingParams(max_new_tokens=max_new)))
    done = {}
    sync(device)
    start = time.perf_counter()
    first_step_end = None
    while engine.has_unfinished():
        done.update((e.request_id, e.completion) for e in engine.step() if e.completion is not None)
        if first_step_end is None:
            sync(device)
            first_step_end = time.perf_counter()
            if proposer is not None:
                proposer.shadow.reset()
    sync(device)
    end = time.perf_counter()
    return end - start, end - first_step_end, [done[i] for i in range(len(prompts))]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args()
    device = torch.device("cpu" if args.smoke else "cuda")
    dtype = torch.float32 if args.smoke else torch.bfloat16
    if args.smoke:
        args.batches, args.max_new_tokens = "1,4", 20
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
    print(json.dumps(info))
    generate(target, None, prompts_for(2, vocab, 0), 8, device)  # warm-up (allocator, kernels)
    if args.smoke:
        torch.set_num_threads(1)
    results = {}
    for batch in (int(b) for b in args.batches.split(",")):
        prompts = prompts_for(batch, vocab, seed=batch, shortest=128, longest=512)
        t_base, t_base_decode, base = generate(target, None, prompts, args.max_new_tokens, device)
        references = {i: p + c.token_ids for i, (p, c) in enumerate(zip(prompts, base))}
        timed = Timed(DominoProposer(draft, target), device)
        t_spec, t_spec_decode, spec = generate(target, OracleProposer(references, k, vocab, shadow=timed), prompts,
                                               args.max_new_tokens, device)
        steps = max(c.stats.num_spec_steps for c in spec)
        # Decode steps after the first: each is one draft block (timed) plus verify + accept (the rest).
        verify_s = (t_spec_decode - timed.seconds) / max(timed.calls, 1)
        tokens = batch * args.max_new_tokens
        same = sum(a == b for c, d in zip(spec, base) for a, b in zip(c.token_ids, d.token_ids)) / tokens
        results[batch] = {
            "target_only_tok_s": tokens / t_base,
            "spec_forced_tok_s": sum(len(c.token_ids) for c in spec) / t_spec,
            "speedup": (sum(len(c.token_ids) for c in spec) / t_spec) / (tokens / t_base),
            "mean_acceptance_length": sum(c.stats.mean_acceptance_length for c in spec) / batch,
            "draft_block_ms": 1e3 * timed.seconds / max(timed.calls, 1),
            "verify_step_ms": 1e3 * verify_s,
            "draft_over_verify": timed.seconds / max(timed.calls, 1) / verify_s,
            "target_only_step_ms": 1e3 * t_base_decode / (args.max_new_tokens - 2),
            "steps": steps, "tokens_identical_to_target_only": same,
        }
        print(f"batch {batch}: " + json.dumps({key: round(v, 3) for key, v in results[batch].items()}), flush=True)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "bench_gpu.json"), "w") as f:
            json.dump({"info": info, "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
