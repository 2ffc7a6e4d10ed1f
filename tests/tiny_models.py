"""Tiny random targets and drafts built from configs (no downloads), shared by the tests."""

from __future__ import annotations

import torch
from transformers import (LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config,
                          Qwen3ForCausalLM)

from domino_ray.spec_decode.draft import DominoDraft, DraftConfig

VOCAB = 96


def tiny_target(kind: str = "qwen3", *, seed: int = 0, vocab: int = VOCAB, layers: int = 4,
                dtype: torch.dtype = torch.float64, max_positions: int = 512, **config):
    """float64 by default: greedy equality tests compare argmaxes, and float64 keeps near-ties from
    flipping between differently shaped (but mathematically equal) computations. `config`: more config
    fields (e.g. `attention_bias=True`)."""
    torch.manual_seed(seed)
    common = dict(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=max_positions,
                  eos_token_id=None, bos_token_id=None, pad_token_id=None)
    common.update(config)
    if kind == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(**common))
    elif kind == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common))
    elif kind == "qwen2":  # q/k/v with biases
        model = Qwen2ForCausalLM(Qwen2Config(**common))
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


def save_tiny_pair(directory, *, block_size: int = 4, seed: int = 0, dtype: torch.dtype = torch.float32,
                   max_positions: int = 512):
    """Write a tiny Qwen3 target (with tokenizer, EOS = <|im_end|>) and a Domino draft in the HF/DFlash
    layout under `directory`; returns (target_dir, draft_dir) as strings."""
    from pathlib import Path

    from domino_ray.spec_decode.checkpoint import save_draft

    directory = Path(directory)
    target = tiny_target("qwen3", seed=seed, dtype=dtype, max_positions=max_positions)
    tokenizer = tiny_tokenizer(target.config.vocab_size)
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    target.config.eos_token_id = eos
    target.generation_config.eos_token_id = eos
    target.save_pretrained(directory / "target")
    tokenizer.save_pretrained(directory / "target")
    save_draft(tiny_draft(target, seed=seed + 1, block_size=block_size), directory / "draft")
    return str(directory / "target"), str(directory / "draft")


def save_agreeing_pair(directory, *, block_size: int = 4, max_positions: int = 512, stop_every: int = 16):
    """`save_tiny_pair`'s files for a pair whose draft the target mostly accepts: `successor_target` with
    the tiny tokenizer (EOS = <|im_end|>) and `successor_draft` in the HF/DFlash layout, float64. The
    end-to-end tests run it so that their greedy and sampled checks cover accepted drafts (`speculation.py`):
    at K = 4 about 60% of greedy tokens and 35-40% of sampled ones (T = 0.8) are accepted drafts, with partial
    and whole-block acceptances, and half the plain prompts stop within 12 tokens, most of them on an accepted
    draft. Returns (target_dir, draft_dir)."""
    from pathlib import Path

    from domino_ray.spec_decode.checkpoint import save_draft

    directory = Path(directory)
    # Seed 2: chat prompts (which all end in the template's same tokens) neither stop at once nor accept
    # only whole blocks, and plain prompts stop inside accepted runs (seen in `speculation.py`'s records).
    target, vectors, predecessor = successor_target(seed=2, max_positions=max_positions)
    tokenizer = tiny_tokenizer(target.config.vocab_size)
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    # More EOS ids (as Qwen3 has two), every `stop_every`-th token along the successor cycle from <|im_end|>:
    # a row following the cycle meets one within `stop_every` tokens, mostly as an accepted draft.
    successor = torch.empty_like(predecessor)
    successor[predecessor] = torch.arange(len(predecessor))
    stops, token = [], eos
    for i in range(len(successor)):
        if i % stop_every == 0:
            stops.append(token)
        token = int(successor[token])
    target.config.eos_token_id = target.generation_config.eos_token_id = stops
    target.save_pretrained(directory / "target")
    tokenizer.save_pretrained(directory / "target")
    draft = successor_draft(target, vectors, predecessor, block_size=block_size, shift_label=True, num_uncorrected=1)
    save_draft(draft, directory / "draft")
    return str(directory / "target"), str(directory / "draft")


class Recorder:
    """Wraps a proposer and records (request_id, committed count, drafts) for every row and step."""

    def __init__(self, inner):
        self.inner, self.records = inner, []
        self.num_spec_tokens, self.target_layer_ids = inner.num_spec_tokens, inner.target_layer_ids
        self.block_size = inner.block_size

    def allocate(self, *a):
        self.inner.allocate(*a)

    def append_context(self, *a):
        self.inner.append_context(*a)

    def propose(self, r, anchor, offsets, keys, width, committed, request_ids):
        drafts = self.inner.propose(r, anchor, offsets, keys, width, committed, request_ids)
        self.records += list(zip(request_ids, committed, drafts.tolist()))  # real rows only (zip stops at them)
        return drafts


# ---- a target and drafts that agree: the accept path, by construction --------------------------------
#
# Hidden dims of `successor_target`: [0, C-2) a unit-scale random vector per token, C-2 a flag that is 1
# for every real token, C-1 the mask token's own direction. `successor_draft` reads them by hand.


