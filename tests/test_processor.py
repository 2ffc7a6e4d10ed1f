"""The Ray Data stage: Domino as a processor in a user's own pipeline, on a local Ray cluster with a tiny
pair whose draft is mostly accepted (`save_agreeing_pair`). Invariants: the rows speculated (accepted drafts,
`speculation.check_speculated`), one output row per input row, greedy rows equal the batch command's and the
target alone's, sampled rows the target alone's with the same seed, error rows as data, statistics that
reconcile with the command's summary.
"""

import gc
import json

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import ray

from batch_fixtures import (agreeing_pair, job_config, make_prompts, prompt_near_limit, ray_cluster,  # noqa: F401
                            tiny_pair, write_shards)
from domino_ray.batch.job import run_job
from domino_ray.batch.processor import DominoEngineProcessorConfig, build_processor
from domino_ray.batch.summary import TOTALS
from domino_ray.config import ConfigError
from domino_ray.llm import DominoLLM
from domino_ray.sample.params import SamplingParams
from speculation import check_speculated, speculate_in_process

pytestmark = pytest.mark.ray

MAX_NEW = 12
K = 3  # draft tokens per step where a test fixes it (the pair's block allows 4)
LONG_PROMPT = "the quick brown fox " * 150  # past the tiny target's 512 positions


def processor_config(pair, **fields) -> DominoEngineProcessorConfig:
    target, draft = pair
    engine = {"cpus_per_actor": 0.5, "max_batch_size": 8, "max_new_tokens": MAX_NEW, "num_draft_tokens": K,
              **fields.pop("engine_kwargs", {})}
    return DominoEngineProcessorConfig(model_source=target, draft_source=draft, engine_kwargs=engine, batch_size=4,
                                       max_concurrent_batches=2, **fields)


def test_jsonl_in_parquet_out_equals_the_command(ray_cluster, agreeing_pair, tmp_path):
    """preprocess builds chats from a JSONL column, postprocess renames: the greedy tokens, the text and the
    statistics of every row equal the batch command's on the same chats, and the target alone's."""
    questions = make_prompts(10, seed=3)
    (tmp_path / "q.jsonl").write_text("".join(json.dumps({"qid": i, "question": q}) + "\n"
                                              for i, q in enumerate(questions)))
    processor = build_processor(
        processor_config(agreeing_pair),
        preprocess=lambda row: dict(id=row["qid"], messages=[{"role": "user", "content": row["question"]}],
                                    sampling_params=dict(temperature=0.0, max_tokens=MAX_NEW)),
        postprocess=lambda row: dict(answer=row.pop("generated_text"), **row))
    processor(ray.data.read_json(str(tmp_path / "q.jsonl"))).write_parquet(str(tmp_path / "out"))
    ours = pq.read_table(tmp_path / "out").to_pandas().set_index("id").sort_index()
    assert list(ours.index) == list(range(len(questions)))  # one row per input row
    assert "generated_text" not in ours.columns and ours["error"].isna().all()

    messages = [[{"role": "user", "content": q}] for q in questions]
    write_shards(tmp_path / "in", {"id": list(range(len(questions))), "messages": messages}, shards=2)
    cfg = job_config(agreeing_pair, str(tmp_path / "in"), str(tmp_path / "cmd"),
                     **{"generation.max_new_tokens": MAX_NEW, "draft.num_draft_tokens": K})
    summary = run_job(cfg, log=lambda *_: None)
    command = pq.read_table(tmp_path / "cmd").to_pandas().set_index("id").sort_index()
    assert [list(t) for t in ours["generated_tokens"]] == [list(t) for t in command["generated_tokens"]]
    assert list(ours["answer"]) == list(command["generated_text"]) and list(ours["prompt"]) == list(command["prompt"])
    for name in TOTALS:  # greedy at a fixed K: every step of every row is batch-independent
        assert int(ours[name].sum()) == summary["totals"][name], name
    assert [int(sum(c)) for c in zip(*ours["acceptance_histogram"])] == summary["acceptance_histogram"]
    assert all(len(ids) == n for ids, n in zip(ours["prompt_token_ids"], ours["num_input_tokens"]))
    check_speculated(list(ours["acceptance_histogram"]), int(ours["num_generated_tokens"].sum()))
    params = [SamplingParams(max_new_tokens=MAX_NEW)] * len(questions)
    here = speculate_in_process(*agreeing_pair, [[int(t) for t in p] for p in ours["prompt_token_ids"]], params, K)
    assert [list(t) for t in ours["generated_tokens"]] == [h.token_ids for h in here] == [h.target_only for h in here]
    assert [list(h) for h in ours["acceptance_histogram"]] == [h.acceptance_histogram for h in here]
    assert any(h.stop_in_accepted_run for h in here)


