"""The GPU check (issue 16): one command on a CUDA machine, production shapes, random weights, bf16.

A Qwen3-4B-shaped target and a Huang2020/Qwen3-4B-Domino-b16-shaped draft (5 layers, block 16, GRU
head, full 151936 vocabulary), random weights, so nothing is downloaded. It reports, printed and as JSON:

  - the production engine (adaptive width, `max_batch_size: auto`): the slot count it chose, its memory plan,
    the peak memory against the plan, the CUDA graphs it captured at start and the seconds, and its tokens/s
    beside target-only's at 1, 8, 32, 128 and the chosen rows (random weights: its draft is rejected, so
    this shows the width policy falling back to target-only speed), ~1k-token ragged prompts, all rows
    admitted as production admits them (`max_prefill_tokens` 16384: in waves at high row counts);
  - speculative at *forced* full acceptance: random drafts accept nothing, so the real draft step runs at
    full cost and its output is then replaced, on the device, by each row's reference continuation
    (`Forced`). The references are the speculative engine's own output (first taken from target-only, then
    from its own forced run: in bf16 a block verify and a one-token decode round differently, and a
    reference that parts from what the verify picks would be rejected from there on); tau ~ K + 1 shows
    the forcing held;
  - losslessness in bf16 against target-only, with the near-tie rule: a row passes if it equals
    target-only output up to the first position where they differ and target-only's top-2 logits there
    are within `--tie-margin`; rows identical / parting at a near-tie / parting elsewhere (failures).
    Checked for the adaptive and the forced runs at every row count (the forced engine, a fixed K, plans
    its own `auto` slots: without the graphs' width cap it holds fewer) and a fixed K's real draft at 8 rows;
  - CUDA graphs on vs off: that real draft at 8 rows, eager against graphed, token for token;
  - graphs captured at start (count, seconds) and lazily (a greedy run: none), per engine; draft-step /
    verify-step time at the largest bucket (graph replays).

    python benchmarks/bench_gpu.py                  # on a CUDA machine; writes $OUT/bench_gpu.json if OUT is set
    python benchmarks/bench_gpu.py --smoke          # tiny shapes on CPU: checks the script runs
    make gpu-check                                  # the same, with the check's defaults
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from pathlib import Path

import torch
import transformers
from transformers import Qwen3Config, Qwen3ForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # runs from a plain checkout, no install
from bench_engine_cpu import prompts_for  # noqa: E402
from domino_ray.engine.memory import MAX_AUTO_SLOTS  # noqa: E402
from domino_ray.engine.request import Request  # noqa: E402
from domino_ray.engine.spec_engine import SpecEngine  # noqa: E402
from domino_ray.spec.checkpoint_layouts import parse_draft_config  # noqa: E402
from domino_ray.spec.draft import DominoDraft  # noqa: E402
from domino_ray.spec.proposer import DominoProposer  # noqa: E402
from domino_ray.spec.sampling import GREEDY  # noqa: E402
from domino_ray.spec.sampling_params import SamplingParams  # noqa: E402

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
PRODUCTION_PREFILL_TOKENS = 16384  # configs/qwen3_4b.yaml generation.max_prefill_tokens


class Forced:
    """The real draft's step, then (when `on`) its drafts replaced on the device by each slot's reference
    continuation: forced full acceptance at the real drafting cost, capturable. `refs [R, L]` follow the
    rows: `load` fills a slot when a row is admitted to it (`track_admissions`), `move_row` follows slot
    compaction."""

    graph_safe = True

    def __init__(self, inner, max_rows: int, max_len: int, device):
        self.inner, self.config, self.on = inner, inner.config, False
        self.num_spec_tokens, self.block_size = inner.num_spec_tokens, inner.block_size
        self.target_layer_ids = inner.target_layer_ids
        self.refs = torch.zeros(max_rows, max_len, dtype=torch.long, device=device)  # [R, L]
        self.ahead = torch.arange(1, self.num_spec_tokens + 1, device=device)        # [K]
        self.by_request: dict[int, list[int]] = {}  # request id -> prompt + reference continuation

    def load(self, slot: int, request_id: int):
        ref = self.by_request.get(request_id)
        if ref:
            self.refs[slot, :len(ref)].copy_(torch.tensor(ref[:self.refs.shape[1]]))

    def allocate(self, *a):
        self.inner.allocate(*a)

    def append_context(self, *a):
        self.inner.append_context(*a)

    def move_row(self, src, dst, length):
        self.inner.move_row(src, dst, length)
        self.refs[dst] = self.refs[src]

    def propose(self, r, anchor, offsets, kv_len, width, *rest):
        drafts = self.inner.propose(r, anchor, offsets, kv_len, width)
        if not self.on:
            return drafts
        index = (offsets[:, None] + self.ahead[:width]).clamp(max=self.refs.shape[1] - 1)  # [r, W] after the anchor
        return self.refs[:r].gather(1, index)


def track_admissions(engine, forced: Forced):
    """Fill each admitted row's slot with its reference before its first step (the engine's prefill names
    the slots a wave of rows goes to)."""
    prefill = engine._prefill

    def prefill_with_refs(batch, rows):
        for slot, row in zip(range(rows.start, rows.stop), batch):
            forced.load(slot, row.request.request_id)
        return prefill(batch, rows)
    engine._prefill = prefill_with_refs


def graph_counts(engine, at_start: int) -> dict:
    """Graphs captured at engine start (and the seconds), and any captured lazily since (a greedy run: none)."""
    total = len(engine.graphs.graphs) if engine.graphs else 0
    return {"at_start": at_start, "capture_s": round(engine.graph_capture_s, 2), "lazily": total - at_start}


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def generate(engine, prompts, max_new) -> tuple[float, list]:
    """Run to completion: (seconds, completions in prompt order)."""
    for i, p in enumerate(prompts):
        engine.add_request(Request(i, p, SamplingParams(max_new_tokens=max_new)))
    done = {}
    sync(engine.device)
    start = time.perf_counter()
    while engine.has_unfinished():
        done.update((e.request_id, e.completion) for e in engine.step() if e.completion is not None)
    sync(engine.device)
    return time.perf_counter() - start, [done[i] for i in range(len(prompts))]


def time_steps(engine, steps, repeats=20) -> dict:
    """ms per call of each step, captured as its own graph with graphs on (else the eager function). Every
    slot is free by now, so the calls change nothing."""
    out = {}
    for name, fn in steps:
        call = fn
        if engine.graphs is not None:
            engine.graphs.run(("bench", name), fn)  # runs once, captures
            call = engine.graphs.graphs[("bench", name)].replay
        call()
        sync(engine.device)
        start = time.perf_counter()
        for _ in range(repeats):
            call()
        sync(engine.device)
        out[name] = 1e3 * (time.perf_counter() - start) / repeats
    return out


@torch.inference_mode()
def tie_check(target, prompts, base, spec, margin: float) -> dict:
    """Rows identical / parting at a near-tie of target-only's top-2 logits / parting elsewhere."""
    counts = {"identical": 0, "near_tie": 0, "differ": 0}
    for prompt, b, s in zip(prompts, base, spec):
        part = next((i for i, (x, y) in enumerate(zip(b.token_ids, s.token_ids)) if x != y), None)
        if part is None:
            counts["identical"] += 1
            continue
        ids = torch.tensor([prompt + b.token_ids[:part]], device=target.device)
        top2 = target(input_ids=ids).logits[0, -1].float().topk(2).values
        counts["near_tie" if float(top2[0] - top2[1]) <= margin else "differ"] += 1
    return counts


