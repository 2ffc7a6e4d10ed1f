"""bf16 on CPU: our linear kernel over bf16 panels, `model.dtype: bfloat16` through `build_engine` (fp32 activations,
bf16 weights), `model.dtype: auto`, and the near-tie rule in real bf16 (torch's bf16 ops: what a GPU's bf16 is like).

Invariants: bf16 panels compute what fp32 panels of the same (bf16-valued) weights compute, bit for bit, and a row's
outputs do not depend on its batch; greedy speculative equals target-only in the bf16 engine; where real bf16 makes
them part, the parting token is one the engine counted as a near-tie.
"""

from __future__ import annotations

import pyarrow.parquet as pq
import pytest
import torch

from domino_ray.backend.library import has_bf16_arithmetic, kernels_loaded
from domino_ray.engine.request import Request
from domino_ray.engine.core import SpecEngine
from domino_ray.llm import build_engine
from domino_ray.target.packed_linear import PackedLinear, keep_bf16_weights
from domino_ray.target.smollm2 import cache_dir
from domino_ray.target.loading import cpu_auto_dtype, encode_prompt, load_target, load_tokenizer
from domino_ray.spec_decode.checkpoint import load_draft
from domino_ray.spec_decode.proposer import DominoProposer
from domino_ray.sample.params import SamplingParams
from domino_ray.spec_decode.verify import TIE_ULPS, near_tie_mask
from tests.test_smollm2_pair import ASSETS, needs_draft, needs_target
from tests.tiny_models import ragged_prompts, tiny_draft, tiny_target

needs_kernels = pytest.mark.skipif(not kernels_loaded(), reason="our CPU kernels did not build")


@needs_kernels
@pytest.mark.parametrize("n, k", [(1536, 576), (100, 70), (17, 64)])
def test_bf16_panels_compute_what_fp32_panels_of_the_same_weights_compute(n, k):
    from domino_ray.backend import ops

    gen = torch.Generator().manual_seed(n)
    weight = (torch.randn(n, k, generator=gen) / 24).bfloat16()
    bias = torch.randn(n, generator=gen)
    bf16, fp32 = ops.pack_linear(weight), ops.pack_linear(weight.float())
    assert bf16.dtype == torch.bfloat16 and bf16.numel() == fp32.numel()
    for rows in (1, 7, 33, 100):
        x = torch.randn(rows, k, generator=gen)
        out = ops.linear(x, bf16, n, bias)
        assert torch.equal(out, ops.linear(x, fp32, n, bias))  # the same sums in the same order
        exact = x.double() @ weight.double().T + bias.double()
        assert (out.double() - exact).abs().max() < 1e-5  # fp32 sums of ~k products of size ~0.05
        assert torch.equal(ops.linear(x[-1:], bf16, n, bias)[0], out[-1])  # a row alone = the row in a batch


@needs_kernels
def test_attention_over_a_bf16_pool_is_attention_over_its_values():
    """Keys and values rounded to bf16 once as they are written (as torch rounds), widened exactly as read: the output
    equals the fp32 kernel's over an fp32 pool holding the same values, bit for bit."""
    from domino_ray.backend import ops

    gen = torch.Generator().manual_seed(5)
    d, heads, groups, bs = 64, 3, 3, 16
    keys, values = (torch.randn(10, heads, bs, d, generator=gen).bfloat16() for _ in range(2))
    tables = torch.tensor([[3, 1, 7, 2]], dtype=torch.int32)
    query = torch.randn(1, heads, 5 * groups, d, generator=gen)
    limits = torch.tensor([[50 + p for p in range(5) for _ in range(groups)]])
    out = ops.decode_attention(query, keys, values, tables, limits, d ** -0.5)
    assert torch.equal(out, ops.decode_attention(query, keys.float(), values.float(), tables, limits, d ** -0.5))
    buffers = [torch.zeros(4, d, dtype=torch.bfloat16) for _ in range(2)]
    new = torch.randn(2, 1, 2, 2, d, generator=gen)  # keys, values [b, Hkv, q, D]
    ops.kv_write(*buffers, torch.arange(4), new[0], new[1])
    assert all(torch.equal(buffer, x.transpose(1, 2).reshape(-1, d).bfloat16()) for buffer, x in zip(buffers, new))


