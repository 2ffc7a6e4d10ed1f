"""The batch job end to end on a local Ray cluster with tiny models: local Parquet in and out.

One job run (module fixture) feeds most tests: good plain and chat prompts, per-row overrides and a
fuzz set of bad rows, with an actor killed once mid-job (tests/faulty_predictor.py), and the
target-only comparison on. Its pair's draft is mostly accepted (`save_agreeing_pair`) at the default
adaptive width, so the greedy equality below covers accepted drafts (`test_the_job_speculated`).
Its output is read back with pyarrow, pandas, DuckDB and Spark.
"""

import json
import re
import shutil
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import ray
import torch

from batch_fixtures import (WORDS, agreeing_pair, check_output_invariants, job_config, make_prompts,  # noqa: F401
                            prompt_near_limit, ray_cluster, tiny_pair, write_shards)
from domino_ray.batch.job import init_ray, read_inputs, run_job
from domino_ray.batch.preflight import check_input
from domino_ray.batch.summary import human_summary, kv_cache_totals
from domino_ray.batch.text_stages import SAMPLES_TO_DO
from domino_ray.config import ConfigError, load_config
from domino_ray.llm import DominoLLM
from domino_ray.target.loading import encode_prompt, load_target, load_tokenizer, stop_token_ids
from domino_ray.sample.params import SamplingParams
from faulty_predictor import faulty_predictor

pytestmark = pytest.mark.ray

MAX_NEW = 12
SAMPLED = 4  # rows at temperature 0.8, each with its own seed
OVERRIDE_TYPE = pa.struct([("max_new_tokens", pa.int64()), ("temperature", pa.float64()), ("seed", pa.int64()),
                           ("temprature", pa.float64()), ("logprobs", pa.int64())])
SCHEMA = pa.schema([("id", pa.int64()), ("prompt", pa.binary()),
                    ("messages", pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))),
                    ("sampling_params", OVERRIDE_TYPE), ("topic", pa.string())])

# Bad rows: (prompt, messages, sampling_params, expected error).
BAD_ROWS = [
    (None, None, None, "prompt is null"),
    (b"", None, None, "prompt is empty"),
    (b" \n ", None, None, "prompt is empty"),
    (b"\xc3\x28 invalid", None, None, "not valid UTF-8"),
    (("the quick brown fox " * 150).encode(), None, None, "the model's limit is 512 tokens"),
    (None, [{"role": "wizard", "content": "hi"}], None, "role='wizard'"),
    (None, [{"role": "user", "content": ""}], None, "messages have no content"),
    (b"a fine prompt", None, {"temprature": 0.5}, "unknown keys \\['temprature'\\]"),
    (b"a fine prompt", None, {"temperature": -1.0}, "temperature=-1.0 is invalid"),
    (b"a fine prompt", None, {"max_new_tokens": 0}, "max_new_tokens=0 is invalid"),
]


def _input_rows(near_limit: str):
    rows = [(p.encode(), None, None) for p in make_prompts(16)]
    rows += [(near_limit.encode(), None, None)]  # the length rule caps it: fewer than MAX_NEW tokens fit
    rows += [(None, [{"role": "user", "content": p}], None) for p in make_prompts(3, seed=1)]
    rows += [(b"a batch of prompts", None, {"max_new_tokens": 3, "logprobs": 2}),  # the one row asking for logprobs
             (b"the lazy dog", None, {"max_new_tokens": 5})]
    rows += [(p.encode(), None, {"temperature": 0.8, "seed": 11 + i}) for i, p in enumerate(make_prompts(SAMPLED, seed=2))]
    good = len(rows)
    rows += [(p, m, s) for p, m, s, _ in BAD_ROWS]
    return rows, good


