"""The offline Python API and the target-side helpers, on a tiny pair saved to disk."""

import pytest
import torch

from domino_ray.llm import DominoLLM
from domino_ray.sampling import SamplingParams
from domino_ray.target import decode, encode_prompt, load_target, load_tokenizer, stop_token_ids
from tiny_models import save_tiny_pair


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


def test_generate_text_tokens_and_stats(pair):
    spec = DominoLLM.from_pretrained(pair[0], draft=pair[1], dtype="float32", max_batch_size=2)
    base = DominoLLM.from_pretrained(pair[0], dtype="float32", max_batch_size=3)
    prompts = ["the quick brown fox", [{"role": "user", "content": "Ray runs actors"}], [5, 6, 7, 8]]
    params = SamplingParams(max_new_tokens=10)
    out, ref = spec.generate(prompts, params), base.generate(prompts, params)
    assert [o.token_ids for o in out] == [r.token_ids for r in ref]
    assert [o.text for o in out] == [r.text for r in ref]
    for o in out:
        assert o.stats["num_spec_tokens"] == 4 and len(o.stats["acceptance_histogram"]) == 5
        assert len(o.token_ids) == 1 + o.stats["num_spec_steps"] + o.stats["num_accepted_draft_tokens"]
        assert o.finish_reason in ("stop", "length") and o.time_taken_s >= o.time_to_first_token_s >= 0
    with pytest.raises(ValueError, match="3 prompts but 2 sampling parameters"):
        spec.generate(prompts, [params, params])
