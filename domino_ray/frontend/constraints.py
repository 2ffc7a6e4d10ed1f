"""What a row may generate: a grammar (vLLM's `structured_outputs`: a JSON schema, any JSON object, a regex, a choice
among strings, an EBNF/GBNF or Lark grammar), OpenAI's `logit_bias` and vLLM's `allowed_token_ids`, as the engine's
`Constraint` (`engine/request.py`): a logit adjustment at each position of a step, forced tokens, and the tokens a row
commits.

Grammars run on llguidance (one ~3 MB wheel, no dependencies; docs/structured-outputs.md says why not xgrammar): its
matcher takes a token at a time, rolls back, and says which tokens the grammar forces. At a verify position j the mask
is the grammar's after the drafts d_1..d_j, so a draft outside the grammar is rejected there and the target's
distribution is the grammar-masked one everywhere: speculative == target-only, constrained. Compiled grammars are
cached by their text (a job whose rows share a schema compiles it once per process); each row gets its own copy of
the compiled matcher.
"""

from __future__ import annotations

import functools

import torch

from domino_ray.sample.params import SamplingParams

# SamplingParams.structured_outputs kinds -> llguidance's grammar formats (JSON through `JSON_LAYOUT`)
FORMATS = {"regex": "regex", "choice": "choice", "grammar": "grammar"}
# JSON laid out as json.dumps does by default (", " and ": ", no other whitespace): a model allowed any whitespace may
# loop on newlines until its token budget runs out (vLLM's `disable_any_whitespace` does the same)
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class RowConstraint:
    """One row's constraint: `matcher` (an llguidance LLMatcher over a vocabulary of `matcher_vocab` ids, or None)
    for its grammar, `bias` ((token, logit added) pairs, kept as `bias_pairs`) and `allowed` (the only tokens it may
    emit, or None); `eos_token_ids` end the row where the grammar allows nothing more."""

    def __init__(self, matcher=None, matcher_vocab: int = 0, bias: tuple[tuple[int, float], ...] | None = None,
                 allowed: tuple[int, ...] | None = None, eos_token_ids: tuple[int, ...] = ()):
        self.matcher, self.matcher_vocab = matcher, matcher_vocab
        self.bias_pairs, self.allowed, self.eos_token_ids = bias or (), allowed, eos_token_ids
        self._static: torch.Tensor | None = None  # [V] the bias and allowed ids' adjustment, made once

    def forced(self) -> list[int]:
        if self.matcher is None or self.matcher.is_stopped():
            return []
        return list(self.matcher.compute_ff_tokens())

    def commit(self, tokens: list[int]):
        if self.matcher is not None and not self.matcher.is_stopped():
            self.matcher.consume_tokens(tokens)

    def allowed_bits(self, drafts: list[int], out: torch.Tensor):
        """`Constraint.allowed_bits`: the grammar walked through the drafts and rolled back, in one call. A grammar with
        nothing left to allow (finished, or in error) allows the EOS ids: the row ends."""
        if self.matcher is None:
            return
        words = -(-self.matcher_vocab // 32)
        if out.shape[1] < words:
            raise ValueError(f"the model's vocabulary ({out.shape[1] * 32} ids at most) is smaller than its "
                             f"tokenizer's ({self.matcher_vocab}): structured_outputs cannot mask it")
        grammar = torch.zeros(out.shape[0], words, dtype=torch.int32)  # [q, words]: llguidance's layout
        if drafts:
            _executor().unsafe_compute_mask_ptr_with_draft_token([(self.matcher, 0, drafts)], grammar.data_ptr(),
                                                                 words * 4, out.shape[0])
        else:
            self.matcher.unsafe_compute_mask_ptr(grammar.data_ptr(), words * 4)
        out[:, :words], out[:, words:] = grammar, 0  # ids past the tokenizer's vocabulary: never
        empty = ~out.any(1)  # [q]
        if empty.any():
            for token in self.eos_token_ids:
                out[empty, token // 32] |= _bit(token % 32)

    def bias(self, vocab_size: int) -> torch.Tensor | None:
        """`Constraint.bias`: `bias` added, -inf outside `allowed`, made once; None without either."""
        if not self.bias_pairs and self.allowed is None:
            return None
        if self._static is None or self._static.shape[0] != vocab_size:
            static = torch.zeros(vocab_size)
            if self.allowed is not None:
                static.fill_(float("-inf"))[list(self.allowed)] = 0.0
            for token, value in self.bias_pairs:
                static[token] += value
            self._static = static
        return self._static


def _bit(b: int) -> int:
    """Bit `b` of an int32 word as a Python int (bit 31 is the sign bit)."""
    return (1 << b) - (1 << 32 if b == 31 else 0)


@functools.cache
def _executor():
    """llguidance's executor for masks after drafts (one thread: a step's rows call it one at a time)."""
    from llguidance import LLExecutor

    return LLExecutor(1)


def row_constraint(params: SamplingParams, tokenizer, eos_token_ids: tuple[int, ...]) -> RowConstraint | None:
    """The constraint of a request with `params` (None when it has none). A grammar needs `tokenizer` (a fast HF
    tokenizer). Raises ValueError naming the problem when the grammar does not compile."""
    if not params.constrained:
        return None
    matcher, vocab = None, 0
    if params.structured_outputs is not None:
        if tokenizer is None:
            raise ValueError("structured_outputs needs a tokenizer (the grammar is matched on text), and there is none")
        kind, text = params.structured_outputs
        ll_tokenizer = _ll_tokenizer(tokenizer, tuple(eos_token_ids))
        matcher, vocab = _compiled(ll_tokenizer, kind, text).deep_copy(), ll_tokenizer.vocab_size
    return RowConstraint(matcher, vocab, params.logit_bias, params.allowed_token_ids, tuple(eos_token_ids))


@functools.lru_cache(maxsize=8)
def _ll_tokenizer(tokenizer, eos_token_ids: tuple[int, ...]):
    """llguidance's view of `tokenizer` (~1 s to build: once per tokenizer and EOS ids). It reads byte-level BPE
    vocabularies (Qwen, Llama 3, SmolLM2, GPT-2); others are refused with the reason."""
    from llguidance.hf import from_tokenizer

    try:
        return from_tokenizer(tokenizer, eos_token=list(eos_token_ids) or None)
    except ValueError as exc:
        raise ValueError(f"structured_outputs needs a tokenizer llguidance reads (byte-level BPE, as Qwen's, Llama 3's "
                         f"or SmolLM2's); this one is not: {exc}") from None


@functools.lru_cache(maxsize=64)
def _compiled(ll_tokenizer, kind: str, text: str):
    """A matcher for the grammar `(kind, text)` at its start, compiled once per text (rows copy it)."""
    from llguidance import LLMatcher, grammar_from

    try:
        if kind in ("json", "json_object"):
            grammar = LLMatcher.grammar_from_json_schema('{"type": "object"}' if kind == "json_object" else text,
                                                         overrides=JSON_LAYOUT)
        else:
            grammar = grammar_from(FORMATS[kind], text)
    except (ValueError, RuntimeError) as exc:
        raise ValueError(f"structured_outputs.{kind} does not compile: {exc}") from None
    error = LLMatcher.validate_grammar(grammar, ll_tokenizer)
    if error:
        raise ValueError(f"structured_outputs.{kind} does not compile: {error}")
    matcher = LLMatcher(ll_tokenizer, grammar, log_level=0)
    if matcher.is_error():
        raise ValueError(f"structured_outputs.{kind} does not compile: {matcher.get_error()}")
    return matcher