@pytest.fixture(scope="module")
def job(ray_cluster, agreeing_pair, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("job")
    rows, good = _input_rows(prompt_near_limit(agreeing_pair[0]))
    ids = [1000 + i for i in range(len(rows))]
    columns = {"id": ids, "prompt": [r[0] for r in rows], "messages": [r[1] for r in rows],
               "sampling_params": [r[2] for r in rows], "topic": [f"t{i % 3}" for i in range(len(rows))]}
    write_shards(tmp / "in", columns, shards=2, schema=SCHEMA)
    marker = tmp / "actor_killed"
    cfg = job_config(agreeing_pair, str(tmp / "in"), str(tmp / "out"),
                     **{"generation.max_new_tokens": MAX_NEW, "runtime.compare_baseline": "true"})
    summary = run_job(cfg, log=lambda *_: None, predictor=faulty_predictor(kill_actor_once=str(marker)))
    return {"out": tmp / "out", "summary": summary, "rows": rows, "good": good, "ids": ids, "marker": marker,
            "cfg": cfg, "pair": agreeing_pair}


def test_output_schema_rows_and_stats(job):
    table = pq.read_table(job["out"])
    assert table.schema.names[:4] == ["id", "messages", "sampling_params", "topic"]  # carried, id first
    assert table.schema.field("messages").type == SCHEMA.field("messages").type
    check_output_invariants(table, job["summary"], job["ids"])
    assert (job["out"] / "_summary.json").exists()
    assert job["summary"]["rows"]["failed"] == len(BAD_ROWS)
    # run.rows counts rows written, not the rows of batches retried after the killed actor
    assert job["summary"]["num_spec_tokens"] == 4 and job["summary"]["run"]["rows"] == len(job["ids"])
    # Ray handed actors two batches at once: their rows shared the engine (continuous batching across batches).
    assert max(a["peak_batches_in_flight"] for a in job["summary"]["run"]["actors"]) == 2
    # every actor names the Ray node it ran on (the session's one node here)
    assert {a["node_id"] for a in job["summary"]["run"]["actors"]} == {ray.get_runtime_context().get_node_id()}
    # and reports its engine's KV cache; the summary's `kv_cache` adds them up (an actor killed before it finished a
    # batch reported none)
    caches = [a["kv_cache"] for a in job["summary"]["run"]["actors"]]
    assert job["summary"]["kv_cache"] == kv_cache_totals(job["summary"]["run"]["actors"])
    assert job["summary"]["kv_cache"]["actors"] == len(caches) >= 1 and all(c["block_size"] == 16 for c in caches)


def test_actor_killed_mid_job_loses_and_duplicates_nothing(job):
    assert job["marker"].exists()  # the fault hook fired: an actor died with a batch in flight
    ids = pq.read_table(job["out"], columns=["id"]).column("id").to_pylist()
    assert sorted(ids) == sorted(job["ids"])


def test_bad_rows_are_error_rows_with_reasons(job):
    by_id = {r["id"]: r for r in pq.read_table(job["out"]).to_pylist()}
    for i, (_, _, _, reason) in enumerate(BAD_ROWS):
        row = by_id[job["ids"][job["good"] + i]]
        assert row["finish_reason"] == "error", row
        assert row["num_generated_tokens"] == 0 and row["num_input_tokens"] == 0  # refused: no work in the totals
        assert re.search(reason, row["error"]), (reason, row["error"])
    for i in range(job["good"]):
        assert by_id[job["ids"][i]]["error"] is None


def test_lost_summary_is_rebuilt_without_generating(job):
    """Killed after the last file but before `_summary.json`: the rerun only writes the summary."""
    (job["out"] / "_summary.json").unlink()
    files = {p.name: p.stat().st_mtime_ns for p in job["out"].glob("*.parquet")}
    summary = run_job(job["cfg"], log=lambda *_: None)
    assert summary["run"]["rows"] == 0 and summary["run"]["actors"] == []  # no actor started, nothing generated
    assert summary["totals"] == job["summary"]["totals"] and summary["rows"] == job["summary"]["rows"]
    assert {p.name: p.stat().st_mtime_ns for p in job["out"].glob("*.parquet")} == files


def test_resume_with_other_settings_is_refused(job):
    """Issue 12 item 12: the output records the settings that made its rows; changed ones are refused
    (naming the keys) before any work, and allowed with output.allow_mixed_settings=true."""
    recorded = json.loads((job["out"] / "_settings.json").read_text())["settings"]
    assert recorded["generation.max_new_tokens"] == MAX_NEW and recorded["draft.source"] == job["pair"][1]
    files = {p.name: p.stat().st_mtime_ns for p in job["out"].glob("*")}
    cfg = job_config(job["pair"], job["cfg"].input.path, job["cfg"].output.path,
                     **{"generation.max_new_tokens": MAX_NEW + 1, "runtime.compare_baseline": "true"})
    with pytest.raises(ConfigError, match=f"generation.max_new_tokens: {MAX_NEW} in the output, {MAX_NEW + 1} now"):
        run_job(cfg, log=lambda *_: None)
    assert {p.name: p.stat().st_mtime_ns for p in job["out"].glob("*")} == files


def test_greedy_outputs_equal_target_only(job):
    """Every greedy row equals Hugging Face `generate` on the target alone (no draft). Fails if a step commits
    one token more than it accepted: checked by making `greedy_accept` return `accepted + 1` after a partial
    acceptance."""
    target, tokenizer = load_target(job["pair"][0]), load_tokenizer(job["pair"][0])
    eos = sorted(stop_token_ids(target, tokenizer))  # <|im_end|> and the pair's other EOS ids
    by_id = {r["id"]: r for r in pq.read_table(job["out"]).to_pylist()}
    checked = capped = 0
    for i, (prompt, messages, overrides) in enumerate(job["rows"][:job["good"]]):
        if overrides and overrides.get("temperature"):
            continue
        row = by_id[job["ids"][i]]
        ids = (encode_prompt(tokenizer, messages=messages) if messages else
               encode_prompt(tokenizer, prompt=prompt.decode(), chat_template=False))
        asked = (overrides or {}).get("max_new_tokens") or MAX_NEW
        budget = min(asked, 512 - len(ids))  # the length rule caps a row near the model's 512 positions
        capped += budget < asked
        out = target.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                              max_new_tokens=budget, do_sample=False, eos_token_id=eos, pad_token_id=eos[0])
        assert row["generated_tokens"] == out[0, len(ids):].tolist(), row["id"]
        assert row["num_input_tokens"] == len(ids)
        assert row["finish_reason"] == ("stop" if row["generated_tokens"][-1] in eos else "length")
        checked += 1
    assert checked == job["good"] - SAMPLED
    assert capped > 0  # the row near the limit ran, capped