def successor_target(*, seed: int = 0, copy_strength: float = 5.0, layer_scale: float = 30.0,
                     max_positions: int = 512):
    """A tiny Qwen3 whose greedy next token is usually `successor[current]` (one random cycle over the
    real tokens) and otherwise what its random layers say (about 1 in 10, depending on the context).

    Its LM head is the random one plus `copy_strength` x a head that maps each token's embedding to
    its successor's logit; its layers are scaled up so the context moves the argmax at times.
    Returns (target, token_vectors [V-1, C-2], predecessor [V-1]) for `successor_draft`.
    """
    target = tiny_target("qwen3", seed=seed, max_positions=max_positions)
    v, c = target.config.vocab_size, target.config.hidden_size
    g = torch.Generator().manual_seed(seed + 100)
    vectors = torch.randn(v - 1, c - 2, generator=g, dtype=torch.float64)
    vectors = vectors / vectors.norm(dim=1, keepdim=True) * c ** 0.5
    embed = torch.zeros(v, c, dtype=torch.float64)
    embed[:v - 1, :c - 2], embed[:v - 1, c - 2], embed[v - 1, c - 1] = vectors, 1.0, c ** 0.5
    order = torch.randperm(v - 1, generator=g)
    successor = torch.empty(v - 1, dtype=torch.long)
    successor[order] = order.roll(-1)
    predecessor = torch.empty(v - 1, dtype=torch.long)
    predecessor[successor] = torch.arange(v - 1)
    dtype = target.lm_head.weight.dtype
    with torch.no_grad():
        target.model.embed_tokens.weight.copy_(embed)
        target.lm_head.weight[:v - 1, :c - 2] += (copy_strength / c) * vectors[predecessor].to(dtype)
        for layer in target.model.layers:
            layer.self_attn.o_proj.weight.mul_(layer_scale)
            layer.mlp.down_proj.weight.mul_(layer_scale)
    return target, vectors, predecessor


def successor_draft(target, vectors, predecessor, *, block_size: int, shift_label: bool,
                    num_uncorrected: int) -> DominoDraft:
    """Hand-set Domino draft for `successor_target`: the backbone copies the anchor into every MASK
    slot (so the base logits, through the target's head, say what the target says without context),
    and the GRU head adds `successor[previous draft]` with a margin that overrides the base. Every
    layout predicts the target's usual continuation, so drafts are accepted often."""
    v, c = target.config.vocab_size, target.config.hidden_size
    t = g = c - 2            # token dims; the GRU state holds one token's vector
    heads, head_dim = 4, 16  # value dims (64) >= t: one layer can move a whole token vector
    cfg = DraftConfig(hidden_size=c, intermediate_size=8, num_hidden_layers=1, num_attention_heads=heads,
                      num_key_value_heads=heads, head_dim=head_dim, vocab_size=v, block_size=block_size,
                      target_layer_ids=(0, 2), mask_token_id=v - 1, shift_label=shift_label,
                      num_uncorrected=num_uncorrected, emb_dim=2 * g, gru_hidden_dim=g)
    draft = DominoDraft(cfg).to(torch.float64)
    state = {k: torch.zeros_like(w) for k, w in draft.state_dict().items()}  # fc = 0: no context; MLP off
    for k in state:
        if k.endswith("norm.weight"):
            state[k] += 1.0
    attn, eye = "layers.0.self_attn.", torch.eye(t, dtype=torch.float64)
    slow = head_dim // 2 - 1  # the lowest RoPE frequency: scores barely depend on the distance
    for h in range(heads):
        state[attn + "q_proj.weight"][h * head_dim + slow, c - 1] = 1.0  # MASK slots query ...
        state[attn + "k_proj.weight"][h * head_dim + slow, c - 2] = 1.0  # ... the one real token (the anchor)
    state[attn + "q_norm.weight"] += 1.5  # score 4 * 2.5^2 = 25: all weight on the anchor
    state[attn + "k_norm.weight"] += 1.5
    state[attn + "v_proj.weight"][:t, :t] = eye
    state[attn + "o_proj.weight"][:t, :t] = 10 * eye
    state["prefix_gru.weight_ih_l0"][g:2 * g, c - 2] = -20.0  # update gate shut: state = tanh(last token / 2)
    state["prefix_gru.weight_ih_l0"][2 * g:, :t] = 0.5 * eye
    state["embed_proj.0.weight"][:g, c:] = eye
    state["embed_proj.0.weight"][g:, c:] = -eye  # silu(s) - silu(-s) = s: the state passes through linearly
    state["embed_proj.2.weight"][:v - 1, :g] = 10 * vectors[predecessor]
    state["embed_proj.2.weight"][:v - 1, g:] = -10 * vectors[predecessor]
    draft.load_state_dict(state)
    return draft.to(next(target.parameters()).dtype).eval()


def load_demo_pair():
    """The shipped demo pair (domino_ray/assets/demo) through the real loaders: (target, tokenizer, draft)."""
    from domino_ray.config import DEMO_ASSETS
    from domino_ray.target.loading import load_target, load_tokenizer
    from domino_ray.spec_decode.checkpoint import load_draft

    target = load_target(str(DEMO_ASSETS / "target"), dtype="auto", device="cpu")
    tokenizer = load_tokenizer(str(DEMO_ASSETS / "target"))
    return target, tokenizer, load_draft(DEMO_ASSETS / "draft", target_config=target.config, dtype=target.dtype)
