"""The Serve edge's response side, Ray-free and from hand-built engine output: log-probabilities in OpenAI's
shapes (chat and completions), n choices in one body (usage: the prompt once, the choices' tokens summed), and a
choice's stream, where log-probabilities travel with the text they belong to while a stop string may be forming
and `include_stop_str_in_output` gives the stop string back."""

import asyncio
import json
from types import SimpleNamespace

import pytest

from domino_ray.engine.request import Completion
from domino_ray.frontend.detokenizer import StopStrings
from domino_ray.serve.openai_api import ModelSpec, parse_request
from domino_ray.serve.responses import MIN_LOGPROB, chunk_body, logprobs_body, response_body, usage_chunk_body
from domino_ray.serve.choices import generate
from domino_ray.sample.params import SamplingParams
from domino_ray.spec_decode.stats import RowStats
from tiny_models import tiny_tokenizer

EOS = 3  # the tiny tokenizer's <|im_end|>


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def model(tokenizer):
    return ModelSpec(name="tiny", tokenizer=tokenizer, vocab_size=96, max_model_len=64, eos_token_ids=(EOS,),
                     defaults=SamplingParams(max_new_tokens=20))


def parse(model, body, kind="completion"):
    return parse_request(kind, json.dumps(body).encode(), model)


def test_logprobs_bodies_have_openai_shapes(tokenizer):
    """Chat: per token {token, logprob, bytes, top_logprobs: [N of the same]}; completions: tokens,
    token_logprobs, top_logprobs (the N most likely plus the sampled token) and text_offset. A token's string is
    the decode of its id alone; -inf (JSON has none) becomes MIN_LOGPROB.
    Fails if the top alternatives lose their order or the sampled token, or the offsets do not add up."""
    entries = [[(40, -0.5), (40, -0.5), (41, -1.25)],          # sampled the most likely
               [(42, -3.0), (41, -0.25), (43, -1.5)],          # sampled one outside the top 2
               [(EOS, float("-inf")), (44, -0.125), (45, -0.5)]]
    s = {t: tokenizer.decode([t]) for t in (40, 41, 42, 43, 44, 45, EOS)}
    chat = logprobs_body("chat", tokenizer, entries)["content"]
    assert [c["token"] for c in chat] == [s[40], s[42], s[EOS]] and s[EOS] == "<|im_end|>"
    assert [c["logprob"] for c in chat] == [-0.5, -3.0, MIN_LOGPROB]
    assert all(c["bytes"] == list(c["token"].encode()) for c in chat)
    assert [[(t["token"], t["logprob"]) for t in c["top_logprobs"]] for c in chat] == [
        [(s[40], -0.5), (s[41], -1.25)], [(s[41], -0.25), (s[43], -1.5)], [(s[44], -0.125), (s[45], -0.5)]]
    assert all(t["bytes"] == list(t["token"].encode()) for c in chat for t in c["top_logprobs"])
    json.dumps(chat, allow_nan=False)  # valid JSON: no infinity

    legacy = logprobs_body("completion", tokenizer, entries, text_offset=7)
    assert legacy["tokens"] == [s[40], s[42], s[EOS]]
    assert legacy["token_logprobs"] == [-0.5, -3.0, MIN_LOGPROB]
    assert legacy["top_logprobs"] == [{s[40]: -0.5, s[41]: -1.25}, {s[41]: -0.25, s[43]: -1.5, s[42]: -3.0},
                                      {s[44]: -0.125, s[45]: -0.5, s[EOS]: MIN_LOGPROB}]
    assert legacy["text_offset"] == [7, 7 + len(s[40]), 7 + len(s[40]) + len(s[42])]
    assert logprobs_body("chat", tokenizer, None) is None and logprobs_body("completion", tokenizer, []) == {
        "tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}


def completion(prompt, tokens, steps, accepted, ttft, taken, logprobs=None) -> Completion:
    stats = RowStats(4)
    for a in accepted:
        stats.observe_step(4, a)
    assert len(accepted) == steps
    return Completion("r", prompt, tokens, "length", stats, ttft, taken, logprobs)


def test_n_choices_in_one_body_sum_usage_and_statistics(model, tokenizer):
    """Choices 0..n-1 in order, each with its own text, finish reason and log-probabilities; usage counts the
    prompt once and every choice's tokens; the statistics are the choices' summed (first token of the first
    choice, end of the last). Fails if usage counts only one choice or the prompt n times."""
    parsed = parse(model, {"messages": [{"role": "user", "content": "hi"}], "n": 2, "logprobs": True,
                           "top_logprobs": 1}, "chat")
    a = completion([1, 2, 3], [40, 41, 42, 43], 2, [1, 0], 0.5, 2.0, [[(t, -1.0), (t, -1.0)] for t in (40, 41, 42, 43)])
    b = completion([1, 2, 3], [44, EOS], 1, [0], 0.25, 1.0, [[(44, -2.0), (45, -1.0)], [(EOS, -0.5), (EOS, -0.5)]])
    body = response_body(parsed, "chatcmpl-x", 5, model, ["ab", "c"], ["length", "stop"], [a, b])
    assert [c["index"] for c in body["choices"]] == [0, 1]
    assert [c["message"]["content"] for c in body["choices"]] == ["ab", "c"]
    assert [c["finish_reason"] for c in body["choices"]] == ["length", "stop"]
    assert [len(c["logprobs"]["content"]) for c in body["choices"]] == [4, 2]
    assert body["choices"][1]["logprobs"]["content"][0]["top_logprobs"][0]["logprob"] == -1.0
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 6, "total_tokens": 9}
    stats = body["speculative_decoding_stats"]
    assert (stats["num_spec_steps"], stats["num_accepted_draft_tokens"], stats["acceptance_histogram"]) == \
        (3, 1, [2, 1, 0, 0, 0])
    assert 6 == 2 + stats["num_spec_steps"] + stats["num_accepted_draft_tokens"]  # n + steps + accepted
    assert (stats["time_to_first_token_s"], stats["time_taken_llm_s"]) == (0.25, 2.0)
    chunk = chunk_body(parsed, "chatcmpl-x", 5, "tiny", 1, "c", first=True)
    assert chunk["choices"][0]["index"] == 1 and chunk["choices"][0]["delta"] == {"role": "assistant", "content": "c"}
    assert usage_chunk_body(parsed, "chatcmpl-x", 5, "tiny", [a, b])["usage"] == body["usage"]
    one = response_body(parse(model, {"prompt": "a"}), "cmpl-y", 5, model, ["ab"], ["length"], [a])
    assert one["speculative_decoding_stats"]["acceptance_histogram"] == a.stats.acceptance_histogram
    assert one["usage"]["completion_tokens"] == 4 and one["choices"][0]["logprobs"] is not None