def test_the_job_speculated(job):
    """The rows ran accepted drafts (else the equality above proves nothing about acceptance), in greedy and
    sampled rows alike. How much the adaptive width drafts depends on the step costs the actor measured on a
    busy machine, so only that drafts were accepted is asserted here; the share and the acceptance shapes are
    asserted at a fixed K (test_batch_s3.py, test_processor.py, test_serve.py)."""
    rows = [r for r in pq.read_table(job["out"]).to_pylist() if r["error"] is None]
    assert sum(r["num_accepted_draft_tokens"] for r in rows) > 0
    sampled = [r for r in rows if (r["sampling_params"] or {}).get("temperature")]
    assert sampled and sum(r["num_accepted_draft_tokens"] for r in sampled) > 0


def test_baseline_comparison(job):
    """The target-only run checks the greedy outputs; the speed-up printed is the probe's, the job's adaptive width
    against target-only side by side in one process, never the two runs' ratio (kept as `two_run_ratio`). Fails
    against a headline from the two runs, a probe without the adaptive engine, or verdicts that ignore the passes."""
    summary = job["summary"]
    base = summary["run"]["baseline"]
    # Sampled rows too: acceptance is coupled to the target's own per-position samples (same seed, same text).
    assert base["compared"] == job["good"] and base["identical"] == job["good"]
    assert base["tokens_per_s"] > 0 and base["two_run_ratio"] > 0
    assert set(base["cpu_s_per_busy_s"]) == {"speculative", "target_only"}  # each run's share of the machine
    # The pair measured in one process on the job's first rows (as many as an engine's slots): the draft at its K,
    # its outputs equal target-only's, Domino at K and at the adaptive width against target-only at one row and at
    # those rows, pass by pass.
    probe, slots = base["probe"], job["cfg"].generation.max_batch_size
    assert probe["num_spec_tokens"] == summary["num_spec_tokens"] and probe["rows"] == slots
    assert probe["identical"] == slots
    assert probe["mean_acceptance_length"] == pytest.approx(1 + sum(probe["per_position_acceptance"]))
    for key in ("speedups", "auto_speedups"):
        assert [c["rows"] for c in probe[key]] == [1, slots]
        assert all(len(c["per_pass"]) == probe["passes"] and min(c["per_pass"]) - 1e-9 <= c["speedup"]
                   <= max(c["per_pass"]) + 1e-9 and c["speedup"] > 0 for c in probe[key])
    assert base["speedup_of"] == {"engine": "auto", "rows": slots, "passes": probe["passes"]}
    assert base["speedup"] == probe["auto_speedups"][-1]["speedup"] != base["two_run_ratio"]
    # the adaptive width's cost table, from the engine actors, at their fewest and most rows
    tables = [a["width_costs"] for a in summary["run"]["actors"] if "width_costs" in a]
    assert tables and all([t["rows"] for t in table["by_rows"]] == [1, slots] for table in tables)
    text = human_summary(summary)
    assert f"greedy outputs identical: {job['good']}/{job['good']}" in text
    [headline] = [line for line in text.splitlines() if line.startswith("  this job's speed-up")]
    widths = summary["verify_width_histogram"]
    assert headline.startswith(f"  this job's speed-up: none: speculation did not pay at {slots} rows"
                               if widths[0] >= 0.99 * sum(widths) else
                               f"  this job's speed-up {base['speedup']:.2f}x: Domino auto over target only at "
                               f"{slots} rows, measured side by side in one process")
    assert f"the draft at K=4 (every step verifying 4 drafts; the first {slots} rows, run together)" in text
    cells = re.findall(r"(\d+) rows? ([\d.]+)x \(([\d.]+)-([\d.]+): (speculation pays|it does not pay|within "
                       r"this machine's noise)\)", text)
    assert [int(n) for n, *_ in cells] == [1, slots, 1, slots]  # K=4, then auto
    for _, _, lo, hi, said in cells:
        assert said == ("speculation pays" if float(lo) > 1.0 else "it does not pay" if float(hi) < 1.0
                        else "within this machine's noise")
    assert "  Domino pays on this machine at" in text
    assert f"why these widths: at {slots} rows the width policy's cost table" in text


