"""Draft checkpoints: every published layout, read without remote code (reference/domino.md §3).

Layouts (detected from `config.json`, every flag read from it):
- `dflash`: HF / DFlash (z-lab/*-DFlash-*, Huang2020/*-Domino-*): Qwen3 fields at the top level,
  `dflash_config{mask_token_id, target_layer_ids, projector_type, pure_draft_prefix_len, emb_dim,
  gru_hidden_dim, shift_label}`, `block_size`; keys `layers.*, fc, hidden_norm, norm, prefix_gru.*,
  embed_proj.{0,2}`. Legacy SpecForge checkpoints nest the head under `logit_head.`.
- `speculators`: speculators PR #685 (Eros483/*-Domino-*): `speculators_model_type: dflash`,
  `transformer_layer_config`, `aux_hidden_state_layer_ids` (HF hidden-state indices = layer ids + 1),
  `draft_vocab_size` with `d2t`/`t2d` and an own `lm_head`, head under `domino_head.`. Its
  `pure_draft_prefix_len` counts corrected slots from 1: with shift_label, P_cfg = 0 means one
  uncorrected draft.
- `speculators-domino`: the later speculators refactor: `speculators_model_type: domino`,
  `sample_from_anchor` (= shift_label), `logits_correction_emb_dim`, head under `logits_correction.`.

Each layout has its own small parser (`dflash_fields`, ...) into `LayoutFields`; `draft_config` does
what they share. A new layout is a new parser in `LAYOUT_PARSERS` plus its case in `detect_layout`.

`check_draft` is the one ordered check, run on config.json and the safetensors headers (plus the
small `d2t` map): pre-flight runs it alone, `load_draft` runs it and then reads the weights, so a bad
checkpoint gives the same first error in both. Every mismatch (missing, unexpected or mis-shaped
tensor; a draft that does not fit the target) raises `CheckpointError` naming the key, the expected
and the found value.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load as load_safetensors
from safetensors.torch import save_file

from domino_ray.spec.draft import DominoDraft, DraftConfig, default_target_layer_ids

DOMINO_PROJECTORS = ("domino", "causal_v5")  # causal_v5: older official alias
HEAD_PREFIXES = ("logit_head.", "domino_head.", "logits_correction.")
IGNORED_KEYS = ("embed_tokens.weight", "t2d", "verifier_lm_head.weight", "verifier_norm.weight")


class CheckpointError(ValueError):
    pass


# ---- reading: config.json and the safetensors headers; tensor values only when asked -------------

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


# ---- layouts ------------------------------------------------------------------------------------

def detect_layout(config: dict) -> str:
    kind = config.get("speculators_model_type")
    if kind == "domino":
        return "speculators-domino"
    if kind == "dflash":
        return "speculators"
    if kind is not None:
        raise CheckpointError(f"config.json speculators_model_type={kind!r} is not a DFlash/Domino draft "
                              "(expected 'dflash' or 'domino')")
    if "dflash_config" in config or "block_size" in config:
        return "dflash"
    raise CheckpointError("config.json is neither a DFlash/Domino draft (no 'dflash_config' or 'block_size') "
                          "nor a speculators draft (no 'speculators_model_type')")


def tensor_names(keys) -> dict[str, str]:
    """Our name -> the checkpoint's, for every tensor we read: every layout's names without `model.` and
    the head prefixes; the copies we ignore left out."""
    names = {}
    for key in keys:
        ours = key.removeprefix("model.")
        for prefix in HEAD_PREFIXES:
            ours = ours.removeprefix(prefix)
        if ours not in IGNORED_KEYS:
            names[ours] = key
    return names


def _get(cfg: dict, key: str, where: str, default=...):
    if key in cfg and cfg[key] is not None:
        return cfg[key]
    if default is ...:
        raise CheckpointError(f"config.json is missing required key {where}{key}")
    return default


def _rope_theta(layer_cfg: dict, where: str) -> float:
    scaling = layer_cfg.get("rope_scaling") or {}
    params = layer_cfg.get("rope_parameters") or {}
    kind = scaling.get("rope_type", scaling.get("type")) or params.get("rope_type") or "default"
    if kind != "default":
        raise CheckpointError(f"config.json {where}rope_scaling type {kind!r} is not supported (only default RoPE)")
    return float(layer_cfg.get("rope_theta") or params.get("rope_theta") or 10000.0)


@dataclass(frozen=True)
class LayoutFields:
    """What one layout's config.json says, in our terms; `draft_config` turns it into a DraftConfig."""
    layers: dict                     # the Qwen3 fields of the draft layers (hidden_size, heads, ...)
    where: str                       # their place in config.json, for error messages ("" = top level)
    block_size: int | None
    mask_token_id: int
    target_layer_ids: list[int]      # target layers whose outputs feed the draft (HF hidden_states[l + 1])
    projector: str | None            # "domino" (a GRU head) or None (plain DFlash, or decided by the tensors)
    shift_label: bool
    num_uncorrected: int             # our P: leading drafts without the head's correction
    emb_dim: int | None              # None: read from the tensors
    gru_hidden_dim: int | None


