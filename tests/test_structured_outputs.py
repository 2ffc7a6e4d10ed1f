"""Structured outputs (issue 52) on the demo pair (a byte-level BPE tokenizer, as Qwen's): the target's distribution is
the constrained one at every position, at every verify position given the drafts before it, so speculative ==
target-only token for token when greedy (and per seed when sampled), and both equal Hugging Face `generate` with a
logits processor that masks by llguidance's own matcher; every output is in its grammar."""

import json
import re

import jsonschema
import pytest
import torch
from transformers import LogitsProcessor, LogitsProcessorList

from batch_fixtures import job_config, ray_cluster, write_shards  # noqa: F401
from domino_ray import DominoLLM, SamplingParams
from domino_ray.config import DEMO_ASSETS
from domino_ray.frontend.constraints import _compiled, _ll_tokenizer, row_constraint
from domino_ray.sample.sampling import sampling_mode
from domino_ray.target.loading import load_target, load_tokenizer, stop_token_ids

TARGET, DRAFT = str(DEMO_ASSETS / "target"), str(DEMO_ASSETS / "draft")
PROMPTS = ["Describe the os module as JSON", "json.dumps returns", "A class for parsing", "Return the path"]
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "count": {"type": "integer", "minimum": 0, "maximum": 999},
                                           "kind": {"enum": ["module", "class", "function"]}},
          "required": ["name", "count", "kind"], "additionalProperties": False}
CONSTRAINTS = {  # name -> (structured_outputs, the check every output passes)
    "json": ({"json": SCHEMA}, lambda text: jsonschema.validate(json.loads(text), SCHEMA) is None),
    "json_object": ({"json_object": True}, lambda text: isinstance(json.loads(text), dict)),
    "regex": ({"regex": r"(def|class) [a-z_]{1,12}\(\d\)"}, lambda text: re.fullmatch(r"(def|class) [a-z_]{1,12}\(\d\)", text)),
    "choice": ({"choice": ["yes", "no", "it depends"]}, lambda text: text in ("yes", "no", "it depends")),
    "grammar": ({"grammar": 'root ::= ("import " | "from ") name ";"\nname ::= [a-z] [a-z]? [a-z]?'},
                lambda text: re.fullmatch(r"(import |from )[a-z]{1,3};", text)),
}


@pytest.fixture(scope="module")
def engines():
    """Target-only, Domino at K = 4 and Domino auto, on the demo pair."""
    return {"target_only": DominoLLM.from_pretrained(TARGET),
            "k4": DominoLLM.from_pretrained(TARGET, draft=DRAFT, num_draft_tokens=4),
            "auto": DominoLLM.from_pretrained(TARGET, draft=DRAFT, num_draft_tokens="auto")}


@pytest.mark.parametrize("name", list(CONSTRAINTS))
def test_greedy_constrained_speculative_equals_target_only_and_every_output_is_in_its_grammar(engines, name):
    """Fails if a verify position's mask ignores the drafts before it: checked by computing every position's mask
    at the row's committed state (drafts that leave the grammar get accepted, and the outputs part)."""
    spec, check = CONSTRAINTS[name]
    params = SamplingParams(max_new_tokens=64, structured_outputs=spec)
    outs = {key: llm.generate(PROMPTS, params) for key, llm in engines.items()}
    tokens = {key: [o.token_ids for o in out] for key, out in outs.items()}
    assert tokens["k4"] == tokens["target_only"] and tokens["auto"] == tokens["target_only"]
    finished = [out for out in outs["target_only"] if out.finish_reason == "stop"]  # the rest ran out of tokens
    assert all(check(out.text) for out in finished), [out.text for out in finished]
    assert finished or name == "json_object"  # any object: the demo target writes strings it never closes
    assert sum(o.stats["num_accepted_draft_tokens"] for o in outs["k4"]) > 0  # the verify did accept drafts
    for out in outs["k4"]:  # forced tokens (the grammar's only continuation) are counted among the accepted drafts
        assert 0 <= out.stats["num_forced_tokens"] <= out.stats["num_accepted_draft_tokens"]
    assert all(o.stats["num_forced_tokens"] == 0 for o in outs["target_only"])
    if name in ("json", "choice"):  # keys and punctuation, the rest of a choice: forced
        assert sum(o.stats["num_forced_tokens"] for o in outs["k4"]) > 0


