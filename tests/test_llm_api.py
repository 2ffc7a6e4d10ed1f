"""The offline Python API and the target-side helpers, on a tiny pair saved to disk."""

from dataclasses import replace

import pytest
import torch

from batch_fixtures import make_prompts
from domino_ray.config import load_config
from domino_ray.engine.request import Request
from domino_ray.llm import DominoLLM, load_engine
from domino_ray.target.loading import decode, encode_prompt, load_target, load_tokenizer, stop_token_ids
from domino_ray.spec_decode.checkpoint import save_draft
from domino_ray.sample.params import SamplingParams
from speculation import FixedCosts, check_speculated, speculate_in_process
from tiny_models import hf_greedy, save_agreeing_pair, save_tiny_pair, tiny_draft, tiny_target


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return save_tiny_pair(tmp_path_factory.mktemp("pair"), block_size=4)


def test_chat_template_thinking_off_and_plain_prompts(pair):
    tok = load_tokenizer(pair[0])
    chat = tok.decode(encode_prompt(tok, prompt="the quick fox", chat_template=True, enable_thinking=False))
    assert chat.startswith("<|im_start|>") and "<think>" in chat and chat.rstrip().endswith("</think>")
    thinking = tok.decode(encode_prompt(tok, prompt="the quick fox", chat_template=True, enable_thinking=True))
    assert "<think>" not in thinking
    plain = encode_prompt(tok, prompt="the quick fox", chat_template=False)
    assert "<|im_start|>" not in tok.decode(plain)
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    assert tok.decode(encode_prompt(tok, messages=msgs)).count("<|im_start|>") == 3


@pytest.mark.parametrize("kwargs,message", [
    ({"prompt": ""}, "empty"), ({"prompt": 3}, "must be a string"), ({"messages": []}, "non-empty"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "role"), ({"messages": [{"role": "user"}]}, "content"),
    ({"messages": [{"role": "user", "content": 5}]}, "content must be a string"), ({}, "exactly one"),
])
def test_bad_prompts(pair, kwargs, message):
    with pytest.raises(ValueError, match=message):
        encode_prompt(load_tokenizer(pair[0]), **kwargs)


def test_stop_ids_and_decode(pair):
    model, tok = load_target(pair[0], dtype="float32", device="cpu"), load_tokenizer(pair[0])
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    assert stop_token_ids(model, tok) == {eos}
    ids = tok("the lazy dog", add_special_tokens=False)["input_ids"]
    assert decode(tok, ids + [eos], {eos}) == decode(tok, ids) == "the lazy dog"
    assert model.dtype == torch.float32


@pytest.fixture(scope="module")
def agreeing(tmp_path_factory):
    return save_agreeing_pair(tmp_path_factory.mktemp("agreeing"))


GREEDY_AND_SAMPLED = [SamplingParams(max_new_tokens=12, temperature=0.8 if i % 3 == 2 else 0.0, seed=i)
                      for i in range(16)]


@pytest.mark.parametrize("num_draft_tokens", [4, "auto"])
def test_generate_text_tokens_and_stats(agreeing, num_draft_tokens):
    """Plain, chat and token-id prompts, greedy and sampled (with a seed), through a draft the target mostly
    accepts: tokens and text equal the target alone's. At a fixed K each row ran the very steps it runs
    alone in the engine, one of which stopped inside an accepted run (`speculation.py`)."""
    # The adaptive width on a fixed cost table (drafting cheap): its choices follow the acceptance, not the load.
    costs = {"width_costs": FixedCosts({r: {w: 1.0 + 0.1 * w for w in range(5)} for r in (1, 5)})} \
        if num_draft_tokens == "auto" else {}
    spec = DominoLLM.from_pretrained(agreeing[0], draft=agreeing[1], chat_template=False, max_batch_size=5,
                                     num_draft_tokens=num_draft_tokens, **costs)
    base = DominoLLM.from_pretrained(agreeing[0], chat_template=False, max_batch_size=3)
    words = make_prompts(16, seed=3)
    prompts = words[:10] + [[{"role": "user", "content": w}] for w in words[10:13]] + [[5, 6, 7, 8], [40, 41], [60]]
    out, ref = spec.generate(prompts, GREEDY_AND_SAMPLED), base.generate(prompts, GREEDY_AND_SAMPLED)
    assert [o.token_ids for o in out] == [r.token_ids for r in ref]
    assert [o.text for o in out] == [r.text for r in ref]
    for o in out:
        assert o.stats["num_spec_tokens"] == 4 and len(o.stats["acceptance_histogram"]) == 5
        assert len(o.token_ids) == 1 + o.stats["num_spec_steps"] + o.stats["num_accepted_draft_tokens"]
        assert o.finish_reason in ("stop", "length") and o.time_taken_s >= o.time_to_first_token_s >= 0
    check_speculated([o.stats["acceptance_histogram"] for o in out], sum(len(o.token_ids) for o in out))
    if num_draft_tokens == 4:
        alone = speculate_in_process(*agreeing, [o.prompt_token_ids for o in out], GREEDY_AND_SAMPLED, 4, max_rows=1)
        assert [o.stats["acceptance_histogram"] for o in out] == [a.acceptance_histogram for a in alone]
        assert any(a.stop_in_accepted_run for a in alone)
    with pytest.raises(ValueError, match="16 prompts but 2 sampling parameters"):
        spec.generate(prompts, GREEDY_AND_SAMPLED[:2])


