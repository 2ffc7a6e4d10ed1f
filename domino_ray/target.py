"""The target model and its tokenizer: loading, chat templates, stop tokens."""

from __future__ import annotations

import torch

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "float64": torch.float64}


def resolve_dtype(name: str | torch.dtype) -> torch.dtype | str:
    if isinstance(name, torch.dtype) or name == "auto":
        return name
    if name not in DTYPES:
        raise ValueError(f"dtype {name!r} is not one of {sorted(DTYPES) + ['auto']}")
    return DTYPES[name]


def resolve_device(name: str | None) -> torch.device:
    """`auto`/None -> cuda when available, else cpu."""
    if name in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def load_target(source: str, *, dtype: str | torch.dtype = "auto", device: str | torch.device | None = None):
    """Any HF causal LM (Qwen3, Llama, ...) from a local directory or a hub id, in eval mode."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(source, dtype=resolve_dtype(dtype), attn_implementation="sdpa")
    return model.to(resolve_device(device) if not isinstance(device, torch.device) else device).eval()


# Files that hold a vocabulary. Without one, AutoTokenizer still "loads" a directory (an empty tokenizer
# whose eos id is 0), so a target saved without its tokenizer would stop rows on token 0.
VOCAB_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model",
               "sentencepiece.bpe.model", "tekken.json")


def load_tokenizer(source: str, *, required: bool = True):
    """The tokenizer at a local directory or hub id. A local directory without vocabulary files has
    none: ValueError naming it, or None when not `required` (token-id prompts only)."""
    from pathlib import Path

    path = Path(source).expanduser()
    if path.is_dir() and not any((path / name).is_file() for name in VOCAB_FILES):
        if not required:
            return None
        raise ValueError(f"{source} has no tokenizer files (none of {', '.join(VOCAB_FILES)}); "
                         "point the tokenizer source (model.tokenizer) at a directory that has them")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(source)


def stop_token_ids(model, tokenizer=None) -> set[int]:
    """The model's EOS ids: generation config and model config, plus the tokenizer's (None: no tokenizer;
    `load_tokenizer` gives None rather than an empty stand-in whose eos id would be invented)."""
    ids: set[int] = set()
    for holder in (getattr(model, "generation_config", None), model.config, tokenizer):
        value = getattr(holder, "eos_token_id", None) if holder is not None else None
        if value is None:
            continue
        ids.update(value if isinstance(value, (list, tuple, set)) else [value])
    return {int(i) for i in ids}


def encode_prompt(tokenizer, *, prompt: str | None = None, messages: list[dict] | None = None,
                  chat_template: bool = True, enable_thinking: bool = False) -> list[int]:
    """Token ids for a plain prompt or a chat. With `chat_template` a plain prompt becomes one user turn.

    Raises ValueError for empty input, malformed messages or a tokenizer without a chat template.
    """
    if (prompt is None) == (messages is None):
        raise ValueError("give exactly one of prompt or messages")
    if prompt is not None:
        if not isinstance(prompt, str):
            raise ValueError(f"prompt must be a string, got {type(prompt).__name__}")
        if not prompt.strip():
            raise ValueError("prompt is empty")
        if not chat_template:
            ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
            if not ids:
                raise ValueError("prompt encodes to no tokens")
            return list(ids)
        messages = [{"role": "user", "content": prompt}]
    check_messages(messages)
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("the tokenizer has no chat template; use plain prompts with chat_template=false")
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                        enable_thinking=enable_thinking, return_dict=False)
    return list(ids)


def check_messages(messages) -> None:
    roles = ("system", "user", "assistant", "tool")
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError("messages must be a non-empty list of {role, content}")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or set(m) - {"role", "content", "name"} or "role" not in m or "content" not in m:
            raise ValueError(f"messages[{i}] must be an object with 'role' and 'content'")
        if m["role"] not in roles:
            raise ValueError(f"messages[{i}].role={m['role']!r} is not one of {roles}")
        if not isinstance(m["content"], str):
            raise ValueError(f"messages[{i}].content must be a string")
    if not any(m["content"].strip() for m in messages):
        raise ValueError("messages have no content")


def decode(tokenizer, token_ids: list[int], stop_ids: set[int] | frozenset = frozenset()) -> str:
    """Text of generated tokens, without a trailing stop token and special tokens."""
    if token_ids and token_ids[-1] in stop_ids:
        token_ids = token_ids[:-1]
    return tokenizer.decode(token_ids, skip_special_tokens=True)