@needs_kernels
def test_bf16_model_runs_fp32_activations_over_bf16_panels_and_speculation_is_exact():
    target = tiny_target(dtype=torch.bfloat16, vocab=96)
    draft = tiny_draft(target)
    reference = tiny_target(dtype=torch.bfloat16, vocab=96).float()  # the same bf16-valued weights in fp32
    assert keep_bf16_weights(target, draft)
    assert next(target.parameters()).dtype == next(draft.parameters()).dtype == torch.float32
    prompts = ragged_prompts(3, seed=4, max_len=12)
    params = SamplingParams(max_new_tokens=20, ignore_eos=True)

    def tokens(engine):
        return [c.token_ids for c in engine.generate([Request(i, p, params) for i, p in enumerate(prompts)])]

    target_only = build_engine(target, None, max_batch_size=3, max_model_len=64)
    assert target_only.precision == "bfloat16 weights and KV, float32 activations"
    assert all(m.packed_weight.dtype == torch.bfloat16 for m in target.modules() if isinstance(m, PackedLinear))
    base = tokens(target_only)
    speculative = build_engine(target, draft, num_draft_tokens=3, max_batch_size=3, max_model_len=64)
    assert speculative.runner.kv.all_keys.dtype == speculative.proposer.kv.all_keys.dtype == torch.bfloat16
    assert tokens(speculative) == base
    # Half the KV bytes of the fp32 engine's plan, for the same blocks.
    fp32_engine = build_engine(reference, None, max_batch_size=3, max_model_len=64)
    assert fp32_engine.precision == "float32" and fp32_engine.runner.kv.all_keys.dtype == torch.float32
    assert 2 * target_only.memory_plan(3, 10)["kv_pool"] == fp32_engine.memory_plan(3, 10)["kv_pool"]
    assert not keep_bf16_weights(tiny_target(dtype=torch.float32))  # only bf16 models


def test_auto_dtype_on_cpu():
    assert cpu_auto_dtype(torch.bfloat16) == (torch.bfloat16 if has_bf16_arithmetic() else torch.float32)
    assert cpu_auto_dtype(torch.float16) == torch.float32
    assert cpu_auto_dtype(torch.float32) == torch.float32 and cpu_auto_dtype(torch.float64) == torch.float64


def test_near_tie_mask_flags_greedy_positions_within_the_rule():
    ulp = 2.0 ** -7 * 16  # bf16's unit in the last place at a top logit in [16, 32)
    logits = torch.full((3, 3, 8), -10.0)
    logits[:, :, 0] = 20.0
    for position, gap in enumerate((0.0, TIE_ULPS * ulp, (TIE_ULPS + 1) * ulp)):
        logits[:, position, 5] = 20.0 - gap
    greedy = torch.tensor([True, False, True])
    mask = near_tie_mask(logits.bfloat16(), greedy, torch.bfloat16)
    assert mask.tolist() == [0b011, 0, 0b011]  # positions 0 and 1 within the rule; a sampled row never
    # Logits made fp32 by the penalties are judged by the dtype they were computed in.
    assert near_tie_mask(logits, greedy, torch.bfloat16).tolist() == [0b011, 0, 0b011]


@needs_target
@needs_draft
@pytest.mark.slow
def test_real_bf16_parts_from_target_only_only_at_counted_near_ties():
    """torch's bf16 ops (no `keep_bf16_weights`: a SpecEngine built directly) on the SmolLM2 pair: a verify of W + 1
    positions rounds differently from a one-position step, so rows part (on the AVX2 VM both of these prompts,
    within 10 tokens). Each parting position p must be a near-tie as the target-only engine saw it: its count over
    tokens 1..p exceeds its count over tokens 1..p-1."""
    target = load_target(str(cache_dir()), dtype="bfloat16", device="cpu")
    tokenizer = load_tokenizer(str(cache_dir()))
    draft = load_draft(ASSETS / "draft", target_config=target.config, dtype=target.dtype)
    rows = [r for r in pq.read_table(ASSETS / "prompts.parquet").to_pylist() if r["held_out"]]
    prompts = [encode_prompt(tokenizer, messages=list(rows[i]["messages"])) for i in (0, 1)]

    def run(proposer, new_tokens, which):
        engine = SpecEngine(target, proposer, max_rows=len(which), max_model_len=512)
        assert engine.precision == "bfloat16"
        params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
        return engine.generate([Request(i, prompts[i], params) for i in which])

    everyone = list(range(len(prompts)))
    base = run(None, 10, everyone)
    spec = run(DominoProposer(draft, target, 8), 10, everyone)
    assert sum(c.stats.near_ties for c in base) > 0  # the rule meets real ties here
    partings = 0
    for i, (b, s) in enumerate(zip(base, spec)):
        part = next((j for j, (x, y) in enumerate(zip(b.token_ids, s.token_ids)) if x != y), None)
        if part is None:
            continue
        partings += 1
        assert part > 0  # the first token comes from the same prefill
        counted = [run(None, n, [i])[0].stats.near_ties for n in (part, part + 1)]
        assert counted[1] == counted[0] + 1, (i, part, counted)
    print(f"{partings} of {len(prompts)} rows parted, each at a counted near-tie")