@pytest.fixture(scope="module")
def bare_target(tmp_path_factory):
    """A target saved without tokenizer files (a config EOS id, not 0) and a draft for it, plus the
    target-only greedy continuation of PROMPT, whose first token is 0 (a stand-in tokenizer's eos id)."""
    directory = tmp_path_factory.mktemp("bare")
    target = tiny_target("qwen3", dtype=torch.float32)
    first = hf_greedy(target, PROMPT, 1)[0]
    with torch.no_grad():  # token 0 takes the place of the first token: rows that stop on 0 stop at once
        target.lm_head.weight[0] = target.lm_head.weight[first] * 2
    reference = hf_greedy(target, PROMPT, 8)
    assert reference[0] == 0
    eos = next(t for t in range(1, target.config.vocab_size - 1) if t not in reference)
    target.config.eos_token_id = target.generation_config.eos_token_id = eos
    target.save_pretrained(directory / "target")
    save_draft(tiny_draft(target, block_size=4), directory / "draft")
    return str(directory / "target"), str(directory / "draft"), eos, reference


PROMPT = [5, 6, 7, 8]


def test_target_without_tokenizer_stops_only_on_the_models_eos_ids(bare_target):
    target_dir, draft_dir, eos, reference = bare_target
    llm = DominoLLM.from_pretrained(target_dir, draft=draft_dir, dtype="float32")
    (out,) = llm.generate([PROMPT], SamplingParams(max_new_tokens=len(reference)))
    assert out.token_ids == reference and out.finish_reason == "length" and out.text is None
    assert llm.tokenizer is None and llm.engine.eos_token_ids == {eos}
    with pytest.raises(ValueError, match="text prompts need a tokenizer"):
        llm.generate(["the quick fox"])
    # Jobs and Serve need text: there a missing tokenizer is an error that names the directory.
    with pytest.raises(ValueError, match=f"{target_dir} has no tokenizer files"):
        load_tokenizer(target_dir)


def test_python_api_and_job_engine_get_every_setting(pair):
    overrides = ["generation.max_prefill_tokens=7", "generation.max_batch_size=3", "generation.seed=11",
                 "model.max_model_len=64", "draft.num_draft_tokens=2", "model.dtype=float32",
                 f"model.source={pair[0]}", f"draft.source={pair[1]}"]
    cfg = load_config(None, overrides)
    job_engine, _ = load_engine(cfg.model, cfg.draft, cfg.generation)
    llm = DominoLLM.from_pretrained(pair[0], draft=pair[1], dtype="float32", max_prefill_tokens=7, max_batch_size=3,
                                    seed=11, max_model_len=64, num_draft_tokens=2)
    for engine in (job_engine, llm.engine):
        assert (engine.max_prefill_tokens, engine.max_rows, engine.max_model_len, engine.num_spec_tokens) == \
            (7, 3, 64, 2)
    assert job_engine.eos_token_ids == llm.engine.eos_token_ids
    # One seed: sampled requests without their own seed draw the same tokens from both engines.
    prompts = [[5, 6, 7], [9, 10, 11, 12]]
    params = SamplingParams(max_new_tokens=8, temperature=1.0)
    job_out = job_engine.generate([Request(i, p, params) for i, p in enumerate(prompts)])
    assert [c.token_ids for c in job_out] == [o.token_ids for o in llm.generate(prompts, params)]


def test_ignore_eos_keeps_a_trailing_eos_in_the_text(pair):
    """The text drops a trailing token only when it stopped the row (as in the engine): with ignore_eos
    an EOS id that was generated is text like any other."""
    target, tok = load_target(pair[0], dtype="float32", device="cpu"), load_tokenizer(pair[0])
    target.generation_config.eos_token_id = target.config.eos_token_id = None
    prompt = tok("the quick brown fox", add_special_tokens=False)["input_ids"]
    plain = DominoLLM(target, tok).generate([prompt], SamplingParams(max_new_tokens=6))[0].token_ids
    last = plain[-1]
    assert tok.decode([last], skip_special_tokens=True).strip() and last not in plain[:-1]
    target.generation_config.eos_token_id = target.config.eos_token_id = last  # a plain word is "EOS" now
    (out,) = DominoLLM(target, tok).generate([prompt], SamplingParams(max_new_tokens=6, ignore_eos=True))
    assert out.token_ids == plain and out.finish_reason == "length"
    assert out.text == tok.decode(plain, skip_special_tokens=True)


