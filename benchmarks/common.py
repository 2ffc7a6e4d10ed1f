"""Shared by the benchmarks: the shipped pairs and their prompts, what every run records next to its figures
(the machine, torch, the date and the command's arguments), the median of timed passes, and decode steps timed
under settings that alternate in one engine."""

from __future__ import annotations

import hashlib
import json
import platform
import time
from pathlib import Path
from typing import NamedTuple

import torch


def run_meta(args) -> dict:
    return {"machine": f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} torch threads",
            "torch": torch.__version__, "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "args": vars(args)}


def median_ms(fn, passes: int = 5) -> float:
    """The median of `passes` timed calls of `fn` after one untimed warm-up call, in ms."""
    fn()
    times = []
    for _ in range(passes):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2] * 1e3


def alternating_decode_steps(rows: int, settings, detail: str = "", rounds: int = 4, steps: int = 6,
                             pair_name: str = "smollm2"):
    """Our engine's steady decode step on a shipped pair (`load_pair`: the SmolLM2 pair by default, make smollm2),
    target-only, `rows` of its prompts, under each of `settings(engine)` (name -> a function applying it) in turn
    for `steps` timed steps (after one untimed), `rounds` times, in one process; prints ms per step."""
    from domino_ray.engine.request import Request
    from domino_ray.llm import build_engine
    from domino_ray.sample.params import SamplingParams

    pair = load_pair(pair_name, num_prompts=rows, dtype="float32")
    engine = build_engine(pair.target, None, pair.tokenizer, max_batch_size=rows, max_model_len=1024)
    named = settings(engine)
    params = SamplingParams(max_new_tokens=rounds * len(named) * (steps + 1) + 3, ignore_eos=True)
    for i, prompt in enumerate(pair.prompts[:rows]):
        engine.add_request(Request(i, prompt, params))
    engine.step()  # prefill
    engine.step()
    print(f"{pair_name} pair target-only decode step, {rows} rows{detail}, {torch.get_num_threads()} threads")
    for _ in range(rounds):
        for name, apply in named.items():
            apply()
            engine.step()
            start = time.perf_counter()
            for _ in range(steps):
                engine.step()
            print(f"  {name}: {(time.perf_counter() - start) / steps * 1e3:.1f} ms/step")


def token_digest(rows: list[list[int]]) -> str:
    """The generated token ids of every row, in request order, as a short hash for the --json output: runs whose
    outputs must be equal (speculative and target-only) compare it, and the report stays small."""
    return hashlib.sha256(json.dumps([list(map(int, row)) for row in rows]).encode()).hexdigest()[:16]


def write_results(path: Path | None, results: dict, args) -> None:
    """`{"meta": ..., "results": ...}` as JSON at `path` (nothing when None)."""
    if path:
        path.write_text(json.dumps({"meta": run_meta(args), "results": results}, indent=1, default=str) + "\n")


SMOLLM2_ASSETS = Path(__file__).resolve().parents[1] / "domino_ray" / "assets" / "smollm2"


class Pair(NamedTuple):
    target: object
    draft: object
    tokenizer: object
    prompts: list     # prompt token ids
    target_dir: str   # the checkpoints' directories (what a peer engine loads)
    draft_dir: Path
    groups: list      # per prompt: how it is held out and its source group ("source: pkg"), when the file says


def load_pair(name: str = "demo", assets: Path | None = None, num_prompts: int = 0, dtype: str | None = None) -> Pair:
    """A shipped pair: `demo` (domino_ray/assets/demo, plain prompts, no chat template) or `smollm2` (the target
    converted by `make smollm2`, float32, with the draft and held-out chat prompts of domino_ray/assets/smollm2).
    `assets`: another draft + prompts directory; `num_prompts` 0: all; `dtype`: the target's and draft's
    (default: float32 for smollm2, the checkpoint's for demo). Exits saying what to run when SmolLM2
    is not converted."""
    import pyarrow.parquet as pq

    from domino_ray.config import DEMO_ASSETS
    from domino_ray.target.loading import encode_prompt, load_target, load_tokenizer
    from domino_ray.spec_decode.checkpoint import load_draft

    if name == "smollm2":
        from domino_ray.target.smollm2 import cache_dir, is_converted

        if not is_converted():
            raise SystemExit(f"error: SmolLM2 is not converted at {cache_dir()}: run `make smollm2` first")
        assets, target_dir = assets or SMOLLM2_ASSETS, str(cache_dir())
    else:
        assets = assets or DEMO_ASSETS
        target_dir = str(assets / "target")
    target = load_target(target_dir, dtype=dtype or ("float32" if name == "smollm2" else "auto"), device="cpu")
    tokenizer = load_tokenizer(target_dir)
    draft = load_draft(assets / "draft", target_config=target.config, dtype=target.dtype)
    table = pq.read_table(assets / "prompts.parquet")
    chat = "messages" in table.column_names  # chat prompts: the chat template path
    texts = table.column("messages" if chat else "prompt").to_pylist()
    if num_prompts > len(texts):
        raise ValueError(f"{num_prompts} prompts asked: {assets} ships only {len(texts)}")
    prompts = [encode_prompt(tokenizer, messages=t) if chat else encode_prompt(tokenizer, prompt=t, chat_template=False)
               for t in texts[:num_prompts or None]]
    groups = [f"{how}: {source.split(':')[0]}" for how, source in
              zip(table.column("held_out").to_pylist(), table.column("source").to_pylist())] \
        if {"held_out", "source"} <= set(table.column_names) else ["all"] * len(texts)
    return Pair(target, draft, tokenizer, prompts, target_dir, assets / "draft", groups[:len(prompts)])


def demo_pair(assets: Path):
    """(target, draft, tokenizer, prompt token ids) of the pair in `assets` (plain prompts, no chat template)."""
    return tuple(load_pair("demo", assets)[:4])
