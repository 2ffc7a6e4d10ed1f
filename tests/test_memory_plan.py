"""The memory plan and the slot planner as pure functions, on the production shapes (Qwen3-4B + Domino-b16)
for devices this machine does not have."""

import pytest
from transformers import Qwen3Config

from domino_ray.draft import DraftConfig
from domino_ray.memory import check_memory_fits, memory_plan, plan_slots

GiB = 2**30
QWEN3_4B = Qwen3Config(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32,
                       num_key_value_heads=8, head_dim=128, vocab_size=151936, max_position_embeddings=40960)
DOMINO_B16 = DraftConfig(hidden_size=2560, intermediate_size=9728, num_hidden_layers=5, num_attention_heads=32,
                         num_key_value_heads=8, head_dim=128, vocab_size=151936, block_size=16,
                         target_layer_ids=(1, 9, 17, 25, 33), mask_token_id=151669, emb_dim=256, gru_hidden_dim=1024)
WEIGHTS = int((4.02e9 + 0.55e9) * 2)  # bf16 target (4.02B parameters) + draft (5 layers + fc: ~0.55B), bytes


def production_plan(rows: int, *, max_model_len=4096, k=16, graphs=True):
    capacity = -(-(max_model_len + 17) // 256) * 256  # the engine's T: max_model_len + span, to the key chunk
    return memory_plan(QWEN3_4B, DOMINO_B16, max_rows=rows, num_spec_tokens=k, capacity=capacity,
                       max_prefill_tokens=16384, itemsize=2, cuda_graphs=graphs)


def test_target_kv_is_144_kib_per_token_per_row():
    plan = production_plan(1)
    assert plan["target_kv"] == 144 * 1024 * 4352  # 36 layers x 8 heads x 128 x (K, V) x 2 bytes, T = 4352


@pytest.mark.parametrize("device_gib", [80, 141])
def test_slots_fit_the_budget_and_use_most_of_it(device_gib):
    budget = int(0.9 * (device_gib * GiB - WEIGHTS))
    rows = plan_slots(budget, production_plan)
    used = sum(production_plan(rows).values())
    assert used <= budget < sum(production_plan(rows + 1).values())  # the most that fits
    assert used >= 0.8 * budget, (rows, used / budget)
    print(f"{device_gib} GB: {rows} slots, {used / GiB:.1f} of {budget / GiB:.1f} GiB")
    assert rows >= (60 if device_gib == 80 else 120)  # an H100 holds far more than the old 16 slots


def test_plan_grows_with_every_term_and_graphs_add_a_pool():
    small, large = production_plan(8), production_plan(16)
    assert all(large[k] > small[k] for k in ("target_kv", "draft_kv", "decode_step"))
    assert large["prefill_peak"] == small["prefill_peak"]  # set by max_prefill_tokens, not the slots
    assert "graph_pool" not in production_plan(8, graphs=False)
    target_only = memory_plan(QWEN3_4B, None, max_rows=8, num_spec_tokens=0, capacity=4352,
                              max_prefill_tokens=16384, itemsize=2)
    assert target_only["draft_kv"] == 0 and target_only["decode_step"] < small["decode_step"]


def test_too_little_memory_plans_no_slot_and_names_the_keys():
    assert plan_slots(GiB, production_plan) == 0
    with pytest.raises(ValueError, match="runtime.gpu_memory_utilization=0.9.*lower generation.max_batch_size"):
        check_memory_fits(production_plan(16), 16 * GiB, "cuda:0")  # 16.7 GiB needed
