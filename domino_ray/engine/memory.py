"""The engine's memory plan, its row cap and its KV pool: bytes beyond the weights, from the shapes alone (docs/engine.md
"Memory").

`memory_plan`, `plan_slots` and `size_engine` are pure functions of the model configs and the engine's sizes, so a
plan can be computed (and tested) for a device this machine does not have. The engine checks the plan against free
device memory before allocating; with `max_batch_size: auto` and `kv_cache_tokens: auto` it sizes its rows and its
KV pool from it (`size_engine`).
"""

from __future__ import annotations

import logging
from typing import Callable

import torch

from domino_ray.backend.malloc import host_memory_available
from domino_ray.engine.context_ring import DEFERRED_STEPS
from domino_ray.engine.step_graphs import verify_positions
from domino_ray.sample.params import MAX_LOGPROBS
from domino_ray.target.packed_linear import kv_dtype

log = logging.getLogger(__name__)

# Slot counts `auto` may choose: vLLM resolves max_num_seqs to 1024 on an H100, and row buckets are powers of two.
MAX_AUTO_SLOTS = 1024


def kv_bytes_per_token(target_config, draft_config, itemsize: int) -> int:
    """Bytes one position of a row takes in the KV pools: the target's keys and values in every layer, and the
    draft's context (`draft_config` None: target only)."""
    cfg = target_config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    out = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * itemsize
    if draft_config is not None:
        out += 2 * draft_config.num_hidden_layers * draft_config.num_key_value_heads * draft_config.head_dim * itemsize
    return out


