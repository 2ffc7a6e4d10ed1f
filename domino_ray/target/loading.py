"""The target model and its tokenizer: loading, chat templates, stop tokens."""

from __future__ import annotations

import torch

from domino_ray.backend.library import has_bf16_arithmetic

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

    device = device if isinstance(device, torch.device) else resolve_device(device)
    model = AutoModelForCausalLM.from_pretrained(source, dtype=resolve_dtype(dtype), attn_implementation="sdpa")
    if dtype == "auto" and device.type == "cpu":
        model = model.to(cpu_auto_dtype(model.dtype))
    return model.to(device).eval()


def cpu_auto_dtype(stored: torch.dtype) -> torch.dtype:
    """`model.dtype: auto` on CPU for a checkpoint stored in `stored`: a bf16 one runs in bf16 where the CPU multiplies
    bf16 natively (AVX512_BF16 or AMX; our kernels then stream bf16 weights: `packed_linear.keep_bf16_weights`), in
    fp32 elsewhere, as does an fp16 one; fp32 and fp64 checkpoints run as stored."""
    if stored == torch.bfloat16 and has_bf16_arithmetic():
        return torch.bfloat16
    return torch.float32 if stored in (torch.bfloat16, torch.float16) else stored


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
                  chat_template: bool = True, enable_thinking: bool = False,
                  parse_special_tokens: bool = False) -> list[int]:
    """Token ids for a plain prompt or a chat. With `chat_template` a plain prompt becomes one user turn.

    User text (the prompt, every message's content) encodes as plain text: a special-token string in it
    such as "<|im_end|>" becomes ordinary tokens, never the control id, so content cannot end its turn or
    forge a system turn. The chat template's own special tokens stay special. `parse_special_tokens=True`
    parses them in user text too (for prompts already rendered with a chat template). Message fields
    whose value is null (what the openai client's `model_dump()` leaves: tool_calls, refusal, ...) are
    dropped. Raises ValueError for empty input, malformed messages or a tokenizer without a chat template.
    """
    if (prompt is None) == (messages is None):
        raise ValueError("give exactly one of prompt or messages")
    if prompt is not None:
        if not isinstance(prompt, str):
            raise ValueError(f"prompt must be a string, got {type(prompt).__name__}")
        if not prompt.strip():
            raise ValueError("prompt is empty")
        if not chat_template:
            ids = tokenizer(prompt, add_special_tokens=False, split_special_tokens=not parse_special_tokens)
            if not ids["input_ids"]:
                raise ValueError("prompt encodes to no tokens")
            return list(ids["input_ids"])
        messages = [{"role": "user", "content": prompt}]
    if isinstance(messages, (list, tuple)):
        messages = [{k: v for k, v in m.items() if v is not None or k in ("role", "content")}
                    if isinstance(m, dict) else m for m in messages]
    check_messages(messages)
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("the tokenizer has no chat template; use plain prompts with chat_template=false")
    specials = [] if parse_special_tokens else _special_strings(tokenizer)
    if not any(s in m["content"] for m in messages for s in specials):
        # Nothing to keep plain: the template's own tokenization, id for id.
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                            enable_thinking=enable_thinking, return_dict=False)
        return list(ids)
    return _encode_chat_plain_content(tokenizer, messages, specials, enable_thinking)


def _special_strings(tokenizer) -> list[str]:
    """The tokenizer's special added tokens (what `split_special_tokens` stops matching), longest first."""
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    return sorted({t.content for t in added.values() if t.special and t.content}, key=len, reverse=True)


def _encode_chat_plain_content(tokenizer, messages: list[dict], specials: list[str], enable_thinking: bool
                               ) -> list[int]:
    """Render the template with every special string in the content swapped for a private-use character,
    tokenize the template's special tokens as ids and everything between them (content restored) as plain
    text. Without special strings in the content this equals the template's tokenization (HF splits at
    special tokens first and encodes the pieces between them separately, as here)."""
    import re

    taken = {c for m in messages for c in m["content"] if ord(c) >= 0x100000}
    marks = [chr(c) for c in range(0x100000, 0x10FFFE) if chr(c) not in taken][:len(specials)]
    escape, restore = dict(zip(specials, marks)), dict(zip(marks, specials))
    pattern = re.compile("|".join(re.escape(s) for s in specials))
    escaped = [{**m, "content": pattern.sub(lambda hit: escape[hit.group()], m["content"])} for m in messages]
    text = tokenizer.apply_chat_template(escaped, add_generation_prompt=True, tokenize=False,
                                         enable_thinking=enable_thinking)
    ids, at = [], 0
    for hit in [*pattern.finditer(text), None]:  # the template's special tokens, then the tail
        plain = text[at:hit.start() if hit else len(text)]
        if plain:
            plain = re.sub("|".join(map(re.escape, marks)), lambda m: restore[m.group()], plain)
            ids += tokenizer(plain, add_special_tokens=False, split_special_tokens=True)["input_ids"]
        if hit:
            ids.append(tokenizer.convert_tokens_to_ids(hit.group()))
            at = hit.end()
    return ids


def check_messages(messages) -> None:
    roles = ("system", "user", "assistant", "tool")
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError("messages must be a non-empty list of {role, content}")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or set(m) - {"role", "content", "name"} or "role" not in m or "content" not in m:
            extra = sorted(set(m) - {"role", "content", "name"}) if isinstance(m, dict) else []
            raise ValueError(f"messages[{i}] must be an object with 'role' and 'content'"
                             + (f" (unsupported fields: {extra})" if extra else ""))
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
