"""Ours vs vLLM's CPU build on the shipped demo pair: tokens/s and greedy agreement, in one run.

    make peers-venv                                             # vLLM CPU in its own venv, .venv-vllm
    python benchmarks/bench_peers.py --repeats 2 --json out/peers.json
    python benchmarks/bench_peers.py --ours-only --prompts 4 --max-new-tokens 12   # no vLLM needed

Workload (issue 9): the demo pair's bundled prompts as plain text (`chat_template=False`), 128 greedy new
tokens each with `ignore_eos`, 16 sequences at a time, 2 threads. Modes: ours target-only and ours Domino
(in this process, through SpecEngine/DominoProposer); vLLM target-only, vLLM ngram speculation and vLLM
dflash on our draft (each in its own `.venv-vllm` subprocess, which gets the same token ids, writes token
ids and timings as JSON, and excludes its start-up compile from tokens/s; the start-up is reported).
Our modes run in interleaved repeats; each vLLM mode starts once and runs its repeats back to back.

The same file is the vLLM worker (`--vllm-worker SPEC OUT`): that side imports vllm only, never
domino_ray or our torch, so the top of this file imports nothing but the standard library.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VLLM_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0-1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "VLLM_CPU_KVCACHE_SPACE": "4",
            "VLLM_ALLOW_LONG_MAX_MODEL_LEN": "1",
            # No network at run time: the models are local directories.
            "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
# vllm-dflash: our draft as shipped; vllm-dflash-no-head: a copy without the GRU head (embed_proj, prefix_gru),
# which is all vLLM's DFlash loader knows of a Domino checkpoint.
VLLM_MODES = ("vllm-target-only", "vllm-ngram", "vllm-dflash", "vllm-dflash-no-head")
HEAD_CONFIG_KEYS = ("projector_type", "pure_draft_prefix_len", "emb_dim", "gru_hidden_dim")


# ---- ours (our venv) --------------------------------------------------------------------------------

def load_pair(assets: Path, num_prompts: int):
    import pyarrow.parquet as pq

    from domino_ray.checkpoint import load_draft
    from domino_ray.target import encode_prompt, load_target, load_tokenizer

    target = load_target(str(assets / "target"), dtype="auto", device="cpu")
    tokenizer = load_tokenizer(str(assets / "target"))
    draft = load_draft(assets / "draft", target_config=target.config, dtype=target.dtype)
    texts = pq.read_table(assets / "prompts.parquet").column("prompt").to_pylist()
    if num_prompts > len(texts):
        raise ValueError(f"--prompts {num_prompts}: the pair ships only {len(texts)} prompts")
    prompts = [encode_prompt(tokenizer, prompt=t, chat_template=False) for t in texts[:num_prompts]]
    return target, draft, prompts


def run_ours(target, draft, prompts, *, rows: int, max_new_tokens: int) -> dict:
    from domino_ray.engine import SpecEngine
    from domino_ray.request import Request
    from domino_ray.proposer import DominoProposer
    from domino_ray.sampling_params import SamplingParams
    from domino_ray.stats import total_stats

    proposer = DominoProposer(draft, target) if draft is not None else None
    engine = SpecEngine(target, proposer, max_rows=rows)
    params = SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True)
    start = time.perf_counter()
    out = engine.generate([Request(i, p, params) for i, p in enumerate(prompts)])
    seconds = time.perf_counter() - start
    total = total_stats(c.stats for c in out)
    return {"seconds": seconds, "tokens": sum(len(c.token_ids) for c in out), "token_ids": [c.token_ids for c in out],
            "mean_acceptance_length": total.mean_acceptance_length if proposer else None}


def profile_ours_step(target, draft, prompts, *, rows: int, steps: int = 8, max_new_tokens: int = 128) -> dict:
    """Where one steady-state decode step at `rows` rows spends its time: wall time per step (no profiler),
    and under torch.profiler the self CPU time of the aten ops by kind. What the ops do not account for is
    Python and dispatch overhead (the profiler's own cost included, so that share is an upper bound)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from domino_ray.engine import SpecEngine
    from domino_ray.request import Request
    from domino_ray.proposer import DominoProposer
    from domino_ray.sampling_params import SamplingParams

    def started_engine():
        proposer = DominoProposer(draft, target) if draft is not None else None
        engine = SpecEngine(target, proposer, max_rows=rows)
        params = SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True)
        for i, p in enumerate(prompts[:rows]):
            engine.add_request(Request(i, p, params))
        engine.step()  # admission (prefill) and the first decode step stay out of the profile
        engine.step()
        return engine

    engine = started_engine()
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    wall_ms = (time.perf_counter() - start) * 1e3 / steps
    assert len(engine.rows) == rows, "rows finished inside the timed window: lower --profile-steps"
    engine = started_engine()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        profiled_ms = (time.perf_counter() - start) * 1e3 / steps
    kinds = {"gemm": ("aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::linear", "aten::baddbmm"),
             "attention": ("aten::_scaled_dot_product", "aten::scaled_dot_product"),
             "gru": ("aten::gru",)}
    by_kind = dict.fromkeys([*kinds, "other ops"], 0.0)
    top = []
    for event in prof.key_averages():
        kind = next((k for k, prefixes in kinds.items() if event.key.startswith(prefixes)), "other ops")
        by_kind[kind] += event.self_cpu_time_total / 1e3 / steps
        top.append((event.self_cpu_time_total / 1e3 / steps, event.count / steps, event.key))
    ops_ms = sum(by_kind.values())
    top.sort(reverse=True)
    return {"rows": rows, "steps": steps, "wall_ms_per_step": round(wall_ms, 2),
            "profiled_ms_per_step": round(profiled_ms, 2),
            "self_cpu_ms_per_step": {k: round(v, 2) for k, v in by_kind.items()},
            "python_and_dispatch_ms_per_step": round(profiled_ms - ops_ms, 2),
            "aten_calls_per_step": round(sum(c for _, c, _ in top), 1),
            "top_ops": [{"op": name, "ms_per_step": round(ms, 3), "calls_per_step": round(c, 1)}
                        for ms, c, name in top[:12]],
            "speculative": draft is not None}


