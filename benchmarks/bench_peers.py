"""Ours vs vLLM's CPU build on a shipped pair: tokens/s and greedy agreement, in one run.

    make peers-venv                                             # vLLM CPU in its own venv, .venv-vllm
    python benchmarks/bench_peers.py --repeats 2 --json out/peers.json
    python benchmarks/bench_peers.py --pair smollm2 --json out/peers_smollm2.json        # after `make smollm2`
    python benchmarks/bench_peers.py --ours-only --prompts 4 --max-new-tokens 12   # no vLLM needed

`--pair demo` (issue 9, the default): the demo pair's bundled prompts as plain text (`chat_template=False`),
128 greedy new tokens each with `ignore_eos`, 16 sequences at a time, 2 threads; ours target-only and Domino
at fixed K; vLLM target-only, ngram speculation and dflash on our draft.
`--pair smollm2` (issue 20): SmolLM2-135M-Instruct (converted by `make smollm2`) with its Domino draft, 32
held-out chat prompts (chat template), up to 128 greedy new tokens stopping at EOS, at 1 and 16 sequences
at a time; ours target-only, Domino at the adaptive width and at fixed K; vLLM target-only and ngram.

Ours runs in this process (the engine `domino_ray.llm.build_engine` assembles, as jobs and Serve do); each
vLLM mode and batch size in its own `.venv-vllm` subprocess, which gets the same token ids and EOS ids,
writes token ids and timings as JSON, and excludes its start-up compile from tokens/s (reported apart).
vLLM runs with Intel OpenMP preloaded, as its CPU docs ask (`--no-vllm-preload-iomp`: without). Per batch
size our modes run in interleaved repeats; each vLLM mode starts once and runs its repeats back to back.
`--isa avx2` on an AVX-512 machine runs both engines as an AVX2-only CPU would (our 2-core AMD EPYC kind): our
kernels built for `haswell`, torch's, MKL's and oneDNN's capped at AVX2 (`AVX2_ENV`), vLLM's AVX2 kernel library
(its engine then in the worker's process): a proxy for that CPU, the same cores and memory with the other ISA.
Every figure, in each table's header and in the JSON (`meta.cpu`, each result's and profile's `cpu`), names the CPU
it was measured on, its model and ISA class (AVX2 / AVX-512 / AVX512_BF16 / AMX, `cpu_kind`).

The same file is the vLLM worker (`--vllm-worker SPEC OUT`): that side imports vllm only, never
domino_ray or our torch, so the top of this file imports nothing but the standard library.
"""

from __future__ import annotations

import argparse
import copy
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
# `--isa avx2`: what each library reads to stay within AVX2 (torch's ATen kernels, MKL, oneDNN; our kernels' build)
AVX2_ENV = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2",
            "DOMINO_RAY_KERNEL_MARCH": "haswell"}
# vllm-dflash: our draft as shipped; vllm-dflash-no-head: a copy without the GRU head (embed_proj, prefix_gru),
# which is all vLLM's DFlash loader knows of a Domino checkpoint.
VLLM_MODES = ("vllm-target-only", "vllm-ngram", "vllm-dflash", "vllm-dflash-no-head")
HEAD_CONFIG_KEYS = ("projector_type", "pure_draft_prefix_len", "emb_dim", "gru_hidden_dim")
# Each pair's workload (flags left unset take these). `domino_widths`: our Domino modes, "auto" (the adaptive
# verify width) or a fixed K ("max": the most the draft proposes). `vllm_modes`: the ones that can run it
# (the dflash ones stay on the demo pair: the SmolLM2 draft, speculators layout with a pruned vocabulary, is
# not one vLLM's DFlash loader is known to take, and is not tried).
PAIRS = {
    "demo": {"prompts": 300, "rows": "16", "max_model_len": 256, "ignore_eos": True, "domino_widths": "max",
             "vllm_modes": VLLM_MODES},
    "smollm2": {"prompts": 32, "rows": "1,16", "max_model_len": 1024, "ignore_eos": False,
                "domino_widths": "auto,max", "vllm_modes": ("vllm-target-only", "vllm-ngram")},
}


# ---- ours (our venv) --------------------------------------------------------------------------------

