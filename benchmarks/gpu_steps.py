"""The GPU check's step timing and forcing (`bench_gpu.py`): decode-only steps over ragged rows set up in free slots,
the bytes a step reads against the device's peak bandwidth, and `Forced`, drafts replaced by references on the device.
"""

from __future__ import annotations

import time
from itertools import accumulate

import torch

from domino_ray.engine.core import SpecEngine
from domino_ray.spec_decode.proposer import DominoProposer
from domino_ray.sample.sampling import GREEDY

# Peak memory bandwidth (bytes/s) by device name: (names it must contain, bandwidth); first match wins
PEAK_BANDWIDTH = ((("H200",), 4.8e12), (("H100", "PCIe"), 2.0e12), (("H100", "HBM3"), 3.35e12),
                  (("H100", "SXM"), 3.35e12))


def peak_bandwidth(device_name: str) -> float | None:
    return next((bw for names, bw in PEAK_BANDWIDTH if all(n in device_name for n in names)), None)


class Forced:
    """The real draft's step, then (when `on`) its drafts replaced on the device by each slot's reference
    continuation: forced full acceptance at the real drafting cost, capturable. `refs [R, L]` follow the rows through
    `follow_rows`: a row's reference is loaded into its slot when it joins, and moves with it."""

    graph_safe = True

    def __init__(self, inner: DominoProposer, max_rows: int, max_len: int, device):
        self.inner, self.config, self.draft, self.on = inner, inner.config, inner.draft, False
        self.num_spec_tokens, self.block_size = inner.num_spec_tokens, inner.block_size
        self.target_layer_ids = inner.target_layer_ids
        self.refs = torch.zeros(max_rows, max_len, dtype=torch.long, device=device)  # [R, L] prompt + continuation
        self.ahead = torch.arange(1, self.num_spec_tokens + 1, device=device)        # [K]
        self.by_request: dict[int, list[int]] = {}  # request id -> prompt + reference continuation

    def load(self, slot: int, request_id: int):
        ref = self.by_request.get(request_id, [])[:self.refs.shape[1]]
        self.refs[slot].zero_()
        self.refs[slot, :len(ref)].copy_(torch.tensor(ref, dtype=torch.long))

    def allocate(self, *a):
        self.inner.allocate(*a)

    def append_context(self, *a):
        self.inner.append_context(*a)

    def propose(self, r, anchor, offsets, keys, width, *rest):
        drafts = self.inner.propose(r, anchor, offsets, keys, width, *rest)
        if not self.on:
            return drafts
        index = (offsets[:, None] + self.ahead[:width]).clamp(max=self.refs.shape[1] - 1)  # [r, W] after the anchor
        return self.refs[:r].gather(1, index)


