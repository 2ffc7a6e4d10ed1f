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


CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)
SPECIALS = ["<unk>", "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]
CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "speculative decoding drafts tokens and the target verifies them",
    "a batch of prompts becomes a batch of completions",
    "def add(a, b):\n    return a + b\n",
    "Ray runs actors on many machines; Parquet stores the results.",
    "0123456789 ,.:;!?'\"()[]{}<>=+-*/_#@$%&|\\^~`",
]


def tiny_tokenizer(vocab_size: int = VOCAB):
    """A small BPE tokenizer with Qwen-style chat markers; ids < vocab_size - 1 (the last id is the mask)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - 1, special_tokens=SPECIALS, show_progress=False)
    tok.train_from_iterator(CORPUS, trainer=trainer)
    assert tok.get_vocab_size() <= vocab_size - 1, tok.get_vocab_size()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>", chat_template=CHAT_TEMPLATE)


def save_tiny_pair(directory, *, block_size: int = 4, seed: int = 0, dtype: torch.dtype = torch.float32):
    """Write a tiny Qwen3 target (with tokenizer, EOS = <|im_end|>) and a Domino draft in the HF/DFlash
    layout under `directory`; returns (target_dir, draft_dir) as strings."""
    from pathlib import Path

    from domino_ray.checkpoint import save_draft

    directory = Path(directory)
    target = tiny_target("qwen3", seed=seed, dtype=dtype)
    tokenizer = tiny_tokenizer(target.config.vocab_size)
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    target.config.eos_token_id = eos
    target.generation_config.eos_token_id = eos
    target.save_pretrained(directory / "target")
    tokenizer.save_pretrained(directory / "target")
    save_draft(tiny_draft(target, seed=seed + 1, block_size=block_size), directory / "draft")
    return str(directory / "target"), str(directory / "draft")


class Recorder:
    """Wraps a proposer and records (request_id, committed count, drafts) for every row and step."""

    def __init__(self, inner):
        self.inner, self.records = inner, []
        self.num_draft_tokens, self.target_layer_ids = inner.num_draft_tokens, inner.target_layer_ids
        self.block_size = inner.block_size

    def allocate(self, *a):
        self.inner.allocate(*a)

    def append_context(self, *a):
        self.inner.append_context(*a)

    def move_row(self, *a):
        self.inner.move_row(*a)

    def propose(self, r, anchor, offsets, kv_len, committed, request_ids):
        drafts = self.inner.propose(r, anchor, offsets, kv_len, committed, request_ids)
        self.records += list(zip(request_ids, committed, drafts.tolist()))  # real rows only (zip stops at them)
        return drafts