def our_modes(pair, widths: str) -> dict:
    """{mode name: (draft, num_draft_tokens)}: target-only, then one Domino mode per entry of `widths`."""
    modes = {"ours-target-only": (None, None)}
    for width in filter(None, widths.split(",")):
        k = width if width == "auto" else pair.draft.config.max_draft_tokens if width == "max" else int(width)
        modes[f"ours-domino-{'auto' if k == 'auto' else f'k{k}'}"] = (pair.draft, k)
    return modes


def our_engine(pair, mode: tuple, *, rows: int, max_model_len: int, width_costs=None):
    """`width_costs`: an adaptive engine's step costs as another engine of this shape measured them at its
    start (None: measure them, the engine's start-up); copied, since real steps refine the engine's table."""
    from domino_ray.llm import build_engine

    draft, num_draft_tokens = mode
    return build_engine(pair.target, draft, pair.tokenizer, num_draft_tokens=num_draft_tokens, max_batch_size=rows,
                        max_model_len=max_model_len, width_costs=copy.deepcopy(width_costs))


def start_costs(engine):
    """An adaptive engine's step costs as measured at its start (None for a fixed width): call before any step,
    since real steps refine them."""
    return copy.deepcopy(engine.width.costs) if engine.width else None


def run_ours(pair, mode: tuple, prompts, *, rows: int, max_new_tokens: int, ignore_eos: bool, max_model_len: int,
             width_costs=None) -> dict:
    from domino_ray.engine.request import Request
    from domino_ray.sample.params import SamplingParams
    from domino_ray.spec_decode.stats import total_stats

    start = time.perf_counter()
    engine = our_engine(pair, mode, rows=rows, max_model_len=max_model_len, width_costs=width_costs)
    startup_s = time.perf_counter() - start
    measured_costs = start_costs(engine)
    params = SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=ignore_eos)
    start = time.perf_counter()
    out = engine.generate([Request(i, p, params) for i, p in enumerate(prompts)])
    seconds = time.perf_counter() - start
    total = total_stats(c.stats for c in out)
    return {"seconds": seconds, "tokens": sum(len(c.token_ids) for c in out), "token_ids": [c.token_ids for c in out],
            "mean_acceptance_length": total.mean_acceptance_length if engine.proposer else None,
            "startup_s": startup_s, "width_costs": measured_costs}


# Op kinds of a step profile, by op-name prefix, ours (aten, MKL's packed GEMM and our own CPU kernels) and vLLM's
# (its own CPU ops). vLLM's compiled model runs its fused elementwise kernels (norms, rotary, SiLU, residual adds)
# inside the compiled graph's call, so they show as that call's self time.
OP_KINDS = {"gemm": ("aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::linear", "aten::baddbmm",
                     "mkl::_mkl_linear", "domino_ray::linear", "_C::onednn_mm", "_C::weight_packed_linear"),
            "attention": ("aten::_scaled_dot_product", "aten::scaled_dot_product", "domino_ray::decode_attention",
                          "_C::cpu_attention", "_C::cpu_attn", "vllm::unified_attention", "vllm::unified_kv_cache"),
            "gru": ("aten::gru",),
            "norms and rotary (ours)": ("domino_ray::rms_norm", "domino_ray::rotary"),
            "fused elementwise (compiled)": ("## Call CompiledFxGraph",)}


def ops_by_kind(events, steps: int) -> tuple[dict, list]:
    """Self CPU ms per step by `OP_KINDS` (the rest: "other ops") and every op as (ms, calls, name) per step,
    from `(name, self_cpu_us, calls)` triples of `steps` steps."""
    by_kind = dict.fromkeys([*OP_KINDS, "other ops"], 0.0)
    top = []
    for name, self_us, calls in events:
        kind = next((k for k, prefixes in OP_KINDS.items() if name.startswith(prefixes)), "other ops")
        by_kind[kind] += self_us / 1e3 / steps
        top.append((self_us / 1e3 / steps, calls / steps, name))
    top.sort(reverse=True)
    return by_kind, top


def step_profile(name: str, rows: int, steps: int, wall_ms: float, profiled_ms: float, events) -> dict:
    """One engine's step profile as the table prints it (`events`: see `ops_by_kind`)."""
    by_kind, top = ops_by_kind(events, steps)
    return {"mode": name, "rows": rows, "steps": steps, "wall_ms_per_step": round(wall_ms, 2),
            "profiled_ms_per_step": round(profiled_ms, 2),
            "self_cpu_ms_per_step": {k: round(v, 2) for k, v in by_kind.items() if v},
            "python_and_dispatch_ms_per_step": round(profiled_ms - sum(by_kind.values()), 2),
            "op_calls_per_step": round(sum(c for _, c, _ in top), 1),
            "top_ops": [{"op": op, "ms_per_step": round(ms, 3), "calls_per_step": round(c, 1)}
                        for ms, c, op in top[:12]]}


