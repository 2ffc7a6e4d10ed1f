"""Driver-side pre-flight: a job that cannot run fails before any Ray work, naming the config key."""

import subprocess

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from batch_fixtures import REPO, job_config, job_overrides, python, tiny_pair  # noqa: F401  (fixture)
from domino_ray.batch.preflight import check_input, check_models, check_output
from domino_ray.config import ConfigError
from domino_ray.spec_decode.checkpoint import save_draft
from tiny_models import tiny_draft, tiny_target


@pytest.fixture()
def prompts(tmp_path):
    pq.write_table(pa.table({"id": [1], "prompt": ["hi"]}), tmp_path / "in.parquet")
    return str(tmp_path / "in.parquet")


def test_good_job_passes(tiny_pair, prompts, tmp_path):
    cfg = job_config(tiny_pair, prompts, tmp_path / "out")
    assert check_models(cfg) == 4  # the draft's block size (shift_label: K = block size)
    plan = check_input(cfg)
    assert not plan.generated_id and plan.schema.names == ["id", "prompt"]
    check_output(cfg)
    assert (tmp_path / "out").is_dir()
    assert check_models(job_config(tiny_pair, prompts, tmp_path / "out", **{"draft.source": "null"})) == 0


def test_bad_models_fail_naming_the_key(tiny_pair, prompts, tmp_path):
    with pytest.raises(ConfigError, match="model.source='/nonexistent'"):
        check_models(job_config(tiny_pair, prompts, tmp_path, **{"model.source": "/nonexistent"}))
    with pytest.raises(ConfigError, match="draft.source=.*not a directory"):
        check_models(job_config(tiny_pair, prompts, tmp_path, **{"draft.source": "/nonexistent"}))
    with pytest.raises(ConfigError, match="draft.num_draft_tokens=9 is out of range.*1..4"):
        check_models(job_config(tiny_pair, prompts, tmp_path, **{"draft.num_draft_tokens": 9}))
    # A draft trained for another target (bigger vocabulary): caught from the safetensors headers alone.
    other = tiny_target("qwen3", vocab=128, dtype=torch.float32)
    save_draft(tiny_draft(other), tmp_path / "other_draft")
    with pytest.raises(ConfigError, match="draft.source.*vocab_size: expected 96.*found 128"):
        check_models(job_config(tiny_pair, prompts, tmp_path, **{"draft.source": tmp_path / "other_draft"}))


def test_bad_inputs_fail_naming_the_key(tiny_pair, prompts, tmp_path):
    with pytest.raises(ConfigError, match="input.path=.*does not exist"):
        check_input(job_config(tiny_pair, str(tmp_path / "missing"), tmp_path))
    pq.write_table(pa.table({"id": [1], "text": ["hi"]}), tmp_path / "wrong.parquet")
    with pytest.raises(ConfigError, match="input.prompt_column.*neither a 'prompt' nor a 'messages'"):
        check_input(job_config(tiny_pair, str(tmp_path / "wrong.parquet"), tmp_path))
    assert not check_input(job_config(tiny_pair, str(tmp_path / "wrong.parquet"), tmp_path,
                                      **{"input.prompt_column": "text"})).generated_id
    pq.write_table(pa.table({"text": ["hi"]}), tmp_path / "no_id.parquet")
    assert check_input(job_config(tiny_pair, str(tmp_path / "no_id.parquet"), tmp_path,
                                  **{"input.prompt_column": "text"})).generated_id  # the default id name is optional
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match="output.path="):
        check_output(job_config(tiny_pair, prompts, tmp_path / "file" / "out"))


def _job_exit(args) -> subprocess.CompletedProcess:
    return subprocess.run([python(), str(REPO / "jobs" / "generate.py"), *args], capture_output=True, text=True,
                          timeout=120)


def test_unreadable_or_mismatched_shards_are_named(tiny_pair, tmp_path):
    """Issue 12 item 14: every footer and schema is read before any Ray work; exit 2 names the file."""
    good = tmp_path / "in"
    good.mkdir()
    pq.write_table(pa.table({"id": [1, 2], "prompt": ["a", "b"]}), good / "a.parquet")
    cases = {"empty.parquet": (b"", "empty.parquet is not a readable Parquet file.*0 bytes"),
             "cut.parquet": ((good / "a.parquet").read_bytes()[:40], "cut.parquet is not a readable Parquet file"),
             "text.parquet": (b"id,prompt\n3,c\n", "text.parquet is not a readable Parquet file")}
    for name, (data, message) in cases.items():
        (good / name).write_bytes(data)
        with pytest.raises(ConfigError, match=f"input.path=.*{message}"):
            check_input(job_config(tiny_pair, str(good), tmp_path / "out"))
        (good / name).unlink()
    pq.write_table(pa.table({"id": ["x"], "prompt": ["c"]}), good / "b.parquet")  # id: string vs int64
    pq.write_table(pa.table({"id": [4], "text": ["d"]}), good / "c.parquet")      # another column
    for name in ("b.parquet", "c.parquet"):
        other = {"b.parquet": "c.parquet", "c.parquet": "b.parquet"}[name]
        (good / other).rename(tmp_path / other)
        with pytest.raises(ConfigError, match=f"{name} does not match .*a.parquet"):
            check_input(job_config(tiny_pair, str(good), tmp_path / "out"))
        (tmp_path / other).rename(good / other)
    (good / "c.parquet").unlink()
    run = _job_exit(job_overrides(tiny_pair, good, tmp_path / "out"))
    assert run.returncode == 2 and "b.parquet does not match" in run.stderr, run.stderr