def dflash_fields(config: dict, num_target_layers: int | None) -> LayoutFields:
    """HF / DFlash: Qwen3 fields at the top level, the draft's own under `dflash_config`."""
    dflash = config.get("dflash_config") or {}
    for flag in ("use_bias_gate", "use_bias_norm"):
        if dflash.get(flag, config.get(flag)):
            raise CheckpointError(f"config.json {flag}=true (a legacy Domino variant) is not supported")
    mask_token_id = _get(dflash, "mask_token_id", "dflash_config.")
    ids = dflash.get("target_layer_ids")
    if ids is None:
        n_target = config.get("num_target_layers", num_target_layers)
        if n_target is None:
            raise CheckpointError("config.json has neither dflash_config.target_layer_ids nor num_target_layers")
        ids = default_target_layer_ids(n_target, _get(config, "num_hidden_layers", ""))
    return LayoutFields(
        layers=config, where="", block_size=config.get("block_size", dflash.get("block_size")),
        mask_token_id=mask_token_id, target_layer_ids=ids, projector=dflash.get("projector_type"),
        shift_label=bool(dflash.get("shift_label", False)),
        num_uncorrected=int(dflash.get("pure_draft_prefix_len", 0)),
        emb_dim=dflash.get("emb_dim", config.get("emb_dim")),
        gru_hidden_dim=dflash.get("gru_hidden_dim", config.get("gru_hidden_dim")))


def _speculators_common(config: dict) -> dict:
    """The fields both speculators layouts share: layers under `transformer_layer_config`, target layers
    as HF hidden-state indices (= layer id + 1)."""
    aux = _get(config, "aux_hidden_state_layer_ids", "")
    return {"layers": _get(config, "transformer_layer_config", ""), "where": "transformer_layer_config.",
            "block_size": config.get("block_size"), "mask_token_id": _get(config, "mask_token_id", ""),
            "target_layer_ids": [int(i) - 1 for i in aux], "gru_hidden_dim": config.get("gru_hidden_dim")}


def speculators_fields(config: dict, num_target_layers: int | None) -> LayoutFields:
    """speculators PR #685 (`speculators_model_type: dflash`)."""
    shift_label = bool(config.get("shift_label", True))
    return LayoutFields(
        **_speculators_common(config), projector=config.get("projector_type"), shift_label=shift_label,
        # PR #685 counts corrected slots from 1 + pure_draft_prefix_len (slot j holds draft j with shift)
        num_uncorrected=int(config.get("pure_draft_prefix_len", 0)) + (1 if shift_label else 0),
        emb_dim=config.get("emb_dim"))


def speculators_domino_fields(config: dict, num_target_layers: int | None) -> LayoutFields:
    """The later speculators refactor (`speculators_model_type: domino`): always a Domino head."""
    return LayoutFields(
        **_speculators_common(config), projector=config.get("projector_type", "domino"),
        shift_label=bool(config.get("sample_from_anchor", config.get("shift_label", True))),
        num_uncorrected=int(config.get("pure_draft_prefix_len", 1)),
        emb_dim=config.get("logits_correction_emb_dim", config.get("emb_dim")))


# detect_layout's names -> their parsers; a new layout is one more function here.
LAYOUT_PARSERS = {"dflash": dflash_fields, "speculators": speculators_fields,
                  "speculators-domino": speculators_domino_fields}