# ---- vLLM (a .venv-vllm subprocess) -------------------------------------------------------------------

def vllm_worker(spec_path: Path, out_path: Path):
    """Runs under .venv-vllm's python: start vLLM for one mode, warm up, time `repeats` full runs."""
    spec = json.loads(spec_path.read_text())
    result = {"mode": spec["mode"], "runs": []}
    try:
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt

        result["vllm"] = __import__("vllm").__version__
        speculative = None
        if spec["mode"] == "vllm-ngram":
            speculative = {"method": "ngram", "num_speculative_tokens": spec["ngram_tokens"]}
        elif spec["mode"] == "vllm-dflash":
            speculative = {"method": "dflash", "model": spec["draft"], "num_speculative_tokens": spec["dflash_tokens"]}
        elif spec["mode"] == "vllm-dflash-no-head":
            speculative = {"method": "dflash", "model": spec["draft_no_head"],
                           "num_speculative_tokens": spec["dflash_tokens"]}
        start = time.perf_counter()
        llm = LLM(model=spec["target"], dtype="float32", max_model_len=spec["max_model_len"],
                  max_num_seqs=spec["rows"], seed=0, enable_prefix_caching=False, disable_log_stats=False,
                  speculative_config=speculative)
        greedy = SamplingParams(temperature=0.0, max_tokens=spec["max_new_tokens"], ignore_eos=True)
        prompts = [TokensPrompt(prompt_token_ids=ids) for ids in spec["prompts"]]
        # Warm-up at full batch: the first steps compile; that stays out of tokens/s.
        llm.generate(prompts[:spec["rows"]], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
                     use_tqdm=False)
        result["startup_s"] = time.perf_counter() - start
        for _ in range(spec["repeats"]):
            before = spec_counters(llm)
            start = time.perf_counter()
            outs = llm.generate(prompts, greedy, use_tqdm=False)
            seconds = time.perf_counter() - start
            after = spec_counters(llm)
            token_ids = [list(o.outputs[0].token_ids) for o in outs]
            drafts = after["drafts"] - before["drafts"]
            result["runs"].append({
                "seconds": seconds, "tokens": sum(map(len, token_ids)), "token_ids": token_ids,
                "mean_acceptance_length": 1 + (after["accepted"] - before["accepted"]) / drafts if drafts else None})
    except Exception as exc:  # reported, not fatal: the other modes still count (e.g. dflash refusing our draft)
        import traceback
        result["error"] = f"{type(exc).__name__}: {exc}"
        result["traceback"] = traceback.format_exc()[-4000:]
    out_path.write_text(json.dumps(result) + "\n")