def test_sampled_constrained_rows_follow_their_seed_and_the_schema(engines):
    params = SamplingParams(max_new_tokens=64, temperature=0.9, seed=5, n=3, structured_outputs={"json": SCHEMA})
    outs = {key: engines[key].generate(PROMPTS[:2], params) for key in ("target_only", "k4")}
    assert [o.token_ids for o in outs["k4"]] == [o.token_ids for o in outs["target_only"]]
    for out in outs["k4"]:
        jsonschema.validate(json.loads(out.text), SCHEMA)
    assert len({o.text for o in outs["k4"]}) > 1  # the samples differ


class LLGuidanceMask(LogitsProcessor):
    """Hugging Face `generate`'s view of a grammar, straight from llguidance's matcher (none of our engine's code):
    each step the matcher takes the last token and masks the next."""

    def __init__(self, matcher, vocab_size: int, prompt_len: int):
        self.matcher, self.vocab_size, self.prompt_len = matcher, vocab_size, prompt_len

    def __call__(self, input_ids, scores):
        if input_ids.shape[1] > self.prompt_len:
            assert self.matcher.consume_token(int(input_ids[0, -1]))
        words = torch.zeros((self.vocab_size + 31) // 32, dtype=torch.int32)
        self.matcher.unsafe_compute_mask_ptr(words.data_ptr(), words.numel() * 4)
        allowed = ((words[:, None] >> torch.arange(32, dtype=torch.int32)) & 1).bool().flatten()[:scores.shape[1]]
        return scores.masked_fill(~allowed, float("-inf"))


@pytest.mark.parametrize("name", ["json", "regex"])
def test_greedy_constrained_equals_hugging_face_generate_with_llguidances_mask(engines, name):
    target, tokenizer = load_target(TARGET), load_tokenizer(TARGET)
    eos = sorted(stop_token_ids(target, tokenizer))
    params = SamplingParams(max_new_tokens=48, structured_outputs=CONSTRAINTS[name][0])
    ours = engines["auto"].generate(PROMPTS, params)
    for out in ours:
        ids = out.prompt_token_ids
        ll = _ll_tokenizer(tokenizer, tuple(eos))
        mask = LLGuidanceMask(_compiled(ll, *params.structured_outputs).deep_copy(), ll.vocab_size, len(ids))
        hf = target.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=48, do_sample=False, eos_token_id=eos, pad_token_id=eos[0],
                             logits_processor=LogitsProcessorList([mask]))
        assert out.token_ids == hf[0, len(ids):].tolist()


def test_logit_bias_and_allowed_token_ids_hold_under_speculation(engines):
    tokenizer = load_tokenizer(TARGET)
    allowed = tokenizer.encode(" a b c d e", add_special_tokens=False) + [tokenizer.eos_token_id]
    favoured = tokenizer.encode(" the", add_special_tokens=False)[0]
    for params in (SamplingParams(max_new_tokens=24, allowed_token_ids=allowed),
                   SamplingParams(max_new_tokens=24, logit_bias={str(favoured): 100}, ignore_eos=True),
                   SamplingParams(max_new_tokens=24, temperature=0.8, seed=3, logit_bias={favoured: -100},
                                  allowed_token_ids=allowed + [favoured])):
        outs = {key: [o.token_ids for o in llm.generate(PROMPTS, params)] for key, llm in engines.items()}
        assert outs["k4"] == outs["target_only"] and outs["auto"] == outs["target_only"]
        generated = {t for row in outs["target_only"] for t in row}
        if params.allowed_token_ids:
            assert generated <= set(params.allowed_token_ids) and favoured not in generated
        else:
            assert generated == {favoured}  # +100 outweighs every other logit


def test_the_mask_follows_the_drafts_and_rolls_back():
    tokenizer = load_tokenizer(TARGET)
    eos = tokenizer.eos_token_id
    constraint = row_constraint(SamplingParams(structured_outputs={"choice": ["yes", "no"]}), tokenizer, (eos,))
    yes, no = (tokenizer.encode(w, add_special_tokens=False) for w in ("yes", "no"))
    before = constraint.forced()
    drafts = yes + no  # `yes` in the grammar, then `no` after it is not
    refused = _refused([constraint], [drafts], 4096)[0]  # [q, V]
    assert refused.shape == (len(drafts) + 1, 4096)
    for j, token in enumerate(yes):
        assert not refused[j, token]
    assert refused[len(yes), no[0]]                     # refused there: the verify rejects it
    assert not refused[len(yes), eos]                   # "yes" complete: the row may end
    assert constraint.forced() == before                # rolled back: the row's state is its committed tokens'


