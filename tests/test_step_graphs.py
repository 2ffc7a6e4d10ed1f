"""The CUDA-graph keys as pure functions (they decide what the engine captures at start on a GPU), and the
engine's own steps checked against them on CPU: a greedy step never meets a key outside the captured set."""

import pytest

from domino_ray.engine.request import Request
from domino_ray.engine.core import SpecEngine
from domino_ray.engine.step_graphs import greedy_step_keys, row_buckets, verify_positions
from domino_ray.spec_decode.proposer import DominoProposer
from domino_ray.sample.params import SamplingParams
from domino_ray.spec_decode.width_costs import MAX_VERIFY_POSITIONS, step_widths
from test_memory_plan import production_sizes
from tiny_models import ragged_prompts, tiny_draft, tiny_target

def test_widths_shrink_as_rows_grow_only_with_graphs():
    buckets = row_buckets(128)
    assert buckets == [1, 2, 4, 8, 16, 32, 64, 128]
    graphed = step_widths(buckets, 16, adaptive=True, graphs=True)
    assert graphed[1] == graphed[64] == [0, 1, 3, 7, 15]  # W + 1 = 2, 4, 8, 16: whole MMA row tiles
    assert graphed[128] == [0, 1, 3, 7]
    assert all(r * (max(ws) + 1) <= MAX_VERIFY_POSITIONS for r, ws in graphed.items())
    assert step_widths(buckets, 16, adaptive=True, graphs=False)[128] == list(range(17))  # CPU: the policy decides
    assert step_widths(buckets, 16, adaptive=False, graphs=True)[128] == [16]              # a fixed K is kept
    assert verify_positions(128, 16, adaptive=True, graphs=True) == 1024      # 128 rows x 8 (W = 7)
    assert verify_positions(128, 16, adaptive=False, graphs=True) == 128 * 17


@pytest.mark.parametrize("device_gib", [80, 141])
def test_production_graph_keys_are_bounded(device_gib):
    """The greedy keys configs/qwen3_4b.yaml captures at start, with the rows `auto` picks on an H100/H200."""
    slots, _, _ = production_sizes(device_gib)
    rows = row_buckets(slots)
    widths = step_widths(rows, 16, adaptive=True, graphs=True)
    graph_keys = greedy_step_keys(rows, widths)
    print(f"{device_gib} GB: {slots} rows, {len(graph_keys)} greedy graphs: row buckets {rows}, widths {widths}")
    # no key length in the keys: the paged kernel reads each row's length from a tensor
    assert len(graph_keys) == len(set(graph_keys)) == sum(len(ws) for ws in widths.values()) <= 80
    assert {k[1] for k in graph_keys} == set(rows)
    fixed = greedy_step_keys(rows, step_widths(rows, 16, adaptive=False, graphs=True))
    assert len(fixed) == len(rows)  # a fixed width: one graph per row bucket


def test_greedy_steps_stay_within_the_captured_keys():
    """A CPU engine padding its rows as the graphs do records each step's key: greedy runs with an adaptive and a
    fixed width only meet keys `greedy_step_keys` lists for that engine, and the lazily captured written-off state."""
    target = tiny_target("qwen3")
    prompts = ragged_prompts(12, seed=3, max_len=90)
    for adaptive in (True, False):
        proposer = DominoProposer(tiny_draft(target, block_size=4), target)
        engine = SpecEngine(target, proposer, max_rows=8, max_model_len=160, adaptive=adaptive)
        engine.pad_rows = True  # rows padded up to a bucket, as graphs pad them
        allowed = set(greedy_step_keys(engine.row_buckets, engine.widths))
        seen, device_step = set(), engine._device_step

        def recording(r, key_len, w, mode, context, forced=()):
            seen.add(("step", r, w, mode, context))
            return device_step(r, key_len, w, mode, context, forced)
        engine._device_step = recording
        engine.generate([Request(i, p, SamplingParams(max_new_tokens=24)) for i, p in enumerate(prompts)])
        # beyond them only the written-off draft's W = 0 steps without context (this random draft's fate)
        assert seen and all(k[2] == 0 and not k[4] for k in seen - allowed), seen - allowed
        assert seen & allowed
        assert len({k[1] for k in seen}) > 1  # several row buckets met (and rows from 1 to ~110 keys in each)
