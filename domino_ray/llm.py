"""The offline Python API: load a target and a draft, generate for a list of prompts.

    from domino_ray import DominoLLM, SamplingParams

    llm = DominoLLM.from_pretrained("Qwen/Qwen3-4B", draft="Huang2020/Qwen3-4B-Domino-b16", dtype="bfloat16")
    for out in llm.generate(["Explain KV caches."], SamplingParams(max_new_tokens=128)):
        print(out.text, out.stats["mean_acceptance_length"])

Prompts may be strings (chat template applied unless `chat_template=False`), chats (lists of
{role, content}) or token-id lists (used as they are). Every `SamplingParams` field works: stop strings
(`stop`, `include_stop_str_in_output`; they need a tokenizer), `n` samples per prompt, `logprobs`, the
penalties and `min_tokens`; the output stays the target's (speculative == target-only).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from domino_ray.engine.request import TokenLogprobs
from domino_ray.engine.core import SpecEngine
from domino_ray.target.packed_linear import keep_bf16_weights
from domino_ray.target.loading import encode_prompt, load_target, load_tokenizer, stop_token_ids
from domino_ray.frontend.detokenizer import row_text
from domino_ray.frontend.requests import prompt_requests
from domino_ray.spec_decode.checkpoint import load_draft
from domino_ray.spec_decode.draft import resolve_num_spec_tokens
from domino_ray.spec_decode.proposer import DominoProposer
from domino_ray.sample.params import SamplingParams


def build_engine(target, draft=None, tokenizer=None, *, num_draft_tokens: int | str | None = "auto",
                 max_batch_size: int | str = 16, **engine_settings) -> SpecEngine:
    """The one way to assemble a SpecEngine from loaded parts; `load_engine` (jobs, Serve) and `DominoLLM`
    both call it. `draft` is a DominoDraft or None (target only); `tokenizer` None means token ids only,
    and only a real tokenizer's EOS id joins the model's stop ids. `engine_settings` go to SpecEngine
    as they are (max_model_len, seed, max_prefill_tokens, kv_block_size, kv_cache_tokens, ...). On CPU a bf16 target
    and draft turn fp32 modules whose linear layers stream bf16 weights (`packed_linear.keep_bf16_weights`)."""
    keep_bf16_weights(target, draft)  # CPU bf16: fp32 modules over bf16 panels, before the proposer copies weights
    proposer, adaptive = None, False
    if draft is not None:
        k, adaptive = resolve_num_spec_tokens(num_draft_tokens, draft.config)
        proposer = DominoProposer(draft, target, k)
    return SpecEngine(target, proposer, max_rows=max_batch_size, eos_token_ids=stop_token_ids(target, tokenizer),
                      adaptive=adaptive, **engine_settings)


def engine_settings(model, draft, generation, runtime=None) -> dict:
    """`build_engine`'s settings from the config sections `model`, `draft` (None: target only), `generation`
    and `runtime` (None: its defaults)."""
    return {"num_draft_tokens": draft.num_draft_tokens if draft is not None else None,
            "max_batch_size": generation.max_batch_size, "max_model_len": model.max_model_len,
            "seed": generation.seed, "max_prefill_tokens": generation.max_prefill_tokens,
            "kv_block_size": generation.kv_block_size, "kv_cache_tokens": generation.kv_cache_tokens,
            "cuda_graphs": runtime.cuda_graphs if runtime is not None else "auto",
            "gpu_memory_utilization": runtime.gpu_memory_utilization if runtime is not None else 0.9}


def load_draft_for(target, source: str):
    """A draft checkpoint checked against `target`, on the target's device and in its dtype."""
    weight = next(target.parameters())
    return load_draft(source, target_config=target.config, device=weight.device, dtype=weight.dtype)