def profile_ours_step(pair, name: str, mode: tuple, prompts, *, rows: int, max_model_len: int, steps: int = 8,
                      max_new_tokens: int = 128) -> dict:
    """Where one steady-state decode step of mode `name` at `rows` rows spends its time: wall time per step (no
    profiler), and under torch.profiler the self CPU time of the aten ops by kind. What the ops do not account
    for is Python and dispatch overhead (the profiler's own cost included, so that share is an upper bound).
    The rows ignore EOS: a steady state needs them all running."""
    from torch.profiler import ProfilerActivity, profile

    from domino_ray.engine.request import Request
    from domino_ray.sample.params import SamplingParams

    def started_engine(width_costs=None):
        engine = our_engine(pair, mode, rows=rows, max_model_len=max_model_len, width_costs=width_costs)
        costs = start_costs(engine)
        params = SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True)
        for i, p in enumerate(prompts[:rows]):
            engine.add_request(Request(i, p, params))
        engine.step()  # admission (prefill) and the first decode step stay out of the profile
        engine.step()
        return engine, costs

    engine, costs = started_engine()  # an adaptive engine measures its step costs here, once
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    wall_ms = (time.perf_counter() - start) * 1e3 / steps
    assert len(engine.rows) == rows, "rows finished inside the timed window: lower --profile-steps"
    engine, _ = started_engine(costs)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        profiled_ms = (time.perf_counter() - start) * 1e3 / steps
    events = [(e.key, e.self_cpu_time_total, e.count) for e in prof.key_averages()]
    return {**step_profile(name, rows, steps, wall_ms, profiled_ms, events), "speculative": mode[0] is not None}


# ---- vLLM (a .venv-vllm subprocess) -------------------------------------------------------------------

def vllm_worker(spec_path: Path, out_path: Path):
    """Runs under .venv-vllm's python: start vLLM for one mode, warm up, time `repeats` full runs."""
    spec = json.loads(spec_path.read_text())
    result = {"mode": spec["mode"], "runs": []}
    try:
        if os.environ.get("ATEN_CPU_CAPABILITY") == "avx2":  # `--isa avx2`: vLLM picks its kernel library by the CPU's
            import torch                                      # own flags, not torch's cap

            torch.cpu._is_avx512_supported = lambda: False
            torch.cpu._is_avx512_bf16_supported = lambda: False
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
        llm = LLM(model=spec["target"], dtype=spec["dtype"], max_model_len=spec["max_model_len"],
                  max_num_seqs=spec["rows"], seed=0, enable_prefix_caching=False, disable_log_stats=False,
                  speculative_config=speculative)
        # stop_token_ids: our engine's EOS ids, so both sides stop on the same set (vLLM alone reads them
        # from the model's files; with ignore_eos it would still stop on these, hence none then)
        greedy = SamplingParams(temperature=0.0, max_tokens=spec["max_new_tokens"], ignore_eos=spec["ignore_eos"],
                                stop_token_ids=[] if spec["ignore_eos"] else spec["stop_token_ids"])
        prompts = [TokensPrompt(prompt_token_ids=ids) for ids in spec["prompts"]]
        # Warm-up at full batch: the first steps compile; that stays out of tokens/s.
        llm.generate(prompts[:spec["rows"]], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
                     use_tqdm=False)
        result["startup_s"] = time.perf_counter() - start
        result["kernel_libraries"] = sorted({Path(line.split()[-1]).name for line in open("/proc/self/maps")
                                             if "/vllm/_C" in line})  # this process's (`--isa avx2`: the engine's)
        if spec.get("profile_steps"):
            result["profile"] = vllm_step_profile(llm, prompts[:spec["rows"]], spec["mode"], spec["profile_steps"])
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


