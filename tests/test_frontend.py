"""The front end is the one way in (issue 51): no other module of the package or the jobs builds a `Request` or
expands n with `for_sample`; its length rule caps or refuses as documented; its n fan-out gives each sample the
parameters and id the edges relied on."""

import ast
from pathlib import Path

import pytest

from domino_ray.frontend.requests import LengthError, check_length, id_requests, prompt_requests
from domino_ray.sample.params import SamplingParams

ROOT = Path(__file__).resolve().parents[1]
FRONTEND = ROOT / "domino_ray" / "frontend"


def request_builders(source: str) -> list[str]:
    """The calls in `source` that build an engine request (`Request(...)`) or expand n (`x.for_sample(...)`)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call):
            name = node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", None)
            if name in ("Request", "for_sample"):
                found.append(f"{name} at line {node.lineno}")
    return found


def test_no_module_outside_the_front_end_builds_a_request_or_expands_n():
    files = [p for p in [*(ROOT / "domino_ray").rglob("*.py"), *(ROOT / "jobs").glob("*.py")]
             if FRONTEND not in p.parents]
    offenders = {str(p.relative_to(ROOT)): calls for p in files if (calls := request_builders(p.read_text()))}
    assert offenders == {}


def test_the_check_sees_a_request_built_at_an_edge():
    source = "from x import Request\ndef f(p):\n    return [Request(1, [2], p.for_sample(0)), engine.Request(2, [])]\n"
    assert sorted(request_builders(source)) == ["Request at line 3", "Request at line 3", "for_sample at line 3"]
    assert request_builders((FRONTEND / "requests.py").read_text())  # the front end itself does build them


def test_length_rule_caps_or_refuses_and_a_prompt_that_fills_the_context_is_an_error():
    assert check_length(30, 10, 40, over_length="refuse") == 10
    assert check_length(30, 11, 40, over_length="cap") == 10
    with pytest.raises(LengthError, match=r"max_tokens \(11\) exceeds .* at most 10 new tokens fit") as info:
        check_length(30, 11, 40, over_length="refuse", max_tokens_field="max_tokens")
    assert info.value.field == "max_tokens"
    for over_length in ("cap", "refuse"):
        with pytest.raises(LengthError, match=r"messages has 40 tokens; the model's limit is 40 tokens") as info:
            check_length(40, 1, 40, over_length=over_length, prompt_field="messages")
        assert info.value.field == "messages"


def test_n_fans_out_with_each_samples_seed_and_id():
    params = SamplingParams(max_new_tokens=4, temperature=0.8, seed=7, n=3)
    requests = prompt_requests("r", [1, 2, 3], params, max_model_len=64)
    assert [r.request_id for r in requests] == [("r", 0), ("r", 1), ("r", 2)]
    assert [r.params for r in requests] == [params.for_sample(i) for i in range(3)]
    assert requests[0].params.seed == 7 and len({r.params.seed for r in requests}) == 3
    assert all(r.params.n == 1 and r.prompt_token_ids == [1, 2, 3] for r in requests)
    [second] = prompt_requests("r", [1, 2, 3], params, max_model_len=64, samples=[1])  # a batch row: one sample
    assert second == requests[1]
    with pytest.raises(ValueError, match="sample index 3 is outside n=3"):
        prompt_requests("r", [1], params, max_model_len=64, samples=[3])


def test_stop_strings_need_a_tokenizer_and_id_requests_take_neither_n_nor_stop():
    with pytest.raises(ValueError, match=r"stop=\['x'\] needs a tokenizer"):
        prompt_requests(0, [1], SamplingParams(stop=("x",)), max_model_len=64)
    assert [r.request_id for r in id_requests([[1], [2, 3]], SamplingParams())] == [0, 1]
    assert [r.request_id for r in id_requests([[1]], SamplingParams(), request_ids=["long"])] == ["long"]
    for bad in (SamplingParams(n=2), SamplingParams(stop=("x",))):
        with pytest.raises(ValueError, match="one sample per prompt without stop strings or constraints"):
            id_requests([[1]], bad)


def test_without_a_known_length_the_rule_is_left_to_the_engine():
    [request] = prompt_requests(0, [1] * 1000, SamplingParams(max_new_tokens=5000), max_model_len=None)
    assert len(request.prompt_token_ids) == 1000 and request.params.max_new_tokens == 5000
