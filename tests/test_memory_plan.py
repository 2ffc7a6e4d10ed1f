"""The memory plan, the row cap and the KV pool as pure functions, on the production shapes (Qwen3-4B + Domino-b16)
for devices this machine does not have."""

from pathlib import Path

import pytest
import torch
from transformers import Qwen3Config

from domino_ray.engine.memory import AUTO_ROW_TOKENS, check_memory_fits, kv_bytes_per_token, memory_plan, plan_slots, size_engine
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