class ScriptedLoop:
    """An EngineLoop stand-in that answers every request with scripted engine events (token ids per step, each
    token's log-probabilities (id, -position)); the last event finishes with `finish_reason`."""

    def __init__(self, steps: list[list[int]], finish_reason: str):
        self.steps, self.finish_reason, self.requests, self.aborted = steps, finish_reason, [], []

    def submit(self, request):
        self.requests.append(request)
        return SimpleNamespace(events=lambda: self._events(request))

    def abort(self, request_id):
        self.aborted.append(request_id)

    async def _events(self, request):
        tokens, entries = [], []
        for step, ids in enumerate(self.steps):
            new = [[(t, -float(len(tokens) + j)), (t, -float(len(tokens) + j))] for j, t in enumerate(ids)]
            tokens, entries = tokens + ids, entries + new
            last = step == len(self.steps) - 1
            done = Completion(request.request_id, request.prompt_token_ids, tokens, self.finish_reason, RowStats(0),
                              0.0, 0.0, entries) if last else None
            yield SimpleNamespace(new_token_ids=ids, completion=done, stats=RowStats(0), new_logprobs=new)


def run(loop, parsed, model):
    async def main():
        return [p async for p in generate(loop, "cmpl-s", parsed, model)]
    return asyncio.run(main())


