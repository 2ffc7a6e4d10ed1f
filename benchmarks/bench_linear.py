"""Packed-weight GEMMs on CPU (`domino_ray/cpu_linear.py`): `F.linear` against MKL's packed op.

Two measurements (BENCHMARKS.md "Packed weights"):
- `sweep` (default): the projections of a SmolLM2-shaped decoder (30 layers x q/k/v/o/gate/up/down + the LM
  head, random fp32 weights, each read once per pass) at each row count, plain and packed for each batch;
  median of 5 passes, in ms.
- `--engine ROWS`: our engine's steady-state decode step on the SmolLM2 pair (make smollm2), target-only,
  ROWS chat prompts, switching the same modules between packed and plain every few steps, in one process.

    python benchmarks/bench_linear.py [--rows 1,4,16,64] [--packed-for 4,16,64,256] [--layers 30]
    python benchmarks/bench_linear.py --engine 16 [--packed-for 64]
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from common import alternating_decode_steps, median_ms

# SmolLM2-135M: hidden 576, 3 K/V heads of 64, MLP 1536, 30 layers, vocabulary 49152 (out, in).
LAYER_SHAPES = [(576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536)]
LAYERS, HEAD = 30, (49152, 576)


def sweep(rows: list[int], packed_for: list[int], layers: int = LAYERS, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    shapes = LAYER_SHAPES * layers + [HEAD]
    weights = [torch.randn(s, generator=gen) for s in shapes]

    def passes(m: int, packed=None) -> float:
        inputs = {k: torch.randn(m, k, generator=gen) for k in {w.shape[1] for w in weights}}
        if packed is None:
            return median_ms(lambda: [F.linear(inputs[w.shape[1]], w) for w in weights])
        return median_ms(lambda: [torch.ops.mkl._mkl_linear(inputs[w.shape[1]], p, w, None, m)
                                  for w, p in zip(weights, packed)])

    threads = torch.get_num_threads()
    print(f"{len(weights)} projections of a SmolLM2-shaped decoder, fp32, {threads} threads; ms per pass")
    print(f"{'rows per call':>16}" + "".join(f"{m:>8}" for m in rows))
    with torch.inference_mode():
        print(f"{'F.linear':>16}" + "".join(f"{passes(m):8.1f}" for m in rows))
        for batch in packed_for:
            packed = [torch.ops.mkl._mkl_reorder_linear_weight(w, batch) for w in weights]
            print(f"{f'packed for {batch}':>16}" + "".join(f"{passes(m, packed):8.1f}" for m in rows))
        print(f"{'F.linear':>16}" + "".join(f"{passes(m):8.1f}" for m in rows))


def engine_steps(rows: int, packed_for: int):
    from domino_ray import cpu_linear

    def settings(engine):
        packed = [m for part in (engine.layers, engine.lm_head) for m in part.modules()
                  if isinstance(m, cpu_linear.PackedLinear)]
        if not packed:
            raise SystemExit("the engine packed nothing (not fp32 on CPU, no MKL, or not enough memory)")

        def use(cls):
            for m in packed:
                m.__class__ = cls
        return {"packed": lambda: use(cpu_linear.PackedLinear), "plain": lambda: use(torch.nn.Linear)}

    cpu_linear.PACKED_FOR = packed_for
    alternating_decode_steps(rows, settings, f", packed for {packed_for}")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default="1,2,4,8,16,32,64,144,256")
    p.add_argument("--packed-for", default=None,
                   help="batches to pack for: the sweep's (default 4,16,64,256), --engine's one (default the engine's)")
    p.add_argument("--engine", type=int, default=0, metavar="ROWS", help="time our engine's step instead")
    p.add_argument("--layers", type=int, default=LAYERS, help="sweep: decoder layers (fewer: a quick look)")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    if args.engine:
        from domino_ray.cpu_linear import PACKED_FOR
        engine_steps(args.engine, int(args.packed_for or PACKED_FOR))
    else:
        sweep([int(r) for r in args.rows.split(",")], [int(b) for b in (args.packed_for or "4,16,64,256").split(",")],
              args.layers)


if __name__ == "__main__":
    main()
