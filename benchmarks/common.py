"""Shared by the benchmarks: the shipped demo pair and its prompts, and what every run records next to its
figures (the machine, torch, the date and the command's arguments)."""

from __future__ import annotations

import json
import platform
import time
from pathlib import Path

import torch


def run_meta(args) -> dict:
    return {"machine": f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} torch threads",
            "torch": torch.__version__, "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "args": vars(args)}


def write_results(path: Path | None, results: dict, args) -> None:
    """`{"meta": ..., "results": ...}` as JSON at `path` (nothing when None)."""
    if path:
        path.write_text(json.dumps({"meta": run_meta(args), "results": results}, indent=1, default=str) + "\n")


def demo_pair(assets: Path):
    """(target, draft, tokenizer, prompt token ids) of the pair in `assets` (plain prompts, no chat template)."""
    import pyarrow.parquet as pq

    from domino_ray.checkpoint import load_draft
    from domino_ray.target import encode_prompt, load_target, load_tokenizer

    target = load_target(str(assets / "target"), dtype="auto", device="cpu")
    tokenizer = load_tokenizer(str(assets / "target"))
    draft = load_draft(assets / "draft", target_config=target.config, dtype=target.dtype)
    texts = pq.read_table(assets / "prompts.parquet").column("prompt").to_pylist()
    return target, draft, tokenizer, [encode_prompt(tokenizer, prompt=t, chat_template=False) for t in texts]
