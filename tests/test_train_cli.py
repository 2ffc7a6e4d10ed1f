"""jobs/train_draft.py end to end on a saved tiny pair: generate, train, save in the HF/DFlash layout, reload
through the real loader, measure in the engine; bad input fails with a message naming it."""

import importlib.util
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from domino_ray.target.loading import load_target
from domino_ray.spec_decode.checkpoint import load_draft
from tiny_models import CORPUS, save_tiny_pair

ROOT = Path(__file__).resolve().parents[1]


def load_cli():
    spec = importlib.util.spec_from_file_location("train_draft_cli", ROOT / "jobs" / "train_draft.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_cli_trains_saves_and_evaluates(tmp_path, capsys):
    target_dir, _ = save_tiny_pair(tmp_path / "pair")
    prompts = tmp_path / "prompts.parquet"
    pq.write_table(pa.table({"id": [str(i) for i in range(30)], "prompt": (CORPUS * 5)[:30]}), prompts)
    out, cache = tmp_path / "draft", tmp_path / "sequences.pt"
    common = ["--target", target_dir, "--prompts", str(prompts), "--out", str(out), "--sequences", str(cache),
              "--max-new-tokens", "16", "--block-size", "4", "--batch-size", "8", "--anchors", "4",
              "--holdout", "6", "--log-every", "3", "--emb-dim", "16", "--gru-hidden-dim", "24"]
    cli = load_cli()
    cli.main(common + ["--steps", "6", "--eval-prompts", str(prompts), "--eval-count", "5",
                       "--eval-max-new-tokens", "8"])
    printed = capsys.readouterr().out
    assert "acc/pos" in printed and "mean acceptance length" in printed and cache.exists()

    target = load_target(target_dir)
    draft = load_draft(out, target_config=target.config)
    assert draft.config.block_size == 4 and draft.config.has_head and draft.config.shift_label
    assert draft.config.mask_token_id == target.config.vocab_size - 1  # the unused embedding row
    record = json.loads((out / "training.json").read_text())
    assert [h["step"] for h in record["history"]] == [3, 6]
    assert len(record["history"][-1]["eval"]["accuracy"]) == 4
    assert set(record["engine"]) == {"domino", "backbone_only"}
    assert len(record["engine"]["domino"]["per_position_acceptance"]) == 4

    cli.main(common + ["--steps", "1", "--no-head", "--out", str(tmp_path / "plain")])  # reuses the cache
    assert "loaded 30 sequences" in capsys.readouterr().out
    assert not load_draft(tmp_path / "plain", target_config=target.config).config.has_head


def test_cli_pruned_vocabulary_in_the_speculators_layout(tmp_path, capsys):
    """Issue 11's pipeline: cached sequences and features, a pruned vocabulary, bf16 weights in the speculators
    layout (d2t/t2d), read back by the real loader; a rerun reuses every stage."""
    from safetensors.torch import load_file

    from domino_ray.spec_decode.checkpoint_layouts import detect_layout

    target_dir, _ = save_tiny_pair(tmp_path / "pair")
    prompts = tmp_path / "prompts.parquet"
    pq.write_table(pa.table({"id": [str(i) for i in range(30)], "prompt": (CORPUS * 5)[:30]}), prompts)
    out = tmp_path / "draft"
    args = ["--target", target_dir, "--prompts", str(prompts), "--out", str(out), "--sequences",
            str(tmp_path / "seq.pt"), "--features", str(tmp_path / "features"), "--checkpoint",
            str(tmp_path / "state.pt"), "--gen-chunk", "8", "--max-new-tokens", "16", "--block-size", "4",
            "--batch-size", "8", "--anchors", "4", "--holdout", "6", "--log-every", "3", "--emb-dim", "16",
            "--gru-hidden-dim", "24", "--steps", "3", "--draft-vocab-size", "40", "--save-dtype", "bfloat16"]
    cli = load_cli()
    cli.main(args)
    printed = capsys.readouterr().out
    assert "generated 30/30 prompts" in printed and "features 30/30" in printed and "pruned vocabulary: 40 ids" in printed
    config = json.loads((out / "config.json").read_text())
    assert detect_layout(config) == "speculators" and config["draft_vocab_size"] == 40
    tensors = load_file(str(out / "model.safetensors"))
    assert tensors["t2d"].sum() == 40 and "domino_head.prefix_gru.weight_ih_l0" in tensors
    assert tensors["lm_head.weight"].dtype.is_floating_point and tensors["fc.weight"].dtype == torch.bfloat16
    target = load_target(target_dir)
    draft = load_draft(out, target_config=target.config)
    assert draft.config.draft_vocab_size == 40 and draft.config.has_d2t and draft.config.has_head
    assert torch.equal(tensors["t2d"].nonzero().flatten(), draft.to_target_ids(torch.arange(40)))
    cli.main(args)  # every stage cached: nothing is generated or computed again, training resumes at its end
    printed = capsys.readouterr().out
    assert "loaded 30 sequences" in printed and "features " not in printed and "resumed from" in printed


def test_cli_names_a_missing_prompt_column(tmp_path):
    target_dir, _ = save_tiny_pair(tmp_path / "pair")
    prompts = tmp_path / "prompts.parquet"
    pq.write_table(pa.table({"text": ["a b c"]}), prompts)
    with pytest.raises(SystemExit, match="has no column 'prompt'"):
        load_cli().main(["--target", target_dir, "--prompts", str(prompts), "--out", str(tmp_path / "d")])