def vllm_step_profile(llm, batch: list, name: str, steps: int) -> dict:
    """`profile_ours_step` for vLLM (in-process engine: VLLM_ENABLE_V1_MULTIPROCESSING=0): a decode step is
    the difference between generating 1 + `steps` tokens and 1 token for `batch` (prefill and the first token
    cancel out), in wall time and op by op under torch.profiler."""
    from torch.profiler import ProfilerActivity, profile
    from vllm import SamplingParams

    def timed(tokens: int) -> float:
        start = time.perf_counter()
        llm.generate(batch, SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True), use_tqdm=False)
        return time.perf_counter() - start

    timed(1 + steps)
    wall_ms = (timed(1 + steps) - timed(1)) * 1e3 / steps
    runs = []
    for tokens in (1, 1 + steps):
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            seconds = timed(tokens)
        runs.append((seconds, {e.key: (e.self_cpu_time_total, e.count) for e in prof.key_averages()}))
    (short_s, short), (long_s, long) = runs
    events = [(op, us - short.get(op, (0, 0))[0], calls - short.get(op, (0, 0))[1]) for op, (us, calls) in long.items()]
    return step_profile(name, len(batch), steps, wall_ms, (long_s - short_s) * 1e3 / steps, events)


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


def iomp_library(vllm_python: Path) -> Path:
    """The Intel OpenMP runtime the vLLM CPU wheel installs into its venv (what vLLM's CPU docs preload)."""
    return vllm_python.parent.parent / "lib" / "libiomp5.so"


def run_vllm(mode: str, args, pair, rows: int, workdir: Path, profile_steps: int = 0) -> dict:
    """`profile_steps`: profile a decode step instead of timing runs (`vllm_step_profile`)."""
    from domino_ray.target.loading import stop_token_ids

    spec = {"mode": mode, "target": pair.target_dir, "draft": str(pair.draft_dir),
            "draft_no_head": str(workdir / "draft-no-head"),
            "prompts": pair.prompts, "rows": rows, "max_new_tokens": args.max_new_tokens,
            "repeats": 0 if profile_steps else args.repeats, "profile_steps": profile_steps,
            "ignore_eos": args.ignore_eos, "stop_token_ids": sorted(stop_token_ids(pair.target, pair.tokenizer)),
            "ngram_tokens": args.ngram_tokens, "dflash_tokens": args.dflash_tokens,
            "max_model_len": args.max_model_len, "dtype": args.dtype}
    stem = f"{mode}.{args.dtype}.rows{rows}{'.profile' if profile_steps else ''}"
    spec_path, out_path, log_path = (workdir / f"{stem}.{x}" for x in ("spec.json", "out.json", "log"))
    out_path.unlink(missing_ok=True)  # never a previous run's output
    spec_path.write_text(json.dumps(spec))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # never our packages in vLLM's venv
    env.update(VLLM_ENV)
    if args.vllm_preload_iomp:  # vLLM warns that speculation is slow without it
        env["LD_PRELOAD"] = str(iomp_library(args.vllm_python))
    if profile_steps or args.isa == "avx2":  # the engine core in the worker's own process, where its profiler sees
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the ops and vLLM's AVX2 kernels are what it loads
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

# The ISA classes a figure depends on, widest first, by their /proc/cpuinfo flag: our kernels, torch's, oneDNN's and
# vLLM's each pick their code paths by these (and bf16 arithmetic needs AVX512_BF16 or AMX).
ISA_CLASSES = (("amx_bf16", "AMX"), ("avx512_bf16", "AVX512_BF16"), ("avx512f", "AVX-512"), ("avx2", "AVX2"))


def cpu_kind(cpuinfo: str) -> dict:
    """The CPU every figure was measured on, from /proc/cpuinfo's text: its model name, its widest ISA class
    (`ISA_CLASSES`; "below AVX2", or "unknown" without a flags line) and which of those flags it has, and `label`,
    what the table prints."""
    fields: dict = {}
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())  # the first processor's
    flags = set(fields.get("flags", "").split())
    isa = next((name for flag, name in ISA_CLASSES if flag in flags), "below AVX2") if flags else "unknown"
    model = fields.get("model name") or platform.processor() or platform.machine()
    return {"model": model, "isa": isa, "isa_flags": [f for f, _ in ISA_CLASSES[::-1] if f in flags],
            "label": f"{model} ({isa})"}


def this_cpu(isa_arg: str) -> dict:
    """`cpu_kind` of this machine, with `--isa` (`run_isa`): a run capped at AVX2 says so beside the CPU's own."""
    try:
        kind = cpu_kind(Path("/proc/cpuinfo").read_text())
    except OSError:  # not Linux
        kind = cpu_kind("")
    if isa_arg == "avx2":
        kind["label"] += ", run capped at AVX2"
    return {**kind, "run_isa": isa_arg}


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


