"""The GPU check (issues 16, 43): one command on a CUDA machine, production shapes, random weights, bf16.

A Qwen3-4B-shaped target and a Huang2020/Qwen3-4B-Domino-b16-shaped draft (5 layers, block 16, GRU head, full
151936 vocabulary), random weights, so nothing is downloaded. Everything runs under `torch.inference_mode()`, every
engine at production's `max_model_len` 4096 (configs/qwen3_4b.yaml) with `cuda_graphs="on"`: a failed capture fails
the check (the error printed, exit status 1). It reports, printed and in $OUT/bench_gpu.json (written after each
section, so a run cut short keeps what it measured):

  - the production engine (adaptive width, `max_batch_size: auto`, `kv_cache_tokens: auto`, paged KV): its rows, KV
    pool (blocks, tokens, GiB), memory plan, the CUDA graphs captured at start and the seconds, and the rows its pool
    holds at a 1k/2k/4k mean row length (pool tokens // mean length, capped by its rows);
  - decode-only ms/step: the engine's own step (with graphs a replay of its captured graph; no prefill, no host
    bookkeeping) at 1/8/32/128/max rows of ragged ~1k-token rows (uniform in [0.75, 1.25] x `--row-length`, each in
    its own blocks; max = the most such rows the pool holds, capped by the engine's rows), at W = 0 (target only) and
    at the bucket's widest graphed width; the bytes it reads at least: the weights once (target; with drafts also the
    draft and the tied lm_head again for the draft's logits) and the keys and values the rows' attention reads (paged
    attention: each row's length x `memory.kv_bytes_per_token` of target, and with drafts of the draft; the gather
    fallback reads the bucket's rows x the key length), and that as a fraction of the device's peak bandwidth
    (`PEAK_BANDWIDTH` by device name; unknown: bytes only);
  - tokens/s of that engine, of target-only and of speculative at *forced* full acceptance at 1/8/32/128/max rows
    (~1k-token ragged prompts, budgets ragged too: rows finish at different steps and move slots). Random drafts
    accept nothing, so the adaptive width falls back to target-only speed; `Forced` runs the real draft step at full
    cost and then replaces its drafts, on the device, by each row's reference continuation (tau ~ K + 1 shows the
    forcing held; a fixed K plans its own `auto` rows, fewer). The references are the engine's own output (first
    taken from target-only, then from its own forced run: in bf16 a block verify and a one-token decode round
    differently). The production engine's `kv_cache` stats after its runs (peak blocks and rows, preemptions);
  - losslessness in bf16 against target-only with the near-tie rule: a row passes if it equals target-only output up
    to the first position where they differ and target-only's top-2 logits there are a near-tie by the engine's own
    rule (`verify.near_tie_mask`, counted in each row's `near_ties`); rows
    identical / parting at a near-tie / parting elsewhere (failures); for the adaptive, forced and real-draft runs;
  - CUDA graphs on vs off: the real draft at a fixed K on 8 rows, eager against graphed, token for token;
  - the draft step and the verify step alone at the forced engine's largest bucket over ragged ~1k-token rows.

It has not run on a GPU in this project yet (no session has been lent one with this version); its time on an
H100/H200 is an estimate from the memory plan's sizes (H100 ~130 rows and ~300k pool tokens, H200 ~465 rows and ~565k):
model build ~20 s; the production engine ~30-60 s (~50 graphs captured, its width costs timed, Triton's first
compiles); decode-only table ~15 s; generation at 1..max rows for the adaptive engine, target-only (twice) and forced
(twice, at its ~47/95 rows) ~1-2 min with prefill; tie checks (an HF forward per differing row) <= 1 min; the draft and
verify steps and graphs on/off ~20 s: ~3-5 min of the 8 `make gpu-check` has. `sections_s` and `wall_s` in the JSON
say what each part took.

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
import traceback
from pathlib import Path

import torch
import transformers
from transformers import Qwen3Config, Qwen3ForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # runs from a plain checkout, no install
from bench_engine_cpu import prompts_for  # noqa: E402
from gpu_steps import Forced, follow_rows, peak_bandwidth, ragged_lengths, sync, time_decode, time_parts  # noqa: E402
from domino_ray.engine.memory import MAX_AUTO_SLOTS, kv_bytes_per_token  # noqa: E402
from domino_ray.engine.request import Request  # noqa: E402
from domino_ray.engine.core import SpecEngine  # noqa: E402
from domino_ray.spec_decode.checkpoint_layouts import parse_draft_config  # noqa: E402
from domino_ray.spec_decode.draft import DominoDraft  # noqa: E402
from domino_ray.spec_decode.proposer import DominoProposer  # noqa: E402
from domino_ray.spec_decode.verify import near_tie_mask  # noqa: E402
from domino_ray.sample.params import SamplingParams  # noqa: E402

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
PRODUCTION = dict(max_model_len=4096, max_prefill_tokens=16384)  # configs/qwen3_4b.yaml model / generation
MEAN_LENGTHS = (1024, 2048, 4096)


def budgets(n: int, max_new: int) -> list[int]:
    """Ragged budgets: even rows stop a quarter early, so rows finish at different steps and later ones move slots."""
    return [max_new - (max_new // 4 if i % 2 == 0 else 0) for i in range(n)]


def generate(engine, prompts, max_new) -> tuple[float, list]:
    """Run to completion: (seconds, completions in prompt order)."""
    for i, (p, m) in enumerate(zip(prompts, budgets(len(prompts), max_new))):
        engine.add_request(Request(i, p, SamplingParams(max_new_tokens=m)))
    done = {}
    sync(engine.device)
    start = time.perf_counter()
    while engine.has_unfinished():
        done.update((e.request_id, e.completion) for e in engine.step() if e.completion is not None)
    sync(engine.device)
    return time.perf_counter() - start, [done[i] for i in range(len(prompts))]


def tie_check(target, prompts, base, spec) -> dict:
    """Rows identical / parting at a near-tie of target-only's top-2 logits / parting elsewhere."""
    counts = {"identical": 0, "near_tie": 0, "differ": 0}
    for prompt, b, s in zip(prompts, base, spec):
        part = next((i for i, (x, y) in enumerate(zip(b.token_ids, s.token_ids)) if x != y), None)
        if part is None and len(b.token_ids) == len(s.token_ids):
            counts["identical"] += 1
            continue
        part = min(len(b.token_ids), len(s.token_ids)) if part is None else part
        ids = torch.tensor([prompt + b.token_ids[:part]], device=target.device)
        logits = target(input_ids=ids).logits[:, -1:]  # [1, 1, V]
        tie = near_tie_mask(logits, torch.ones(1, dtype=torch.bool, device=ids.device), logits.dtype)
        counts["near_tie" if int(tie) else "differ"] += 1
    return counts


