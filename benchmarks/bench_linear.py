"""Linear layers on CPU at decode batch sizes (`domino_ray/target/packed_linear.py`): `F.linear`, MKL's packed GEMM and our
kernel (`csrc/linear.cpp`).

Two measurements (docs/benchmarks-log.md "Our layer ops and linear kernel"):
- `sweep` (default): the projections of a SmolLM2-shaped decoder (30 layers x q/k/v/o/gate/up/down + the LM
  head, random weights rounded to bf16, each read once per pass) at each row count: `F.linear`, MKL's packed op
  (weights packed for 64 rows, what the engine used before our kernel), ours over fp32 panels and ours over bf16
  panels (`model.dtype: bfloat16` on CPU: the same numbers, half the bytes); median of 5 passes, in ms.
- `--engine ROWS`: our engine's steady-state decode step on the SmolLM2 pair (make smollm2; `--pair demo`: the
  demo pair), target-only, ROWS prompts, switching the same modules every few steps, in one process, between
  "ours" (what the engine runs: our kernel up to 1,024 rows), "MKL packed" (MKL's for 4-128 rows, as before our
  kernel) and "plain" (`F.linear`).

    python benchmarks/bench_linear.py [--rows 1,4,16,64] [--layers 30]
    python benchmarks/bench_linear.py --engine 16
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch import nn

from common import alternating_decode_steps, median_ms

# SmolLM2-135M: hidden 576, 3 K/V heads of 64, MLP 1536, 30 layers, vocabulary 49152 (out, in).
LAYER_SHAPES = [(576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536)]
LAYERS, HEAD = 30, (49152, 576)
MKL_PACKED_FOR = 64  # the batch MKL's packing was made for when the engine used it (4-128 rows)


class MKLPackedLinear(nn.Linear):
    """For comparison: MKL's packing (`mkl_weight`, set by `engine_steps`) for 4-128 rows, as the engine ran before our
    kernel."""

    def forward(self, x):
        rows = x.numel() // self.in_features
        if not 4 <= rows <= 128:
            return F.linear(x, self.weight, self.bias)
        return torch.ops.mkl._mkl_linear(x, self.mkl_weight, self.weight, self.bias, rows)


def sweep(rows: list[int], layers: int = LAYERS, seed: int = 0):
    from domino_ray.backend import ops
    from domino_ray.backend.library import kernels_loaded

    if not kernels_loaded():
        raise SystemExit("our CPU kernels did not build here (see the warning above)")
    gen = torch.Generator().manual_seed(seed)
    shapes = LAYER_SHAPES * layers + [HEAD]
    weights = [(torch.randn(s, generator=gen) / s[1] ** 0.5).bfloat16().float() for s in shapes]  # bf16-valued
    mkl = [torch.ops.mkl._mkl_reorder_linear_weight(w, MKL_PACKED_FOR) for w in weights]
    ours = [ops.pack_linear(w) for w in weights]
    ours_bf16 = [ops.pack_linear(w.bfloat16()) for w in weights]
    kernels = {
        "F.linear": lambda x, i, m: F.linear(x, weights[i]),
        "MKL packed": lambda x, i, m: torch.ops.mkl._mkl_linear(x, mkl[i], weights[i], None, m),
        "ours": lambda x, i, m: ops.linear(x, ours[i], weights[i].shape[0], None),
        "ours bf16": lambda x, i, m: ops.linear(x, ours_bf16[i], weights[i].shape[0], None),
    }

    def passes(m: int, kernel) -> float:
        inputs = {k: torch.randn(m, k, generator=gen) for k in {w.shape[1] for w in weights}}
        return median_ms(lambda: [kernel(inputs[w.shape[1]], i, m) for i, w in enumerate(weights)])

    threads = torch.get_num_threads()
    print(f"{len(weights)} projections of a SmolLM2-shaped decoder, fp32 activations, {threads} threads; ms per pass")
    print(f"{'rows per call':>16}" + "".join(f"{m:>8}" for m in rows))
    with torch.inference_mode():
        for name, kernel in [*kernels.items(), ("F.linear", kernels["F.linear"])]:  # F.linear again: drift
            print(f"{name:>16}" + "".join(f"{passes(m, kernel):8.1f}" for m in rows), flush=True)


def engine_steps(rows: int, rounds: int = 4, pair: str = "smollm2"):
    from domino_ray.target import packed_linear

    def settings(engine):
        packed = [m for part in (engine.layers, engine.lm_head) for m in part.modules()
                  if isinstance(m, packed_linear.PackedLinear)]
        if not packed:
            raise SystemExit("the engine packed nothing (not fp32 on CPU, our kernels did not build, or not enough "
                             "memory)")

        for m in packed:  # MKL's copy, for the comparison only (the engine keeps none)
            m.mkl_weight = torch.ops.mkl._mkl_reorder_linear_weight(m.weight.detach(), MKL_PACKED_FOR)

        def use(cls):
            for m in packed:
                m.__class__ = cls
        return {"ours": lambda: use(packed_linear.PackedLinear), "MKL packed": lambda: use(MKLPackedLinear),
                "plain": lambda: use(torch.nn.Linear)}

    alternating_decode_steps(rows, settings, "", rounds=rounds, pair_name=pair)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default="1,2,4,8,16,32,64,144,256")
    p.add_argument("--engine", type=int, default=0, metavar="ROWS", help="time our engine's step instead")
    p.add_argument("--rounds", type=int, default=4, help="--engine: rounds through the settings")
    p.add_argument("--pair", choices=("smollm2", "demo"), default="smollm2", help="--engine: the shipped pair")
    p.add_argument("--layers", type=int, default=LAYERS, help="sweep: decoder layers (fewer: a quick look)")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    if args.engine:
        engine_steps(args.engine, args.rounds, args.pair)
    else:
        sweep([int(r) for r in args.rows.split(",")], args.layers)


if __name__ == "__main__":
    main()
