"""Ray-free pieces of the batch job: file resolution, resume scan, atomic JSON, row parsing, the output
schema of ok and error rows, and summary totals."""

import json
import subprocess
import sys
from dataclasses import replace

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from domino_ray.batch.io import list_parquet_files, read_json, resolve, scan_output, write_json_atomic
from domino_ray.batch.schema import (GENERATED_FIELDS, RowError, engine_columns, error_row, ok_row, output_schema,
                                     output_table, read_row, row_params, sample_count, with_columns)
from domino_ray.batch.summary import STATS_COLUMNS, human_summary, run_stats, summarize
from domino_ray.config import ConfigError, InputConfig, S3Config, load_config
from domino_ray.engine.request import Completion
from domino_ray.sample.params import SamplingParams
from domino_ray.spec_decode.stats import RowStats

IC = InputConfig()


def test_resolve_and_list(tmp_path):
    for name in ("a.parquet", "sub/b.parquet", "_tmp/c.parquet", ".hidden.parquet", "notes.txt"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(pa.table({"x": [1]}), tmp_path / name)
    loc = resolve(str(tmp_path), S3Config())
    assert [p.removeprefix(str(tmp_path)) for p in list_parquet_files(loc)] == ["/a.parquet", "/sub/b.parquet"]
    assert list_parquet_files(resolve(str(tmp_path / "sub/b.parquet"), S3Config())) == [str(tmp_path / "sub/b.parquet")]
    glob = lambda pattern: [p.removeprefix(str(tmp_path)) for p in list_parquet_files(resolve(pattern, S3Config()))]
    assert glob(str(tmp_path / "*.parquet")) == ["/a.parquet"]  # shell semantics: one segment, no hidden files
    assert glob(str(tmp_path / "*" / "*.parquet")) == ["/sub/b.parquet"]
    with pytest.raises(FileNotFoundError, match="does not exist"):
        list_parquet_files(resolve(str(tmp_path / "missing"), S3Config()))
    assert list_parquet_files(resolve(str(tmp_path / "missing"), S3Config()), missing_ok=True) == []
    s3 = resolve("s3://bucket/prefix/", S3Config(endpoint_url="http://127.0.0.1:1"))
    assert s3.path == "bucket/prefix"
    with pytest.raises(ValueError, match="only local paths and s3://"):
        resolve("gs://bucket/x", S3Config())


def test_scan_output_trusts_only_complete_files(tmp_path):
    pq.write_table(pa.table({"id": [1, 2, 3], "v": ["a", "b", "c"]}), tmp_path / "done.parquet")
    pq.write_table(pa.table({"id": [4, 5], "v": ["d", "e"]}), tmp_path / "cut.parquet")
    data = (tmp_path / "cut.parquet").read_bytes()
    (tmp_path / "cut.parquet").write_bytes(data[: len(data) // 2])  # a writer killed mid-file: no footer
    pq.write_table(pa.table({"id": [7, 7], "sample_index": pa.array([1, 0], pa.int32())}), tmp_path / "n.parquet")
    scan = scan_output(resolve(str(tmp_path), S3Config()), "id")
    # the resume key is (id, sample_index); a file written before sample_index holds sample 0 of its rows
    assert sorted(zip(*scan.done.to_pydict().values())) == [(1, 0), (2, 0), (3, 0), (7, 0), (7, 1)]
    assert [p.rsplit("/", 1)[1] for p in scan.removed] == ["cut.parquet"]
    assert not (tmp_path / "cut.parquet").exists()
    assert len(scan_output(resolve(str(tmp_path / "none"), S3Config()), "id").done) == 0
    pq.write_table(pa.table({"key": [1]}), tmp_path / "foreign.parquet")  # complete, but not our output
    with pytest.raises(ValueError, match="has no 'id' column"):
        scan_output(resolve(str(tmp_path), S3Config()), "id")
    assert (tmp_path / "foreign.parquet").exists()


def test_write_json_atomic(tmp_path):
    loc = resolve(str(tmp_path / "out"), S3Config())
    write_json_atomic(loc, "_summary.json", {"rows": 3})
    write_json_atomic(loc, "_summary.json", {"rows": 4})
    assert read_json(loc, "_summary.json") == {"rows": 4}
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["_summary.json"]  # no temporary left
    assert read_json(loc, "other.json") is None


@pytest.mark.parametrize("row, reason", [
    ({"prompt": None}, "prompt is null"),
    ({"prompt": float("nan")}, "prompt is null"),  # a missing cell of a pandas-built dataset
    ({"prompt": float("nan"), "messages": float("nan")}, "prompt is null"),
    ({"prompt": ""}, "prompt is empty"),
    ({"prompt": " \n\t"}, "prompt is empty"),
    ({"prompt": b"\xff\xfehello"}, "not valid UTF-8"),
    ({"prompt": 42}, "must be a string, got int"),
    ({"prompt": ["a", "b"]}, "must be a string, got list"),
    ({"prompt": {"text": "hi"}}, "must be a string, got dict"),
    ({"messages": []}, "non-empty list"),
    ({"messages": "not json"}, "messages is not valid JSON"),
    ({"messages": [{"role": "user"}]}, r"messages\[0\] must be an object"),
    ({"messages": [{"role": "user", "content": None}]}, r"messages\[0\] must be an object"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "role='wizard'"),
    ({"messages": '[{"role": "user", "content": 5}]'}, "content must be a string"),
    ({"messages": [{"role": "user", "content": "  "}]}, "no content"),
    ({"messages": None}, "no 'prompt' column"),
])
def test_bad_rows_say_why(row, reason):
    with pytest.raises(RowError, match=reason):
        read_row(row, IC)


def test_good_rows():
    assert read_row({"prompt": "hi", "messages": None}, IC).prompt == "hi"
    assert read_row({"prompt": "héllo".encode()}, IC).prompt == "héllo"
    chat = read_row({"prompt": None, "messages": [{"role": "user", "content": "hi", "name": None}]}, IC)
    assert chat.messages == [{"role": "user", "content": "hi"}]  # Arrow struct nulls dropped
    assert read_row({"prompt": "hi", "messages": float("nan")}, IC).prompt == "hi"  # pandas' missing cell
    assert read_row({"messages": '[{"role": "user", "content": "hi"}]'}, IC).messages[0]["content"] == "hi"


def test_row_params():
    base = SamplingParams(max_new_tokens=8)
    assert row_params(None, base, None, 1) == base
    assert row_params(float("nan"), base, None, 1) == base  # a missing cell of a pandas-built dataset
    assert row_params({"temperature": None, "max_new_tokens": 3}, base, None, 1).max_new_tokens == 3
    assert row_params('{"top_k": 5, "stop_token_ids": [1, 2]}', base, None, 1).stop_token_ids == (1, 2)
    seeded = [row_params({"temperature": 1.0}, base, 7, i).seed for i in ("a", "a", "b")]
    assert seeded[0] == seeded[1] != seeded[2]  # per-row seed from (generation.seed, id): batch-independent
    assert row_params({"temperature": 1.0}, base, 7, None).seed is None  # no id: the engine's generator
    # Ray Data LLM's names for the same settings
    assert row_params({"max_tokens": 5, "top_k": -1}, base, None, 1) == replace(base, max_new_tokens=5, top_k=0)
    for bad, reason in [({"temprature": 1.0}, "unknown keys"), ({"temperature": -1.0}, "temperature=-1.0"),
                        ({"max_new_tokens": "5"}, "max_new_tokens='5'"), ("{oops", "not valid JSON"),
                        ([1, 2], "must be an object"), ({"stop_token_ids": 5}, "sampling_params"),
                        ({"max_tokens": 5, "max_new_tokens": 6}, "both max_tokens and max_new_tokens"),
                        ({"top_k": -2}, "top_k=-2")]:
        with pytest.raises(RowError, match=reason):
            row_params(bad, base, None, 1)


def _completion(tokens, k=2):
    stats = RowStats(k)
    stats.observe_step(2, 1)
    stats.observe_step(1, 0)
    return Completion(request_id=0, prompt_token_ids=[5, 6, 7], token_ids=tokens, finish_reason="length",
                      stats=stats, time_to_first_token_s=0.1, time_taken_s=0.3)


def test_error_and_ok_rows_share_the_schema():
    input_schema = pa.schema([("id", pa.int64()), ("prompt", pa.binary()), ("topic", pa.string())])
    schema = output_schema(input_schema, "id", generated_id=False)
    assert schema.names[:2] == ["id", "topic"] and schema.names[2:] == [f.name for f in GENERATED_FIELDS]
    assert output_schema(pa.schema([("prompt", pa.string())]), "id", generated_id=True).field("id").type == pa.string()
    carried = pa.table({"id": [1, 2], "prompt": [b"a", None], "topic": ["x", "y"]}, schema=input_schema)
    rows = [ok_row(_completion([1, 2, 3, 4])), error_row("prompt is null", num_spec_tokens=2)]
    table = output_table(with_columns(carried, {**engine_columns(rows), "prompt": ["a", None], "sample_index": [0, 0],
                                                "generated_text": ["hello", ""]}), schema)
    assert table.schema == schema
    ok, err = table.to_pylist()
    assert ok["generated_tokens"] == [1, 2, 3, 4] and ok["acceptance_histogram"] == [1, 1, 0]
    assert ok["num_generated_tokens"] == 1 + ok["num_spec_steps"] + ok["num_accepted_draft_tokens"]
    assert err["finish_reason"] == "error" and err["error"] == "prompt is null" and err["generated_tokens"] == []
    assert err["acceptance_histogram"] == [0, 0, 0] and err["topic"] == "y"
    # an empty batch (every row of a block already done) leaves the stages with every column too
    empty = with_columns(carried.slice(0, 0), {**engine_columns([]), "prompt": [], "sample_index": [],
                                               "generated_text": []})
    assert output_table(empty, schema).schema == schema


def test_summary_reconciles_with_rows():
    schema = output_schema(pa.schema([("id", pa.string())]), "id", generated_id=False)
    rows = [ok_row(_completion([1, 2, 3, 4])) for _ in range(3)]
    rows.append(error_row("too long", num_spec_tokens=2))
    table = with_columns(pa.table({"id": ["a", "b", "c", "d"]}), engine_columns(rows))
    run = run_stats(2.0, 0, [{"actor": "x", "rows": 4, "generated_tokens": 12, "busy_s": 1.5}])
    s = summarize(table.select(["id", *STATS_COLUMNS]), "id", run=run, config={}, output_uri="out")
    assert s["rows"] == {"total": 4, "ok": 3, "failed": 1, "unique_ids": 4}
    assert s["totals"] == {"num_input_tokens": 9, "num_generated_tokens": 12, "num_spec_steps": 6,
                           "num_draft_tokens": 9, "num_accepted_draft_tokens": 3,
                           "near_ties": 0, "num_forced_tokens": 0}  # fp32 logits: none counted; no constraint
    assert s["acceptance_histogram"] == [3, 3, 0] and s["per_position_acceptance"] == [0.5, 0.0]
    assert s["mean_acceptance_length"] == 1.5 and s["draft_acceptance_rate"] == pytest.approx(3 / 9)
    assert s["errors"] == {"too long": 1} and s["run"]["tokens_per_s"] == 6.0
    text = human_summary(s)
    assert "4 rows (3 ok, 1 failed)" in text and "0.50 0.00" in text
    json.dumps(s)


def test_summary_of_an_empty_output():
    s = summarize(pa.table({c: [] for c in ["id", *STATS_COLUMNS]}), "id", run=run_stats(0.0, 0, []), config={},
                  output_uri="out")
    assert s["rows"] == {"total": 0, "ok": 0, "failed": 0, "unique_ids": 0} and s["totals"]["num_spec_steps"] == 0
    assert "0 rows (0 ok, 0 failed)" in human_summary(s)


def test_new_config_keys_are_checked():
    cfg = load_config(None, ["runtime.max_concurrent_batches=3", "output.min_rows_per_file=10",
                             "input.sampling_column=params", "runtime.compare_baseline=true"])
    assert cfg.runtime.max_concurrent_batches == 3 and cfg.runtime.compare_baseline
    for override, key in [("runtime.max_concurrent_batches=0", "runtime.max_concurrent_batches"),
                          ("output.max_rows_per_file=0", "output.max_rows_per_file"),
                          ("runtime.compare_baselin=true", "runtime.compare_baselin")]:
        with pytest.raises(ConfigError, match=key):
            load_config(None, [override])


def test_job_helpers_import_without_ray():
    """Ray stays at the edge (`ray_*.py`): the batch job's IO, schema, summary and pre-flight do not need it."""
    code = ("import sys; sys.modules['ray'] = None\n"
            "import domino_ray.batch.io, domino_ray.batch.schema, domino_ray.batch.summary, domino_ray.batch.preflight")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr


def test_summary_keeps_count_of_every_error_reason():
    """Issue 12 item 17: reasons beyond the listed ones are counted, and the printed summary says so."""
    schema = output_schema(pa.schema([("id", pa.int64())]), "id", generated_id=False)
    reasons = [f"prompt has {800 + i} tokens" for i in range(25)] + ["prompt is null"] * 3
    rows = [error_row(reason, num_spec_tokens=2) for reason in reasons]
    table = with_columns(pa.table({"id": list(range(len(rows)))}), engine_columns(rows))
    s = summarize(table.select(["id", *STATS_COLUMNS]), "id", run=run_stats(1.0, 0, []), config={}, output_uri="o")
    assert len(s["errors"]) == 20 and list(s["errors"].items())[0] == ("prompt is null", 3)
    assert s["errors_not_listed"] == {"reasons": 6, "rows": 6}
    assert sum(s["errors"].values()) + s["errors_not_listed"]["rows"] == s["rows"]["failed"] == 28
    text = human_summary(s)
    assert text.count("  error x") == 5 and "... and 21 more error reasons (21 rows)" in text


def test_run_counts_the_rows_it_wrote_not_the_rows_actors_retried():
    actors = [{"actor": "a", "rows": 1820, "generated_tokens": 9000, "busy_s": 3.0}]
    run = run_stats(2.0, 0, actors, written=(1500, 7000))
    assert (run["rows"], run["generated_tokens"], run["tokens_per_s"]) == (1500, 7000, 3500.0)
    assert run["actors"][0]["rows"] == 1820  # the work done, retries included


def _keys(ids, samples=None) -> pa.Table:
    return pa.table({"id": ids, "sample_index": pa.array(samples or [0] * len(ids), pa.int32())})


def test_resume_compares_ids_and_settings(tmp_path):
    """Issue 12 item 12: 'nothing to do' means every input id is done (not equal counts), and a changed
    output-determining setting is refused unless output.allow_mixed_settings=true."""
    from domino_ray.batch.job import rows_to_do
    from domino_ray.batch.preflight import InputPlan, check_settings, output_settings

    loc = resolve(str(tmp_path), S3Config())
    plan = InputPlan(loc, ["f"], pa.schema([("id", pa.string())]), False, {"f": 2}, 2, pa.array(["a", "b"]),
                     samples=pa.array([1, 1]), num_samples=2)
    assert rows_to_do(plan, _keys(["x", "y"]), {"rows": {}}) == 2  # same count, other ids
    assert rows_to_do(plan, _keys(["b", "a", "x"]), None) == 0
    # n: a row is done when all its samples are, each (id, sample_index) once
    plan.samples, plan.num_samples = pa.array([3, 1]), 4
    assert rows_to_do(plan, _keys(["b", "a", "x"]), None) == 2
    assert rows_to_do(plan, _keys(["b", "a", "a", "a"], [0, 0, 2, 7]), None) == 1  # a's sample 1
    assert rows_to_do(plan, _keys(["b", "a", "a", "a"], [0, 0, 2, 1]), None) == 0
    generated = InputPlan(loc, ["f"], pa.schema([("prompt", pa.string())]), True, {"f": 2}, 2,
                          samples=pa.array([1, 1]), num_samples=2)
    assert rows_to_do(generated, _keys(["1", "2"]), {"input": {"files": {"g": 2}}}) is None  # other files
    assert rows_to_do(generated, _keys(["1", "2"]), {"input": {"files": {"f": 2}}}) == 0

    base = output_settings(load_config(None, []))
    assert {"model.source", "draft.source", "generation.max_new_tokens", "generation.seed",
            "model.chat_template", "input.id_column"} <= set(base)
    assert "generation.max_batch_size" not in base and "model.device" not in base  # speed, not output
    assert output_settings(load_config(None, ["generation.max_batch_size=3", "runtime.max_actors=4"])) == base
    changed = output_settings(load_config(None, ["generation.max_new_tokens=7", "model.enable_thinking=true"]))
    with pytest.raises(ConfigError, match=r"output.path='out' holds rows generated with other settings "
                                          r"\(generation.max_new_tokens: 128 in the output, 7 now; "
                                          r"model.enable_thinking: False in the output, True now\).*"
                                          r"output.allow_mixed_settings=true"):
        check_settings(base, changed, "out", allow_mixed=False)
    assert check_settings(base, changed, "out", allow_mixed=True) == ["generation.max_new_tokens",
                                                                      "model.enable_thinking"]
    assert check_settings(None, changed, "out", allow_mixed=False) == [] == check_settings(base, base, "out", False)


@pytest.mark.parametrize("overrides, message", [
    ({"logprobs": 42}, "sampling_params: sampling parameter logprobs=42 is invalid: expected null or an int in "
                       r"\[0, 20\]"),
    ({"n": 0}, "sampling_params: sampling parameter n=0 is invalid"),
    ({"stop": ["ok", ""]}, "sampling_params: sampling parameter stop=.* is invalid"),
    ({"presence_penalty": 3}, "presence_penalty=3 is invalid"),
    ({"min_tokens": 9}, r"min_tokens=9 is invalid: expected an int <= max_new_tokens \(8\)"),
    ({"logit_bias": {"5": 101.0}}, r"^sampling_params: sampling parameter logit_bias=.* is invalid"),
    ({"use_beam_search": True}, r"^sampling_params.use_beam_search=True is not supported \(only False\)$"),
    ({"best_of": 2}, "sampling_params.best_of is not supported"),
    ({"guided_decoding": {"json": {}, "regex": "a"}}, "structured_outputs=.* is invalid: expected an object with "
                                                       "exactly one of json"),
    ({"structured_outputs": {"choice": []}}, r"structured_outputs.choice=\[\] is invalid"),
    ({"guided_decoding": {"json": {}}, "structured_outputs": {"json": {}}}, "gives both guided_decoding and "
                                                                            "structured_outputs"),
    ({"allowed_token_ids": [1, -2]}, "allowed_token_ids=.* is invalid"),
    ({"bad_words": ["x"]}, "sampling_params.bad_words is not supported"),
    ({"prompt_logprobs": 1}, "sampling_params.prompt_logprobs is not supported"),
    ({"truncate_prompt_tokens": 5}, "sampling_params.truncate_prompt_tokens is not supported"),
    ({"skip_special_tokens": False}, r"sampling_params.skip_special_tokens=False is not supported \(only True\)"),
])
def test_bad_and_unsupported_sampling_fields_name_the_field(overrides, message):
    """Issue 44: a bad value or a vLLM field we do not have is a RowError (the row's `error`) naming the field; the
    row's n is then unknown: one output row (schema.sample_count)."""
    base = SamplingParams(max_new_tokens=8, n=3)
    with pytest.raises(RowError, match=message):
        row_params(overrides, base, None, 1)
    assert sample_count(overrides, base) == 1


def test_vllm_fields_asking_for_nothing_and_the_new_fields_pass():
    base = SamplingParams(max_new_tokens=8)
    neutral = {"use_beam_search": False, "skip_special_tokens": True, "logit_bias": {}, "bad_words": [],
               "min_p": 0.0, "best_of": None, "structured_outputs": None}
    assert row_params(neutral, base, None, 1) == base
    constrained = row_params({"guided_decoding": {"regex": "a+", "backend": "xgrammar"}, "allowed_token_ids": [3, 4],
                              "logit_bias": {"3": -2}}, base, None, 1)
    assert (constrained.structured_outputs, constrained.allowed_token_ids, constrained.logit_bias) == (
        ("regex", "a+"), (3, 4), ((3, -2.0),))
    p = row_params('{"stop": ["a b", "c"], "include_stop_str_in_output": true, "n": 3, "logprobs": 2, '
                   '"presence_penalty": 0.5, "min_tokens": 2, "temperature": 1.0}', base, 7, "x")
    assert (p.stop, p.include_stop_str_in_output, p.n, p.logprobs, p.min_tokens) == (("a b", "c"), True, 3, 2, 2)
    assert sample_count({"n": 3}, base) == 3 and sample_count(None, replace(base, n=2)) == 2
    # sample 0 is the n = 1 row; the others get seeds of their own, the same on every run
    seeds = [p.for_sample(i).seed for i in range(3)]
    assert seeds[0] == p.seed and len(set(seeds)) == 3
    assert [row_params({"n": 3, "temperature": 1.0}, base, 7, "x").for_sample(i).seed for i in range(3)] == seeds


def test_logprobs_column_from_a_completion():
    """Issue 44: the `logprobs` column, per generated token the generated token's (id, logprob) first, then the top
    N, as list<list<struct<token_id: int64, logprob: float32>>>; null when not asked. Read back with pandas."""
    import pandas as pd

    schema = output_schema(pa.schema([("id", pa.int64())]), "id", generated_id=False)
    assert schema.field("logprobs").type == pa.list_(pa.list_(pa.struct([("token_id", pa.int64()),
                                                                          ("logprob", pa.float32())])))
    asked = _completion([4, 9])
    asked.logprobs = [[(4, -0.25), (4, -0.25), (7, -2.0)], [(9, -3.5), (2, -0.5), (9, -3.5)]]
    rows = [ok_row(asked), ok_row(_completion([1, 2])), error_row("bad", num_spec_tokens=2)]
    table = output_table(with_columns(pa.table({"id": [1, 2, 3]}), {
        **engine_columns(rows), "sample_index": [0, 0, 0], "prompt": ["p"] * 3, "generated_text": ["t"] * 3}), schema)
    cells = table.column("logprobs").to_pylist()
    assert cells[0] == [[{"token_id": 4, "logprob": -0.25}, {"token_id": 4, "logprob": -0.25},
                         {"token_id": 7, "logprob": -2.0}],
                        [{"token_id": 9, "logprob": -3.5}, {"token_id": 2, "logprob": -0.5},
                         {"token_id": 9, "logprob": -3.5}]]
    assert cells[1] is None and cells[2] is None  # not asked; an error row
    buffer = pa.BufferOutputStream()
    pq.write_table(table, buffer)
    df = pd.read_parquet(pa.BufferReader(buffer.getvalue()))
    first = df["logprobs"][0]
    assert [[(int(e["token_id"]), float(e["logprob"])) for e in token] for token in first] == asked.logprobs
    assert df["logprobs"][1] is None and df["sample_index"].tolist() == [0, 0, 0]