def load_engine(model, draft, generation, runtime=None):
    """(SpecEngine, tokenizer) from the config sections `model`, `draft` (None: target only),
    `generation` and `runtime`: what a Ray Data actor and a Serve replica each load once. Jobs and
    Serve take text, so the tokenizer is required."""
    target = load_target(model.source, dtype=model.dtype, device=model.device)
    tokenizer = load_tokenizer(model.tokenizer or model.source)
    draft_model = load_draft_for(target, draft.source) if draft is not None and draft.source else None
    engine = build_engine(target, draft_model, tokenizer, **engine_settings(model, draft, generation, runtime))
    return engine, tokenizer


@dataclass
class GenerationOutput:
    prompt_token_ids: list[int]
    text: str | None              # None when no tokenizer was given; ends before a stop string (vLLM's rule)
    token_ids: list[int]          # through the stop token, or the token that completed a stop string
    finish_reason: str            # "stop" | "length"
    stats: dict                   # RowStats.to_columns(): acceptance statistics
    time_to_first_token_s: float
    time_taken_s: float
    sample_index: int = 0         # which of the prompt's `n` samples
    logprobs: list[TokenLogprobs] | None = None  # per token of token_ids when params.logprobs is set


class DominoLLM:
    """`engine_settings` are `build_engine`'s: num_draft_tokens, max_batch_size, max_model_len, seed,
    max_prefill_tokens, kv_block_size, kv_cache_tokens, ... (the defaults of the config's `generation` section)."""

    def __init__(self, target, tokenizer=None, draft=None, *, chat_template: bool = True,
                 enable_thinking: bool = False, **engine_settings):
        self.tokenizer, self.chat_template, self.enable_thinking = tokenizer, chat_template, enable_thinking
        self.engine = build_engine(target, draft, tokenizer, **engine_settings)

    @classmethod
    def from_pretrained(cls, target: str, draft: str | None = None, *, dtype: str = "auto", device: str | None = None,
                        **kwargs) -> "DominoLLM":
        """Target and draft from local directories or hub ids; the draft takes the target's dtype and device.
        A target directory without tokenizer files loads with tokenizer None: token-id prompts only."""
        model = load_target(target, dtype=dtype, device=device)
        tokenizer = load_tokenizer(target, required=False)
        return cls(model, tokenizer, load_draft_for(model, draft) if draft else None, **kwargs)

    def encode(self, prompt) -> list[int]:
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt):
            return list(prompt)
        if self.tokenizer is None:
            raise ValueError("text prompts need a tokenizer (this DominoLLM has none: the target directory has "
                             "no tokenizer files); pass token-id lists instead")
        if isinstance(prompt, str):
            return encode_prompt(self.tokenizer, prompt=prompt, chat_template=self.chat_template,
                                 enable_thinking=self.enable_thinking)
        return encode_prompt(self.tokenizer, messages=list(prompt), enable_thinking=self.enable_thinking)

    def generate(self, prompts: Sequence, params: SamplingParams | Sequence[SamplingParams] = SamplingParams()
                 ) -> list[GenerationOutput]:
        """One output per prompt and sample: `n` outputs per prompt (sample i with `params.for_sample(i)`: its seed
        derived from the prompt's), in prompt order, then sample order. The length rule (`frontend.requests`): a
        prompt whose `max_new_tokens` do not fit is capped (`finish_reason` "length"); one that alone fills the
        model's length raises ValueError naming it, before anything runs."""
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling parameters")
        requests = []
        for i, (prompt, sp) in enumerate(zip(prompts, params)):
            requests += prompt_requests(i, self.encode(prompt), sp, tokenizer=self.tokenizer,
                                        max_model_len=self.engine.max_model_len, prompt_field=f"prompts[{i}]",
                                        eos_token_ids=sorted(self.engine.eos_token_ids))
        return [GenerationOutput(
            prompt_token_ids=c.prompt_token_ids, text=row_text(self.tokenizer, c.token_ids, r.params, c.finish_reason == "stop") if self.tokenizer else None,
            token_ids=c.token_ids, finish_reason=c.finish_reason, stats=c.stats.to_columns(),
            time_to_first_token_s=c.time_to_first_token_s, time_taken_s=c.time_taken_s,
            sample_index=r.request_id[1], logprobs=c.logprobs,
        ) for c, r in zip(self.engine.generate(requests), requests)]
