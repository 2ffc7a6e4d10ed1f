"""The engine's memory plan and its slot count: bytes beyond the weights, from the shapes alone (README "Memory").

`memory_plan` and `plan_slots` are pure functions of the model configs and the engine's sizes, so a plan can
be computed (and tested) for a device this machine does not have. The engine checks the plan against free
device memory before allocating, and with `max_batch_size: auto` sizes its slots from it (`auto_slots`).
"""

from __future__ import annotations

import logging
import os
from typing import Callable

import torch

from domino_ray.spec.sampling_params import MAX_LOGPROBS

log = logging.getLogger(__name__)

# Slot counts `auto` may choose: vLLM resolves max_num_seqs to 1024 on an H100, and row buckets are powers of two.
MAX_AUTO_SLOTS = 1024


def memory_plan(target_config, draft_config, *, max_rows: int, num_spec_tokens: int, capacity: int,
                max_prefill_tokens: int, itemsize: int, cuda_graphs: bool = False,
                verify_positions: int | None = None, deferred_positions: int = 0) -> dict[str, int]:
    """Bytes the engine preallocates or peaks at beyond the weights. `draft_config`: a DraftConfig or None
    (target only); `capacity`: KV positions per slot; `itemsize`: bytes per element of the model dtype;
    `cuda_graphs`: the captured steps keep their own pool (about one decode step) beside the eager cache;
    `verify_positions`: the most positions a verify forward takes (rows x (W+1)), default all rows at K+1;
    `deferred_positions`: per slot, the taps kept for the draft's context (`context_ring.DEFERRED_STEPS`)."""
    cfg, elt = target_config, itemsize
    r, t = max_rows, capacity
    p = verify_positions or r * (num_spec_tokens + 1)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    groups = cfg.num_attention_heads // cfg.num_key_value_heads
    draft = draft_config
    draft_kv = 2 * draft.num_hidden_layers * r * draft.num_key_value_heads * t * draft.head_dim * elt if draft else 0
    # The largest decode bucket's intermediates. Logits, and when sampling fp32 probabilities + a float64
    # CDF (12 bytes); with top-k/top-p also the sort (fp32 values + int64 indices) and two fp32 masked
    # copies (20 bytes); with penalties the adjusted fp32 logits, the block's counts, one fp32 temporary and
    # three masks (15 bytes, `penalties.RowPenalties.apply`); with logprobs their fp32 log-softmax (4 bytes).
    # The widest activations, one layer's attention scores and the additive key mask.
    logits = p * cfg.vocab_size * (elt + 12 + 20 + 15 + 4)
    step = logits + p * 4 * cfg.intermediate_size * elt + p * cfg.num_attention_heads * t * 4 + p * groups * t * elt
    if draft:  # the draft block's base logits (fp32 for the correction loop) and its attention scores
        vocab = draft.draft_vocab_size or draft.vocab_size
        step += r * draft.block_size * (vocab * (elt + 4) + draft.num_attention_heads * t * 4)
    # Prefill: the widest activations of `max_prefill_tokens` positions, plus the draft's context inputs
    # (the tapped hidden states, their projection and every draft layer's keys and values).
    prefill = max_prefill_tokens * (6 * cfg.hidden_size + 3 * cfg.intermediate_size) * elt
    if draft:
        taps = len(draft.target_layer_ids) * cfg.hidden_size
        prefill += max_prefill_tokens * (taps + cfg.hidden_size
                                         + 2 * draft.num_hidden_layers * draft.num_key_value_heads * draft.head_dim) * elt
    plan = {"target_kv": 2 * cfg.num_hidden_layers * r * cfg.num_key_value_heads * t * head_dim * elt,
            "draft_kv": draft_kv, "decode_step": step, "prefill_peak": prefill,
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


def plan_slots(budget_bytes: int, plan_for: Callable[[int], dict[str, int]], most: int = MAX_AUTO_SLOTS) -> int:
    """The most slots (1..`most`) whose plan fits `budget_bytes`; 0 when not even one does. `plan_for(rows)`
    is a memory plan, which grows with the rows: a bisection."""
    fits = lambda rows: sum(plan_for(rows).values()) <= budget_bytes  # noqa: E731
    if not fits(1):
        return 0
    lo, hi = 1, most
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    return lo


def auto_slots(device: torch.device, utilization: float, plan_for: Callable[[int], dict[str, int]]) -> tuple[int, str]:
    """`max_batch_size: auto`: (slots, a one-line report). CUDA: the most slots whose plan fits `utilization`
    of the memory free after the weights. CPU: 8 slots per thread (8..64: more rows only queue behind the
    cores) within `utilization` of a quarter of the available host memory."""
    if device.type == "cuda":
        where, budget, most = str(device), utilization * free_device_memory(device), MAX_AUTO_SLOTS
    else:
        host = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        where, budget, most = "host", utilization * host / 4, min(64, max(8, 8 * torch.get_num_threads()))
    rows = plan_slots(int(budget), plan_for, most)
    if rows == 0:
        raise ValueError(f"generation.max_batch_size=auto: not one slot fits {budget / 2**30:.1f} GiB on {where} "
                         f"(runtime.gpu_memory_utilization={utilization}; one slot needs "
                         f"{sum(plan_for(1).values()) / 2**30:.1f} GiB): lower model.max_model_len or "
                         "generation.max_prefill_tokens")
    report = f"max_batch_size=auto: {rows} slots on {where} (budget {budget / 2**30:.1f} GiB; plan {_gib(plan_for(rows))})"
    log.info(report)
    return rows, report


def free_device_memory(device) -> int:
    """Free bytes on a CUDA device, counting what torch's allocator has cached but not handed out."""
    free, _ = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)


def check_memory_fits(plan: dict[str, int], free_bytes: int, device, utilization: float = 0.9) -> None:
    """Fail with advice instead of an opaque out-of-memory error: buffers are static per slot."""
    need = sum(plan.values())
    if need > utilization * free_bytes:
        raise ValueError(f"the engine needs {need / 2**30:.1f} GiB beyond the weights ({_gib(plan)}) but "
                         f"{free_bytes / 2**30:.1f} GiB are free on {device} (runtime.gpu_memory_utilization="
                         f"{utilization}): lower generation.max_batch_size, model.max_model_len or "
                         "generation.max_prefill_tokens")


def _gib(plan: dict[str, int]) -> str:
    return ", ".join(f"{k} {v / 2**30:.2f}" for k, v in plan.items()) + " GiB"
