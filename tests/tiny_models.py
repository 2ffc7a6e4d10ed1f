"""Tiny random targets and drafts built from configs (no downloads), shared by the tests."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from domino_ray.draft import DominoDraft, DraftConfig

VOCAB = 96


def tiny_target(kind: str = "qwen3", *, seed: int = 0, vocab: int = VOCAB, layers: int = 4,
                dtype: torch.dtype = torch.float64, max_positions: int = 512):
    """float64 by default: greedy equality tests compare argmaxes, and float64 keeps near-ties from
    flipping between differently shaped (but mathematically equal) computations."""
    torch.manual_seed(seed)
    common = dict(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=max_positions,
                  eos_token_id=None, bos_token_id=None, pad_token_id=None)
    if kind == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(**common))
    elif kind == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common))
    else:
        raise ValueError(kind)
    # Random init gives nearly flat logits; scaling the head up makes continuations less repetitive.
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    model.generation_config.eos_token_id = None
    return model.to(dtype).eval()


def tiny_draft_config(target, *, block_size: int = 4, shift_label: bool = True, num_uncorrected: int = 1,
                      head: bool = True, draft_vocab: int | None = None, layer_ids=(0, 2)) -> DraftConfig:
    cfg = target.config
    return DraftConfig(
        hidden_size=cfg.hidden_size, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, vocab_size=cfg.vocab_size, block_size=block_size,
        target_layer_ids=tuple(layer_ids), mask_token_id=cfg.vocab_size - 1, shift_label=shift_label,
        num_uncorrected=num_uncorrected if head else 0, emb_dim=16 if head else None,
        gru_hidden_dim=24 if head else None, draft_vocab_size=draft_vocab, has_d2t=draft_vocab is not None,
    )


def tiny_draft(target, *, seed: int = 1, dtype: torch.dtype | None = None, **kwargs) -> DominoDraft:
    torch.manual_seed(seed)
    cfg = tiny_draft_config(target, **kwargs)
    draft = DominoDraft(cfg)
    if cfg.draft_vocab_size is not None:
        # speculators-style pruned vocabulary: a sorted subset of target ids, lm_head rows copied.
        kept = torch.randperm(cfg.vocab_size)[:cfg.draft_vocab_size].sort().values
        with torch.no_grad():
            draft.d2t.copy_(kept - torch.arange(cfg.draft_vocab_size))
            draft.lm_head.weight.copy_(target.lm_head.weight[kept].float())
    weight = next(target.parameters())
    return draft.to(dtype or weight.dtype).eval()


def ragged_prompts(n: int, *, seed: int = 0, vocab: int = VOCAB, min_len: int = 1, max_len: int = 24) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(min_len, max_len + 1, (n,), generator=g).tolist()
    return [torch.randint(0, vocab - 1, (m,), generator=g).tolist() for m in lengths]


def hf_greedy(target, prompt: list[int], max_new_tokens: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                          min_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()