def test_the_masks_of_a_step_equal_a_walk_of_each_rows_grammar_position_by_position():
    """`constraint_mask` (one llguidance call a row, bit masks unpacked for the whole step) against the grammar walked
    one draft at a time with a fresh matcher: every position before a refused draft, every row, ids past the
    tokenizer's vocabulary refused; a row without a constraint and the padding slot refuse nothing."""
    tokenizer = load_tokenizer(TARGET)
    eos, vocab = tokenizer.eos_token_id, 4096 + 40  # a model vocabulary wider than the tokenizer's
    ll_tokenizer = _ll_tokenizer(tokenizer, (eos,))
    params = SamplingParams(structured_outputs={"json": SCHEMA})
    texts = ['{"count": 7, "kind": "class"', '{"count": "7', '{"co']
    drafts = [tokenizer.encode(t, add_special_tokens=False)[:6] for t in texts]
    drafts = [d + [eos] * (6 - len(d)) for d in drafts] + [[eos] * 6]  # the last row: no constraint
    constraints = [row_constraint(params, tokenizer, (eos,)) for _ in texts] + [None]
    refused = _refused(constraints, drafts, vocab, r=5)  # [5, 7, V]
    assert not refused[3:].any()
    walked = []  # drafts each row's grammar takes before refusing one
    for i in range(3):
        walk = _compiled(ll_tokenizer, *params.structured_outputs).deep_copy()
        for j in range(7):
            words = torch.zeros(-(-ll_tokenizer.vocab_size // 32), dtype=torch.int32)
            walk.unsafe_compute_mask_ptr(words.data_ptr(), words.numel() * 4)
            allowed = ((words[:, None] >> torch.arange(32, dtype=torch.int32)) & 1).bool().flatten()
            assert torch.equal(~refused[i, j, :4096], allowed[:4096]) and refused[i, j, 4096:].all(), (i, j)
            if j == 6 or not allowed[drafts[i][j]]:
                walked.append(j)
                break
            assert walk.consume_token(drafts[i][j])
    assert walked[0] == 6 and 0 < min(walked) < 6, walked  # a row taking all its drafts, a row refusing one


def _refused(constraints, drafts, vocab, r=None):
    from types import SimpleNamespace

    from domino_ray.engine.constrained import constraint_mask

    rows = [SimpleNamespace(request=SimpleNamespace(constraint=c)) for c in constraints]
    return constraint_mask(rows, drafts, r or len(rows), vocab, "cpu").refused


def test_bad_grammars_and_ids_are_errors_naming_the_field(engines):
    llm = engines["target_only"]
    for spec, message in [({"regex": "(unclosed"}, "structured_outputs.regex does not compile"),
                          ({"json": {"type": "nonsense"}}, "structured_outputs.json does not compile"),
                          ({"grammar": "root ::= missing"}, "structured_outputs.grammar does not compile")]:
        with pytest.raises(ValueError, match=re.escape(message)):
            llm.generate(["x"], SamplingParams(structured_outputs=spec))
    with pytest.raises(ValueError, match="exactly one of json, json_object, regex, choice, grammar"):
        SamplingParams(structured_outputs={"regex": "a", "choice": ["a"]})
    with pytest.raises(ValueError, match="token id 5000 is outside the vocabulary"):
        llm.generate(["x"], SamplingParams(allowed_token_ids=[5000]))
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={"5": 101})


def test_rows_without_constraints_keep_their_step_mode():
    plain, constrained = SamplingParams(), SamplingParams(logit_bias={1: 1.0})
    assert not sampling_mode([plain, plain]).constrained and sampling_mode([plain, constrained]).constrained


@pytest.mark.ray
def test_batch_job_rows_with_structured_outputs_are_valid_and_a_bad_schema_is_an_error_row(ray_cluster, tmp_path):
    """vLLM's `structured_outputs` and Ray Data LLM's `guided_decoding` in a row's sampling_params, through the job on
    a local Ray cluster (the demo pair, K = 4): each constrained row's text validates and equals the Python API's
    target-only output; a schema that does not compile is an error row naming the field; other rows run as ever."""
    import pyarrow.parquet as pq

    from domino_ray.batch.job import init_ray, run_job

    rows = [("p0", PROMPTS[0], {"structured_outputs": {"json": SCHEMA}}),
            ("p1", PROMPTS[1], {"guided_decoding": {"json": SCHEMA, "backend": "xgrammar"}}),
            ("p2", PROMPTS[2], {"structured_outputs": {"choice": ["yes", "no"]}, "temperature": 0.8, "seed": 3}),
            ("p3", PROMPTS[3], {"structured_outputs": {"json": {"type": "nonsense"}}}),
            ("p4", PROMPTS[0], None)]
    write_shards(tmp_path / "in", {"id": [r[0] for r in rows], "prompt": [r[1] for r in rows],
                                   "sampling_params": [json.dumps(r[2]) if r[2] else None for r in rows]}, shards=1)
    cfg = job_config((TARGET, DRAFT), str(tmp_path / "in"), str(tmp_path / "out"),
                     **{"generation.max_new_tokens": 64, "draft.num_draft_tokens": 4})  # a fixed K: no start-up timing
    init_ray(cfg)
    run_job(cfg, log=lambda *_: None)
    out = {r["id"]: r for r in pq.read_table(tmp_path / "out").to_pylist()}
    for key in ("p0", "p1"):
        jsonschema.validate(json.loads(out[key]["generated_text"]), SCHEMA)
    assert out["p2"]["generated_text"] in ("yes", "no")
    assert out["p3"]["finish_reason"] == "error" and "structured_outputs.json does not compile" in out["p3"]["error"]
    assert out["p4"]["error"] is None
    alone = DominoLLM.from_pretrained(TARGET, chat_template=False).generate(
        [PROMPTS[0], PROMPTS[2]], [SamplingParams(max_new_tokens=64, structured_outputs={"json": SCHEMA}),
                                   SamplingParams(max_new_tokens=64, temperature=0.8, seed=3,
                                                  structured_outputs={"choice": ["yes", "no"]})])
    assert [out["p0"]["generated_tokens"], out["p2"]["generated_tokens"]] == [a.token_ids for a in alone]


def test_serves_fields_become_the_same_constraints():
    """OpenAI's response_format, vLLM's structured_outputs and guided_* fields, logit_bias and allowed_token_ids reach
    SamplingParams; a bad one is a 400 naming its field (parsing only: the HTTP run is tests/test_serve_job.py)."""
    from domino_ray.serve.openai_api import APIError, ModelSpec, parse_request

    tokenizer = load_tokenizer(TARGET)
    model = ModelSpec(name="demo", tokenizer=tokenizer, vocab_size=4096, max_model_len=512,
                      eos_token_ids=(tokenizer.eos_token_id,))

    def parse(body: dict):
        return parse_request("completion", json.dumps({"prompt": "x", **body}).encode(), model).params

    schema_format = {"type": "json_schema", "json_schema": {"name": "t", "schema": SCHEMA}}
    assert parse({"response_format": schema_format}).structured_outputs == ("json", json.dumps(SCHEMA, sort_keys=True))
    assert parse({"response_format": {"type": "json_object"}}).structured_outputs == ("json_object", "")
    assert parse({"response_format": {"type": "text"}}).structured_outputs is None
    assert parse({"guided_regex": "a+"}).structured_outputs == parse({"structured_outputs": {"regex": "a+"}}).structured_outputs
    assert parse({"logit_bias": {"7": -100}, "allowed_token_ids": [7, 8]}).logit_bias == ((7, -100.0),)
    for body, param in [({"response_format": {"type": "xml"}}, "response_format"),
                        ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "nonsense"}}}},
                         "response_format"),
                        ({"guided_regex": "(a"}, "guided_regex"),
                        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
                        ({"response_format": schema_format, "guided_regex": "a"}, "guided_regex"),
                        ({"logit_bias": {"7": 500}}, "logit_bias"), ({"allowed_token_ids": [9999]}, "allowed_token_ids")]:
        with pytest.raises(APIError) as info:
            parse(body)
        assert info.value.status == 400 and info.value.param == param, (body, info.value.message)


def test_forced_tokens_widen_a_step_only_where_the_cost_table_says_they_pay():
    from domino_ray.engine.constrained import forced_width

    forced = [[5, 6, 7]] + [[]] * 15  # one row of 16 has three forced tokens
    assert forced_width(forced, 0, 8) == 3  # a fixed K: wide enough for them
    cheap = {0: 1.0, 1: 1.01, 2: 1.02, 4: 1.04, 8: 1.1}   # widths cost almost nothing: take them
    dear = {0: 1.0, 1: 1.5, 2: 2.0, 4: 3.0, 8: 5.0}       # 16 rows on a CPU: +3 tokens do not pay for 2x the step
    assert forced_width(forced, 0, 8, cheap) == 4 and forced_width(forced, 0, 8, dear) == 0
    assert forced_width([[5, 6, 7]], 0, 8, dear) == 2   # one row alone: 3 tokens for 2x pay
    assert forced_width([[5]], 4, 8, cheap) == 4          # never narrower than the policy's width
