"""CUDA graphs for the engine's fixed-shape steps: captured once per key, replayed every step.

A step (`SpecEngine._draft_step`, `_verify_step`) reads and writes only the engine's preallocated
buffers, with shapes fixed by its key, and makes no host sync, so its kernels can be recorded once and
replayed. The keys (`SpecEngine._device_step`):
  ("draft", r, groups, W)                                 the draft block + correction loop for W tokens
  ("verify", r, groups, W, sampled, filtered, context)    target forward over W+1 positions and acceptance
with r the row bucket, groups the key groups (`key_groups.py`; with graphs always the one range `((r, t),)`,
t the key bucket, a multiple of `kv_chunk`: several ranges would make the keys combinatorial), W the verify
width (0, 1, 2, 4, ..., K with an adaptive width; K otherwise), `sampled`/`filtered` the rows' sampling mode
(`sampling.sampling_mode`) and `context` whether the step feeds the draft's context (off only while the
adaptive width has written the draft off). The first call of a key runs eagerly: it is the real step
and the warm-up the capture needs (lazy kernels, cuBLAS workspaces, allocator state). The capture that
follows only records (kernels do not run while capturing), so it changes no state. All graphs share one
memory pool, captured on one stream; a capture that fails raises under `cuda_graphs: on`, and otherwise
turns graphs off for the engine (logged once).

Capturing lazily bounds the graphs to the keys a workload meets: all of them ahead of time would be
thousands (row buckets x key buckets x widths x modes).
"""

from __future__ import annotations

import logging
from typing import Callable, Hashable

import torch

log = logging.getLogger(__name__)


def use_cuda_graphs(setting: str, device: torch.device) -> bool:
    """`runtime.cuda_graphs`: auto (on for CUDA devices) | on | off."""
    if setting not in ("auto", "on", "off"):
        raise ValueError(f"cuda_graphs={setting!r} must be one of auto, on, off")
    if setting == "on" and device.type != "cuda":
        raise ValueError(f"cuda_graphs=on needs a CUDA device; the model is on {device}")
    return device.type == "cuda" and setting != "off"


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

    def run(self, key: Hashable, step: Callable[[], None]):
        graph = self.graphs.get(key)
        if graph is not None:
            graph.replay()
            return
        step()  # the real step, and the capture's warm-up
        if not self.disabled:
            self._capture(key, step)

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