def follow_rows(engine: SpecEngine, forced: Forced):
    """Rows joining take slots `len(engine.rows)..` in `engine.rows`' order (`SpecEngine._join`): load their
    references before their first step; a slot move (`SpecEngine._vacate` -> `runner.move_slots`) moves them."""
    join, move = engine._join, engine.runner.move_slots

    def join_with_refs(events, done, last):
        first = len(engine.rows)
        join(events, done, last)
        for slot in range(first, len(engine.rows)):
            forced.load(slot, engine.rows[slot].request.request_id)

    def move_with_refs(src, dst):
        move(src, dst)
        forced.refs[dst] = forced.refs[src]  # an index tensor gathers the sources first, as `move_slots` does
    engine._join, engine.runner.move_slots = join_with_refs, move_with_refs


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def ragged_lengths(engine, mean: int, seed: int = 0) -> tuple[list[int], list[int]]:
    """Lengths uniform in [0.75, 1.25] x `mean` for every row the engine holds, and the blocks each takes (its length
    and a step's positions), as many rows as the pool holds."""
    g = torch.Generator().manual_seed(seed)
    most = engine.max_model_len - engine.span
    lengths = [min(x, most) for x in torch.randint(mean * 3 // 4, mean * 5 // 4 + 1, (engine.max_rows,), generator=g)
               .tolist()]
    need = [-(-(x + engine.span) // engine.block_size) for x in lengths]
    fits = sum(1 for total in accumulate(need) if total <= engine.kv_blocks - 1)
    return lengths[:fits], need[:fits]


def set_rows(engine, lengths: list[int], need: list[int]):
    """Slots `0..len(lengths)` hold rows of `lengths` in `need` distinct blocks each (their keys are whatever the pool
    holds: timing needs none); the other slots are free (inert padding rows)."""
    runner = engine.runner
    runner.lens.zero_()
    runner.block_tables.zero_()
    for i, ids in enumerate(torch.arange(1, 1 + sum(need), dtype=torch.int32).split(need)):
        runner.block_tables[i, :len(ids)] = ids.to(engine.device)
    runner.lens[:len(lengths)] = torch.tensor(lengths, device=engine.device)


def time_decode(engine, row_counts, mean: int, weights: dict, kv_token: dict, peak: float | None, repeats: int):
    """Decode-only ms/step (`SpecEngine._device_step`, with graphs its replay) at each row count, rows at ragged
    lengths around `mean` in distinct blocks (as `measure_costs` sets free slots up: lengths and tables only, no
    prefill: timing needs no real keys), at W = 0 and the widest width graphed; restored to free slots after."""
    runner, bs, span = engine.runner, engine.block_size, engine.span
    lengths, need = ragged_lengths(engine, mean)
    counts = sorted({len(lengths) if c == "max" else int(c) for c in row_counts} - {0})
    paged = runner.kv.kernel or runner.kv.triton
    out = []
    try:
        for n in [c for c in counts if c <= len(lengths)]:
            bucket = next(b for b in engine.row_buckets if b >= n)
            r = bucket if engine.pad_rows else n
            set_rows(engine, lengths[:n], need[:n])
            key_len = engine.capacity if engine.cuda_graphs else -(-(max(lengths[:n]) + span) // bs) * bs
            for w in sorted({min(engine.widths[bucket]), max(engine.widths[bucket])}):
                replay = ("step", r, w, GREEDY, True) in (engine.graphs.graphs if engine.graphs else {})
                engine._device_step(r, key_len, w, GREEDY, True)  # warm-up (without a graph yet: its capture)
                sync(engine.device)
                start = time.perf_counter()
                for _ in range(repeats):
                    engine._device_step(r, key_len, w, GREEDY, True)
                sync(engine.device)
                ms = 1e3 * (time.perf_counter() - start) / repeats
                models = ("target", "draft") if w else ("target",)
                keys = sum(lengths[:n]) if paged else r * key_len
                kv = keys * sum(kv_token[m] for m in models)
                weight = sum(weights[m] for m in models) + (weights["draft_head"] if w else 0)
                tb_s = (weight + kv) / ms / 1e9
                out.append({"rows": n, "bucket": r, "width": w, "mean_length": sum(lengths[:n]) / n, "ms_per_step": ms,
                            "replay": replay, "attention": "paged" if paged else "gather", "key_len": key_len,
                            "keys_read": keys, "weights_bytes": weight, "kv_bytes": kv, "bytes_per_step": weight + kv,
                            "TB_per_s": tb_s, "bandwidth_fraction": tb_s * 1e12 / peak if peak else None})
                print(f"decode rows {n:>4} (bucket {r}) W={w:<2} {ms:8.2f} ms/step, {(weight + kv) / 1e9:.3g} GB read "
                      f"({kv / 1e9:.3g} KV), {tb_s:.3g} TB/s" + (f" = {tb_s * 1e12 / peak:.0%} of peak" if peak else ""),
                      flush=True)
    finally:  # free slots again: inert padding rows
        runner.lens.zero_()
        runner.block_tables.zero_()
        if engine.ring.deferred:
            engine.ring.deferred.clear()
    return out


def time_parts(engine, r: int, lengths: list[int], need: list[int], k: int, repeats: int) -> dict:
    """ms per call of the draft step and of the verify step at width K over slots `0..r` (rows at `lengths` in distinct
    blocks), each captured as its own graph with graphs on (else eager); free slots again after."""
    runner, n = engine.runner, len(lengths)
    key_len = engine.capacity if engine.cuda_graphs else -(-(max(lengths) + engine.span) // engine.block_size) * \
        engine.block_size
    out = {}
    try:
        set_rows(engine, lengths, need)
        for name, fn in (("draft_step_ms", lambda: runner.draft(r, key_len, k)),
                         ("verify_step_ms", lambda: runner.verify(r, key_len, k, GREEDY))):
            call = fn
            if engine.graphs is not None:
                engine.graphs.run(("bench", name), fn)  # runs once, captures
                call = engine.graphs.graphs[("bench", name)].replay
            call()
            sync(engine.device)
            start = time.perf_counter()
            for _ in range(repeats):
                call()
            sync(engine.device)
            out[name] = 1e3 * (time.perf_counter() - start) / repeats
    finally:
        runner.lens.zero_()
        runner.block_tables.zero_()
    out["rows"], out["mean_length"] = n, sum(lengths) / max(n, 1)
    return out