def test_python_api_caps_what_the_context_cannot_hold_and_refuses_a_prompt_that_fills_it(pair):
    """The length rule (frontend.requests) at the Python API: max_new_tokens past the context is capped with
    finish_reason "length" and does not fail the other prompts (vLLM's offline LLM); a prompt that alone fills the
    context is a ValueError naming it, raised before anything runs."""
    target_dir, draft_dir = pair
    llm = DominoLLM.from_pretrained(str(target_dir), draft=str(draft_dir), max_model_len=40)
    prompt = list(range(1, 31))  # 30 tokens: 10 new tokens fit
    capped, short = llm.generate([prompt, [5, 6, 7]], SamplingParams(max_new_tokens=11, ignore_eos=True))
    assert len(capped.token_ids) == 10 and capped.finish_reason == "length"
    assert len(short.token_ids) == 11 and short.finish_reason == "length"
    (exact,) = llm.generate([prompt], SamplingParams(max_new_tokens=10, ignore_eos=True))
    assert exact.token_ids == capped.token_ids
    with pytest.raises(ValueError, match=r"prompts\[1\] has 40 tokens; the model's limit is 40 tokens"):
        llm.generate([prompt, list(range(1, 41))], SamplingParams(max_new_tokens=1))


def test_n_samples_come_prompt_major_each_as_its_own_request_would(agreeing):
    """n = 3 sampled with penalties and logprobs: outputs in prompt order then sample order, sample i the very
    output of a request with `for_sample(i)` (sample 0 the n = 1 request), the samples not all alike.
    Fails if the samples share one seed or come out sample-major."""
    llm = DominoLLM.from_pretrained(agreeing[0], draft=agreeing[1], chat_template=False, max_batch_size=4,
                                    num_draft_tokens=4)
    prompts = [[5, 6, 7, 8], "the quick brown fox"]
    sp = SamplingParams(max_new_tokens=12, temperature=1.0, seed=7, n=3, logprobs=2, repetition_penalty=1.2,
                        ignore_eos=True)
    out = llm.generate(prompts, sp)
    assert [o.sample_index for o in out] == [0, 1, 2] * 2
    assert [o.prompt_token_ids for o in out] == [prompts[0]] * 3 + [llm.encode(prompts[1])] * 3
    for prompt, group in zip(prompts, (out[:3], out[3:])):
        assert len({tuple(o.token_ids) for o in group}) > 1
        for i, o in enumerate(group):
            (alone,) = llm.generate([prompt], sp.for_sample(i))
            assert alone.sample_index == 0 and alone.token_ids == o.token_ids
            assert len(o.logprobs) == len(o.token_ids) and all(len(e) == 3 for e in o.logprobs)
            # float64 logprobs of differently shaped batches: equal up to rounding
            assert all(abs(a[0][1] - b[0][1]) < 1e-9 for a, b in zip(alone.logprobs, o.logprobs))
    assert llm.generate([prompts[0]], replace(sp, n=1))[0].token_ids == out[0].token_ids


@pytest.mark.parametrize("include", [False, True])
def test_stop_strings_cut_the_text_and_the_tokens(agreeing, include):
    """A stop string from the middle of a greedy text: the text ends before it (or through it with
    include_stop_str_in_output), the tokens are the plain run's through the one that completed it."""
    llm = DominoLLM.from_pretrained(agreeing[0], draft=agreeing[1], chat_template=False, num_draft_tokens=4)
    prompt = "the quick brown fox"
    plain = llm.generate([prompt], SamplingParams(max_new_tokens=24, ignore_eos=True))[0]
    text = plain.text  # three characters a third in, first seen there
    at = next(a for a in range(len(text) // 3, len(text)) if text.find(text[a:a + 3]) == a and text[a:a + 3].strip())
    stop = text[at:at + 3]
    (out,) = llm.generate([prompt], SamplingParams(max_new_tokens=24, ignore_eos=True, stop=[stop],
                                                   include_stop_str_in_output=include))
    assert out.finish_reason == "stop" and out.text == plain.text[:at + (len(stop) if include else 0)]
    assert out.token_ids == plain.token_ids[:len(out.token_ids)] and len(out.token_ids) < len(plain.token_ids)
    assert stop in decode(llm.tokenizer, out.token_ids) and stop not in decode(llm.tokenizer, out.token_ids[:-1])


def test_stop_strings_without_a_tokenizer_are_refused_naming_stop(bare_target):
    llm = DominoLLM.from_pretrained(bare_target[0])
    with pytest.raises(ValueError, match=r"stop=\['x'\] needs a tokenizer"):
        llm.generate([PROMPT], SamplingParams(max_new_tokens=4, stop=["x"]))