def test_read_back_with_pandas_and_duckdb(job):
    import duckdb
    import pandas as pd

    df = pd.read_parquet(job["out"])
    assert len(df) == len(job["ids"]) and df["id"].is_unique
    assert (df["num_generated_tokens"] == df["generated_tokens"].map(len)).all()
    asked = df["sampling_params"].map(lambda s: s is not None and s["logprobs"] is not None)
    assert asked.sum() == 1 and df["logprobs"][~asked].isna().all() and (df["sample_index"] == 0).all()  # n = 1
    entries = df["logprobs"][asked].iloc[0]
    assert [e[0]["token_id"] for e in entries] == list(df["generated_tokens"][asked].iloc[0]) and len(entries[0]) == 3
    con = duckdb.connect()
    q = f"SELECT count(*), count(DISTINCT id), sum(num_spec_steps), sum(num_generated_tokens), " \
        f"sum(CASE WHEN finish_reason = 'error' THEN 1 ELSE 0 END) FROM read_parquet('{job['out']}/*.parquet')"
    rows, distinct, steps, tokens, failed = con.execute(q).fetchone()
    totals = job["summary"]["totals"]
    assert (rows, distinct, failed) == (len(job["ids"]), len(job["ids"]), len(BAD_ROWS))
    assert (steps, tokens) == (totals["num_spec_steps"], totals["num_generated_tokens"])
    types = dict(con.execute(f"DESCRIBE SELECT generated_tokens, acceptance_histogram, num_spec_steps "
                             f"FROM read_parquet('{job['out']}/*.parquet')").fetchall()[i][:2] for i in range(3))
    assert types == {"generated_tokens": "INTEGER[]", "acceptance_histogram": "INTEGER[]", "num_spec_steps": "INTEGER"}


@pytest.mark.slow
def test_read_back_with_spark(job):
    from pyspark.sql import SparkSession

    # A JVM for a few small queries: the JIT's first tier alone, one compiler thread and the serial GC take 16-17 CPU
    # seconds where the defaults took 29 (measured with /proc/stat around a session like this one)
    spark = (SparkSession.builder.master("local[1]").appName("domino-ray-test")
             .config("spark.ui.enabled", "false").config("spark.sql.shuffle.partitions", "1")
             .config("spark.driver.extraJavaOptions", "-XX:TieredStopAtLevel=1 -XX:CICompilerCount=1 -XX:+UseSerialGC")
             .getOrCreate())
    try:
        df = spark.read.parquet(str(job["out"]))
        types = dict(df.dtypes)
        assert types["generated_tokens"] == "array<int>" and types["acceptance_histogram"] == "array<int>"
        assert types["num_spec_steps"] == "int" and types["mean_acceptance_length"] == "double"
        assert types["sample_index"] == "int"
        assert types["logprobs"] == "array<array<struct<token_id:bigint,logprob:float>>>"
        assert df.filter("sample_index != 0").count() == 0
        asked = df.filter("logprobs IS NOT NULL").select("logprobs", "generated_tokens").collect()
        assert len(asked) == 1 and [t[0].token_id for t in asked[0].logprobs] == list(asked[0].generated_tokens)
        assert all(len(t) == 3 and t[1].logprob >= t[2].logprob for t in asked[0].logprobs)
        df.createOrReplaceTempView("out")
        row = spark.sql("SELECT count(*) n, count(DISTINCT id) ids, sum(num_accepted_draft_tokens) acc, "
                        "sum(size(generated_tokens)) toks, sum(num_generated_tokens) gen FROM out").collect()[0]
        totals = job["summary"]["totals"]
        assert (row.n, row.ids) == (len(job["ids"]), len(job["ids"]))
        assert row.acc == totals["num_accepted_draft_tokens"] and row.toks == row.gen == totals["num_generated_tokens"]
    finally:
        spark.stop()