def measure_batch(pair, modes: dict, vllm_modes: list, args, rows: int, loads: dict) -> tuple[list, dict]:
    """Every mode at `rows` sequences at a time: (table entries, vLLM results by mode). Asserts that our
    modes generate our target-only tokens."""
    run = dict(rows=rows, ignore_eos=args.ignore_eos, max_model_len=args.max_model_len)
    # Warm-up: first-call costs (hooks, allocator) stay out of timing, and the adaptive engine's start-up (it
    # times every step width) happens once per batch size, reported as its start-up; later engines reuse it.
    warm = {name: run_ours(pair, mode, pair.prompts[:rows], max_new_tokens=8, **run) for name, mode in modes.items()}
    ours_runs = {name: [] for name in modes}
    for repeat in range(args.repeats):  # interleaved: our modes see the same machine state
        for name, mode in modes.items():
            r = run_ours(pair, mode, pair.prompts, max_new_tokens=args.max_new_tokens,
                         width_costs=warm[name]["width_costs"], **run)
            ours_runs[name].append(r)
            print(f"{name} at {rows} rows, repeat {repeat}: {r['tokens'] / r['seconds']:.0f} tok/s", file=sys.stderr,
                  flush=True)
    loads[f"after ours at {rows} rows"] = os.getloadavg()[0]
    reference = ours_runs["ours-target-only"][0]["token_ids"]
    for name, runs in ours_runs.items():  # lossless: every run of every mode gives target-only's greedy tokens
        assert all(r["token_ids"] == reference for r in runs), \
            f"{name} at {rows} rows: output differs from our target-only"
    entries = [summarize(name, runs, batch_size=rows, startup_s=round(warm[name]["startup_s"], 1),
                         greedy_agreement_with_ours=agreement(reference, runs[-1]["token_ids"]))
               for name, runs in ours_runs.items()]
    vllm_results = {}
    for mode in vllm_modes:
        res = vllm_results[mode] = run_vllm(mode, args, pair, rows, args.workdir)
        print(f"{mode} at {rows} rows: {[round(r['tokens'] / r['seconds']) for r in res['runs']]} tok/s, "
              f"{res.get('error', 'ok')}", file=sys.stderr, flush=True)
        loads[f"after {mode} at {rows} rows"] = os.getloadavg()[0]
        if not res.get("error"):
            entries.append(summarize(mode, res["runs"], batch_size=rows, startup_s=round(res["startup_s"], 1),
                                     greedy_agreement_with_ours=agreement(reference, res["runs"][0]["token_ids"]),
                                     kernel_libraries=res.get("kernel_libraries")))
    by_mode = {e["mode"]: e for e in entries}
    vllm_base, ours_base = by_mode.get("vllm-target-only"), by_mode["ours-target-only"]
    for e in entries:
        e["vs_vllm_target_only"] = (round(e["median_tokens_per_s"] / vllm_base["median_tokens_per_s"], 2)
                                    if vllm_base else None)
        e["vs_ours_target_only"] = round(e["median_tokens_per_s"] / ours_base["median_tokens_per_s"], 2)
    return entries, vllm_results


