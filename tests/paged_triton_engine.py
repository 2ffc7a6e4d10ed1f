"""Run by tests/test_paged_triton.py in a fresh process with TRITON_INTERPRET=1: the engine with its attention on the
Triton kernel (`KVPool.triton`, as on CUDA; here under the interpreter on CPU), greedy speculative and target-only
over ragged rows in a small pool, prompts in chunks, against HF's greedy tokens. Prints one JSON line."""

import json
import os
import sys
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from domino_ray.engine.request import Request  # noqa: E402
from domino_ray.engine.core import SpecEngine  # noqa: E402
from domino_ray.spec_decode.proposer import DominoProposer  # noqa: E402
from domino_ray.sample.params import SamplingParams  # noqa: E402
from paged_triton_cases import patch_interpreter_index  # noqa: E402
from tiny_models import hf_greedy, ragged_prompts, tiny_draft, tiny_target  # noqa: E402


def main():
    patch_interpreter_index()
    torch.set_num_threads(1)
    target = tiny_target("qwen3", dtype=torch.float32, head_dim=16)
    prompts = ragged_prompts(2, seed=4, min_len=10, max_len=30)
    new = 6
    out, calls = {}, []
    from domino_ray.backend import paged_triton
    kernel = paged_triton.paged_attention
    paged_triton.paged_attention = lambda *a: calls.append(a[3].dtype) or kernel(*a)
    for name, proposer in (("target_only", None), ("speculative", DominoProposer(tiny_draft(target), target))):
        engine = SpecEngine(target, proposer, max_rows=2, max_model_len=64, kv_block_size=8, kv_cache_tokens=80,
                            max_prefill_tokens=16)
        pools = [engine.runner.kv] + ([proposer.kv] if proposer is not None else [])
        for pool in pools:  # the CUDA path: our Triton kernel reads the blocks (the gather path would otherwise)
            pool.kernel, pool.triton = False, True
        engine.gathers = False
        done = engine.generate([Request(i, p, SamplingParams(max_new_tokens=new, ignore_eos=True))
                                for i, p in enumerate(prompts)])
        out[name] = {"tokens": [c.token_ids for c in done], **engine.kv_cache_stats()}
    out["hf"] = [hf_greedy(target, p, new) for p in prompts]
    out["kernel_calls"] = len(calls)
    out["table_dtypes"] = sorted({str(d) for d in calls})
    print(json.dumps(out))


if __name__ == "__main__":
    main()