def spec_counters(llm) -> dict:
    values = {m.name: getattr(m, "value", 0) for m in llm.get_metrics()}
    return {"drafts": values.get("vllm:spec_decode_num_drafts", 0),
            "accepted": values.get("vllm:spec_decode_num_accepted_tokens", 0)}


def draft_without_head(draft_dir: Path, out_dir: Path) -> Path:
    """A copy of a Domino draft with its GRU head's weights and config keys removed (a plain DFlash draft)."""
    from safetensors.torch import load_file, save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    weights = load_file(draft_dir / "model.safetensors")
    save_file({k: v for k, v in weights.items() if not k.startswith(("embed_proj.", "prefix_gru."))},
              out_dir / "model.safetensors")
    config = json.loads((draft_dir / "config.json").read_text())
    for section in (config, config.get("dflash_config", {})):
        for key in HEAD_CONFIG_KEYS:
            section.pop(key, None)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out_dir


def run_vllm(mode: str, args, prompts: list[list[int]], workdir: Path) -> dict:
    spec = {"mode": mode, "target": str(args.assets / "target"), "draft": str(args.assets / "draft"),
            "draft_no_head": str(workdir / "draft-no-head"),
            "prompts": prompts, "rows": args.rows, "max_new_tokens": args.max_new_tokens, "repeats": args.repeats,
            "ngram_tokens": args.ngram_tokens, "dflash_tokens": args.dflash_tokens,
            "max_model_len": args.max_model_len}
    spec_path, out_path, log_path = (workdir / f"{mode}.{x}" for x in ("spec.json", "out.json", "log"))
    spec_path.write_text(json.dumps(spec))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # never our packages in vLLM's venv
    env.update(VLLM_ENV)
    if args.vllm_preload_iomp:  # what vLLM's CPU docs ask for (it warns that speculation is slow without it)
        env["LD_PRELOAD"] = str(args.vllm_python.parent.parent / "lib" / "libiomp5.so")
    start = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.run([str(args.vllm_python), __file__, "--vllm-worker", str(spec_path), str(out_path)],
                              stdout=log, stderr=subprocess.STDOUT, env=env, cwd=workdir, timeout=args.vllm_timeout)
    result = json.loads(out_path.read_text()) if out_path.exists() else {"mode": mode, "runs": []}
    result["wall_s"] = time.perf_counter() - start
    result["log"] = str(log_path)
    if proc.returncode and "error" not in result:
        result["error"] = f"worker exited with {proc.returncode}; see {log_path}"
    return result


# ---- the table -------------------------------------------------------------------------------------------

def agreement(a: list[list[int]], b: list[list[int]]) -> dict:
    """Prompts whose greedy token ids are equal, and the mean length of the common prefix."""
    def common(x, y):
        n = 0
        while n < min(len(x), len(y)) and x[n] == y[n]:
            n += 1
        return n
    return {"equal": sum(x == y for x, y in zip(a, b)), "total": len(a),
            "mean_common_prefix": round(statistics.fmean(common(x, y) for x, y in zip(a, b)), 1)}


