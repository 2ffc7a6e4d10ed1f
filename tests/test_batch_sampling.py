"""Issue 44 in the batch job: stop strings, n samples per row, the logprobs column, vLLM fields we do not have,
penalties and min_tokens. One small job (module fixture) on the agreeing pair at a fixed K, then a resume of it.

The oracle of every generated row is the target alone: greedy rows against the target's own greedy tokens (cut
where a stop string first appears in their text), sampled rows against `SpecEngine` without a draft with the same
per-sample parameters (`row_params(...).for_sample(i)`), logprobs and penalties against the target's logits.
"""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from batch_fixtures import agreeing_pair, job_config, make_prompts, ray_cluster, write_shards  # noqa: F401
from domino_ray.batch.job import run_job
from domino_ray.batch.schema import TOKEN_LOGPROBS, row_params
from domino_ray.config import generation_defaults
from domino_ray.target.loading import encode_prompt, load_target, load_tokenizer, stop_token_ids
from domino_ray.sample.params import SamplingParams
from speculation import speculate_in_process

pytestmark = pytest.mark.ray

MAX_NEW = 12
K = 3
SAMPLED = {"temperature": 0.8, "seed": 5}
PENALTIES = {"repetition_penalty": 1.5, "presence_penalty": 0.7, "frequency_penalty": 0.4, "min_tokens": 6}
# (id, sampling_params, expected error): one error row each, sample_index 0 (n unknown or bad)
BAD = [("bias", {"bad_words": ["x"]}, "^sampling_params.bad_words is not supported$"),
       ("beam", {"use_beam_search": True, "n": 2}, "^sampling_params.use_beam_search=True is not supported"),
       # this pair's tokenizer is SentencePiece-style (no byte-level BPE): a grammar cannot run on it
       ("structured", {"structured_outputs": {"json": {}}}, "^sampling_params: structured_outputs needs a tokenizer"),
       ("lp42", {"logprobs": 42}, "^sampling_params: sampling parameter logprobs=42 is invalid: expected null or an"),
       ("n0", {"n": 0}, "^sampling_params: sampling parameter n=0 is invalid: expected an int >= 1"),
       ("stop_empty", {"stop": [""]}, "^sampling_params: sampling parameter stop=.* is invalid"),
       ("pen", {"presence_penalty": 2.5}, "^sampling_params: sampling parameter presence_penalty=2.5 is invalid"),
       # Issue 12 item 11: `{"seed": true}` once passed validation, torch's manual_seed(True) raised in add_request,
       # the engine loop died and Ray restarted the actor forever (the engine loop's own guard:
       # test_batch_faults.test_any_error_adding_a_request_fails_only_that_request)
       ("seed_bool", {"seed": True, "temperature": 0.5}, "^sampling_params: sampling parameter seed=True is invalid")]


def _greedy_oracle(pair, prompt_ids):
    rows = speculate_in_process(*pair, prompt_ids, [SamplingParams(max_new_tokens=MAX_NEW)] * len(prompt_ids), K)
    return [r.target_only for r in rows]


def _first_with(tokenizer, tokens, stop) -> int:
    """The fewest generated tokens whose text holds the stop string (the target-only row cut there)."""
    return next(m for m in range(1, len(tokens) + 1) if stop in tokenizer.decode(tokens[:m], skip_special_tokens=True))


