"""The memory plan, the row cap and the KV pool as pure functions, on the production shapes (Qwen3-4B + Domino-b16)
for devices this machine does not have."""

from pathlib import Path

import pytest
import torch
from transformers import Qwen3Config

from domino_ray.engine.memory import (AUTO_ROW_TOKENS, check_memory_fits, kv_bytes_per_token, memory_plan, plan_slots,
                                      prefill_attention_bytes, size_engine)
from domino_ray.engine.step_graphs import verify_positions
from domino_ray.spec_decode.draft import DraftConfig

REPO = Path(__file__).resolve().parents[1]
GiB = 2**30
QWEN3_4B = Qwen3Config(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32,
                       num_key_value_heads=8, head_dim=128, vocab_size=151936, max_position_embeddings=40960)
DOMINO_B16 = DraftConfig(hidden_size=2560, intermediate_size=9728, num_hidden_layers=5, num_attention_heads=32,
                         num_key_value_heads=8, head_dim=128, vocab_size=151936, block_size=16,
                         target_layer_ids=(1, 9, 17, 25, 33), mask_token_id=151669, emb_dim=256, gru_hidden_dim=1024)
WEIGHTS = int((4.02e9 + 0.55e9) * 2)  # bf16 target (4.02B parameters) + draft (5 layers + fc: ~0.55B), bytes


CAPACITY = 4096 + 16  # configs/qwen3_4b.yaml: max_model_len 4096 + span 17, to a block of 16


def production_plan(rows: int, blocks: int = 0, *, k=16, graphs=True):
    """The plan of configs/qwen3_4b.yaml's engine: adaptive width (num_draft_tokens: auto), graphs and the paged
    Triton kernel on CUDA, a pool of `blocks` blocks of 16."""
    return memory_plan(QWEN3_4B, DOMINO_B16, max_rows=rows, num_spec_tokens=k, capacity=CAPACITY, kv_blocks=blocks,
                       block_size=16, max_prefill_tokens=16384, itemsize=2, cuda_graphs=graphs, paged_kernel=True,
                       verify_positions=verify_positions(rows, k, adaptive=True, graphs=graphs))


def production_sizes(device_gib: int, rows="auto", tokens="auto") -> tuple[int, int, int]:
    """(rows, pool blocks, budget) `auto` picks on a device of `device_gib` GiB at gpu_memory_utilization 0.9."""
    budget = int(0.9 * (device_gib * GiB - WEIGHTS))
    rows, blocks, _ = size_engine(budget, "cuda", 1024, rows, tokens, production_plan, 16, CAPACITY, dense_cap=False)
    return rows, blocks, budget


