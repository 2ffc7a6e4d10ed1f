"""The engine's memory plan: bytes beyond the weights, from the shapes alone (README "Memory").

A pure function of the model configs and the engine's sizes, so a plan can be computed (and tested) for a
device this machine does not have. The engine checks it against free device memory before allocating.
"""

from __future__ import annotations


def memory_plan(target_config, draft_config, *, max_rows: int, num_spec_tokens: int, capacity: int,
                max_prefill_tokens: int, itemsize: int) -> dict[str, int]:
    """Bytes the engine preallocates or peaks at beyond the weights. `draft_config`: a DraftConfig or None
    (target only); `capacity`: KV positions per slot; `itemsize`: bytes per element of the model dtype."""
    cfg, elt = target_config, itemsize
    r, q, t = max_rows, num_spec_tokens + 1, capacity
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    groups = cfg.num_attention_heads // cfg.num_key_value_heads
    draft = draft_config
    draft_kv = 2 * draft.num_hidden_layers * r * draft.num_key_value_heads * t * draft.head_dim * elt if draft else 0
    # The largest decode bucket's intermediates: logits (+ float32 probabilities and float64 CDF when
    # sampling), the widest activations, one layer's attention scores and the key mask. CUDA graphs share
    # one pool, so this is also about what the captured graphs hold.
    step = r * q * (cfg.vocab_size * (elt + 4 + 8) + 4 * cfg.intermediate_size * elt) \
        + r * cfg.num_attention_heads * q * t * 4 + r * groups * q * t
    prefill = max_prefill_tokens * (6 * cfg.hidden_size + 3 * cfg.intermediate_size) * elt
    return {"target_kv": 2 * cfg.num_hidden_layers * r * cfg.num_key_value_heads * t * head_dim * elt,
            "draft_kv": draft_kv, "decode_step": step, "prefill_peak": prefill}


def check_memory_fits(plan: dict[str, int], free_bytes: int, device) -> None:
    """Fail with advice instead of an opaque out-of-memory error: buffers are static per slot."""
    need = sum(plan.values())
    if need > 0.9 * free_bytes:
        parts = ", ".join(f"{k} {v / 2**30:.2f}" for k, v in plan.items())
        raise ValueError(f"the engine needs {need / 2**30:.1f} GiB beyond the weights ({parts} GiB) but "
                         f"{free_bytes / 2**30:.1f} GiB are free on {device}: lower generation.max_batch_size, "
                         "model.max_model_len or generation.max_prefill_tokens")