@pytest.fixture(scope="module")
def job(ray_cluster, agreeing_pair, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sampling_job")
    tokenizer = load_tokenizer(agreeing_pair[0])
    prompts = make_prompts(8, seed=7)
    ids = [encode_prompt(tokenizer, prompt=p, chat_template=False) for p in prompts]
    greedy = _greedy_oracle(agreeing_pair, ids)
    rows = []  # (id, prompt, sampling_params)
    stops = {}
    for i, tokens in enumerate(greedy):
        if len(tokens) >= 6:  # a stop string of two tokens' text, from the middle: it spans their boundary
            stops[i] = tokenizer.decode(tokens[2:4], skip_special_tokens=True)
            rows.append((f"stop{i}", prompts[i], {"stop": [stops[i]]}))
            rows.append((f"keep{i}", prompts[i], {"stop": ["never there", stops[i]],
                                                  "include_stop_str_in_output": True}))
    rows += [("n3", prompts[1], {"n": 3, **SAMPLED}), ("n1", prompts[1], SAMPLED),
             ("n2", prompts[2], {"n": 2, "temperature": 0.8}), ("greedy_n2", prompts[3], {"n": 2})]
    rows += [(name, prompts[0], overrides) for name, overrides, _ in BAD]
    rows += [("empty_n2", "", {"n": 2}), ("plain", prompts[4], None), ("lp", prompts[1], {"logprobs": 2}),
             ("penalized", prompts[7], PENALTIES)]
    columns = {"id": [r[0] for r in rows], "prompt": [r[1] for r in rows],
               "sampling_params": [json.dumps(r[2]) if r[2] is not None else None for r in rows]}
    write_shards(tmp / "in", columns, shards=2)
    cfg = job_config(agreeing_pair, str(tmp / "in"), str(tmp / "out"),
                     **{"generation.max_new_tokens": MAX_NEW, "draft.num_draft_tokens": K})
    summary = run_job(cfg, log=lambda *_: None)
    out = pq.read_table(tmp / "out")
    return {"cfg": cfg, "out": out, "dir": tmp / "out", "summary": summary, "rows": rows, "stops": stops,
            "greedy": greedy, "prompt_ids": ids, "prompts": prompts, "tokenizer": tokenizer, "pair": agreeing_pair}


def _by_key(table: pa.Table) -> dict:
    return {(r["id"], r["sample_index"]): r for r in table.to_pylist()}


def test_every_input_row_yields_its_samples(job):
    """n rows per input row (sample_index 0..n-1), 1 for a row whose n is unknown or bad; keys unique."""
    keys = sorted(_by_key(job["out"]))
    assert len(keys) == job["out"].num_rows
    n_of = {"n3": 3, "n2": 2, "greedy_n2": 2, "empty_n2": 2}
    assert keys == sorted((name, i) for name, _, _ in job["rows"] for i in range(n_of.get(name, 1)))
    assert job["out"].schema.field("sample_index").type == pa.int32()
    s = job["summary"]
    assert s["rows"]["total"] == s["rows"]["unique_ids"] == len(keys) and s["input"]["rows"] == len(job["rows"])


def test_stop_strings_end_rows_as_target_only_does(job):
    """A row's stop string (here two tokens' text: it spans their boundary) ends it on the token that completes
    it: tokens trimmed there, finish_reason stop, the text before the string (or through it with
    include_stop_str_in_output), equal to the target alone's row cut at the string's first appearance; and some
    rows' strings complete inside an accepted run (the cut token an accepted draft)."""
    rows, tok = _by_key(job["out"]), job["tokenizer"]
    assert len(job["stops"]) >= 3
    for i, stop in job["stops"].items():
        full = job["greedy"][i]
        m = _first_with(tok, full, stop)
        assert stop not in tok.decode(full[m - 1:m], skip_special_tokens=True)  # spans a token boundary
        text = tok.decode(full[:m], skip_special_tokens=True)
        cut, kept = rows[(f"stop{i}", 0)], rows[(f"keep{i}", 0)]
        for row in (cut, kept):
            assert row["generated_tokens"] == full[:m] and row["finish_reason"] == "stop", (i, stop, row)
            assert row["num_generated_tokens"] == m < len(full) or m == len(full)
        assert cut["generated_text"] == text[:text.index(stop)] and stop not in cut["generated_text"]
        assert kept["generated_text"] == text[:text.index(stop) + len(stop)] and kept["generated_text"].endswith(stop)
    assert any(_first_with(tok, job["greedy"][i], s) < len(job["greedy"][i]) for i, s in job["stops"].items())
    # the same rows in one process: speculative == target-only with the stop strings, some cut inside an accepted run
    chosen = sorted(job["stops"])
    here = speculate_in_process(*job["pair"], [job["prompt_ids"][i] for i in chosen],
                                [SamplingParams(max_new_tokens=MAX_NEW, stop=(job["stops"][i],)) for i in chosen], K)
    assert [h.token_ids for h in here] == [h.target_only for h in here] == \
        [rows[(f"stop{i}", 0)]["generated_tokens"] for i in chosen]
    assert any(h.stop_in_accepted_run for h in here)


def test_n_samples_follow_for_sample(job):
    """Sample i runs `row_params(...).for_sample(i)`: sample 0 equals the n = 1 row, the samples differ (seeds of
    their own), each equals the target alone's with those parameters (so a rerun gives the same samples)."""
    rows, cfg = _by_key(job["out"]), job["cfg"]
    n3 = [rows[("n3", i)]["generated_tokens"] for i in range(3)]
    assert n3[0] == rows[("n1", 0)]["generated_tokens"]
    assert len({tuple(t) for t in n3}) == 3
    greedy = [rows[("greedy_n2", i)]["generated_tokens"] for i in range(2)]
    assert greedy[0] == greedy[1] == job["greedy"][3]  # greedy samples are all the same (as vLLM's)
    base = generation_defaults(cfg.generation)
    cases = [("n3", 1, {"n": 3, **SAMPLED}, i) for i in range(3)] + [("n2", 2, {"n": 2, "temperature": 0.8}, i)
                                                                     for i in range(2)]
    params = [row_params(o, base, cfg.generation.seed, name).for_sample(i) for name, _, o, i in cases]
    assert len({p.seed for p in params}) == len(params)
    here = speculate_in_process(*job["pair"], [job["prompt_ids"][p] for _, p, _, _ in cases], params, K)
    assert [h.target_only for h in here] == [rows[(name, i)]["generated_tokens"] for name, _, _, i in cases]


def test_bad_values_and_unsupported_fields_are_error_rows_naming_the_field(job):
    import re

    rows = _by_key(job["out"])
    for name, _, reason in BAD:
        row = rows[(name, 0)]
        assert row["finish_reason"] == "error" and re.search(reason, row["error"]), (name, row["error"])
    # a bad prompt with a good n: n error rows
    assert [rows[("empty_n2", i)]["error"] for i in range(2)] == ["prompt is empty"] * 2
    bad = {name for name, _, _ in BAD} | {"empty_n2"}
    assert all(r["error"] is None and r["finish_reason"] in ("stop", "length") for (name, _), r in rows.items()
               if name not in bad)
    assert job["summary"]["rows"]["failed"] == len(BAD) + 2


def test_logprobs_column_is_null_unless_asked(job):
    """The column's type, null for rows that did not ask (and error rows), read back with pandas."""
    import pandas as pd

    assert job["out"].schema.field("logprobs").type == pa.list_(TOKEN_LOGPROBS)
    rows = _by_key(job["out"])
    assert all(r["logprobs"] is None for (name, _), r in rows.items() if name != "lp")
    df = pd.read_parquet(job["dir"])
    assert df.loc[df["id"] == "plain", "logprobs"].iloc[0] is None
    assert sorted(df.loc[df["id"] == "n3", "sample_index"]) == [0, 1, 2]


def _target_logits(target, prompt_ids, tokens):
    with torch.no_grad():
        logits = target(torch.tensor([prompt_ids + tokens])).logits[0].double()
    return logits[len(prompt_ids) - 1:len(prompt_ids) - 1 + len(tokens)]  # [T, V]: the logits each token came from


def test_logprobs_and_penalties_end_to_end(job):
    """Needs the engine's logprobs and penalties (issue 44). `lp` asks for logprobs=2: per generated token its
    logprob and the 2 most likely, the log-softmax of the target's raw logits there. `penalized` runs greedy with
    repetition, presence and frequency penalties and min_tokens: equal to the target's greedy loop with vLLM's
    penalties applied (repetition over prompt and generated tokens, then frequency and presence over generated
    ones; the stop ids suppressed before min_tokens)."""
    rows = _by_key(job["out"])
    target = load_target(job["pair"][0])
    ids = job["prompt_ids"]
    lp = rows[("lp", 0)]
    assert lp["generated_tokens"] == job["greedy"][1]
    assert lp["logprobs"] is not None and len(lp["logprobs"]) == len(lp["generated_tokens"])
    reference = torch.log_softmax(_target_logits(target, ids[1], lp["generated_tokens"]), -1)  # [T, V]
    for j, (token, entries) in enumerate(zip(lp["generated_tokens"], lp["logprobs"])):
        assert len(entries) == 3 and entries[0]["token_id"] == token
        for e in entries:
            assert e["logprob"] == pytest.approx(float(reference[j, e["token_id"]]), abs=1e-4)
        top = torch.topk(reference[j], 2).values.tolist()
        assert [e["logprob"] for e in entries[1:]] == pytest.approx(top, abs=1e-4)

    tokenizer = job["tokenizer"]
    stops = stop_token_ids(target, tokenizer)
    prompt, generated = ids[7], []
    while len(generated) < MAX_NEW:
        with torch.no_grad():
            logits = target(torch.tensor([prompt + generated])).logits[0, -1].double()
        seen = torch.tensor(sorted(set(prompt + generated)))
        logits[seen] = torch.where(logits[seen] > 0, logits[seen] / PENALTIES["repetition_penalty"],
                                   logits[seen] * PENALTIES["repetition_penalty"])
        counts = torch.bincount(torch.tensor(generated, dtype=torch.long), minlength=len(logits)).double()
        logits -= PENALTIES["frequency_penalty"] * counts + PENALTIES["presence_penalty"] * (counts > 0).double()
        if len(generated) < PENALTIES["min_tokens"]:
            logits[sorted(stops)] = float("-inf")
        generated.append(int(logits.argmax()))
        if generated[-1] in stops:
            break
    assert len(job["greedy"][7]) < PENALTIES["min_tokens"]  # the row would stop before min_tokens unpenalized
    row = rows[("penalized", 0)]
    assert row["generated_tokens"] == generated and row["num_generated_tokens"] >= PENALTIES["min_tokens"]


def test_resume_neither_repeats_nor_loses_a_sample(job):
    """An output missing some samples (a partial run: some of a row's samples written, others not): the rerun
    writes exactly the missing (id, sample_index) rows, each equal to the first run's. Fails if the resume key is
    the id alone (n3's missing sample is never written) or if a row's samples are all redone (repeats)."""
    full = job["out"]
    dropped = {("n3", 1), ("n2", 0), ("n2", 1), ("stop0", 0), ("empty_n2", 1), ("bias", 0)} & set(_by_key(full))
    assert ("n3", 1) in dropped and len(dropped) >= 5
    keys = zip(full.column("id").to_pylist(), full.column("sample_index").to_pylist())
    keep = [key not in dropped for key in keys]
    for path in job["dir"].glob("*.parquet"):
        path.unlink()
    (job["dir"] / "_summary.json").unlink()
    pq.write_table(full.filter(pa.array(keep)), job["dir"] / "kept.parquet")
    summary = run_job(job["cfg"], log=lambda *_: None)
    assert summary["run"]["rows"] == len(dropped)
    assert summary["run"]["rows_already_done"] == full.num_rows - len(dropped)
    again = pq.read_table(job["dir"])
    assert again.num_rows == full.num_rows and summary["rows"]["unique_ids"] == full.num_rows
    before, after = _by_key(full), _by_key(again)
    for key in dropped:
        for column in ("generated_tokens", "generated_text", "finish_reason", "error", "logprobs"):
            assert after[key][column] == before[key][column], (key, column)