def test_model_that_fails_to_load_fails_the_job_at_once(ray_cluster, tiny_pair, tmp_path):
    """Config and shapes pass the pre-flight, the weights are corrupt: the actor's __init__ fails and the job
    fails with the reason after that one actor start, instead of restarting actors forever. Counted in actor
    starts, not seconds: a busy machine only makes the one start slower.
    Fails if Ray replaces the actor: checked by making `init_ray` allow unlimited actor init deaths (-1)."""
    import threading

    target = tmp_path / "target"
    shutil.copytree(tiny_pair[0], target)
    (target / "model.safetensors").write_bytes(b"not a safetensors file")
    write_shards(tmp_path / "in", {"id": [1, 2], "prompt": ["hi", "there"]}, shards=1)
    cfg = job_config((str(target), tiny_pair[1]), str(tmp_path / "in"), str(tmp_path / "out"))
    starts = tmp_path / "starts"
    starts.mkdir()
    failure = []

    def job():  # on a thread: a job that restarts actors forever would never return to be checked
        try:
            run_job(cfg, log=lambda *_: None, predictor=faulty_predictor(starts_dir=str(starts)))
        except Exception as exc:  # noqa: BLE001
            failure.append(exc)
    thread = threading.Thread(target=job, daemon=True)
    thread.start()
    deadline = time.monotonic() + 300  # a ceiling only: the job ends after its first actor's death
    while thread.is_alive() and len(list(starts.iterdir())) <= 1 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert len(list(starts.iterdir())) == 1, "the engine actor was started again after its model failed to load"
    thread.join(max(deadline - time.monotonic(), 1))
    assert not thread.is_alive() and len(failure) == 1 and re.search("(?i)safetensors|header", str(failure[0]))
    assert not (tmp_path / "out" / "_summary.json").exists()
    with pytest.raises(ConfigError, match="model.source"):  # a missing model never reaches Ray
        run_job(job_config(tiny_pair, str(tmp_path / "in"), str(tmp_path / "out"), **{"model.source": tmp_path / "x"}))
    assert ray.is_initialized()


def test_generated_ids_are_stable_unique_and_resumable(ray_cluster, tmp_path):
    """Without an id column, ids come from (file path, row position): the same on every read, unique
    across files and row groups, and rows whose id is done are dropped."""
    (tmp_path / "in").mkdir()
    for s in range(2):
        pq.write_table(pa.table({"prompt": [f"p{s}-{i}" for i in range(300)]}), tmp_path / "in" / f"s{s}.parquet",
                       row_group_size=64)
    cfg = load_config(None, [f"input.path={tmp_path / 'in'}", f"output.path={tmp_path / 'out'}"])
    plan = check_input(cfg)
    assert plan.generated_id
    init_ray(cfg)

    def ids(done: pa.Array) -> dict:
        keys = pa.table({"id": done, "sample_index": pa.array([0] * len(done), pa.int32())})
        table = pa.concat_tables(ray.get(read_inputs(cfg, plan, ray.put(keys)).to_arrow_refs()))
        # resuming, rows whose id has samples done say which are left (none here: n = 1, a done row is dropped)
        assert table.column_names == ["prompt", "id", *([SAMPLES_TO_DO] if len(done) else [])]
        assert len(done) == 0 or table.column(SAMPLES_TO_DO).null_count == table.num_rows
        return dict(zip(table.column("prompt").to_pylist(), table.column("id").to_pylist()))

    first = ids(pa.array([], pa.null()))
    assert len(first) == 600 and len(set(first.values())) == 600
    assert ids(pa.array([], pa.null())) == first
    prompts = sorted(first)
    rest = ids(pa.array([first[p] for p in prompts[:250]]))
    assert sorted(rest) == prompts[250:] and all(first[p] == i for p, i in rest.items())