def print_table(entries: list, vllm_results: dict, args, rows: int, loads: dict, cpu: dict):
    stopping = "ignore_eos" if args.ignore_eos else "stopping at EOS"
    print(f"\n{args.pair} pair on {cpu['label']}, {args.dtype}, {rows} rows: {args.prompts} prompts x "
          f"{args.max_new_tokens} greedy new tokens at most ({stopping}), {args.threads} threads, "
          f"{args.repeats} repeat(s), "
          f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', 'unset')}; "
          + (f"vLLM with Intel OpenMP {'preloaded' if args.vllm_preload_iomp else 'not preloaded'}; "
             if vllm_results else "") + f"load average {loads}")
    print(f"{'mode':<18} {'tok/s (each repeat)':>24} {'tokens':>7} {'vs vLLM':>8} {'vs ours':>8} {'tau':>5} "
          f"{'start-up':>9}  agreement")
    for e in entries:
        tps = " / ".join(f"{x:.0f}" for x in e["tokens_per_s"])
        vs = f"{e['vs_vllm_target_only']:.2f}" if e["vs_vllm_target_only"] else "-"
        tau = f"{e['mean_acceptance_length']:.2f}" if e["mean_acceptance_length"] else "-"
        up = f"{e['startup_s']:.1f} s"
        agree = e["greedy_agreement_with_ours"]
        print(f"{e['mode']:<18} {tps:>24} {e['tokens']:>7} {vs:>8} {e['vs_ours_target_only']:>8.2f} {tau:>5} {up:>9}  "
              f"{agree['equal']}/{agree['total']} equal to ours, mean common prefix {agree['mean_common_prefix']}")
    for mode, res in vllm_results.items():
        if res.get("error"):
            print(f"{mode:<18} did not run: {res['error'][:300]}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pair", choices=tuple(PAIRS), default="demo", help="the workload: see the module docstring")
    p.add_argument("--assets", type=Path, default=None, help="draft + prompts directory (default: the pair's)")
    p.add_argument("--prompts", type=int, default=None, help="default: the pair's (demo 300, smollm2 32)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--rows", default=None, help="sequences at a time (our max_rows, vLLM max_num_seqs), a list: "
                                                "each is measured for every mode (default: demo 16, smollm2 1,16)")
    p.add_argument("--domino-widths", default=None,
                   help="our Domino modes: auto (adaptive width), max (fixed K, the most the draft proposes) or a K "
                        "(default: demo max, smollm2 auto,max)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                   help="ours and vLLM's: bfloat16 is vLLM's CPU default; ours then streams bf16 weights with fp32 "
                        "activations (docs/cpu-kernels.md); run once per dtype, one after the other")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--ngram-tokens", type=int, default=8)
    p.add_argument("--dflash-tokens", type=int, default=7, help="vLLM's DFlash verifies block_size - 1 drafts")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="positions per sequence, ours and vLLM's (default: demo 256, the target's; smollm2 1024)")
    p.add_argument("--vllm-python", type=Path, default=ROOT / ".venv-vllm" / "bin" / "python")
    p.add_argument("--vllm-modes", default=None, help="default: the ones that can run the pair")
    p.add_argument("--vllm-timeout", type=int, default=1800)
    p.add_argument("--vllm-preload-iomp", action=argparse.BooleanOptionalAction, default=True,
                   help="LD_PRELOAD the venv's Intel OpenMP for vLLM, as its CPU docs ask")
    p.add_argument("--isa", choices=("native", "avx2"), default="native",
                   help="avx2: both engines as on an AVX2-only CPU, on an AVX-512 machine (see the module docstring)")
    p.add_argument("--ours-only", action="store_true", help="skip vLLM (no .venv-vllm needed)")
    p.add_argument("--profile", action="store_true", help="also profile one decode step of each of our modes and "
                                                          "of vLLM target-only at the largest --rows")
    p.add_argument("--profile-steps", type=int, default=16, help="steady-state steps timed and profiled")
    p.add_argument("--workdir", type=Path, default=ROOT / "out" / "bench_peers", help="vLLM specs, outputs, logs")
    p.add_argument("--json", type=Path, default=None, help="also write the results here")
    p.add_argument("--vllm-worker", nargs=2, type=Path, metavar=("SPEC", "OUT"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.vllm_worker:
        return vllm_worker(*args.vllm_worker)
    workload = PAIRS[args.pair]
    for key in ("prompts", "rows", "max_model_len", "domino_widths"):
        if getattr(args, key) is None:
            setattr(args, key, workload[key])
    args.ignore_eos = workload["ignore_eos"]
    args.vllm_modes = ",".join(workload["vllm_modes"]) if args.vllm_modes is None else args.vllm_modes
    args.workdir = args.workdir.resolve()  # the worker runs in workdir
    batch_sizes = [int(r) for r in str(args.rows).split(",") if r]
    vllm_modes = [] if args.ours_only else [m for m in args.vllm_modes.split(",") if m]
    unavailable = sorted(set(vllm_modes) - set(workload["vllm_modes"]))
    if unavailable:
        raise SystemExit(f"--vllm-modes: {unavailable} cannot run --pair {args.pair}; choose from "
                         f"{', '.join(workload['vllm_modes'])}")
    args.vllm_python = args.vllm_python.absolute()  # the worker runs in the workdir; not resolve(): a venv's python is a link
    if vllm_modes and not args.vllm_python.exists():
        raise SystemExit(f"{args.vllm_python} is missing: run `make peers-venv` first, or pass --ours-only")
    if vllm_modes and args.vllm_preload_iomp and not iomp_library(args.vllm_python).exists():
        raise SystemExit(f"{iomp_library(args.vllm_python)} is missing (vLLM's CPU wheel installs it): reinstall with "
                         "`make peers-venv`, or pass --no-vllm-preload-iomp")

    if args.isa == "avx2":
        os.environ.update(AVX2_ENV)  # before torch's first op and our kernels' build, both read them once
    import torch

    from common import load_pair
    from domino_ray.backend.library import compile_flags, kernels_loaded

    if args.isa == "avx2" and torch.backends.cpu.get_cpu_capability() != "AVX2":
        raise SystemExit(f"--isa avx2: torch runs {torch.backends.cpu.get_cpu_capability()} kernels (set "
                         "ATEN_CPU_CAPABILITY=avx2 before it starts)")
    torch.set_num_threads(args.threads)
    pair = load_pair(args.pair, args.assets and args.assets.resolve(), args.prompts, args.dtype)
    longest = max(map(len, pair.prompts)) + args.max_new_tokens
    if longest > args.max_model_len:
        raise SystemExit(f"--max-model-len {args.max_model_len}: the longest prompt plus {args.max_new_tokens} new "
                         f"tokens needs {longest}")
    modes = our_modes(pair, args.domino_widths)
    if vllm_modes:
        args.workdir.mkdir(parents=True, exist_ok=True)
    if "vllm-dflash-no-head" in vllm_modes:
        draft_without_head(pair.draft_dir, args.workdir / "draft-no-head")
    loads = {"start": os.getloadavg()[0]}
    cpu = this_cpu(args.isa)
    entries, vllm_results = [], {}
    for rows in batch_sizes:
        batch_entries, batch_vllm = measure_batch(pair, modes, vllm_modes, args, rows, loads)
        entries += [{**e, "cpu": cpu["label"]} for e in batch_entries]  # each figure with the CPU it was measured on
        vllm_results.update({(mode, rows): res for mode, res in batch_vllm.items()})
        print_table(batch_entries, batch_vllm, args, rows, loads, cpu)
    profiles = [profile_ours_step(pair, name, mode, pair.prompts, rows=max(batch_sizes), steps=args.profile_steps,
                                  max_model_len=args.max_model_len)
                for name, mode in modes.items()] if args.profile else []
    if args.profile and "vllm-target-only" in vllm_modes:
        res = run_vllm("vllm-target-only", args, pair, max(batch_sizes), args.workdir, args.profile_steps)
        if res.get("error"):
            print(f"vLLM's step profile did not run: {res['error'][:300]}", file=sys.stderr)
        else:
            profiles.append(res["profile"])
    for prof in profiles:
        prof["cpu"] = cpu["label"]
        print(f"\nprofile, {prof['mode']}, {prof['rows']} rows on {cpu['label']}: "
              f"{prof['wall_ms_per_step']} ms/step ({prof['profiled_ms_per_step']} under the profiler), "
              f"{prof['op_calls_per_step']} op calls/step; self CPU ms/step {prof['self_cpu_ms_per_step']}, "
              f"python+dispatch {prof['python_and_dispatch_ms_per_step']}")
        for op in prof["top_ops"][:8]:
            print(f"    {op['op']:<40} {op['ms_per_step']:>8.3f} ms {op['calls_per_step']:>7.1f} calls")
    meta = {"machine": f"{cpu['model']}, {os.cpu_count()} CPUs", "cpu": cpu,
            "torch": torch.__version__, "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "load_average": loads,
            "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"), "vllm_env": VLLM_ENV if vllm_modes else None,
            "isa_env": AVX2_ENV if args.isa == "avx2" else None,
            "aten_capability": torch.backends.cpu.get_cpu_capability(),
            "our_kernel_flags": compile_flags() if kernels_loaded() else None,
            "vllm_ld_preload": str(iomp_library(args.vllm_python)) if vllm_modes and args.vllm_preload_iomp else None,
            "args": {k: str(v) for k, v in vars(args).items()}}
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        errors = [{"mode": mode, "batch_size": rows, **{k: r[k] for k in ("error", "traceback", "log") if k in r}}
                  for (mode, rows), r in vllm_results.items() if r.get("error")]
        args.json.write_text(json.dumps({"meta": meta, "results": entries, "vllm_errors": errors,
                                         "profiles": profiles}, indent=1) + "\n")


if __name__ == "__main__":
    main()