@pytest.mark.parametrize("include", [False, True], ids=["stop-left-out", "stop-included"])
def test_streamed_logprobs_travel_with_their_text_at_a_stop_string(model, tokenizer, include):
    """"hello w" with stop "lo w" (across tokens): the engine ended the row on "w" (the request carried a
    StopStrings matcher). The text is cut before the stop string (or keeps it: include_stop_str_in_output), the
    tokens of text held back while "lo w" might be forming carry their log-probabilities to the next piece that
    releases text or to the last, and all pieces' log-probabilities together are the engine's, in order.
    Fails if a piece releases log-probabilities of tokens whose text it holds back, or the stop string is not
    given back with include_stop_str_in_output."""
    ids = tokenizer("hello world", add_special_tokens=False)["input_ids"][:7]
    assert tokenizer.decode(ids) == "hello w"
    loop = ScriptedLoop([ids[:2], ids[2:4], ids[4:6], ids[6:]], "stop")
    parsed = parse(model, {"prompt": "a", "stop": "lo w", "logprobs": 1, "include_stop_str_in_output": include})
    pieces = run(loop, parsed, model)
    [request] = loop.requests
    assert isinstance(request.stop_strings, StopStrings) and request.params.n == 1
    assert "".join(p.text for p in pieces) == ("hello w" if include else "hel")
    released = [entry for p in pieces if p.logprobs is not None for entry in p.logprobs]
    assert released == pieces[-1].completion.logprobs and len(released) == 7
    assert all(p.logprobs is None for p in pieces if not p.text and p.completion is None)
    assert all(p.logprobs for p in pieces if p.text)
    assert any(not p.text and p.completion is None for p in pieces)  # some text was held back
    assert [p.finish_reason for p in pieces][-1] == "stop" and not loop.aborted


def test_a_stop_token_is_no_text_but_has_its_logprob(model, tokenizer):
    """A row that ends on a stop id (here a request's stop_token_ids: an ordinary character) leaves it out of the
    text; its log-probabilities stay, as it counts in usage. Fails if the edge decodes the stop token too."""
    ids = tokenizer("hello", add_special_tokens=False)["input_ids"]
    [x] = tokenizer("x", add_special_tokens=False)["input_ids"][-1:]
    loop = ScriptedLoop([ids[:3], ids[3:] + [x]], "stop")
    pieces = run(loop, parse(model, {"prompt": "a", "logprobs": 0, "stop_token_ids": [x]}), model)
    assert tokenizer.decode(ids + [x]).endswith("x") and "".join(p.text for p in pieces) == "hello"
    assert [e[0][0] for p in pieces for e in p.logprobs] == ids + [x]


def test_n_choices_are_n_engine_requests_of_their_samples_params(model, tokenizer):
    """n = 3: three engine requests, (id, i) with params.for_sample(i) (choice 0 keeps the seed), each with its
    own stop matcher; the pieces of every choice come back, each choice ending once.
    Fails if every choice runs sample 0's params: checked by `params.for_sample(0)` in `generate`."""
    loop = ScriptedLoop([[40, 41], [42]], "length")
    parsed = parse(model, {"prompt": "a", "n": 3, "seed": 5, "temperature": 1.0, "stop": ["zz"]})
    pieces = run(loop, parsed, model)
    assert [r.request_id for r in loop.requests] == [("cmpl-s", i) for i in range(3)]
    assert [r.params for r in loop.requests] == [parsed.params.for_sample(i) for i in range(3)]
    assert loop.requests[0].params.seed == 5 and len({r.params.seed for r in loop.requests}) == 3
    assert len({id(r.stop_strings) for r in loop.requests}) == 3  # a matcher holds one row's text
    assert sorted(p.index for p in pieces if p.completion is not None) == [0, 1, 2]
    assert ["".join(p.text for p in pieces if p.index == i) for i in range(3)] == [tokenizer.decode([40, 41, 42])] * 3