KV_NEW = 96  # generated tokens per row of the KV cache job: rows outgrow the room admission leaves them (64 positions)


def test_kv_cache_stats_with_shared_prefixes_and_preemption(ray_cluster, agreeing_pair, tmp_path):
    """Prompts sharing a long prefix, two shards, through a pool of 16 blocks (`kv_cache_tokens=256`: one row at
    `max_model_len` fits, two or so at once) with EOS ignored so that every row grows: rows share their prefix blocks
    and rows are preempted, yet every row equals target-only greedy (without a draft, a pool that preempts nothing).
    `_summary.json`'s `kv_cache` adds up the engines of its run (`run.actors`; a resume's are its own run's, the
    same path).
    Fails without the actors' `kv_cache` reports (predictor.py) or their sum (summary.kv_cache_totals)."""
    prompts = [f"{' '.join(WORDS[:10])} {p}" for p in make_prompts(6, seed=3)]
    write_shards(tmp_path / "in", {"id": list(range(len(prompts))), "prompt": prompts}, shards=2)
    cfg = job_config(agreeing_pair, str(tmp_path / "in"), str(tmp_path / "out"), **{
        "model.max_model_len": 192, "generation.kv_cache_tokens": 256, "generation.max_new_tokens": KV_NEW,
        "generation.ignore_eos": "true"})
    llm = DominoLLM.from_pretrained(agreeing_pair[0], draft=None, chat_template=False)
    reference = [o.token_ids for o in llm.generate(prompts, SamplingParams(max_new_tokens=KV_NEW, ignore_eos=True))]
    assert llm.engine.kv_cache_stats()["preemptions"] == 0

    def check(summary: dict, engines: int):
        table = pq.read_table(tmp_path / "out")
        check_output_invariants(table, summary, list(range(len(prompts))))
        by_id = {r["id"]: r["generated_tokens"] for r in table.to_pylist()}
        assert [by_id[i] for i in range(len(prompts))] == reference
        kv, actors = summary["kv_cache"], [a["kv_cache"] for a in summary["run"]["actors"]]
        assert len(actors) == kv["actors"] == engines
        assert kv == {"block_size": 16, "actors": engines, **{k: sum(a[k] for a in actors) for k in (
            "blocks", "peak_blocks_used", "peak_rows", "preemptions", "prefix_hit_tokens")}}
        assert kv["blocks"] == 16 * engines and 0 < kv["peak_blocks_used"] <= kv["blocks"]
        assert engines <= kv["peak_rows"] <= 8 * engines
        assert json.loads((tmp_path / "out" / "_summary.json").read_text())["kv_cache"] == kv
        return kv

    kv = check(run_job(cfg, log=lambda *_: None), engines=1)
    assert kv["preemptions"] > 0 and kv["prefix_hit_tokens"] >= 16
    text = human_summary(json.loads((tmp_path / "out" / "_summary.json").read_text()))
    assert f"KV cache (1 engine): 16 blocks x 16 positions, peak {kv['peak_blocks_used']} blocks" in text


def test_kv_cache_totals_add_the_engines_of_a_run():
    """Several engine actors: counts and peaks summed (the peaks as an upper bound), the actors counted; a run with no
    engine report has none."""
    a = {"block_size": 16, "blocks": 100, "peak_blocks_used": 40, "peak_rows": 5, "preemptions": 2, "prefix_hit_tokens": 32}
    b = {"block_size": 16, "blocks": 100, "peak_blocks_used": 70, "peak_rows": 8, "preemptions": 0, "prefix_hit_tokens": 64}
    assert kv_cache_totals([{"actor": "x", "kv_cache": a}, {"actor": "y", "kv_cache": b}]) == {
        "block_size": 16, "blocks": 200, "peak_blocks_used": 110, "peak_rows": 13, "preemptions": 2,
        "prefix_hit_tokens": 96, "actors": 2}
    assert kv_cache_totals([]) is None and kv_cache_totals([{"actor": "x"}]) is None
