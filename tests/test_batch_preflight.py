"""Driver-side pre-flight: a job that cannot run fails before any Ray work, naming the config key."""

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from batch_fixtures import job_config, tiny_pair  # noqa: F401  (fixture)
from domino_ray.checkpoint import save_draft
from domino_ray.config import ConfigError
from domino_ray.preflight import check_input, check_models, check_output
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
    with pytest.raises(ConfigError, match="draft.num_draft_tokens=9 is invalid.*1..4"):
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
    assert check_input(job_config(tiny_pair, str(tmp_path / "wrong.parquet"), tmp_path,
                                  **{"input.prompt_column": "text", "input.id_column": "key"})).generated_id
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match="output.path="):
        check_output(job_config(tiny_pair, prompts, tmp_path / "file" / "out"))