def _bad_rows():
    good = make_prompts(4, seed=5)
    rows = [{"id": f"g{i}", "prompt": p, "sampling_params": None} for i, p in enumerate(good)]
    return rows + [
        {"id": "null", "prompt": None, "sampling_params": None},
        {"id": "params", "prompt": good[0], "sampling_params": json.dumps({"temprature": 0.5})},
        {"id": "vllm-only", "prompt": good[0], "sampling_params": json.dumps({"bad_words": ["x"]})},
        {"id": "long", "prompt": LONG_PROMPT, "sampling_params": None},
    ]


BAD_REASONS = {"null": "prompt is null", "params": r"unknown keys \['temprature'\]",
               "vllm-only": r"^sampling_params.bad_words is not supported$", "long": "the model's limit is 512 tokens"}


def test_pandas_in_and_out_through_rays_build_processor_with_stages_around_it_and_bad_rows(ray_cluster,
                                                                                           agreeing_pair):
    """`ray.data.llm.build_processor(our config)` (Ray's registry), a `map` before and a `filter` after:
    input columns carried, rows never leak into each other (each good row, greedy or sampled with its seed,
    equals the target alone on its prompt, after accepted drafts at the adaptive width), and bad rows become error rows in Ray Data
    LLM's error column while the pipeline finishes. (One pipeline for both: each costs an engine actor's start-up.)"""
    import re

    from ray.data.llm import build_processor as rays_build_processor

    prompts = make_prompts(12, seed=4)
    sampled = {i: json.dumps({"temperature": 0.8, "seed": 100 + i}) for i in range(1, len(prompts), 2)}
    rows = [{"id": f"p{i}", "prompt": p, "sampling_params": sampled.get(i), "topic": f"t{i % 3}"}
            for i, p in enumerate(prompts)]
    rows += [{**r, "topic": "bad"} for r in _bad_rows()]
    # The length rule: a prompt near the target's 512 positions runs with its max_new_tokens capped
    rows += [{"id": "near", "prompt": prompt_near_limit(agreeing_pair[0]), "sampling_params": None, "topic": "t1"}]
    processor = rays_build_processor(processor_config(agreeing_pair, chat_template_stage=False,
                                                      error_column="__inference_error__",
                                                      engine_kwargs={"num_draft_tokens": "auto"}))
    # A missing prompt reaches the map, and from it the processor, as pandas' NaN (a float): "prompt is null".
    def chars(row):
        return {**row, "chars": len(row["prompt"]) if isinstance(row["prompt"], str) else 0}

    ds = ray.data.from_pandas(pd.DataFrame(rows)).map(chars)
    out = processor(ds).filter(lambda row: row["topic"] != "t0").to_pandas()
    assert sorted(out["id"]) == sorted(r["id"] for r in rows if r["topic"] != "t0")  # one row per input row
    assert (out["chars"] == out["prompt"].fillna("").str.len()).all() and "error" not in out.columns

    failed = out[out["id"].isin(list(BAD_REASONS))]
    for row in failed.to_dict("records"):
        assert re.search(BAD_REASONS[row["id"]], row["__inference_error__"]), row["__inference_error__"]
        assert row["finish_reason"] == "error" and row["generated_text"] == "" and len(row["generated_tokens"]) == 0
        assert row["num_generated_tokens"] == 0 and len(row["acceptance_histogram"]) == 5  # auto: K = the block, 4
    ok = out[~out["id"].isin(list(BAD_REASONS))]
    assert len(failed) == len(BAD_REASONS) and ok["__inference_error__"].isna().all()
    alone = DominoLLM.from_pretrained(agreeing_pair[0], chat_template=False)  # the target without a draft
    is_sampled = [isinstance(p, str) for p in ok["sampling_params"]]  # pandas gives NaN for a missing one
    params = [SamplingParams(max_new_tokens=MAX_NEW, **(json.loads(p) if s else {}))
              for p, s in zip(ok["sampling_params"], is_sampled)]
    expected = alone.generate(list(ok["prompt"]), params)
    assert [list(t) for t in ok["generated_tokens"]] == [e.token_ids for e in expected]
    assert list(ok["generated_text"]) == [e.text for e in expected]
    # The adaptive width's drafting follows step costs measured on a busy machine: accepted drafts, not their share
    assert int(ok["num_accepted_draft_tokens"].sum()) > 0
    near = ok[ok["id"] == "near"].iloc[0]
    assert near["num_input_tokens"] + near["num_generated_tokens"] <= 512 and near["num_generated_tokens"] < MAX_NEW
    assert sum(is_sampled) >= 3 and sum(n for n, s in zip(ok["num_accepted_draft_tokens"], is_sampled) if s) > 0