def memory_plan(target_config, draft_config, *, max_rows: int, num_spec_tokens: int, capacity: int,
                max_prefill_tokens: int, itemsize: int, kv_blocks: int = 0, block_size: int = 16, kv_itemsize: int = 0,
                cuda_graphs: bool = False, paged_kernel: bool = False, verify_positions: int | None = None,
                deferred_positions: int = 0, prefill_in_place: bool | None = None) -> dict[str, int]:
    """Bytes the engine preallocates or peaks at beyond the weights. `draft_config`: a DraftConfig or None
    (target only); `capacity`: KV positions a row may reach; `kv_blocks`: the KV pool's blocks of `block_size`
    positions (0: the plan without its pool); `itemsize`: bytes per element of the model dtype; `cuda_graphs`: the
    captured steps keep their own pool (about one decode step) beside the eager cache; `paged_kernel`: attention reads
    the pool in place (our CPU and Triton kernels; otherwise a step gathers the longest row's keys and builds a mask);
    `verify_positions`: the most positions a verify forward takes (rows x (W+1)), default all rows at K+1;
    `deferred_positions`: per slot, the taps kept for the draft's context (`context_ring.DEFERRED_STEPS`);
    `kv_itemsize`: bytes per element of the KV pools (default `itemsize`; 2 for bf16 pools under fp32 activations);
    `prefill_in_place`: a prefill reads its rows' earlier keys in place (our Triton kernel, `KVPool.triton`) rather
    than gathering them (`prefill_attention_bytes`); None: as `paged_kernel` (a CUDA engine's in-place kernel is the
    Triton one; a CPU engine's prefill gathers even with our CPU kernel, so pass False there)."""
    cfg, elt = target_config, itemsize
    r, t = max_rows, capacity
    p = verify_positions or r * (num_spec_tokens + 1)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    groups = cfg.num_attention_heads // cfg.num_key_value_heads
    draft = draft_config
    # The largest decode bucket's intermediates. Logits, and when sampling fp32 probabilities + a float64
    # CDF (12 bytes); with top-k/top-p also the sort (fp32 values + int64 indices) and two fp32 masked
    # copies (20 bytes); with penalties the adjusted fp32 logits, the block's counts, one fp32 temporary and
    # three masks (15 bytes, `penalties.RowPenalties.apply`); with logprobs their fp32 log-softmax (4 bytes).
    # The widest activations; without a paged kernel, one layer's gathered keys and values, its attention scores and
    # the additive key mask (an upper bound: the longest row's keys for every row).
    logits = p * cfg.vocab_size * (elt + 12 + 20 + 15 + 4)
    step = logits + p * 4 * cfg.intermediate_size * elt
    if not paged_kernel:
        step += p * cfg.num_attention_heads * t * 4 + p * groups * t * elt + 2 * r * cfg.num_key_value_heads * t * head_dim * elt
    if draft:  # the drafts' base logits (fp32 for the correction loop: W <= the verify's positions) and attention scores
        vocab = draft.draft_vocab_size or draft.vocab_size
        step += p * vocab * (elt + 4)
        if not paged_kernel:
            step += r * draft.block_size * draft.num_attention_heads * t * 4
    # Prefill: the widest activations of `max_prefill_tokens` positions, one layer's attention, plus the draft's context
    # inputs (the tapped hidden states, their projection and every draft layer's keys and values).
    in_place = paged_kernel if prefill_in_place is None else prefill_in_place
    prefill = max_prefill_tokens * (6 * cfg.hidden_size + 3 * cfg.intermediate_size) * elt \
        + prefill_attention_bytes(cfg, max_prefill_tokens, t, elt, in_place)
    if draft:
        taps = len(draft.target_layer_ids) * cfg.hidden_size
        prefill += max_prefill_tokens * (taps + cfg.hidden_size
                                         + 2 * draft.num_hidden_layers * draft.num_key_value_heads * draft.head_dim) * elt
    plan = {"kv_pool": kv_blocks * block_size * kv_bytes_per_token(cfg, draft, kv_itemsize or elt),
            "block_tables": r * (t // block_size) * 4, "decode_step": step, "prefill_peak": prefill,
            "target_rope": 2 * t * head_dim * elt,  # rotary cos/sin of every position (`target_forward.rotary_table`)
            # per slot: the penalties' counts and masks over the vocabulary, and a step's logprobs (fp32 values,
            # int64 ids: `runner.StepRunner`), both at fixed addresses
            "sampling_state": r * (6 * cfg.vocab_size + (num_spec_tokens + 1) * (1 + MAX_LOGPROBS) * 12)}
    if draft:  # the draft's rotary cos/sin of every position (`DominoProposer.allocate`)
        plan["draft_rope"] = 2 * t * draft.head_dim * elt
    if draft and deferred_positions:
        plan["deferred_taps"] = r * deferred_positions * len(draft.target_layer_ids) * cfg.hidden_size * elt
    if cuda_graphs:
        plan["graph_pool"] = step
    return plan


def prefill_attention_bytes(target_config, tokens: int, capacity: int, itemsize: int, in_place: bool) -> int:
    """Bytes one layer's prefill attention (`kv.pools.prefill_attention`) allocates over `tokens` packed query positions
    in rows of up to `capacity` keys. Either path: the output `[N, H, D]`, a segment's SDPA output before it is copied
    in (or concatenated) and its fp32 log-sum-exp; the Triton kernel's tile plan and tables fit in the latter. That is
    all when the rows are read in place (our Triton kernel): O(N H D) at any row length. Gathered, also a row's keys
    and values and its additive mask `[n, L]` (torch's math kernel, which SDPA takes for that mask on CUDA, also makes
    fp32 scores `[H, n, L]`: not counted, CUDA's path being the Triton one)."""
    cfg = target_config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    outputs = tokens * cfg.num_attention_heads * (2 * head_dim * itemsize + 4)
    if in_place:
        return outputs
    return outputs + tokens * capacity * itemsize + 2 * cfg.num_key_value_heads * capacity * head_dim * itemsize


def plan_slots(budget_bytes: int, plan_for: Callable[[int], dict[str, int]], most: int = MAX_AUTO_SLOTS) -> int:
    """The most rows (1..`most`) whose plan fits `budget_bytes`; 0 when not even one does. `plan_for(rows)`
    is a memory plan, which grows with the rows."""
    return _most(lambda rows: sum(plan_for(rows).values()) <= budget_bytes, most)


def _most(holds: Callable[[int], bool], most: int) -> int:
    """The largest n in 1..`most` for which `holds(n)`, for a `holds` true up to some n and false after (a
    bisection); 0 when `holds(1)` is false."""
    if not holds(1):
        return 0
    lo, hi = 1, most
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if holds(mid) else (lo, mid - 1)
    return lo


AUTO_ROW_TOKENS = 1024  # with rows and pool both `auto`: as many rows as the pool holds at this mean row length


def memory_budget(device: torch.device, utilization: float) -> tuple[int, str, int]:
    """(bytes the engine may take beyond the weights, where, most rows `auto` picks). CUDA: `utilization` of the memory
    free after the weights, up to `MAX_AUTO_SLOTS` rows. CPU: `utilization` of a quarter of the available host memory,
    8 rows per thread (8..64: more rows only queue behind the cores)."""
    if device.type == "cuda":
        return int(utilization * free_device_memory(device)), str(device), MAX_AUTO_SLOTS
    host = host_memory_available()
    return int(utilization * host / 4), "host", min(64, max(8, 8 * torch.get_num_threads()))


def size_engine(budget: int, where: str, most_rows: int, rows, tokens, plan_for: Callable[[int, int], dict[str, int]],
                block_size: int, capacity: int, dense_cap: bool) -> tuple[int, int, str]:
    """(rows, pool blocks with the null block, a one-line report) for `generation.max_batch_size` (`rows`: an int or
    "auto") and `generation.kv_cache_tokens` (`tokens`: an int or "auto"); `plan_for(rows, blocks)` is `memory_plan`.
    Both auto: the most rows (up to `most_rows`) that the pool left beside them holds at `AUTO_ROW_TOKENS` tokens each
    (rows cost activations, mostly logits: more rows, a smaller pool), then the pool takes the rest; a fixed pool: the
    most rows that fit beside it. `dense_cap` (CPU): an auto pool holds at most every row at `capacity` (what the
    dense layout held). Raises ValueError naming the key when the pool cannot hold one row at `capacity`."""
    per_block = sum(plan_for(1, 1).values()) - sum(plan_for(1, 0).values())
    row_blocks = capacity // block_size  # one row at its longest
    fixed = None if tokens == "auto" else -(-tokens // block_size) + 1
    pool_blocks = lambda r: (budget - sum(plan_for(r, 0).values())) // per_block  # noqa: E731
    rows_fixed = rows != "auto"
    if rows == "auto":
        if fixed is not None:
            rows = plan_slots(budget, lambda r: plan_for(r, fixed), most_rows)
        else:
            rows = _most(lambda r: r * AUTO_ROW_TOKENS <= pool_blocks(r) * block_size, most_rows) or \
                (1 if pool_blocks(1) > row_blocks else 0)
        if rows == 0:
            raise ValueError(f"generation.max_batch_size=auto: not one row fits {budget / 2**30:.1f} GiB on {where} "
                             f"(runtime.gpu_memory_utilization; one row needs {sum(plan_for(1, 0).values()) / 2**30:.2f}"
                             " GiB beside the KV pool): lower model.max_model_len or generation.max_prefill_tokens")
    blocks = fixed
    if blocks is None:
        blocks = pool_blocks(rows)
        if dense_cap:
            blocks = min(blocks, rows * row_blocks + 1)
    if blocks < row_blocks + 1:
        need = f"one row at model.max_model_len needs {row_blocks * block_size} tokens (with its step's positions)"
        if fixed is None and rows_fixed:  # the rows' own buffers left the pool too little (or nothing)
            rest = sum(plan_for(rows, 0).values())
            raise ValueError(f"generation.max_batch_size={rows}: the KV pool gets what the memory budget leaves beside "
                             f"the rows' other buffers, and {rows} rows leave {max(budget - rest, 0) / 2**30:.2f} of "
                             f"{budget / 2**30:.2f} GiB on {where} (plan without the pool {_gib(plan_for(rows, 0))}); "
                             f"{need}: lower generation.max_batch_size, set generation.kv_cache_tokens, or raise "
                             "runtime.gpu_memory_utilization")
        key = "generation.kv_cache_tokens" if fixed is not None else "runtime.gpu_memory_utilization"
        raise ValueError(f"{key}: the KV pool holds {(blocks - 1) * block_size} tokens but {need}: raise {key} or "
                         "lower model.max_model_len")
    report = (f"{rows} rows at most, KV pool {blocks - 1} blocks x {block_size} = {(blocks - 1) * block_size} tokens "
              f"on {where} (budget {budget / 2**30:.1f} GiB; plan {_gib(plan_for(rows, blocks))})")
    log.info(report)
    return rows, blocks, report


def fit_to_memory(device: torch.device, utilization: float, rows, tokens,
                  plan_for: Callable[[int, int], dict[str, int]], block_size: int, capacity: int) -> tuple[int, int, str]:
    """(rows, pool blocks with the null block, a one-line report) of an engine on `device` within `utilization` of its
    memory (`memory_budget`, `size_engine`: `rows`, `tokens` and `plan_for` as there); on CUDA the whole plan is then
    checked against free memory, before anything is allocated."""
    budget, where, most = memory_budget(device, utilization)
    rows, blocks, report = size_engine(budget, where, most, rows, tokens, plan_for, block_size, capacity,
                                       dense_cap=device.type != "cuda")
    if device.type == "cuda":
        check_memory_fits(plan_for(rows, blocks), free_device_memory(device), device, utilization)
    return rows, blocks, report


def free_device_memory(device) -> int:
    """Free bytes on a CUDA device, counting what torch's allocator has cached but not handed out."""
    free, _ = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)


def check_memory_fits(plan: dict[str, int], free_bytes: int, device, utilization: float = 0.9) -> None:
    """Fail with advice instead of an opaque out-of-memory error: the pool and the buffers are allocated up front."""
    need = sum(plan.values())
    if need > utilization * free_bytes:
        raise ValueError(f"the engine needs {need / 2**30:.1f} GiB beyond the weights ({_gib(plan)}) but "
                         f"{free_bytes / 2**30:.1f} GiB are free on {device} (runtime.gpu_memory_utilization="
                         f"{utilization}): lower generation.kv_cache_tokens, generation.max_batch_size or "
                         "generation.max_prefill_tokens")


def _gib(plan: dict[str, int]) -> str:
    return ", ".join(f"{k} {v / 2**30:.2f}" for k, v in plan.items()) + " GiB"


def engine_plan(engine, rows: int, blocks: int) -> dict[str, int]:
    """`memory_plan` for a built `SpecEngine`: its shapes and attention paths, with `rows` rows and `blocks` blocks."""
    return memory_plan(engine.target.config, getattr(engine.proposer, "config", None),
                       max_rows=rows, num_spec_tokens=engine.num_spec_tokens, capacity=engine.capacity,
                       kv_blocks=blocks, block_size=engine.block_size, max_prefill_tokens=engine.max_prefill_tokens,
                       itemsize=engine.dtype.itemsize, kv_itemsize=kv_dtype(engine.target).itemsize,
                       cuda_graphs=engine.cuda_graphs, paged_kernel=not engine.gathers,
                       prefill_in_place=engine.device.type == "cuda" and not engine.gathers,  # the Triton kernels
                       verify_positions=verify_positions(rows, engine.num_spec_tokens, engine.adaptive,
                                                         engine.cuda_graphs),
                       deferred_positions=DEFERRED_STEPS if engine.defer_context else 0)