def release_memory():
    """After `del engine` and every other name for its proposer (`Forced` holds the draft's KV pool): its pools and
    graph pool go back to the device before the next engine plans. `gc.collect`: `follow_rows`' closures make a
    cycle through the engine."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def build_models(smoke: bool, device, dtype):
    torch.manual_seed(0)
    with torch.device(device), torch.no_grad():
        target = Qwen3ForCausalLM(Qwen3Config(**(SMOKE_TARGET if smoke else QWEN3_4B))).to(dtype).eval()
        draft = DominoDraft(parse_draft_config(SMOKE_DRAFT if smoke else HUANG2020_DRAFT, {}, "dflash"))
        draft = draft.to(dtype).eval()
    target.generation_config.eos_token_id = None
    return target.requires_grad_(False), draft.requires_grad_(False)


def weight_bytes(module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def graph_count(engine) -> int:
    return len(engine.graphs.graphs) if engine.graphs is not None else 0


def engine_report(engine) -> dict:
    """Rows, KV pool, plan, rows held at 1k/2k/4k mean lengths, graphs captured at start."""
    plan, pool_tokens = engine.memory_plan(), (engine.kv_blocks - 1) * engine.block_size
    return {"max_rows": engine.max_rows, "slot_report": engine.slot_report, "block_size": engine.block_size,
            "kv_blocks": engine.kv_blocks, "pool_tokens": pool_tokens, "pool_GiB": plan["kv_pool"] / 2**30,
            "plan_GiB": {k: v / 2**30 for k, v in plan.items()}, "plan_total_GiB": sum(plan.values()) / 2**30,
            "rows_held": {str(m): min(engine.max_rows, pool_tokens // m) for m in MEAN_LENGTHS},
            "graphs": graph_count(engine), "capture_s": engine.graph_capture_s}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,8,32,128,max", help="row counts; max = the most the engine holds")
    ap.add_argument("--prompt-lengths", default="768,1280", help="shortest,longest prompt (tokens)")
    ap.add_argument("--row-length", type=int, default=1024, help="mean row length of the decode-only table")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=20, help="timed decode steps per figure")
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args()
    if args.smoke:
        args.rows, args.prompt_lengths, args.max_new_tokens, args.row_length, args.repeats = "1,4,max", "8,40", 20, 96, 2
        torch.set_num_threads(1)
    report = {"sections_s": {}}
    started = time.perf_counter()
    try:
        models = build_models(args.smoke, torch.device("cpu" if args.smoke else "cuda"),
                              torch.float32 if args.smoke else torch.bfloat16)
        with torch.inference_mode():  # no autograd graph over the steps' in-place KV writes
            run(args, report, *models)
    except Exception as exc:  # noqa: BLE001 -- any failure (a graph capture under cuda_graphs=on) fails the check
        traceback.print_exc()
        report["error"] = f"{type(exc).__name__}: {exc}"
        print(f"\nGPU CHECK FAILED: {report['error']}", flush=True)
    report["wall_s"] = time.perf_counter() - started
    save(report)
    if "error" in report:
        sys.exit(1)
    print_table(report)


def save(report: dict):
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "bench_gpu.json"), "w") as f:
            json.dump(report, f, indent=2)


def run(args, report: dict, target, draft):
    device, dtype = target.device, target.dtype
    shortest, longest = map(int, args.prompt_lengths.split(","))
    clock = [time.perf_counter()]

    def section(name: str):
        now = time.perf_counter()
        report["sections_s"][name] = now - clock[0]
        clock[0] = now
        save(report)

    vocab, k = target.config.vocab_size, draft.config.max_draft_tokens
    graphs = "on" if device.type == "cuda" else "off"  # on: a failed capture raises
    max_len = min(PRODUCTION["max_model_len"], target.config.max_position_embeddings)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    peak = peak_bandwidth(name)
    head = target.get_output_embeddings().weight
    weights = {"target": weight_bytes(target), "draft": weight_bytes(draft),  # the draft's logits read the tied lm_head
               "draft_head": head.numel() * head.element_size() if draft.config.draft_vocab_size is None else 0}
    kv_token = {"target": kv_bytes_per_token(target.config, None, dtype.itemsize)}
    kv_token["draft"] = kv_bytes_per_token(target.config, draft.config, dtype.itemsize) - kv_token["target"]
    weights_allocated = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    info = report["info"] = {
        "device": name, "peak_bandwidth_TB_s": peak and peak / 1e12, "dtype": str(dtype), "torch": torch.__version__,
        "transformers": transformers.__version__, "date": time.strftime("%Y-%m-%d"), "K": k, "max_model_len": max_len,
        "target_params_B": sum(p.numel() for p in target.parameters()) / 1e9,
        "draft_params_B": sum(p.numel() for p in draft.parameters()) / 1e9, "weights_bytes": weights,
        "kv_bytes_per_token": kv_token, "prompt_lengths": [shortest, longest], "max_new_tokens": args.max_new_tokens,
        "row_length": args.row_length, "weights_GiB": weights_allocated / 2**30}
    print(json.dumps(info), flush=True)
    section("models")

    def spec_engine(rows, cuda_graphs=graphs, forced_on=True):
        """A fixed-K engine on the real draft, its drafts replaced by the references when `forced_on` (set before the
        engine captures its graphs at start: a graph replays the branch taken at capture)."""
        forced = Forced(DominoProposer(draft, target), MAX_AUTO_SLOTS if rows == "auto" else rows,
                        max_len + 2 * (k + 1), device)
        forced.on = forced_on
        engine = SpecEngine(target, forced, max_rows=rows, max_model_len=max_len, cuda_graphs=cuda_graphs,
                            max_prefill_tokens=PRODUCTION["max_prefill_tokens"], kv_cache_tokens="auto")
        follow_rows(engine, forced)
        return engine, forced

    # The production engine (adaptive width, as configs/qwen3_4b.yaml): rows, pool, graphs; decode-only steps; tok/s
    # at every row count (random weights: the draft is rejected, so the width policy falls back to target-only speed).
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    engine = SpecEngine(target, DominoProposer(draft, target), max_rows="auto", max_model_len=max_len,
                        kv_cache_tokens="auto", cuda_graphs=graphs, adaptive=True,
                        max_prefill_tokens=PRODUCTION["max_prefill_tokens"])
    slots, at_start = engine.max_rows, graph_count(engine)
    production = report["engine"] = engine_report(engine)
    print(f"max_batch_size=auto: {engine.slot_report}; {at_start} graphs captured at start in "
          f"{engine.graph_capture_s:.1f} s; rows held at mean length {production['rows_held']}", flush=True)
    section("production_engine")
    report["decode"] = time_decode(engine, args.rows.split(","), args.row_length, weights, kv_token, peak, args.repeats)
    section("decode")
    row_counts = sorted({slots if r == "max" else int(r) for r in args.rows.split(",")} - {0})
    row_counts = [n for n in row_counts if n <= slots]
    prompts = {n: prompts_for(n, vocab, seed=n, shortest=shortest, longest=longest) for n in row_counts}
    results, adaptive_out = {str(n): {} for n in row_counts}, {}
    report["results"] = results
    for n in row_counts:
        seconds, adaptive_out[n] = generate(engine, prompts[n], args.max_new_tokens)
        results[str(n)]["adaptive_tok_s"] = sum(len(c.token_ids) for c in adaptive_out[n]) / seconds
    report["kv_cache"] = engine.kv_cache_stats()
    report["graphs"] = {"adaptive": {"at_start": at_start, "capture_s": engine.graph_capture_s,
                                     "lazily": graph_count(engine) - at_start}}
    report["peak_beyond_weights_GiB"] = (torch.cuda.max_memory_allocated(device) - weights_allocated) / 2**30 \
        if device.type == "cuda" else None
    print(f"kv_cache {report['kv_cache']}", flush=True)
    del engine
    release_memory()
    section("adaptive_runs")

    # Target-only, every row count, same rows: a warm-up run then a timed one.
    engine = SpecEngine(target, None, max_rows=slots, max_model_len=max_len, cuda_graphs=graphs,
                        kv_cache_tokens="auto", max_prefill_tokens=PRODUCTION["max_prefill_tokens"])
    at_start, base = graph_count(engine), {}
    for n in row_counts:
        generate(engine, prompts[n], args.max_new_tokens)
        seconds, base[n] = generate(engine, prompts[n], args.max_new_tokens)
        row = results[str(n)]
        row.update(target_only_tok_s=sum(len(c.token_ids) for c in base[n]) / seconds,
                   adaptive_lossless=tie_check(target, prompts[n], base[n], adaptive_out[n]))
        row["adaptive_vs_target_only"] = row["adaptive_tok_s"] / row["target_only_tok_s"]
        print(f"rows {n}: target-only {row['target_only_tok_s']:.0f} tok/s, adaptive {row['adaptive_tok_s']:.0f}",
              flush=True)
    report["graphs"]["target_only"] = {"at_start": at_start, "capture_s": engine.graph_capture_s,
                                       "lazily": graph_count(engine) - at_start}
    del engine
    release_memory()
    section("target_only_runs")

    # Speculative at forced full acceptance (fixed K: no width cap, so its own `auto` rows may be fewer).
    engine, forced = spec_engine("auto")
    at_start = graph_count(engine)
    info["forced_auto_slots"] = engine.max_rows
    for n in [n for n in row_counts if n <= engine.max_rows]:
        forced.by_request = {i: p + c.token_ids for i, (p, c) in enumerate(zip(prompts[n], base[n]))}
        _, own = generate(engine, prompts[n], args.max_new_tokens)  # warm-up; its output is the engine's own
        forced.by_request = {i: p + c.token_ids for i, (p, c) in enumerate(zip(prompts[n], own))}
        seconds, spec = generate(engine, prompts[n], args.max_new_tokens)
        tokens = sum(len(c.token_ids) for c in spec)
        row = results[str(n)]
        row.update(spec_forced_tok_s=tokens / seconds, speedup=tokens / seconds / row["target_only_tok_s"],
                   mean_acceptance_length=sum(c.stats.mean_acceptance_length for c in spec) / n,
                   rows_at_full_acceptance=sum(c.stats.num_spec_steps == -(-(len(c.token_ids) - 1) // (k + 1))
                                               for c in spec),
                   lossless_forced=tie_check(target, prompts[n], base[n], spec))
        print(f"rows {n}: " + json.dumps({key: round(v, 3) if isinstance(v, float) else v for key, v in row.items()}),
              flush=True)
    report["graphs"]["forced"] = {"at_start": at_start, "capture_s": engine.graph_capture_s,
                                  "lazily": graph_count(engine) - at_start}
    section("forced_runs")
    r = engine.row_buckets[-1]  # the draft step and the verify step alone, graphed apart, over ragged ~1k-token rows
    lengths, need = ragged_lengths(engine, args.row_length)
    steps = time_parts(engine, r, lengths[:r], need[:r], k, args.repeats)
    report["steps_at_max_bucket"], report["draft_over_verify"] = steps, steps["draft_step_ms"] / steps["verify_step_ms"]
    del engine, forced
    release_memory()
    section("draft_verify_steps")

    # The real (rejecting) draft at a fixed K on 8 rows: CUDA graphs on == graphs off, token for token.
    n = min(8, slots)
    check_prompts = prompts.get(n) or prompts_for(n, vocab, seed=n, shortest=shortest, longest=longest)
    check_base = base.get(n)
    real = {}
    for mode in ("on", "off") if graphs == "on" else ("off",):
        engine, forced = spec_engine(n, cuda_graphs=mode, forced_on=False)
        _, real[mode] = generate(engine, check_prompts, args.max_new_tokens)
        del engine, forced  # the proposer (its draft KV pool) too, before the next engine plans its memory
        release_memory()
    report["checks"] = {"rows": n, "graphs_on_vs_off": (tie_check(target, check_prompts, real["off"], real["on"])
                                                         if "on" in real else None),
                        "real_draft_lossless": (tie_check(target, check_prompts, check_base, real["off"])
                                                if check_base else None)}
    section("graphs_on_off")


def print_table(report: dict):
    e = report["engine"]
    print(f"\nproduction engine: {e['max_rows']} rows, KV pool {e['kv_blocks'] - 1} blocks x {e['block_size']} = "
          f"{e['pool_tokens']} tokens ({e['pool_GiB']:.1f} GiB), plan {e['plan_total_GiB']:.1f} GiB, "
          f"{e['graphs']} graphs captured in {e['capture_s']:.1f} s; rows held at mean length {e['rows_held']}")
    print(f"{'rows':>5} {'W':>3} {'ms/step':>9} {'GB/step':>8} {'KV GB':>7} {'TB/s':>6} {'of peak':>8}")
    for d in report["decode"]:
        frac = f"{d['bandwidth_fraction']:.0%}" if d["bandwidth_fraction"] is not None else "-"
        print(f"{d['rows']:>5} {d['width']:>3} {d['ms_per_step']:>9.2f} {d['bytes_per_step'] / 1e9:>8.3g} "
              f"{d['kv_bytes'] / 1e9:>7.3g} {d['TB_per_s']:>6.3g} {frac:>8}  {d['attention']}")
    print(f"\n{'rows':>6} {'target-only':>12} {'adaptive':>9} {'ratio':>6} {'forced spec':>12} {'speed-up':>9} "
          f"{'tau':>6}  lossless (adaptive; forced)")
    for n, row in report["results"].items():
        forced = (f"{row['spec_forced_tok_s']:>12.0f} {row['speedup']:>9.2f} {row['mean_acceptance_length']:>6.2f}"
                  if "speedup" in row else f"{'-':>12} {'-':>9} {'-':>6}")
        print(f"{n:>6} {row['target_only_tok_s']:>12.0f} {row['adaptive_tok_s']:>9.0f} "
              f"{row['adaptive_vs_target_only']:>6.2f} {forced}  {row['adaptive_lossless']}; {row.get('lossless_forced')}")
    peak = report["peak_beyond_weights_GiB"]
    print(f"kv_cache {report['kv_cache']}; forced fixed K rows {report['info']['forced_auto_slots']}; peak beyond "
          f"weights {f'{peak:.1f} GiB' if peak is not None else 'n/a (CPU)'}; graphs {report['graphs']}; "
          f"draft/verify {report['draft_over_verify']:.2f} {report['steps_at_max_bucket']}; checks {report['checks']}; "
          f"sections {({k: round(v) for k, v in report['sections_s'].items()})}; wall {report['wall_s']:.0f} s",
          flush=True)


if __name__ == "__main__":
    main()