def summarize(name: str, runs: list[dict], **extra) -> dict:
    tps = [r["tokens"] / r["seconds"] for r in runs]
    taus = [r["mean_acceptance_length"] for r in runs if r.get("mean_acceptance_length")]
    return {"mode": name, "tokens_per_s": [round(x, 1) for x in tps], "median_tokens_per_s": round(statistics.median(tps), 1),
            "tokens": runs[0]["tokens"], "mean_acceptance_length": round(taus[0], 2) if taus else None, **extra}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--assets", type=Path, default=ROOT / "domino_ray" / "assets" / "demo")
    p.add_argument("--prompts", type=int, default=300)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--rows", type=int, default=16, help="sequences at a time (our max_rows, vLLM max_num_seqs)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--ngram-tokens", type=int, default=8)
    p.add_argument("--dflash-tokens", type=int, default=7, help="vLLM's DFlash verifies block_size - 1 drafts")
    p.add_argument("--max-model-len", type=int, default=256, help="vLLM max_model_len (the target's positions)")
    p.add_argument("--vllm-python", type=Path, default=ROOT / ".venv-vllm" / "bin" / "python")
    p.add_argument("--vllm-modes", default=",".join(VLLM_MODES))
    p.add_argument("--vllm-timeout", type=int, default=1800)
    p.add_argument("--vllm-preload-iomp", action="store_true", help="LD_PRELOAD the venv's Intel OpenMP for vLLM")
    p.add_argument("--ours-only", action="store_true", help="skip vLLM (no .venv-vllm needed)")
    p.add_argument("--profile", action="store_true", help="also profile one of our decode steps at --rows rows")
    p.add_argument("--profile-steps", type=int, default=16, help="steady-state steps timed and profiled")
    p.add_argument("--workdir", type=Path, default=ROOT / "out" / "bench_peers", help="vLLM specs, outputs, logs")
    p.add_argument("--json", type=Path, default=None, help="also write the results here")
    p.add_argument("--vllm-worker", nargs=2, type=Path, metavar=("SPEC", "OUT"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.vllm_worker:
        return vllm_worker(*args.vllm_worker)
    args.assets, args.workdir = args.assets.resolve(), args.workdir.resolve()  # the worker runs in workdir
    vllm_modes = [] if args.ours_only else [m for m in args.vllm_modes.split(",") if m]
    unknown = sorted(set(vllm_modes) - set(VLLM_MODES))
    if unknown:
        raise SystemExit(f"--vllm-modes: unknown {unknown}; choose from {', '.join(VLLM_MODES)}")
    if vllm_modes and not args.vllm_python.exists():
        raise SystemExit(f"{args.vllm_python} is missing: run `make peers-venv` first, or pass --ours-only")

    import torch
    torch.set_num_threads(args.threads)
    target, draft, prompts = load_pair(args.assets, args.prompts)
    modes = {"ours-target-only": None, "ours-domino": draft}
    loads = {"start": os.getloadavg()[0]}
    for name, d in modes.items():  # warm-up: first-call costs (hooks, allocator) stay out of timing
        run_ours(target, d, prompts[:args.rows], rows=args.rows, max_new_tokens=8)
    ours_runs = {name: [] for name in modes}
    for repeat in range(args.repeats):  # interleaved: both our modes see the same machine state
        for name, d in modes.items():
            ours_runs[name].append(run_ours(target, d, prompts, rows=args.rows, max_new_tokens=args.max_new_tokens))
            r = ours_runs[name][-1]
            print(f"{name} repeat {repeat}: {r['tokens'] / r['seconds']:.0f} tok/s", file=sys.stderr, flush=True)
    loads["after ours"] = os.getloadavg()[0]
    reference = ours_runs["ours-target-only"][0]["token_ids"]
    for name, runs in ours_runs.items():  # lossless: every run of every mode gives target-only's greedy tokens
        assert all(r["token_ids"] == reference for r in runs), f"{name}: output differs from our target-only"
    rows = [summarize(name, runs, greedy_agreement_with_ours=agreement(reference, runs[-1]["token_ids"]))
            for name, runs in ours_runs.items()]

    vllm_results = {}
    if vllm_modes:
        args.workdir.mkdir(parents=True, exist_ok=True)
        draft_without_head(args.assets / "draft", args.workdir / "draft-no-head")
    for mode in vllm_modes:
        res = vllm_results[mode] = run_vllm(mode, args, prompts, args.workdir)
        print(f"{mode}: {[round(r['tokens'] / r['seconds']) for r in res['runs']]} tok/s, "
              f"{res.get('error', 'ok')}", file=sys.stderr, flush=True)
        loads[f"after {mode}"] = os.getloadavg()[0]
        if res.get("error"):
            print(f"{mode}: did not run: {res['error']}", file=sys.stderr)
            continue
        vllm_reference = res["runs"][0]["token_ids"]
        rows.append(summarize(mode, res["runs"], startup_s=round(res["startup_s"], 1),
                              greedy_agreement_with_ours=agreement(reference, vllm_reference)))
    by_mode = {r["mode"]: r for r in rows}
    base = by_mode.get("vllm-target-only")
    for r in rows:
        r["vs_vllm_target_only"] = (round(r["median_tokens_per_s"] / base["median_tokens_per_s"], 2) if base else None)
        r["vs_ours_target_only"] = round(r["median_tokens_per_s"] / by_mode["ours-target-only"]["median_tokens_per_s"], 2)
    profiles = [profile_ours_step(target, d, prompts, rows=args.rows, steps=args.profile_steps)
                for d in modes.values()] if args.profile else []

    print(f"\n{len(prompts)} prompts x {args.max_new_tokens} greedy new tokens (ignore_eos), {args.rows} rows, "
          f"{args.threads} threads, {args.repeats} repeat(s), OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', 'unset')}; "
          f"load average {loads}")
    print(f"{'mode':<18} {'tok/s (each repeat)':>24} {'vs vLLM':>8} {'vs ours':>8} {'tau':>5} {'start-up':>9}  agreement")
    for r in rows:
        tps = " / ".join(f"{x:.0f}" for x in r["tokens_per_s"])
        vs = f"{r['vs_vllm_target_only']:.2f}" if r["vs_vllm_target_only"] else "-"
        tau = f"{r['mean_acceptance_length']:.2f}" if r["mean_acceptance_length"] else "-"
        up = f"{r['startup_s']:.0f} s" if "startup_s" in r else "-"
        agree = r.get("greedy_agreement_with_ours")
        agree = f"{agree['equal']}/{agree['total']} equal to ours" if agree else "-"
        print(f"{r['mode']:<18} {tps:>24} {vs:>8} {r['vs_ours_target_only']:>8.2f} {tau:>5} {up:>9}  {agree}")
    for mode, res in vllm_results.items():
        if res.get("error"):
            print(f"{mode:<18} did not run: {res['error'][:300]}")
    for prof in profiles:
        print(f"\nprofile, ours {'domino' if prof['speculative'] else 'target-only'}, {prof['rows']} rows: "
              f"{prof['wall_ms_per_step']} ms/step ({prof['profiled_ms_per_step']} under the profiler), "
              f"{prof['aten_calls_per_step']} aten calls/step; self CPU ms/step {prof['self_cpu_ms_per_step']}, "
              f"python+dispatch {prof['python_and_dispatch_ms_per_step']}")
        for op in prof["top_ops"][:8]:
            print(f"    {op['op']:<40} {op['ms_per_step']:>8.3f} ms {op['calls_per_step']:>7.1f} calls")
    meta = {"machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs",
            "torch": torch.__version__, "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "load_average": loads,
            "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
            "args": {k: str(v) for k, v in vars(args).items()}}
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        errors = {m: {k: r[k] for k in ("error", "traceback", "log") if k in r} for m, r in vllm_results.items()
                  if r.get("error")}
        args.json.write_text(json.dumps({"meta": meta, "results": rows, "vllm_errors": errors,
                                         "profiles": profiles}, indent=1) + "\n")


if __name__ == "__main__":
    main()