def test_should_continue_on_error_false_fails_naming_the_row(ray_cluster, tiny_pair):
    processor = build_processor(processor_config(tiny_pair, chat_template_stage=False, should_continue_on_error=False))
    rows = [r for r in _bad_rows() if r["id"] in ("g0", "g1", "params")]
    with pytest.raises(Exception, match=r"row id='params' failed: sampling_params has unknown keys"):
        processor(ray.data.from_items(rows)).take_all()
    # The failed stage's actor lives while the exception's traceback (a reference cycle) holds its handle:
    # collect it, so that later tests of this session find the cluster's CPUs free.
    gc.collect()


@pytest.mark.parametrize("fields, key", [
    ({"engine_kwargs": {"max_batch_sise": 8}}, "max_batch_sise"),
    ({"engine_kwargs": {"source": "x"}}, r"give it as section.key \(it is in \['model', 'draft'\]\)"),
    ({"engine_kwargs": {"batch_size": 8}}, "set it with the processor config's batch_size"),
    ({"engine_kwargs": {"temperature": 9.0}}, "generation.temperature=9.0"),
    ({"engine_kwargs": {"seed": 1, "generation.seed": 2}}, "gives generation.seed twice"),
    ({"concurrency": (3, 2)}, r"concurrency=\(3, 2\)"),
    ({"tokenize_stage": False}, "tokenize_stage=False"),
    ({"detokenize_stage": {"cpus": 1}}, r"detokenize_stage has unknown keys \['cpus'\]"),
    ({"tokenize_stage": {"concurrency": (1, 2)}}, "tokenize_stage.concurrency"),
    ({"chat_template_stage": {"batch_size": 8}}, "chat_template_stage="),
    ({"error_column": "err"}, "error_column='err'"),
])
def test_bad_processor_configs_fail_at_once_naming_the_field(fields, key):
    with pytest.raises(ConfigError, match=key):
        DominoEngineProcessorConfig(model_source="m", **fields)


def test_engine_kwargs_reach_the_job_config():
    config = DominoEngineProcessorConfig(model_source="m", draft_source=None, concurrency=(1, 3), engine_kwargs={
        "dtype": "bfloat16", "num_draft_tokens": 4, "seed": 6, "id_column": "key"})
    cfg = config.cfg
    assert (cfg.model.dtype, cfg.draft.num_draft_tokens, cfg.draft.source) == ("bfloat16", 4, None)
    assert (cfg.generation.seed, cfg.input.id_column) == (6, "key")  # bare `seed` is generation.seed
    assert (cfg.runtime.min_actors, cfg.runtime.max_actors, cfg.model.chat_template) == (1, 3, True)


@pytest.mark.slow
def test_the_example_pipeline_runs(ray_cluster, tmp_path, capsys):
    """examples/ray_data_pipeline.py on the demo pair, four of its snippets: every row completed."""
    import importlib.util

    from batch_fixtures import REPO

    spec = importlib.util.spec_from_file_location("example", REPO / "examples" / "ray_data_pipeline.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    snippets = (REPO / "examples" / "snippets.jsonl").read_text().splitlines()[:4]
    (tmp_path / "in.jsonl").write_text("\n".join(snippets) + "\n")
    example.main(["--input", str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "out"), "--max-tokens", "8"])
    out = pq.read_table(tmp_path / "out").to_pandas()
    assert sorted(out["name"]) == sorted(json.loads(s)["name"] for s in snippets)
    assert out["error"].isna().all() and (out["tokens"] > 0).all() and (out["tokens"] <= 8).all()
    assert "4 rows -> " in capsys.readouterr().out
