"""The adaptive width's start-up step costs, timed on the engine's own device step while every slot is free (the last
stage of building an engine, `width_controller`).

Free slots are padding rows, which a step leaves unchanged: for the timing their lengths are set to fill the keys
timed and their block tables to distinct blocks (on the null block alone they would read one block from the cache),
since attention reads only the keys a row holds; both are set back after. Real steps then refine the figures
(`spec_decode/width_costs.py`).
"""

from __future__ import annotations

import torch

from domino_ray.sample.sampling import GREEDY
from domino_ray.spec_decode.width_costs import StepCosts, measure_step_costs
from domino_ray.spec_decode.width_policy import WidthController


def width_controller(engine, width_costs: dict | StepCosts | None) -> WidthController | None:
    """The adaptive width of `engine` (None for a fixed one) from `width_costs` (`{bucket: {W: seconds}}` or a
    `StepCosts`), or from its own steps timed now when None (`measure_costs`)."""
    if not engine.adaptive:
        return None
    costs = (width_costs if isinstance(width_costs, StepCosts) else StepCosts(width_costs) if width_costs
             else measure_costs(engine, engine.widths))
    return WidthController(engine.num_spec_tokens, engine.max_rows, costs, lazy_context=engine.defer_context)


@torch.inference_mode()
def measure_costs(engine, widths: dict[int, list[int]], repeats: int = 3) -> StepCosts:
    """Seconds per step of `engine` (a `SpecEngine` with no rows) for each row bucket and its `widths`, at the
    shortest and the longest key length (`measure_step_costs`)."""
    runner = engine.runner

    def run_step(r: int, t: int, w: int):
        runner.lens[:r] = t - engine.span  # a step writes `span` positions past a row's length
        engine._device_step(r, t, w, GREEDY, True)
        runner.read_output(0, w)
        if engine.device.type == "cuda":
            torch.cuda.synchronize(engine.device)

    tables, bs = runner.block_tables, engine.block_size
    tables.copy_((1 + torch.arange(tables.numel()) % (engine.kv_blocks - 1)).view(tables.shape))
    try:
        return measure_step_costs(run_step, widths, (-(-engine.span // bs) * bs, engine.capacity), repeats)
    finally:
        runner.lens.zero_()  # free slots are inert padding rows on the null block
        tables.zero_()
