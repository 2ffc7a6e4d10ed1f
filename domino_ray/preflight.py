"""Cheap driver-side checks before any Ray work: a job that cannot run fails at once, saying why.

Model checks read configs, the tokenizer and the draft's safetensors *headers* (shapes only, from a
local directory or the hub), never the weights. Every error names the config key it came from.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import torch

from domino_ray.checkpoint import (CheckpointError, check_against_target, check_tensors, detect_layout,
                                   normalize_keys, parse_draft_config)
from domino_ray.config import ConfigError, JobConfig
from domino_ray.io import Location, list_parquet_files, resolve


@dataclass
class InputPlan:
    location: Location
    files: list[str]
    schema: pa.Schema        # of the first file; Ray reads all files with it unified
    generated_id: bool       # the input has no id column: ids come from (file path, row position)


def check_input(cfg: JobConfig) -> InputPlan:
    ic = cfg.input
    try:
        loc = resolve(ic.path, ic.s3)
        files = list_parquet_files(loc)
        with loc.fs.open_input_file(files[0]) as f:
            schema = pq.read_schema(f)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"config key input.path={ic.path!r}: {exc}") from None
    if ic.prompt_column not in schema.names and ic.messages_column not in schema.names:
        raise ConfigError(f"config key input.prompt_column / input.messages_column: {files[0]} has neither a "
                          f"{ic.prompt_column!r} nor a {ic.messages_column!r} column (columns: {schema.names})")
    return InputPlan(loc, files, schema, generated_id=ic.id_column not in schema.names)


def check_output(cfg: JobConfig) -> Location:
    try:
        loc = resolve(cfg.output.path, cfg.output.s3)
        loc.fs.create_dir(loc.path, recursive=True)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"config key output.path={cfg.output.path!r}: {exc}") from None
    return loc


def check_models(cfg: JobConfig) -> int:
    """Target config, tokenizer and draft shapes; returns K (draft tokens per step, 0 = target only)."""
    from transformers import AutoConfig

    from domino_ray.target import load_tokenizer

    try:
        target_config = AutoConfig.from_pretrained(cfg.model.source)
    except Exception as exc:  # transformers raises OSError/ValueError/KeyError depending on what is wrong
        raise ConfigError(f"config key model.source={cfg.model.source!r}: cannot read the target config: "
                          f"{exc}") from None
    tokenizer_key = "model.tokenizer" if cfg.model.tokenizer else "model.source"
    try:
        load_tokenizer(cfg.model.tokenizer or cfg.model.source)
    except Exception as exc:
        raise ConfigError(f"config key {tokenizer_key}: cannot load the tokenizer: {exc}") from None
    if cfg.draft.source is None:
        return 0
    try:
        config, tensors = _draft_header(cfg.draft.source)
        layout = detect_layout(config)
        tensors = normalize_keys(tensors)
        draft_config = parse_draft_config(config, tensors, layout, num_target_layers=target_config.num_hidden_layers)
        check_tensors(draft_config, tensors)
        check_against_target(draft_config, target_config)
    except (CheckpointError, OSError, ValueError, KeyError) as exc:
        raise ConfigError(f"config key draft.source={cfg.draft.source!r}: {exc}") from None
    k = cfg.draft.num_draft_tokens or draft_config.max_draft_tokens
    if not 1 <= k <= draft_config.max_draft_tokens:
        raise ConfigError(f"config key draft.num_draft_tokens={k} is invalid: this draft proposes "
                          f"1..{draft_config.max_draft_tokens} tokens per step")
    return k


def _draft_header(source: str) -> tuple[dict, dict[str, torch.Tensor]]:
    """config.json and every tensor as an empty `meta` tensor of the right shape (weights not read)."""
    path = Path(source).expanduser()
    shapes: dict[str, list[int]] = {}
    if path.is_dir():
        config = json.loads((path / "config.json").read_text())
        from safetensors import safe_open

        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"no *.safetensors weights in {path}")
        for file in files:
            with safe_open(str(file), framework="pt") as f:
                shapes.update({k: f.get_slice(k).get_shape() for k in f.keys()})
    elif path.exists() or source.startswith((".", "/", "~")):
        raise CheckpointError(f"{source!r} is not a directory")
    else:  # a hub id: config.json plus the safetensors headers (HTTP range requests), no weights
        from huggingface_hub import get_safetensors_metadata, hf_hub_download

        config = json.loads(Path(hf_hub_download(source, "config.json")).read_text())
        for meta in get_safetensors_metadata(source).files_metadata.values():
            shapes.update({k: info.shape for k, info in meta.tensors.items()})
    return config, {k: torch.empty(shape, device="meta") for k, shape in shapes.items()}