def parse_draft_config(config: dict, tensors: dict[str, torch.Tensor], layout: str,
                       num_target_layers: int | None = None) -> DraftConfig:
    """A `DraftConfig` from `config.json` and the (normalised) tensors of a checkpoint; only their
    shapes are read, so the header's empty meta tensors do."""
    if layout not in LAYOUT_PARSERS:
        raise CheckpointError(f"unknown draft layout {layout!r} (expected one of {sorted(LAYOUT_PARSERS)})")
    return draft_config(LAYOUT_PARSERS[layout](config, num_target_layers), tensors)


def draft_config(f: LayoutFields, tensors: dict[str, torch.Tensor]) -> DraftConfig:
    """What every layout shares: required fields, the head's sizes (from the tensors when the config
    omits them), our DraftConfig."""
    if f.block_size is None:
        raise CheckpointError("config.json is missing required key block_size")
    if f.projector is not None and f.projector not in DOMINO_PROJECTORS:
        raise CheckpointError(f"config.json projector_type={f.projector!r} is not supported "
                              f"(expected one of {DOMINO_PROJECTORS} or none)")
    # A declared head whose tensors are missing is reported by check_tensors, naming them.
    has_head = f.projector in DOMINO_PROJECTORS or any(k.startswith(("prefix_gru.", "embed_proj.")) for k in tensors)
    emb_dim, gru_dim = f.emb_dim, f.gru_hidden_dim
    if has_head:
        if emb_dim is None and "embed_proj.0.weight" in tensors:
            emb_dim = tensors["embed_proj.0.weight"].shape[0]
        if gru_dim is None and "prefix_gru.weight_hh_l0" in tensors:
            gru_dim = tensors["prefix_gru.weight_hh_l0"].shape[1]
        if emb_dim is None or gru_dim is None:
            raise CheckpointError("config.json is missing emb_dim / gru_hidden_dim of the Domino head")
    layers, where = f.layers, f.where
    hidden = _get(layers, "hidden_size", where)
    heads = _get(layers, "num_attention_heads", where)
    return DraftConfig(
        hidden_size=hidden,
        intermediate_size=_get(layers, "intermediate_size", where),
        num_hidden_layers=_get(layers, "num_hidden_layers", where),
        num_attention_heads=heads,
        num_key_value_heads=layers.get("num_key_value_heads") or heads,
        head_dim=layers.get("head_dim") or hidden // heads,
        vocab_size=_get(layers, "vocab_size", where),
        block_size=int(f.block_size),
        target_layer_ids=tuple(int(i) for i in f.target_layer_ids),
        mask_token_id=int(f.mask_token_id),
        shift_label=f.shift_label,
        num_uncorrected=f.num_uncorrected if has_head else 0,
        emb_dim=int(emb_dim) if has_head else None,
        gru_hidden_dim=int(gru_dim) if has_head else None,
        draft_vocab_size=tensors["lm_head.weight"].shape[0] if "lm_head.weight" in tensors else None,
        has_d2t="d2t" in tensors,
        rms_norm_eps=float(layers.get("rms_norm_eps", 1e-6)),
        rope_theta=_rope_theta(layers, where),
        attention_bias=bool(layers.get("attention_bias", False)),
    )


# ---- the checks and loading ---------------------------------------------------------------------

def check_draft(files: DraftFiles, target_config=None) -> tuple[DraftConfig, dict[str, str]]:
    """The one ordered check of a draft checkpoint. Pre-flight and `load_draft` both run exactly this, so
    a bad checkpoint fails with the same first error in both. Reads no tensor values but `d2t` ([Vd] ints).

    Returns the DraftConfig and our tensor names -> the checkpoint's (what the loader reads).
    """
    layout = detect_layout(files.config)
    names = tensor_names(files.header)
    header = {ours: files.header[key] for ours, key in names.items()}
    cfg = parse_draft_config(files.config, header, layout,
                             num_target_layers=getattr(target_config, "num_hidden_layers", None))
    if target_config is not None:  # before the shapes: "made for another target" explains most shape errors
        check_against_target(cfg, target_config)
    check_tensors(cfg, header)
    if target_config is not None and cfg.has_d2t:  # last: the one check on values, read once the shape is right
        check_d2t(files.read([names["d2t"]])[names["d2t"]], target_config.vocab_size)
    return cfg, names


