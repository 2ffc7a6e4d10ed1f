"""The memory plan and the slot planner as pure functions, on the production shapes (Qwen3-4B + Domino-b16)
for devices this machine does not have."""

from pathlib import Path

import pytest
import torch
from transformers import Qwen3Config

from domino_ray.engine.memory import check_memory_fits, memory_plan, plan_slots
from domino_ray.engine.step_graphs import verify_positions
from domino_ray.spec.draft import DraftConfig

REPO = Path(__file__).resolve().parents[1]
GiB = 2**30
QWEN3_4B = Qwen3Config(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32,
                       num_key_value_heads=8, head_dim=128, vocab_size=151936, max_position_embeddings=40960)
DOMINO_B16 = DraftConfig(hidden_size=2560, intermediate_size=9728, num_hidden_layers=5, num_attention_heads=32,
                         num_key_value_heads=8, head_dim=128, vocab_size=151936, block_size=16,
                         target_layer_ids=(1, 9, 17, 25, 33), mask_token_id=151669, emb_dim=256, gru_hidden_dim=1024)
WEIGHTS = int((4.02e9 + 0.55e9) * 2)  # bf16 target (4.02B parameters) + draft (5 layers + fc: ~0.55B), bytes


def production_plan(rows: int, *, max_model_len=4096, k=16, graphs=True):
    """The plan of configs/qwen3_4b.yaml's engine: adaptive width (num_draft_tokens: auto), graphs on CUDA."""
    capacity = -(-(max_model_len + 17) // 256) * 256  # the engine's T: max_model_len + span, to the key chunk
    return memory_plan(QWEN3_4B, DOMINO_B16, max_rows=rows, num_spec_tokens=k, capacity=capacity,
                       max_prefill_tokens=16384, itemsize=2, cuda_graphs=graphs,
                       verify_positions=verify_positions(rows, k, adaptive=True, graphs=graphs))


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
        check_memory_fits(production_plan(16), 16 * GiB, "cuda:0")  # 18.2 GiB needed


# ---- the engine sizing itself (CPU here: the CUDA branch is the same planner over free device memory) ----

def test_auto_slots_on_cpu_follow_the_threads_and_the_engine_runs_at_that_size():
    from domino_ray.engine.request import Request
    from domino_ray.engine.spec_engine import SpecEngine
    from domino_ray.spec.proposer import DominoProposer
    from domino_ray.spec.sampling_params import SamplingParams
    from tiny_models import ragged_prompts, tiny_draft, tiny_target

    target = tiny_target("qwen3")
    threads = torch.get_num_threads()
    try:
        for n, slots in ((1, 8), (2, 16), (16, 64)):  # 8 per thread, within 8..64
            torch.set_num_threads(n)
            engine = SpecEngine(target, DominoProposer(tiny_draft(target, block_size=4), target), max_rows="auto")
            assert engine.max_rows == slots and engine.row_buckets[-1] == slots
            assert f"{slots} slots on host" in engine.slot_report
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