def release_memory():
    """After `del engine`: its buffers and graph pool go back to the device before the next engine plans."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def build_models(smoke: bool, device, dtype):
    torch.manual_seed(0)
    with torch.device(device):
        target = Qwen3ForCausalLM(Qwen3Config(**(SMOKE_TARGET if smoke else QWEN3_4B))).to(dtype).eval()
        draft = DominoDraft(parse_draft_config(SMOKE_DRAFT if smoke else HUANG2020_DRAFT, {}, "dflash"))
        draft = draft.to(dtype).eval()
    target.generation_config.eos_token_id = None
    return target, draft


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,8,32,128,max", help="row counts; max = what max_batch_size auto chose")
    ap.add_argument("--prompt-lengths", default="768,1280", help="shortest,longest prompt (tokens)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--tie-margin", type=float, default=0.125, help="top-2 logit gap counted as a near-tie (bf16)")
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args()
    device = torch.device("cpu" if args.smoke else "cuda")
    dtype = torch.float32 if args.smoke else torch.bfloat16
    if args.smoke:
        args.rows, args.prompt_lengths, args.max_new_tokens = "1,4,max", "8,40", 20
        torch.set_num_threads(1)
    shortest, longest = map(int, args.prompt_lengths.split(","))
    started = time.perf_counter()
    target, draft = build_models(args.smoke, device, dtype)
    vocab, k = target.config.vocab_size, draft.config.max_draft_tokens
    graphs = "on" if device.type == "cuda" else "off"
    max_len = longest + args.max_new_tokens + 2
    weights = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    info = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", "dtype": str(dtype),
            "torch": torch.__version__, "transformers": transformers.__version__, "date": time.strftime("%Y-%m-%d"),
            "target_params_B": sum(p.numel() for p in target.parameters()) / 1e9,
            "draft_params_B": sum(p.numel() for p in draft.parameters()) / 1e9, "K": k, "prompt_lengths": [shortest, longest],
            "max_new_tokens": args.max_new_tokens, "weights_GiB": weights / 2**30}
    print(json.dumps(info), flush=True)

    def spec_engine(rows, cuda_graphs=graphs, forced_on=True):
        """A fixed-K engine on the real draft, its drafts replaced by the references when `forced_on` (set
        before the engine captures its graphs at start: a graph replays the branch taken at capture)."""
        forced = Forced(DominoProposer(draft, target), rows if rows != "auto" else MAX_AUTO_SLOTS, max_len + k + 1, device)
        forced.on = forced_on
        engine = SpecEngine(target, forced, max_rows=rows, max_model_len=max_len, cuda_graphs=cuda_graphs,
                            max_prefill_tokens=PRODUCTION_PREFILL_TOKENS)
        track_admissions(engine, forced)
        return engine, forced

    # The production engine (adaptive width, as configs/qwen3_4b.yaml) on the real draft, `auto` slots: its
    # slot count, plan, graphs captured at start and peak memory; tok/s at every row count (random weights:
    # the draft is rejected, so the width policy must fall back to target-only speed), lossless checked below.
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    engine = SpecEngine(target, DominoProposer(draft, target), max_rows="auto", max_model_len=max_len,
                        cuda_graphs=graphs, adaptive=True, max_prefill_tokens=PRODUCTION_PREFILL_TOKENS)
    slots, plan = engine.max_rows, engine.memory_plan()
    info.update(auto_slots=slots, auto_report=engine.slot_report, plan_GiB={n: v / 2**30 for n, v in plan.items()})
    print(f"max_batch_size=auto chose {slots} slots: {info['auto_report']}; {len(engine.graphs.graphs) if graphs == 'on' else 0}"
          f" graphs captured at start in {engine.graph_capture_s:.1f} s", flush=True)
    row_counts = sorted({slots if r == "max" else int(r) for r in args.rows.split(",")} - {0})
    row_counts = [n for n in row_counts if n <= slots]
    prompts = {n: prompts_for(n, vocab, seed=n, shortest=shortest, longest=longest) for n in row_counts}
    results, adaptive_out = {n: {} for n in row_counts}, {}
    at_start = len(engine.graphs.graphs) if engine.graphs else 0
    for n in row_counts:
        seconds, adaptive_out[n] = generate(engine, prompts[n], args.max_new_tokens)
        results[n]["adaptive_tok_s"] = n * args.max_new_tokens / seconds
    graph_report = {"adaptive": graph_counts(engine, at_start)}
    peak = {"allocated_GiB": (torch.cuda.max_memory_allocated(device) - weights) / 2**30,
            "reserved_GiB": (torch.cuda.max_memory_reserved(device) - weights) / 2**30} if device.type == "cuda" else {}
    del engine
    release_memory()

    # Target-only, every row count, same slots: a warm-up run then a timed one.
    base_engine = SpecEngine(target, None, max_rows=slots, max_model_len=max_len, cuda_graphs=graphs,
                             max_prefill_tokens=PRODUCTION_PREFILL_TOKENS)
    at_start, base = len(base_engine.graphs.graphs) if base_engine.graphs else 0, {}
    for n in row_counts:
        generate(base_engine, prompts[n], args.max_new_tokens)
        seconds, base[n] = generate(base_engine, prompts[n], args.max_new_tokens)
        row = results[n]
        row.update(target_only_tok_s=n * args.max_new_tokens / seconds,
                   adaptive_lossless=tie_check(target, prompts[n], base[n], adaptive_out[n], args.tie_margin))
        row["adaptive_vs_target_only"] = row["adaptive_tok_s"] / row["target_only_tok_s"]
        print(f"rows {n}: target-only {row['target_only_tok_s']:.0f} tok/s, adaptive {row['adaptive_tok_s']:.0f}",
              flush=True)
    graph_report["target_only"] = graph_counts(base_engine, at_start)
    del base_engine
    release_memory()

    # Speculative at forced full acceptance (fixed K: no width cap, so its own `auto` slots may be fewer).
    engine, forced = spec_engine("auto")
    forced_slots, at_start = engine.max_rows, len(engine.graphs.graphs) if engine.graphs else 0
    info["forced_auto_slots"] = forced_slots
    for n in [n for n in row_counts if n <= forced_slots]:
        forced.by_request = {i: p + c.token_ids for i, (p, c) in enumerate(zip(prompts[n], base[n]))}
        _, own = generate(engine, prompts[n], args.max_new_tokens)  # warm-up; its output is the engine's own
        forced.by_request = {i: p + c.token_ids for i, (p, c) in enumerate(zip(prompts[n], own))}
        seconds, spec = generate(engine, prompts[n], args.max_new_tokens)
        tokens = sum(len(c.token_ids) for c in spec)
        row = results[n]
        row.update(spec_forced_tok_s=tokens / seconds, speedup=tokens / seconds / row["target_only_tok_s"],
                   mean_acceptance_length=sum(c.stats.mean_acceptance_length for c in spec) / n,
                   steps=max(c.stats.num_spec_steps for c in spec),
                   lossless_forced=tie_check(target, prompts[n], base[n], spec, args.tie_margin))
        print(f"rows {n}: " + json.dumps({key: round(v, 3) if isinstance(v, float) else v for key, v in row.items()}),
              flush=True)
    graph_report["forced"] = graph_counts(engine, at_start)
    r = engine.row_buckets[-1]
    groups = ((r, engine.capacity),)  # one key bucket, as graphed
    steps = time_steps(engine, [("draft_step_ms", lambda: engine.runner.draft(r, groups, k)),
                                ("verify_step_ms", lambda: engine.runner.verify(r, groups, k, GREEDY))])
    del engine, forced
    release_memory()

    # The real (rejecting) draft at a fixed K on 8 rows: CUDA graphs on == graphs off, token for token.
    n = min(8, slots)
    check_prompts = prompts.get(n) or prompts_for(n, vocab, seed=n, shortest=shortest, longest=longest)
    real = {}
    for mode in ("on", "off") if graphs == "on" else ("off",):
        engine, _ = spec_engine(n, cuda_graphs=mode, forced_on=False)
        _, real[mode] = generate(engine, check_prompts, args.max_new_tokens)
        del engine
        release_memory()
    checks = {"rows": n, "graphs_on_vs_off": (tie_check(target, check_prompts, real["off"], real["on"], args.tie_margin)
                                              if "on" in real else None),
              "real_draft_lossless": (tie_check(target, check_prompts, base[n], real["off"], args.tie_margin)
                                      if n in base else None)}
    report = {"info": info, "results": {str(n): row for n, row in results.items()}, "steps_at_max_bucket": steps,
              "draft_over_verify": steps["draft_step_ms"] / steps["verify_step_ms"], "checks": checks,
              "peak_beyond_weights": peak, "plan_total_GiB": sum(plan.values()) / 2**30, "graphs": graph_report,
              "wall_s": time.perf_counter() - started}
    print_table(report)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "bench_gpu.json"), "w") as f:
            json.dump(report, f, indent=2)


def print_table(report: dict):
    print(f"\n{'rows':>6} {'target-only':>12} {'adaptive':>9} {'ratio':>6} {'forced spec':>12} {'speed-up':>9} "
          f"{'tau':>6}  lossless (adaptive; forced)")
    for n, row in report["results"].items():
        forced = (f"{row['spec_forced_tok_s']:>12.0f} {row['speedup']:>9.2f} {row['mean_acceptance_length']:>6.2f}"
                  if "speedup" in row else f"{'-':>12} {'-':>9} {'-':>6}")
        print(f"{n:>6} {row['target_only_tok_s']:>12.0f} {row['adaptive_tok_s']:>9.0f} "
              f"{row['adaptive_vs_target_only']:>6.2f} {forced}  {row['adaptive_lossless']}; {row.get('lossless_forced')}")
    print(f"auto slots {report['info']['auto_slots']} (forced fixed K: {report['info']['forced_auto_slots']}); plan "
          f"{report['plan_total_GiB']:.1f} GiB; peak beyond weights {report['peak_beyond_weights'] or 'n/a (CPU)'}; "
          f"graphs {report['graphs']}; draft/verify {report['draft_over_verify']:.2f}; checks {report['checks']}; "
          f"wall {report['wall_s']:.0f} s", flush=True)


if __name__ == "__main__":
    main()