def check_tensors(cfg: DraftConfig, tensors: dict[str, torch.Tensor]):
    """Every expected tensor present with its exact shape, nothing unexpected."""
    with torch.device("meta"):
        expected = {k: tuple(v.shape) for k, v in DominoDraft(cfg).state_dict().items()}
    missing = sorted(set(expected) - set(tensors))
    if missing:
        raise CheckpointError(f"draft checkpoint is missing tensors: {missing[:8]}{' ...' if len(missing) > 8 else ''}")
    unexpected = sorted(set(tensors) - set(expected))
    if unexpected:
        raise CheckpointError(f"draft checkpoint has unexpected tensors: {unexpected[:8]}"
                              f"{' ...' if len(unexpected) > 8 else ''}")
    for key, shape in expected.items():
        found = tuple(tensors[key].shape)
        if found != shape:
            raise CheckpointError(f"draft tensor {key}: expected shape {list(shape)}, found {list(found)}")


def check_against_target(cfg: DraftConfig, target_config):
    """The draft must share the target's hidden size and vocabulary and read existing layers."""
    t_hidden, t_vocab, t_layers = target_config.hidden_size, target_config.vocab_size, target_config.num_hidden_layers
    if cfg.hidden_size != t_hidden:
        raise CheckpointError(f"draft hidden_size: expected {t_hidden} (the target's), found {cfg.hidden_size}")
    if cfg.vocab_size != t_vocab:
        raise CheckpointError(f"draft vocab_size: expected {t_vocab} (the target's), found {cfg.vocab_size}")
    bad = [i for i in cfg.target_layer_ids if not 0 <= i < t_layers]
    if bad:
        raise CheckpointError(f"draft target_layer_ids {list(cfg.target_layer_ids)}: expected ids in "
                              f"[0, {t_layers}) for a {t_layers}-layer target, found {bad}")
    if not 0 <= cfg.mask_token_id < t_vocab:
        raise CheckpointError(f"draft mask_token_id: expected an id in [0, {t_vocab}), found {cfg.mask_token_id}")
    if cfg.draft_vocab_size and cfg.draft_vocab_size != t_vocab and not cfg.has_d2t:
        raise CheckpointError(f"draft lm_head has {cfg.draft_vocab_size} rows but the target vocabulary has "
                              f"{t_vocab} and there is no d2t map")


def check_d2t(d2t: torch.Tensor, vocab_size: int):
    """Every draft id lands in the target vocabulary (target id = draft id + d2t[draft id])."""
    mapped = torch.arange(d2t.shape[0]) + d2t.long()  # [Vd] target ids
    if int(mapped.min()) < 0 or int(mapped.max()) >= vocab_size:
        raise CheckpointError(f"draft d2t maps ids outside the target vocabulary [0, {vocab_size}): "
                              f"range [{int(mapped.min())}, {int(mapped.max())}]")


def load_draft(source: str | Path, *, target_config=None, device: str | torch.device = "cpu",
               dtype: torch.dtype | None = None) -> DominoDraft:
    """Load a Domino or plain DFlash draft from a local directory or a hub id (no remote code).

    With `target_config` (the target's HF config) the draft is checked against the target.
    `dtype=None` keeps the checkpoint's floating dtype.
    """
    files = local_files(resolve_checkpoint_dir(source))
    cfg, names = check_draft(files, target_config)
    values = files.read(list(names.values()))  # the ignored copies (embed_tokens, t2d) are not read
    tensors = {ours: values[key] for ours, key in names.items()}
    if dtype is None:
        dtype = next(v.dtype for v in tensors.values() if v.is_floating_point())
    with torch.device("meta"):
        draft = DominoDraft(cfg)
    draft.load_state_dict(tensors, strict=True, assign=True)
    return draft.to(device=device, dtype=dtype).eval()  # .to() also re-links the GRU's flat weights


