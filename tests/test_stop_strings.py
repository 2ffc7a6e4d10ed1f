"""Stop strings against HF transformers' own `generate(stop_strings=...)` (greedy: the same tokens, through the one
that completes the string), speculative (a fixed K and the adaptive width) == target-only, with `min_tokens` (no stop
string looked for before it, as vLLM) and `include_stop_str_in_output` in the text."""

import pytest
import torch

from domino_ray.llm import DominoLLM
from domino_ray.target.loading import load_target, load_tokenizer, stop_token_ids
from domino_ray.spec_decode.checkpoint import load_draft
from domino_ray.sample.params import SamplingParams
from speculation import FixedCosts
from tiny_models import ragged_prompts, save_agreeing_pair

K = 4
PROMPTS = ragged_prompts(8, seed=5, max_len=10)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    target_dir, draft_dir = save_agreeing_pair(tmp_path_factory.mktemp("agreeing"), block_size=K + 1)
    target = load_target(target_dir)
    tokenizer = load_tokenizer(target_dir)
    return target, tokenizer, load_draft(draft_dir, target_config=target.config, dtype=target.dtype)


def llm(pair, kind):
    target, tokenizer, draft = pair
    if kind == "target":
        return DominoLLM(target, tokenizer, chat_template=False, max_batch_size=4)
    costs = FixedCosts({r: {w: 1.0 + 0.1 * w for w in range(K + 1)} for r in (1, 2, 4)})
    return DominoLLM(target, tokenizer, draft, chat_template=False, max_batch_size=4,
                     num_draft_tokens=K if kind == "fixed" else "auto", **({"width_costs": costs} if kind == "auto" else {}))


@pytest.fixture(scope="module")
def stops(pair):
    """Per prompt, a two-token piece of its own greedy continuation (ignoring EOS), its 3rd and 4th tokens: a string
    that completes inside a step's run and may span a token boundary."""
    _, tokenizer, _ = pair
    plain = llm(pair, "target").generate(PROMPTS, SamplingParams(max_new_tokens=24, ignore_eos=True))
    return [tokenizer.decode(o.token_ids[2:4]) for o in plain]


def test_stop_strings_equal_hf_generate_and_speculation_changes_nothing(pair, stops):
    """Fails if a step's tokens after the completing one are kept, or if the string is matched per step rather than
    token by token (a speculative step would stop elsewhere than target-only)."""
    target, tokenizer, _ = pair
    eos = sorted(stop_token_ids(target, tokenizer))
    reference = []
    for prompt, stop in zip(PROMPTS, stops):
        ids = torch.tensor([prompt])
        out = target.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=24,
                              stop_strings=[stop], tokenizer=tokenizer, eos_token_id=eos, pad_token_id=0)
        reference.append(out[0, len(prompt):].tolist())
    params = [SamplingParams(max_new_tokens=24, stop=(s,)) for s in stops]
    results = {kind: llm(pair, kind).generate(PROMPTS, params) for kind in ("target", "fixed", "auto")}
    for kind, outputs in results.items():
        assert [o.token_ids for o in outputs] == reference, kind
    stopped = [o for o in results["target"] if o.finish_reason == "stop" and o.token_ids[-1] not in eos]
    assert len(stopped) >= 3  # most rows ended on their string, not on EOS
    for o, stop in zip(results["target"], stops):
        if o in stopped:
            assert stop not in o.text and stop in tokenizer.decode(o.token_ids)
    assert sum(o.stats["num_accepted_draft_tokens"] for o in results["fixed"]) > 0


def test_min_tokens_defers_stop_strings_and_include_keeps_the_string(pair, stops):
    """A string that completes before min_tokens does not stop the row (vLLM); speculative == target-only."""
    _, tokenizer, _ = pair
    early = [SamplingParams(max_new_tokens=24, stop=(s,), ignore_eos=True) for s in stops]
    late = [SamplingParams(max_new_tokens=24, stop=(s,), ignore_eos=True, min_tokens=12,
                           include_stop_str_in_output=True) for s in stops]
    results = {kind: (llm(pair, kind).generate(PROMPTS, early), llm(pair, kind).generate(PROMPTS, late))
               for kind in ("target", "fixed")}
    assert [[o.token_ids for o in r] for r in results["fixed"]] == [[o.token_ids for o in r] for r in results["target"]]
    first, deferred = results["target"]
    for a, b, stop in zip(first, deferred, stops):
        assert len(a.token_ids) <= 4 < 12 <= len(b.token_ids) or b.finish_reason == "length"
        if b.finish_reason == "stop":
            assert b.text.endswith(stop) and b.text.count(stop) >= 1
