"""The CUDA-graph keys as pure functions (they decide what the engine captures at start on a GPU), and the
engine's own steps checked against them on CPU: a greedy step never meets a key outside the captured set."""

import pytest

from domino_ray.engine.memory import plan_slots
from domino_ray.engine.request import Request
from domino_ray.engine.spec_engine import SpecEngine
from domino_ray.engine.step_graphs import MIN_GRAPH_KEYS, greedy_step_keys, key_buckets, row_buckets, verify_positions
from domino_ray.spec.proposer import DominoProposer
from domino_ray.spec.sampling_params import SamplingParams
from domino_ray.spec.width_costs import MAX_VERIFY_POSITIONS, step_widths
from test_memory_plan import GiB, WEIGHTS, production_plan
from tiny_models import ragged_prompts, tiny_draft, tiny_target

PRODUCTION_CAPACITY = 4352  # configs/qwen3_4b.yaml: max_model_len 4096 + span 17, to the 256 key chunk


def test_key_buckets_cover_every_length_eagerly_by_chunk_and_with_graphs_under_twice():
    assert key_buckets(256, 32, graphs=False) == list(range(32, 257, 32))
    graphed = key_buckets(PRODUCTION_CAPACITY, 256, graphs=True)
    assert graphed == [512, 1024, 2048, 4352]  # 4096 is within 25% of the capacity: dropped
    for capacity, chunk in ((PRODUCTION_CAPACITY, 256), (1024, 32), (384, 32), (256, 256), (40960 + 256, 256)):
        buckets = key_buckets(capacity, chunk, graphs=True)
        assert buckets == sorted(set(buckets)) and buckets[-1] == capacity
        assert all(t % chunk == 0 for t in buckets)
        for length in range(1, capacity + 1, 7):  # the bucket a row of `length` positions reads
            t = next(b for b in buckets if b >= length)
            assert t <= max(2 * length, MIN_GRAPH_KEYS, chunk) or t == capacity and t <= 2.5 * length


def test_widths_shrink_as_rows_grow_only_with_graphs():
    buckets = row_buckets(128)
    assert buckets == [1, 2, 4, 8, 16, 32, 64, 128]
    graphed = step_widths(buckets, 16, adaptive=True, graphs=True)
    assert graphed[1] == graphed[32] == [0, 1, 2, 4, 8, 16]
    assert graphed[64] == [0, 1, 2, 4, 8] and graphed[128] == [0, 1, 2, 4]
    assert all(r * (max(ws) + 1) <= MAX_VERIFY_POSITIONS for r, ws in graphed.items())
    assert step_widths(buckets, 16, adaptive=True, graphs=False)[128] == list(range(17))  # CPU: the policy decides
    assert step_widths(buckets, 16, adaptive=False, graphs=True)[128] == [16]              # a fixed K is kept
    assert verify_positions(128, 16, adaptive=True, graphs=True) == 640       # 128 rows x 5 (W = 4)
    assert verify_positions(128, 16, adaptive=False, graphs=True) == 128 * 17


@pytest.mark.parametrize("device_gib", [80, 141])
def test_production_graph_keys_are_bounded(device_gib):
    """The greedy keys configs/qwen3_4b.yaml captures at start, with the slots `auto` picks on an H100/H200."""
    slots = plan_slots(int(0.9 * (device_gib * GiB - WEIGHTS)), production_plan)
    rows = row_buckets(slots)
    keys = key_buckets(PRODUCTION_CAPACITY, 256, graphs=True)
    widths = step_widths(rows, 16, adaptive=True, graphs=True)
    graph_keys = greedy_step_keys(rows, keys, widths)
    print(f"{device_gib} GB: {slots} slots, {len(graph_keys)} greedy graphs: row buckets {rows}, key buckets "
          f"{keys}, widths {widths}")
    assert len(graph_keys) == len(set(graph_keys)) <= 200
    assert {k[1] for k in graph_keys} == set(rows) and {k[2][0][1] for k in graph_keys} == set(keys)
    fixed = greedy_step_keys(rows, keys, step_widths(rows, 16, adaptive=False, graphs=True))
    assert len(fixed) == len(rows) * len(keys)  # a fixed width: one graph per (row bucket, key bucket)


def test_greedy_steps_stay_within_the_captured_keys():
    """A CPU engine shaped as the graphs are (one key group) records each step's key: greedy runs with an
    adaptive and a fixed width only meet keys `greedy_step_keys` lists for that engine, and the lazily
    captured written-off state."""
    target = tiny_target("qwen3")
    prompts = ragged_prompts(12, seed=3, max_len=90)
    for adaptive in (True, False):
        proposer = DominoProposer(tiny_draft(target, block_size=4), target)
        engine = SpecEngine(target, proposer, max_rows=8, max_model_len=160, max_key_groups=1, adaptive=adaptive)
        engine.pad_rows = True  # rows padded up to a bucket, as graphs pad them
        allowed = set(greedy_step_keys(engine.row_buckets, engine.key_buckets, engine.widths))
        seen, device_step = set(), engine._device_step

        def recording(r, groups, w, mode, context):
            seen.add(("step", r, groups, w, mode, context))
            return device_step(r, groups, w, mode, context)
        engine._device_step = recording
        engine.generate([Request(i, p, SamplingParams(max_new_tokens=24)) for i, p in enumerate(prompts)])
        # beyond them only the written-off draft's W = 0 steps without context (this random draft's fate)
        assert seen and all(k[3] == 0 and not k[5] for k in seen - allowed), seen - allowed
        assert seen & allowed
        assert len({k[1] for k in seen}) > 1 and len({k[2] for k in seen}) > 1  # several row and key buckets met