def test_duplicate_ids_are_refused_up_front(tiny_pair, tmp_path):
    """Issue 12 item 13: ids repeated across shards can never all complete (resume skips done ids)."""
    (tmp_path / "in").mkdir()
    pq.write_table(pa.table({"id": ["a", "b", "c"], "prompt": ["x"] * 3}), tmp_path / "in" / "s0.parquet")
    pq.write_table(pa.table({"id": ["d", "b", None, None], "prompt": ["x"] * 4}), tmp_path / "in" / "s1.parquet")
    with pytest.raises(ConfigError, match=r"input.id_column='id': 1 ids appear more than once.*'b' in \[.*s0.parquet"
                                          r"', '.*s1.parquet'\].*make the ids unique, or drop the 'id' column"):
        check_input(job_config(tiny_pair, str(tmp_path / "in"), tmp_path / "out"))
    # Within input.limit the ids are unique (nulls are error rows, not duplicates).
    plan = check_input(job_config(tiny_pair, str(tmp_path / "in"), tmp_path / "out", **{"input.limit": 4}))
    assert plan.num_rows == 4 and plan.ids.to_pylist() == ["a", "b", "c", "d"]
    run = _job_exit(job_overrides(tiny_pair, tmp_path / "in", tmp_path / "out"))
    assert run.returncode == 2 and "ids appear more than once" in run.stderr, run.stderr


def test_column_keys_that_match_nothing_and_flat_sampling_columns(tiny_pair, tmp_path):
    """Issue 12 item 15: a configured column that is absent is an error unless it is the default name;
    flat per-row sampling columns are carried through with one warning saying where overrides go."""
    pq.write_table(pa.table({"id": [1], "prompt": ["hi"], "temperature": [0.5], "max_tokens": [3]}),
                   tmp_path / "in.parquet")
    for key in ("id_column", "sampling_column", "messages_column", "prompt_column"):
        with pytest.raises(ConfigError, match=f"config key input.{key}='ident': .*has no such column"):
            check_input(job_config(tiny_pair, str(tmp_path / "in.parquet"), tmp_path / "out",
                                   **{f"input.{key}": "ident"}))
    plan = check_input(job_config(tiny_pair, str(tmp_path / "in.parquet"), tmp_path / "out"))
    assert len(plan.warnings) == 1
    assert "['temperature', 'max_tokens'] look like per-row sampling parameters" in plan.warnings[0]
    assert "'sampling_params' column" in plan.warnings[0]


def test_input_columns_named_like_output_columns_are_refused(tiny_pair, tmp_path):
    pq.write_table(pa.table({"id": [1], "prompt": ["hi"], "error": ["x"], "finish_reason": ["y"]}),
                   tmp_path / "in.parquet")
    with pytest.raises(ConfigError, match=r"input columns \['error', 'finish_reason'\] have the names of output"):
        check_input(job_config(tiny_pair, str(tmp_path / "in.parquet"), tmp_path / "out"))
    pq.write_table(pa.table({"id": [1], "text": ["hi"], "prompt": ["p"]}), tmp_path / "in.parquet")
    with pytest.raises(ConfigError, match=r"\['prompt'\] have the names of output"):  # `prompt` is not the prompt here
        check_input(job_config(tiny_pair, str(tmp_path / "in.parquet"), tmp_path / "out",
                               **{"input.prompt_column": "text"}))


def test_output_path_overlapping_the_input_is_refused(tiny_pair, tmp_path):
    """Issue 12 item 16: output.path equal to or inside input.path, and input inside output."""
    (tmp_path / "data" / "in").mkdir(parents=True)
    pq.write_table(pa.table({"id": [1], "prompt": ["hi"]}), tmp_path / "data" / "in" / "a.parquet")
    data, inp = tmp_path / "data", tmp_path / "data" / "in"
    for input_path, output_path, reason in [(inp, inp, "is the input path"), (f"{inp}/", inp, "is the input path"),
                                            (inp, inp / "out", "output.path is inside input.path"),
                                            (f"{inp}/*.parquet", inp, "is the input path"),
                                            (inp, data, "input.path is inside output.path"),
                                            (inp / "a.parquet", data, "input.path is inside output.path")]:
        with pytest.raises(ConfigError, match=f"output.path=.*{reason}"):
            check_output(job_config(tiny_pair, str(input_path), str(output_path)))
    check_output(job_config(tiny_pair, str(inp), str(tmp_path / "data" / "in-out")))  # a sibling is fine
    check_output(job_config(tiny_pair, f"{inp}/*.parquet", str(inp / "out")))  # the glob cannot match its files
    run = _job_exit(job_overrides(tiny_pair, inp, inp))
    assert run.returncode == 2 and "output.path is the input path" in run.stderr, run.stderr
