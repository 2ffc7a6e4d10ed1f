"""Decode attention on CPU (`domino_ray/backend/library.py`): our kernel over the paged KV pool against torch's SDPA
under the mask over the same keys gathered.

Two measurements (docs/benchmarks-log.md "Our decode-attention kernel"):
- `sweep` (default): one decode step's attention over every layer of a model's shape (random fp32 K/V pools
  `[N, Hkv, bs, D]` a layer, each row's blocks a random permutation of the pool's, each layer's read once per
  pass, so from memory as in a real step), `--rows` rows, each at key lengths `--keys` (limits a little under them)
  and `--positions` query positions per row (1: target-only decode; W+1: a verify step); median of 7 passes in ms,
  and the K/V bytes read per ms as GB/s. The baseline gathers each row's blocks into dense keys, then SDPA (what
  torch's ops do over pages).
- `--engine ROWS`: our engine's steady decode step on the SmolLM2 pair (make smollm2; `--pair demo`: the
  demo pair), target-only, ROWS prompts, switching between the kernel and SDPA every few steps, in one process.

    python benchmarks/bench_attention.py [--model smollm2|qwen3-4b] [--rows 16] [--keys 128,256,512,1024]
                                         [--block-size 16]
    python benchmarks/bench_attention.py --engine 16 [--rounds 4]
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from common import alternating_decode_steps, median_ms

# (layers, K/V heads, query heads per K/V head, head dim)
MODELS = {"smollm2": (30, 3, 3, 64), "qwen3-4b": (36, 8, 4, 128)}


def sweep(model: str, rows: int, keys: list[int], positions: list[int], block_size: int, seed: int = 0):
    from domino_ray.backend import ops
    from domino_ray.backend.library import kernels_loaded

    op = ops.decode_attention
    if not kernels_loaded():
        raise SystemExit("the kernel did not build here (see the warning above)")
    layers, heads, groups, dim = MODELS[model]
    gen = torch.Generator().manual_seed(seed)
    per_row = -(-max(keys) // block_size)
    blocks = 1 + rows * per_row  # block 0: the null block
    pools = torch.randn(2, layers, blocks, heads, block_size, dim, generator=gen)  # K, V: [2, L, N, Hkv, bs, D]
    tables = (1 + torch.randperm(blocks - 1, generator=gen)).view(rows, per_row).to(torch.int32)  # [R, nb]
    print(f"{model}: {layers} layers x {rows} rows x {heads} K/V heads x {groups} query heads each, head dim {dim}, "
          f"blocks of {block_size}, fp32, {torch.get_num_threads()} threads; ms per step's attention (K/V GB/s)")
    print(f"{'keys':>6} {'positions':>9} {'gather + SDPA':>16} {'our kernel':>16} {'speed-up':>9}")
    for t in keys:
        nb = -(-t // block_size)
        table = tables[:, :nb].contiguous()                                                   # [R, nb]
        ids = table.long()
        for q in positions:
            lens = torch.randint(max(0, t - 31), t - q + 1, (rows,), generator=gen)              # [R]
            limits = (lens[:, None] + 1 + torch.arange(q)).repeat(1, groups)                    # [R, G*q]
            mask = torch.arange(nb * block_size) < limits[:, None, :, None]                     # [R, 1, G*q, nb*bs]
            query = torch.randn(rows, heads, groups * q, dim, generator=gen)

            def dense(pool):  # [N, Hkv, bs, D] -> each row's keys [R, Hkv, nb*bs, D]
                return pool[ids].transpose(1, 2).reshape(rows, heads, nb * block_size, dim)

            sdpa = median_ms(lambda: [F.scaled_dot_product_attention(query, dense(pools[0, i]), dense(pools[1, i]),
                                                                     attn_mask=mask, scale=dim ** -0.5)
                                      for i in range(layers)], passes=7)
            ours = median_ms(lambda: [op(query, pools[0, i], pools[1, i], table, limits, dim ** -0.5)
                                      for i in range(layers)], passes=7)
            gb = 2 * layers * rows * heads * t * dim * 4 / 1e6  # K/V bytes per step, in MB (per ms = GB/s)
            # three significant digits: on a loaded machine a slow step's rate would print as 0.0 to one decimal
            print(f"{t:>6} {q:>9} {sdpa:9.3g} ({gb / sdpa:4.3g}) {ours:9.3g} ({gb / ours:4.3g}) {sdpa / ours:8.2f}x")


def engine_steps(rows: int, rounds: int = 4, pair: str = "smollm2"):
    def settings(engine):
        if not engine.runner.kv.kernel:
            raise SystemExit("the engine's attention is not our kernel here (not fp32 on CPU, or it did not build)")

        def use(kernel: bool):
            engine.runner.kv.kernel = kernel  # what kv_cache.group_visibility reads each forward
        return {"our kernel": lambda: use(True), "SDPA + mask": lambda: use(False)}

    alternating_decode_steps(rows, settings, rounds=rounds, pair_name=pair)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=sorted(MODELS), default="smollm2")
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--keys", default="128,256,512,1024")
    p.add_argument("--positions", default="1,4,9", help="query positions per row: 1 = decode, W+1 = verify")
    p.add_argument("--block-size", type=int, default=16, help="positions per KV block (a power of two, from 8)")
    p.add_argument("--engine", type=int, default=0, metavar="ROWS", help="time our engine's step instead")
    p.add_argument("--rounds", type=int, default=4, help="--engine: rounds through the settings")
    p.add_argument("--pair", choices=("smollm2", "demo"), default="smollm2", help="--engine: the shipped pair")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    if args.engine:
        engine_steps(args.engine, args.rounds, args.pair)
    else:
        with torch.inference_mode():
            sweep(args.model, args.rows, [int(k) for k in args.keys.split(",")],
                  [int(q) for q in args.positions.split(",")], args.block_size)


if __name__ == "__main__":
    main()
