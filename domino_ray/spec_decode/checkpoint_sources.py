"""Draft checkpoint files: config.json and the safetensors headers of a local directory or a hub id, tensor values
only when asked (a hub id by HTTP range requests: pre-flight reads no weights). Safetensors only; no remote code.
Every failure is a `CheckpointError` saying what was asked for.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load as load_safetensors


class CheckpointError(ValueError):
    pass


@dataclass(frozen=True)
class DraftFiles:
    """A draft checkpoint as `check_draft` sees it: config.json and the safetensors headers, no weights."""
    config: dict                                          # config.json
    header: dict[str, torch.Tensor]                       # checkpoint name -> empty meta tensor of its shape
    read: Callable[[list[str]], dict[str, torch.Tensor]]  # checkpoint names -> their values


def _local_dir(source: str | Path) -> Path | None:
    """`source` as a local directory; None for a hub id. A path that is no directory is an error."""
    path = Path(source).expanduser()
    if path.is_dir():
        return path
    if path.exists() or str(source).startswith((".", "/", "~")):
        raise CheckpointError(f"draft checkpoint {source!r} is not a directory")
    return None


def resolve_checkpoint_dir(source: str | Path) -> Path:
    """A local directory as is; anything else is a hub id, fetched (config + safetensors only)."""
    path = _local_dir(source)
    if path is not None:
        return path
    from huggingface_hub import snapshot_download
    return Path(_from_hub(source, lambda: snapshot_download(str(source), allow_patterns=["*.json", "*.safetensors"])))


def _from_hub(repo_id, fetch):
    """fetch(), its hub errors (of many types) as one CheckpointError saying what was asked for."""
    try:
        return fetch()
    except Exception as exc:
        raise CheckpointError(f"could not fetch draft checkpoint {repo_id!r} from the hub: {exc}") from exc


def open_draft(source: str | Path) -> DraftFiles:
    """Headers only: a local directory, or a hub id read by HTTP range requests (weights not downloaded)."""
    path = _local_dir(source)
    return local_files(path) if path is not None else hub_files(str(source))


def _parse_config(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path} is not valid JSON: {exc}") from exc


def local_files(directory: Path) -> DraftFiles:
    """config.json and every safetensors header of a local checkpoint (one file, or shards with an index)."""
    config_path = directory / "config.json"
    if not config_path.exists():
        raise CheckpointError(f"{directory} has no config.json")
    config = _parse_config(config_path)
    index = directory / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in directory.glob("*.safetensors"))
    if not files:
        found = sorted(p.name for p in directory.iterdir())
        raise CheckpointError(f"no *.safetensors weights in {directory} (found: {found}); only safetensors is read")
    header, file_of = {}, {}
    for name in files:
        path = directory / name
        try:
            with safe_open(str(path), framework="pt") as f:
                for key in f.keys():
                    header[key] = torch.empty(f.get_slice(key).get_shape(), device="meta")
                    file_of[key] = path
        except Exception as exc:  # safetensors raises its own error types for a corrupt header
            raise CheckpointError(f"cannot read {path}: {exc}") from exc
    return DraftFiles(config, header, lambda keys: _local_values(file_of, keys))


def _local_values(file_of: dict[str, Path], keys: list[str]) -> dict[str, torch.Tensor]:
    values = {}
    for path in sorted({file_of[k] for k in keys}):
        try:
            with safe_open(str(path), framework="pt") as f:
                values.update({k: f.get_tensor(k) for k in keys if file_of[k] == path})
        except Exception as exc:
            raise CheckpointError(f"cannot read {path}: {exc}") from exc
    return values


def hub_files(repo_id: str) -> DraftFiles:
    """config.json and the safetensors headers of a hub checkpoint; values come by HTTP range requests."""
    from huggingface_hub import get_safetensors_metadata, hf_hub_download

    config = _parse_config(Path(_from_hub(repo_id, lambda: hf_hub_download(repo_id, "config.json"))))
    meta = _from_hub(repo_id, lambda: get_safetensors_metadata(repo_id))
    header = {k: torch.empty(info.shape, device="meta")
              for file in meta.files_metadata.values() for k, info in file.tensors.items()}
    return DraftFiles(config, header,
                      lambda keys: _from_hub(repo_id, lambda: {k: _hub_tensor(repo_id, meta, k) for k in keys}))


def _hub_tensor(repo_id: str, meta, key: str) -> torch.Tensor:
    """One tensor by two range requests: the header's length, then the tensor's bytes (its data offsets
    count from the end of the header)."""
    filename = meta.weight_map[key]
    info = meta.files_metadata[filename].tensors[key]
    data_start = 8 + int.from_bytes(_hub_range(repo_id, filename, 0, 8), "little")
    begin, end = info.data_offsets
    data = _hub_range(repo_id, filename, data_start + begin, data_start + end) if end > begin else b""
    # A one-tensor safetensors buffer: the library, not us, turns dtype, shape and bytes into a tensor.
    head = json.dumps({key: {"dtype": info.dtype, "shape": list(info.shape), "data_offsets": [0, len(data)]}}).encode()
    return load_safetensors(len(head).to_bytes(8, "little") + head + data)[key]


def _hub_range(repo_id: str, filename: str, start: int, end: int) -> bytes:
    """Bytes [start, end) of a file in a hub repo."""
    from huggingface_hub import hf_hub_url
    from huggingface_hub.utils import build_hf_headers, get_session, hf_raise_for_status

    response = get_session().get(hf_hub_url(repo_id, filename), timeout=30,
                                 headers={**build_hf_headers(), "range": f"bytes={start}-{end - 1}"})
    hf_raise_for_status(response)
    return response.content