def test_the_kv_is_144_kib_per_token_for_the_target_and_20_for_the_draft():
    assert kv_bytes_per_token(QWEN3_4B, None, 2) == 144 * 1024  # 36 layers x 8 heads x 128 x (K, V) x 2 bytes
    assert kv_bytes_per_token(QWEN3_4B, DOMINO_B16, 2) == 164 * 1024  # + 5 draft layers
    assert production_plan(1, 10)["kv_pool"] == 10 * 16 * 164 * 1024
    assert production_plan(8)["block_tables"] == 8 * (CAPACITY // 16) * 4  # int32


@pytest.mark.parametrize("device_gib", [80, 141])
def test_auto_sizes_fit_the_budget_and_the_pool_holds_far_more_rows_than_dense_slots(device_gib):
    """Both `auto`: as many rows as the pool left beside them holds at a 1k-token mean length, the pool the rest; at
    typical lengths it holds several times the rows a dense layout holds at max_model_len (each row's KV reserved at
    4,112 positions, the activations of its rows beside it), and about as many at max_model_len."""
    rows, blocks, budget = production_sizes(device_gib)
    plan = production_plan(rows, blocks)
    assert sum(plan.values()) <= budget < sum(production_plan(rows, blocks + 1).values())  # the pool takes the rest
    tokens = (blocks - 1) * 16
    assert rows * AUTO_ROW_TOKENS <= tokens < (rows + 1) * AUTO_ROW_TOKENS * 1.05  # balanced at a 1k mean length
    per_row = kv_bytes_per_token(QWEN3_4B, DOMINO_B16, 2) * CAPACITY
    dense_rows = plan_slots(budget, lambda r: {**production_plan(r), "kv": r * per_row})
    held = {mean: min(rows, tokens // mean) for mean in (1024, 2048, 4096)}
    print(f"{device_gib} GB: rows cap {rows}, pool {tokens} tokens ({plan['kv_pool'] / GiB:.1f} GiB); rows held at "
          f"1k/2k/4k mean length {held}; dense at max_model_len: {dense_rows}")
    assert held[1024] >= 2.5 * dense_rows and held[2048] >= 1.5 * dense_rows and held[4096] >= 0.85 * dense_rows


def test_plan_grows_with_every_term_and_graphs_add_a_pool():
    small, large = production_plan(8, 100), production_plan(16, 200)
    assert all(large[k] > small[k] for k in ("kv_pool", "block_tables", "decode_step"))
    assert large["prefill_peak"] == small["prefill_peak"]  # set by max_prefill_tokens, not the rows
    assert "graph_pool" not in production_plan(8, graphs=False)
    gathered = memory_plan(QWEN3_4B, DOMINO_B16, max_rows=8, num_spec_tokens=16, capacity=CAPACITY,
                           max_prefill_tokens=16384, itemsize=2)  # no paged kernel: a step gathers keys
    assert gathered["decode_step"] > production_plan(8, graphs=False)["decode_step"]
    target_only = memory_plan(QWEN3_4B, None, max_rows=8, num_spec_tokens=0, capacity=CAPACITY,
                              max_prefill_tokens=16384, itemsize=2, kv_blocks=100)
    assert target_only["kv_pool"] == 100 * 16 * 144 * 1024 and target_only["decode_step"] < small["decode_step"]


def test_too_little_memory_plans_no_row_and_names_the_keys():
    with pytest.raises(ValueError, match="generation.max_batch_size=auto: not one row fits"):
        size_engine(GiB, "cuda:0", 1024, "auto", "auto", production_plan, 16, CAPACITY, dense_cap=False)
    with pytest.raises(ValueError, match="generation.kv_cache_tokens: the KV pool holds 4000 tokens but one row"):
        production_sizes(80, tokens=4000)
    # Fixed rows whose other buffers leave the pool less than one row (a CI runner with little host memory):
    # the message names the rows, not a negative pool.
    with pytest.raises(ValueError, match=r"generation.max_batch_size=1024: .* leave 0.00 of 1.00 GiB on cuda:0.*"
                                         r"set generation.kv_cache_tokens"):
        size_engine(GiB, "cuda:0", 1024, 1024, "auto", production_plan, 16, CAPACITY, dense_cap=False)
    with pytest.raises(ValueError, match="runtime.gpu_memory_utilization=0.9.*lower generation.kv_cache_tokens"):
        check_memory_fits(production_plan(16, 8000), 16 * GiB, "cuda:0")


def test_a_fixed_pool_leaves_the_rest_to_the_rows():
    rows, blocks, budget = production_sizes(80, tokens=100_000)
    assert blocks == 100_000 // 16 + 1
    assert sum(production_plan(rows, blocks).values()) <= budget
    assert rows == 1024 or budget < sum(production_plan(rows + 1, blocks).values())  # the most up to MAX_AUTO_SLOTS
    assert production_sizes(80, rows=64)[0] == 64


# ---- the engine sizing itself (CPU here: the CUDA branch is the same planner over free device memory) ----

def test_auto_slots_on_cpu_follow_the_threads_and_the_engine_runs_at_that_size():
    from domino_ray.engine.request import Request
    from domino_ray.engine.core import SpecEngine
    from domino_ray.spec_decode.proposer import DominoProposer
    from domino_ray.sample.params import SamplingParams
    from tiny_models import ragged_prompts, tiny_draft, tiny_target

    target = tiny_target("qwen3")
    threads = torch.get_num_threads()
    try:
        for n, slots in ((1, 8), (2, 16), (16, 64)):  # 8 per thread, within 8..64
            torch.set_num_threads(n)
            engine = SpecEngine(target, DominoProposer(tiny_draft(target, block_size=4), target), max_rows="auto")
            assert engine.max_rows == slots and engine.row_buckets[-1] == slots
            assert f"{slots} rows at most" in engine.slot_report and "on host" in engine.slot_report
            # on CPU an auto pool holds every row at its longest, as the dense layout did
            assert engine.kv_blocks == slots * engine.capacity // engine.block_size + 1
    finally:
        torch.set_num_threads(threads)
    prompts = ragged_prompts(2 * slots, seed=4)
    requests = lambda: [Request(i, p, SamplingParams(max_new_tokens=6)) for i, p in enumerate(prompts)]  # noqa: E731
    base = SpecEngine(target, None, max_rows=slots).generate(requests())
    assert [c.token_ids for c in engine.generate(requests())] == [c.token_ids for c in base]


def test_config_takes_auto_slots_and_checks_the_memory_share():
    from domino_ray.config import ConfigError, load_config

    cfg = load_config(None, ["generation.max_batch_size=auto", "runtime.gpu_memory_utilization=0.8"])
    assert cfg.generation.max_batch_size == "auto" and cfg.runtime.gpu_memory_utilization == 0.8
    with pytest.raises(ConfigError, match="generation.max_batch_size='lots' is invalid: expected auto or an int >= 1"):
        load_config(None, ["generation.max_batch_size=lots"])
    for bad in ("0", "1.5"):
        with pytest.raises(ConfigError, match=r"runtime.gpu_memory_utilization=.* expected a number in \(0, 1\]"):
            load_config(None, [f"runtime.gpu_memory_utilization={bad}"])
    with pytest.raises(ConfigError, match="runtime.gpu_memory_utilization"):  # OmegaConf's own type check
        load_config(None, ["runtime.gpu_memory_utilization=true"])
    for path in ("configs/qwen3_4b.yaml", "configs/qwen3_0_6b.yaml"):  # production sizes itself
        assert load_config(REPO / path, ["input.path=x", "output.path=y"]).generation.max_batch_size == "auto"


# ---- prefill attention: the plan's term against what a CPU run of the same shapes allocates ----

def test_prefill_on_the_triton_path_plans_no_prompt_by_context_term():
    """A prefill that reads its rows in place (our Triton kernel) plans O(N H D) for its attention at any context; the
    gather path's mask grows with n x L. At Qwen3-4B's shapes, 16k tokens: far below fp32 scores [32, 16k, 4k]."""
    def prefill(capacity, **kwargs):
        return memory_plan(QWEN3_4B, DOMINO_B16, max_rows=8, num_spec_tokens=16, capacity=capacity,
                           max_prefill_tokens=16384, itemsize=2, **kwargs)["prefill_peak"]

    assert prefill(CAPACITY, paged_kernel=True) == prefill(4 * CAPACITY, paged_kernel=True)
    assert prefill(4 * CAPACITY, prefill_in_place=False) - prefill(CAPACITY, prefill_in_place=False) >= \
        16384 * 3 * CAPACITY * 2
    attention = prefill_attention_bytes(QWEN3_4B, 16384, CAPACITY, 2, in_place=True)
    output = 16384 * 32 * 128 * 2  # [N, H, D] bf16
    scores = 32 * 16384 * CAPACITY * 4  # fp32 [H, n, L]: what SDPA's math kernel makes over a gathered row
    assert output < attention <= 2.1 * output and 30 * attention < scores


def allocated_peak(fn) -> int:
    """Peak bytes of CPU memory that `fn()` allocates beyond what was live before, from torch's profiler timeline
    (every allocation and free, workspaces inside ops included; `_memory_profile` is private, the public
    `export_memory_timeline` over it deprecated)."""
    from torch.profiler import ProfilerActivity, profile
    from torch.profiler._memory_profiler import Action

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True) as prof:
        fn()
    live = peak = 0
    for _, action, _, size in sorted(prof._memory_profile().timeline, key=lambda event: event[0]):
        live += size if action == Action.CREATE else -size if action == Action.DESTROY else 0
        peak = max(peak, live)
    return peak


class _NoLaunch:
    """Stands in for the jitted kernel: a launch allocates nothing, so what is left is what the CUDA path allocates."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def test_prefill_attention_allocates_within_its_planned_term_on_the_triton_path(monkeypatch):
    """`prefill_attention` on the Triton path (the launch stubbed: the kernel allocates nothing) allocates no more than
    the plan's term, and the same whether the rows' earlier keys are 512 or 4096 positions; the gather path at the
    same shapes allocates its mask, growing with n x L (so the measurement sees such growth)."""
    from domino_ray.backend import paged_prefill_triton
    from domino_ray.kv.pools import KVPool, prefill_attention

    monkeypatch.setattr(paged_prefill_triton, "_kernel", _NoLaunch)
    cfg = Qwen3Config(hidden_size=512, num_attention_heads=8, num_key_value_heads=2, head_dim=64)
    lengths, bs = (256, 512, 256), 16  # a prompt from 0 (SDPA), two after earlier keys (the kernel)
    gen = torch.Generator().manual_seed(0)
    query = torch.randn(1, 8, sum(lengths), 64, generator=gen)  # [1, H, N, D]
    keys, values = (torch.randn(1, 2, sum(lengths), 64, generator=gen) for _ in range(2))  # [1, Hkv, N, D]
    peaks = {}
    for context in (512, 4096):
        offsets = (0, context, context + 100)
        blocks = [-(-(o + n) // bs) for o, n in zip(offsets, lengths)]
        pool = KVPool(1, 1 + sum(blocks), bs, 2, 64, torch.float32, "cpu")
        pool.kernel = False
        first = [1 + sum(blocks[:i]) for i in range(3)]
        tables = tuple(torch.arange(f, f + b, dtype=torch.int32)[None] for f, b in zip(first, blocks))
        for triton in (True, False):
            pool.triton = triton
            peaks[triton, context] = allocated_peak(lambda: prefill_attention(
                query, keys, values, 0.125, lengths, offsets, tables, pool, 0))
    planned = prefill_attention_bytes(cfg, sum(lengths), 8192, 4, in_place=True)  # any capacity: the term has none
    output = sum(lengths) * 8 * 64 * 4  # [N, H, D] fp32: what any path returns
    assert output <= peaks[True, 512] <= planned and output <= peaks[True, 4096] <= planned, (peaks, planned)
    for context in (512, 4096):  # the gather path within its own term, at its longest row (context + 512)
        assert peaks[False, context] <= prefill_attention_bytes(cfg, sum(lengths), context + 512, 4, in_place=False)
    assert abs(peaks[True, 4096] - peaks[True, 512]) <= 4 * 4096 // bs  # only the tables grow
    assert peaks[False, 4096] - peaks[False, 512] >= 512 * (4096 - 512) * 4  # the gathered row's mask
