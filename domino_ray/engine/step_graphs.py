"""CUDA graphs for the engine's fixed-shape decode step: every greedy key captured at engine start, replayed.

A decode step (`SpecEngine._device_step`: the draft block + correction loop for W tokens, then the target's
verify forward over W+1 positions and the acceptance) reads and writes only the engine's preallocated
buffers, with shapes fixed by its key, and makes no host sync, so its kernels are recorded once, as one
graph, and replayed. The key:
  ("step", r, W, mode, context)
with r the row bucket (`row_buckets`), W the verify width (`width_costs.step_widths`), `mode` what the rows ask
beyond greedy decoding (sampling, top-k/p, penalties, logprobs: `sampling.StepMode`) and `context` whether the step
feeds the draft's context (off only while the adaptive width has written the draft off). The rows' lengths are not
in the key: attention reads each row's length and blocks from tensors (the paged Triton kernel,
`backend/paged_triton.py`), so one graph serves every key length.

Bounded up front: wide verifies are left out where the rows make them compute-bound
(`width_costs.MAX_VERIFY_POSITIONS`), so the greedy keys (`greedy_step_keys`) are a few dozen for the production
config and the engine captures all of them at start (count and time logged): no greedy step stalls on a capture.
Any other key (sampling, penalties, logprobs, a written-off draft) is captured at its first use: that step runs
eagerly (it is also the capture's warm-up: lazy kernels, cuBLAS workspaces) and its time is kept out of the width
policy's costs. The capture itself only records (kernels do not run while capturing), so it changes no state. All
graphs share one memory pool, captured on one stream; a capture that fails raises under `cuda_graphs: on`, and
otherwise turns graphs off for the engine (logged once).
"""

from __future__ import annotations

import logging
import time
from typing import Callable, Hashable, Mapping, Sequence

import torch

from domino_ray.sample.sampling import GREEDY
from domino_ray.spec_decode.width_costs import step_widths

log = logging.getLogger(__name__)


def use_cuda_graphs(setting: str, device: torch.device) -> bool:
    """`runtime.cuda_graphs`: auto (on for CUDA devices) | on | off."""
    if setting not in ("auto", "on", "off"):
        raise ValueError(f"cuda_graphs={setting!r} must be one of auto, on, off")
    if setting == "on" and device.type != "cuda":
        raise ValueError(f"cuda_graphs=on needs a CUDA device; the model is on {device}")
    return device.type == "cuda" and setting != "off"


def row_buckets(max_rows: int) -> list[int]:
    """The row counts a step is padded to: 1, 2, 4, ... and `max_rows`."""
    return sorted({min(1 << i, max_rows) for i in range(max_rows.bit_length() + 1)})


def verify_positions(max_rows: int, num_spec_tokens: int, adaptive: bool, graphs: bool) -> int:
    """The most positions a verify forward of an engine with `max_rows` slots takes: rows x (W+1) at its
    widest (`width_costs.step_widths`), what the memory plan sizes the step's intermediates for."""
    widths = step_widths(row_buckets(max_rows), num_spec_tokens, adaptive, graphs)
    return max(r * (max(ws) + 1) for r, ws in widths.items())


def greedy_step_keys(rows: Sequence[int], widths: Mapping[int, Sequence[int]]) -> list[tuple]:
    """The step keys greedy decoding can meet: every row bucket x that bucket's widths (with the draft's context fed:
    the written-off state is rare and captured when met)."""
    return [("step", r, w, GREEDY, True) for r in rows for w in widths[r]]


@torch.inference_mode()
def capture_steps(graphs: "StepGraphs", keys: Sequence[tuple], run_step: Callable[[tuple], None]) -> float:
    """Capture `keys` up front (`run_step(key)` runs the engine's step for a key: eagerly, then captured);
    stops at a failed capture (graphs off). Logs the count and returns the seconds."""
    started = time.perf_counter()
    for key in keys:
        if graphs.disabled:
            break
        run_step(key)
    torch.cuda.synchronize(graphs.device)
    seconds = time.perf_counter() - started
    log.info("captured %d CUDA graphs in %.1f s%s", len(graphs.graphs), seconds,
             "; then a capture failed: graphs are off" if graphs.disabled else "")
    return seconds


class StepGraphs:
    """Graphs by step key, all captured on one side stream into one memory pool: the caching allocator
    reuses a block only on the stream that allocated it, so a stream per capture would split the pool.
    `required` (`cuda_graphs: on`): a failed capture raises; otherwise the first failure turns graphs off
    for this engine (one log line) and every step runs eagerly from then on."""

    def __init__(self, device: torch.device, required: bool = False):
        self.device, self.required = device, required
        self.pool = torch.cuda.graph_pool_handle()
        self.stream = torch.cuda.Stream(device)
        self.graphs: dict[Hashable, torch.cuda.CUDAGraph] = {}
        self.disabled = False

    def run(self, key: Hashable, step: Callable[[], None]) -> bool:
        """Replay `key`'s graph (True), or run `step` eagerly and capture it (False: a first use)."""
        graph = self.graphs.get(key)
        if graph is not None:
            graph.replay()
            return True
        step()  # the real step, and the capture's warm-up
        if self.disabled:
            return True  # graphs are off: an ordinary eager step
        self._capture(key, step)
        return False

    def _capture(self, key: Hashable, step: Callable[[], None]):
        graph = torch.cuda.CUDAGraph()
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        try:
            with torch.cuda.stream(self.stream), torch.cuda.graph(graph, pool=self.pool, stream=self.stream):
                step()
        except Exception as exc:  # noqa: BLE001 -- any capture failure: graphs off, or an error under `on`
            if self.required:
                raise RuntimeError(f"CUDA graph capture failed for step {key} (runtime.cuda_graphs=on; "
                                   f"'auto' would run eagerly instead): {exc}") from exc
            log.warning("CUDA graph capture failed for step %s: %s; CUDA graphs are off for this engine", key, exc)
            self.disabled = True
            return
        finally:
            torch.cuda.current_stream(self.device).wait_stream(self.stream)
        self.graphs[key] = graph