def save_draft(draft: DominoDraft, directory: str | Path, **extra_config):
    """Write a draft in the HF/DFlash layout (the one the Huang2020 checkpoints use)."""
    cfg = draft.config
    if cfg.draft_vocab_size is not None:
        raise ValueError("save_draft writes the HF/DFlash layout, which has no own lm_head; this draft has one")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    dflash = {"mask_token_id": cfg.mask_token_id, "target_layer_ids": list(cfg.target_layer_ids),
              "shift_label": cfg.shift_label}
    if cfg.has_head:
        dflash.update(projector_type="domino", pure_draft_prefix_len=cfg.num_uncorrected, emb_dim=cfg.emb_dim,
                      gru_hidden_dim=cfg.gru_hidden_dim)
    config = {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3",
        "dtype": str(next(draft.parameters()).dtype).removeprefix("torch."),
        "block_size": cfg.block_size, "dflash_config": dflash,
        "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_hidden_layers, "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads, "head_dim": cfg.head_dim, "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": cfg.rope_theta, "rope_scaling": None,
        "attention_bias": cfg.attention_bias, "vocab_size": cfg.vocab_size, "tie_word_embeddings": False,
        **({"emb_dim": cfg.emb_dim} if cfg.has_head else {}),
        **extra_config,
    }
    state = {k: v.detach().contiguous().cpu() for k, v in draft.state_dict().items()}
    save_file(state, str(directory / "model.safetensors"), metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def save_draft_speculators(draft: DominoDraft, directory: str | Path, *, verifier: str = "", **extra_config):
    """Write a draft in the speculators PR #685 layout (Eros483/*-Domino-*): `transformer_layer_config`,
    `aux_hidden_state_layer_ids` (= layer ids + 1), the head under `domino_head.`, an own (pruned) lm_head
    with `d2t`/`t2d`. The copy of the target's embedding that layout carries (`embed_tokens.weight`,
    V x C) is left out: every loader here uses the target's own (`IGNORED_KEYS`), and it would be most
    of the file. PR #685 counts corrected slots from 1 + pure_draft_prefix_len, so only shift_label
    drafts with at least one uncorrected draft have this layout."""
    cfg = draft.config
    if cfg.has_head and not (cfg.shift_label and cfg.num_uncorrected >= 1):
        raise ValueError("the speculators layout needs shift_label=True and num_uncorrected >= 1 for a Domino head, "
                         f"found shift_label={cfg.shift_label}, num_uncorrected={cfg.num_uncorrected}")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().contiguous().cpu() for k, v in draft.state_dict().items()}
    tensors = {("domino_head." + k if k.startswith(("prefix_gru.", "embed_proj.")) else k): v for k, v in state.items()}
    if cfg.has_d2t:
        t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
        t2d[draft.to_target_ids(torch.arange(cfg.draft_vocab_size, device=draft.d2t.device)).cpu()] = True
        tensors["t2d"] = t2d
    layer_config = {
        "model_type": "qwen3", "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_hidden_layers, "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads, "head_dim": cfg.head_dim, "hidden_act": "silu",
        "vocab_size": cfg.vocab_size, "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": cfg.rope_theta,
        "rope_scaling": None, "attention_bias": cfg.attention_bias}
    config = {
        "speculators_model_type": "dflash", "architectures": ["DFlashSpeculator"], "speculators_version": "0.4.0",
        "dtype": str(next(draft.parameters()).dtype).removeprefix("torch."),
        "transformer_layer_config": layer_config, "draft_vocab_size": cfg.logits_vocab_size,
        "block_size": cfg.block_size, "target_hidden_size": None,
        "aux_hidden_state_layer_ids": [i + 1 for i in cfg.target_layer_ids], "mask_token_id": cfg.mask_token_id,
        "sliding_window_non_causal": False, "shift_label": cfg.shift_label,
        **({"projector_type": "domino", "pure_draft_prefix_len": cfg.num_uncorrected - 1, "emb_dim": cfg.emb_dim,
            "gru_hidden_dim": cfg.gru_hidden_dim} if cfg.has_head else {}),
        "speculators_config": {"algorithm": "dflash", "default_proposal_method": "greedy",
                               "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": cfg.block_size}],
                               "verifier": {"name_or_path": verifier}},
        **extra_config,
    }
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