# ---- prefills on oneDNN's bf16 GEMM (target/prefill_gemm.py) ----------------------------------------------------

def test_prefills_take_the_gemm_from_the_fewest_rows_where_it_wins_at_every_larger_count():
    from domino_ray.target.prefill_gemm import gemm_from_rows

    def timings(gemm_wins_at):
        return lambda path, rows: 1.0 if path == "ours" else (0.5 if rows in gemm_wins_at else 2.0)

    rows = (32, 64, 128, 256, 512)
    assert gemm_from_rows(None, rows, timings({128, 256, 512})) == 128
    assert gemm_from_rows(None, rows, timings(set(rows))) == 32
    assert gemm_from_rows(None, rows, timings(set())) is None
    assert gemm_from_rows(None, rows, timings({32, 64, 512})) == 512  # not at 256: only from 512
    assert gemm_from_rows(None, rows, timings({32, 64, 128, 256})) is None  # losing at the largest: never


@needs_kernels
def test_prefills_on_the_gemm_keep_greedy_speculation_equal_to_target_only(monkeypatch):
    """A bf16 model's prefills on oneDNN's bf16 GEMM (forced from 1 row: this CPU's own timing decides in an engine):
    prefill calls take it and decode or verify steps never do, a linear layer's output stays within bf16 input
    rounding of our kernel's, and greedy speculative == target-only (a prompt is prefilled the same way by both)."""
    from domino_ray.backend import ops
    from domino_ray.target import packed_linear
    from domino_ray.target.prefill_gemm import bf16_gemm, in_prefill, use_prefill_gemm

    target = tiny_target(dtype=torch.bfloat16, vocab=96)
    draft = tiny_draft(target)
    assert keep_bf16_weights(target, draft)
    prompts = ragged_prompts(3, seed=9, max_len=12)
    params = SamplingParams(max_new_tokens=20, ignore_eos=True)
    calls = []

    def counted(x, weight, bias):
        calls.append(in_prefill())
        return bf16_gemm(x, weight, bias)

    monkeypatch.setattr(packed_linear, "bf16_gemm", counted)
    monkeypatch.setattr(packed_linear, "ONE_OP_POSITIONS", range(0))  # every step's layers through their linears

    def tokens(engine):
        linears = [m for m in engine.layers.modules() if isinstance(m, PackedLinear) and m.bf16_panels]
        assert use_prefill_gemm(linears, seconds=lambda path, rows: 1.0 if path == "ours" else 0.5) == 32
        for m in linears:
            m.gemm_from_rows = 1
        return [c.token_ids for c in engine.generate([Request(i, p, params) for i, p in enumerate(prompts)])]

    base = tokens(build_engine(target, None, max_batch_size=3, max_model_len=64))
    assert calls and all(calls)  # prefills took the GEMM; no call outside a prefill did
    speculative = build_engine(target, draft, num_draft_tokens=3, max_batch_size=3, max_model_len=64)
    assert tokens(speculative) == base
    linear = next(m for m in speculative.layers.modules() if isinstance(m, PackedLinear) and m.bf16_panels)
    x = torch.randn(40, linear.in_features, generator=torch.Generator().manual_seed(1))
    ours = ops.linear(x, linear.current_pack(), linear.out_features, linear.bias)
    bound = (x.abs() @ linear.weight.abs().T) * 2.0 ** -8  # each input rounded to bf16 (8 significant bits)
    assert ((bf16_gemm(x, linear.gemm_weight(), linear.bias) - ours).abs() <= bound + 1e-6).all()


@needs_kernels
@pytest.mark.skipif(not has_bf16_arithmetic(), reason="this CPU has no bf16 dot products (AVX512_BF16 or AMX): "
                                                      "the engine never times oneDNN's bf16 GEMM here")
def test_this_cpu_times_the_gemm_for_a_bf16_engine_and_its_prefills_keep_speculation_exact():
    from domino_ray.target.prefill_gemm import CALIBRATION_ROWS

    target = tiny_target(dtype=torch.bfloat16, vocab=96)
    draft = tiny_draft(target)
    prompts = ragged_prompts(3, seed=9, max_len=12)
    params = SamplingParams(max_new_tokens=20, ignore_eos=True)
    engines = [build_engine(target, d, num_draft_tokens=3, max_batch_size=3, max_model_len=64) for d in (None, draft)]
    assert engines[0].prefill_gemm_rows in (None, *CALIBRATION_ROWS)
    base, speculative = ([c.token_ids for c in e.generate([Request(i, p, params) for i, p in enumerate(prompts)])]
                         for e in engines)
    assert speculative == base
