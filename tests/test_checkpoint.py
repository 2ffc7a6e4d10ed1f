"""Draft checkpoints: every layout round-trips, the published 4B shape is exact, bad files fail clearly."""

import json
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file

from batch_fixtures import job_config, tiny_pair  # noqa: F401  (fixture)
from checkpoint_layouts import write_dflash, write_hub_cache, write_speculators, write_speculators_domino
from domino_ray.batch.preflight import check_models
from domino_ray.config import ConfigError
from domino_ray.spec_decode.checkpoint import load_draft
from domino_ray.spec_decode.checkpoint_layouts import parse_draft_config
from domino_ray.spec_decode.checkpoint_sources import CheckpointError
from domino_ray.spec_decode.draft import DominoDraft, default_target_layer_ids
from tiny_models import tiny_draft, tiny_target
from oracles import corrected_logits_full_prefix


@pytest.fixture(scope="module")
def target():
    return tiny_target("qwen3", seed=41, dtype=torch.float32)


def same_function(a: DominoDraft, b: DominoDraft, target) -> None:
    """Both drafts compute the same block hidden states, corrected logits and draft tokens."""
    assert a.config == b.config
    g = torch.Generator().manual_seed(0)
    c, f, blk = a.config.hidden_size, a.fc.in_features, a.config.block_size
    feats, block = torch.randn(2, 7, f, generator=g), torch.randn(2, blk, c, generator=g)
    positions = torch.arange(7, 7 + blk).expand(2, -1)
    mask = torch.ones(2, 1, blk, 7 + blk, dtype=torch.bool)
    embed, head = target.get_input_embeddings(), target.get_output_embeddings()
    with torch.no_grad():
        ha, hb = a.block_hidden(feats, block, positions, mask), b.block_hidden(feats, block, positions, mask)
        assert torch.equal(ha, hb)
        anchor, k = torch.tensor([3, 5]), a.config.max_draft_tokens
        drafts = a.draft_tokens(ha, anchor, k, embed, head)
        assert torch.equal(drafts, b.draft_tokens(hb, anchor, k, embed, head))
        if a.config.has_head:
            ids = torch.randint(0, a.config.vocab_size, (2, k), generator=g)
            assert torch.equal(corrected_logits_full_prefix(a, ha, anchor, ids, embed, head),
                               corrected_logits_full_prefix(b, hb, anchor, ids, embed, head))


LAYOUTS = {
    "dflash": lambda d, t, p: write_dflash(d, p),
    "dflash-legacy-logit_head": lambda d, t, p: write_dflash(d, p, legacy_head=True),
    "dflash-model-prefix": lambda d, t, p: write_dflash(d, p, model_prefix=True),
    "speculators": lambda d, t, p: write_speculators(d, t, p),
    "speculators-domino": lambda d, t, p: write_speculators_domino(d, p),
}


# PR #685 (speculators) always trains with shifted targets and slot 0 uncorrected.
ROUND_TRIPS = [(layout, shift, p) for layout in sorted(LAYOUTS) for shift, p in
               [(True, 1), (True, 2), (False, 0), (False, 1)] if layout != "speculators" or (shift and p >= 1)]


@pytest.mark.parametrize("layout,shift_label,num_uncorrected", ROUND_TRIPS)
def test_layouts_round_trip(target, tmp_path, layout, shift_label, num_uncorrected):
    draft = tiny_draft(target, block_size=4, shift_label=shift_label, num_uncorrected=num_uncorrected,
                       draft_vocab=40 if layout == "speculators" else None)
    LAYOUTS[layout](draft, target, tmp_path)
    same_function(draft, load_draft(tmp_path, target_config=target.config), target)


def test_plain_dflash_round_trip(target, tmp_path):
    draft = tiny_draft(target, head=False, shift_label=False, block_size=8)
    write_dflash(draft, tmp_path)
    loaded = load_draft(tmp_path, target_config=target.config)
    assert not loaded.config.has_head
    same_function(draft, loaded, target)


def test_speculators_without_pruned_vocab(target, tmp_path):
    draft = tiny_draft(target, draft_vocab=target.config.vocab_size)  # own full-vocab lm_head (PR #773)
    write_speculators(draft, target, tmp_path)
    same_function(draft, load_draft(tmp_path, target_config=target.config), target)


HUANG2020_QWEN3_4B_CONFIG = {
    "architectures": ["DFlashDraftModel"], "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
    "model_type": "qwen3", "dtype": "bfloat16", "block_size": 16, "num_target_layers": 36, "emb_dim": 256,
    "dflash_config": {"mask_token_id": 151669, "target_layer_ids": [1, 9, 17, 25, 33], "projector_type": "domino",
                      "pure_draft_prefix_len": 1, "emb_dim": 256, "gru_hidden_dim": 1024, "shift_label": True},
    "hidden_size": 2560, "intermediate_size": 9728, "num_hidden_layers": 5, "num_attention_heads": 32,
    "num_key_value_heads": 8, "head_dim": 128, "hidden_act": "silu", "rms_norm_eps": 1e-06,
    "rope_theta": 1000000, "rope_scaling": None, "max_position_embeddings": 40960, "attention_bias": False,
    "attention_dropout": 0.0, "layer_types": ["full_attention"] * 5, "sliding_window": None,
    "use_sliding_window": False, "tie_word_embeddings": False, "vocab_size": 151936,
    "bos_token_id": 151643, "eos_token_id": 151645,
}


def test_huang2020_4b_parameter_names_and_shapes():
    """reference/domino.md §3.1: the Qwen3-4B Domino b16 draft, built on the meta device."""
    cfg = parse_draft_config(HUANG2020_QWEN3_4B_CONFIG, {}, "dflash")
    assert (cfg.shift_label, cfg.num_uncorrected, cfg.block_size, cfg.max_draft_tokens) == (True, 1, 16, 16)
    with torch.device("meta"):
        shapes = {k: list(v.shape) for k, v in DominoDraft(cfg).state_dict().items()}
    expected = {}
    for i in range(5):
        p = f"layers.{i}."
        expected.update({
            p + "self_attn.q_proj.weight": [4096, 2560], p + "self_attn.k_proj.weight": [1024, 2560],
            p + "self_attn.v_proj.weight": [1024, 2560], p + "self_attn.o_proj.weight": [2560, 4096],
            p + "self_attn.q_norm.weight": [128], p + "self_attn.k_norm.weight": [128],
            p + "mlp.gate_proj.weight": [9728, 2560], p + "mlp.up_proj.weight": [9728, 2560],
            p + "mlp.down_proj.weight": [2560, 9728],
            p + "input_layernorm.weight": [2560], p + "post_attention_layernorm.weight": [2560],
        })
    expected.update({
        "fc.weight": [2560, 12800], "hidden_norm.weight": [2560], "norm.weight": [2560],
        "prefix_gru.weight_ih_l0": [3072, 2560], "prefix_gru.weight_hh_l0": [3072, 1024],
        "embed_proj.0.weight": [256, 3584], "embed_proj.2.weight": [151936, 256],
    })
    assert shapes == expected


def test_default_target_layer_ids():
    assert default_target_layer_ids(36, 5) == (1, 9, 17, 25, 33)
    assert default_target_layer_ids(28, 1) == (14,)


def test_hub_id_resolves_from_the_local_cache(target, tmp_path, monkeypatch):
    import huggingface_hub.constants as hf_constants

    source = tmp_path / "src"
    draft = tiny_draft(target)
    write_dflash(draft, source)
    write_hub_cache(tmp_path / "hub", "Huang2020/Tiny-Domino-b4", source)
    monkeypatch.setattr(hf_constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", True)
    same_function(draft, load_draft("Huang2020/Tiny-Domino-b4", target_config=target.config), target)
    with pytest.raises(CheckpointError, match="could not fetch draft checkpoint 'Huang2020/Missing'"):
        load_draft("Huang2020/Missing")


# ---- corrupt or mismatched checkpoints ------------------------------------------------------------

def edit_tensors(directory, fn):
    tensors = load_file(str(directory / "model.safetensors"))
    fn(tensors)
    save_file(tensors, str(directory / "model.safetensors"))


def edit_config(directory, fn):
    cfg = json.loads((directory / "config.json").read_text())
    fn(cfg)
    (directory / "config.json").write_text(json.dumps(cfg))


BAD = {
    "missing tensor": (lambda d: edit_tensors(d, lambda t: t.pop("fc.weight")), r"missing tensors: \['fc.weight'\]"),
    "mis-shaped tensor": (lambda d: edit_tensors(d, lambda t: t.update({"norm.weight": torch.ones(7)})),
                          r"norm.weight: expected shape \[32\], found \[7\]"),
    "unexpected tensor": (lambda d: edit_tensors(d, lambda t: t.update({"extra.weight": torch.ones(2)})),
                          r"unexpected tensors: \['extra.weight'\]"),
    "head declared, weights missing": (
        lambda d: edit_tensors(d, lambda t: [t.pop(k) for k in list(t) if k.startswith("prefix_gru")]),
        r"missing tensors: \['prefix_gru.weight_hh_l0', 'prefix_gru.weight_ih_l0'\]"),
    "mis-shaped head": (lambda d: edit_tensors(d, lambda t: t.update({"embed_proj.2.weight": torch.ones(50, 16)})),
                        r"embed_proj.2.weight: expected shape \[96, 16\], found \[50, 16\]"),
    "layer id out of range": (lambda d: edit_config(d, lambda c: c["dflash_config"].update(target_layer_ids=[0, 7])),
                              r"expected ids in \[0, 4\) for a 4-layer target, found \[7\]"),
    "hidden size": (lambda d: edit_config(d, lambda c: c.update(hidden_size=48)),
                    r"hidden_size: expected 32 \(the target's\), found 48"),
    "vocabulary": (lambda d: edit_config(d, lambda c: c.update(vocab_size=100)),
                   r"vocab_size: expected 96 \(the target's\), found 100"),
    "no mask token": (lambda d: edit_config(d, lambda c: c["dflash_config"].pop("mask_token_id")),
                      r"missing required key dflash_config.mask_token_id"),
    "unknown projector": (lambda d: edit_config(d, lambda c: c["dflash_config"].update(projector_type="medusa")),
                          r"projector_type='medusa' is not supported"),
    "rope scaling": (lambda d: edit_config(d, lambda c: c.update(rope_scaling={"rope_type": "yarn", "factor": 4})),
                     r"rope_scaling type 'yarn' is not supported"),
    "not json": (lambda d: (d / "config.json").write_text("{oops"), r"config.json is not valid JSON"),
    "no weights": (lambda d: (d / "model.safetensors").unlink(), r"no \*.safetensors weights"),
    "corrupt weights": (lambda d: (d / "model.safetensors").write_bytes(b"\x00" * 64), r"cannot read"),
    "not a draft": (lambda d: edit_config(d, lambda c: [c.pop("block_size"), c.pop("dflash_config")]),
                    r"neither a DFlash/Domino draft"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_checkpoints_fail_naming_the_key(target, tmp_path, case):
    write_dflash(tiny_draft(target), tmp_path)
    corrupt, message = BAD[case]
    corrupt(tmp_path)
    with pytest.raises(CheckpointError, match=message):
        load_draft(tmp_path, target_config=target.config)


def write_bad_d2t(target, directory):
    """A speculators draft whose last draft id maps past the target vocabulary."""
    draft = tiny_draft(target, draft_vocab=40)
    with torch.no_grad():
        draft.d2t[-1] = 1000
    write_speculators(draft, target, directory)
    edit_tensors(directory, lambda t: t.pop("t2d"))


def test_d2t_outside_the_target_vocabulary(target, tmp_path):
    write_bad_d2t(target, tmp_path)
    with pytest.raises(CheckpointError, match="d2t maps ids outside the target vocabulary"):
        load_draft(tmp_path, target_config=target.config)


def test_missing_directory():
    with pytest.raises(CheckpointError, match="is not a directory"):
        load_draft("./no/such/draft")


SPECULATORS_BAD = {
    "no aux layer ids": (lambda c: c.pop("aux_hidden_state_layer_ids"), r"missing required key aux_hidden_state_layer_ids"),
    "no layer config": (lambda c: c.pop("transformer_layer_config"), r"missing required key transformer_layer_config"),
    "no hidden size": (lambda c: c["transformer_layer_config"].pop("hidden_size"),
                       r"missing required key transformer_layer_config.hidden_size"),
    "no mask token": (lambda c: c.pop("mask_token_id"), r"missing required key mask_token_id"),
    "no block size": (lambda c: c.pop("block_size"), r"missing required key block_size"),
}


@pytest.mark.parametrize("layout", ["speculators", "speculators-domino"])
@pytest.mark.parametrize("case", sorted(SPECULATORS_BAD))
def test_bad_speculators_configs_fail_naming_the_key(target, tmp_path, layout, case):
    draft = tiny_draft(target, block_size=4)
    LAYOUTS[layout](draft, target, tmp_path)
    corrupt, message = SPECULATORS_BAD[case]
    edit_config(tmp_path, corrupt)
    with pytest.raises(CheckpointError, match=message):
        load_draft(tmp_path, target_config=target.config)


def test_unknown_layout_name_is_refused_naming_the_known_ones():
    with pytest.raises(CheckpointError, match=r"unknown draft layout 'medusa' \(expected one of \['dflash', "):
        parse_draft_config(HUANG2020_QWEN3_4B_CONFIG, {}, "medusa")


# ---- pre-flight and load_draft: one ordered check, one first error (issue 19) ---------------------

def _dflash_then(corrupt):
    return lambda target, d: (write_dflash(tiny_draft(target), d), corrupt(d))


D2T = r"d2t maps ids outside the target vocabulary \[0, 96\): range \[\d+, 1039\]"
# Every BAD case, the d2t range (pre-flight used to skip it), and two faults at once (pre-flight used
# to check the tensors before the target, so it named the other fault).
SAME_FIRST_ERROR = {
    **{case: (_dflash_then(corrupt), message) for case, (corrupt, message) in BAD.items()},
    "d2t out of range": (write_bad_d2t, D2T),
    "d2t out of range, mis-shaped tensor": (
        lambda target, d: (write_bad_d2t(target, d), BAD["mis-shaped tensor"][0](d)), BAD["mis-shaped tensor"][1]),
    "layer id out of range, missing tensor": (
        _dflash_then(lambda d: (BAD["layer id out of range"][0](d), BAD["missing tensor"][0](d))),
        BAD["layer id out of range"][1]),
    "no config.json": (_dflash_then(lambda d: (d / "config.json").unlink()), r"has no config.json"),
}


@pytest.mark.parametrize("case", sorted(SAME_FIRST_ERROR))
def test_preflight_and_load_draft_fail_with_the_same_first_error(target, tiny_pair, tmp_path, case):
    """Both run `check_draft`; pre-flight's message is load_draft's behind the config key."""
    from transformers import AutoConfig

    target_config = AutoConfig.from_pretrained(tiny_pair[0])  # tiny_pair's target has `target`'s shapes
    write, message = SAME_FIRST_ERROR[case]
    write(target, tmp_path / "draft")
    with pytest.raises(CheckpointError, match=message) as loading:
        load_draft(tmp_path / "draft", target_config=target_config)
    with pytest.raises(ConfigError) as preflight:
        check_models(job_config(tiny_pair, tmp_path / "in.parquet", tmp_path / "out",
                                **{"draft.source": tmp_path / "draft"}))
    assert str(preflight.value) == f"config key draft.source={str(tmp_path / 'draft')!r}: {loading.value}"


@pytest.fixture
def hub_server():
    """A hub on 127.0.0.1: `GET /{repo}/resolve/main/{file}` of the directory `hub_server.files`, with `Range:
    bytes=a-b` answered 206 and those bytes (as the hub's CDN does), without it 200 and the whole file. Records
    `(file, range header)` per request. The real `_hub_range` runs against it: only its HTTP is local."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    state = SimpleNamespace(files=None, requests=[])

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            repo_and_file = self.path.split("/resolve/main/", 1)
            path = state.files / repo_and_file[-1] if len(repo_and_file) == 2 else None
            state.requests.append((repo_and_file[-1], self.headers.get("range")))
            if path is None or not path.is_file():
                self.send_error(404)
                return
            data, wanted = path.read_bytes(), self.headers.get("range")
            if wanted:
                first, last = (int(x) for x in wanted.removeprefix("bytes=").split("-"))
                self.send_response(206)
                self.send_header("Content-Range", f"bytes {first}-{last}/{len(data)}")
                data = data[first:last + 1]
            else:
                self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):  # quiet
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    state.endpoint = f"http://127.0.0.1:{server.server_address[1]}"
    yield state
    server.shutdown()
    server.server_close()


def fake_hub(monkeypatch, directory, server):
    """Serve `directory` as a hub repo to `open_draft`: config.json and the safetensors header from the files
    (huggingface_hub's own calls, replaced), the tensors' byte ranges by real HTTP from `server` (the endpoint
    set as HF_ENDPOINT sets it when huggingface_hub is imported)."""
    import huggingface_hub
    import huggingface_hub.constants as hf_constants
    from huggingface_hub.utils import SafetensorsFileMetadata, SafetensorsRepoMetadata, TensorInfo

    raw = (directory / "model.safetensors").read_bytes()
    header = json.loads(raw[8:8 + int.from_bytes(raw[:8], "little")])
    header.pop("__metadata__", None)
    tensors = {k: TensorInfo(dtype=v["dtype"], shape=v["shape"], data_offsets=tuple(v["data_offsets"]))
               for k, v in header.items()}
    meta = SafetensorsRepoMetadata(metadata=None, sharded=False, weight_map={k: "model.safetensors" for k in tensors},
                                   files_metadata={"model.safetensors": SafetensorsFileMetadata({}, tensors)})
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", lambda repo, name: str(directory / name))
    monkeypatch.setattr(huggingface_hub, "get_safetensors_metadata", lambda repo: meta)
    monkeypatch.setattr(hf_constants, "ENDPOINT", server.endpoint)
    monkeypatch.setattr(hf_constants, "HUGGINGFACE_CO_URL_TEMPLATE",
                        server.endpoint + "/{repo_id}/resolve/{revision}/{filename}")
    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", False)  # the tests' default; only 127.0.0.1 is reached
    server.files, server.requests[:] = directory, []
    return server.requests


def test_hub_tensors_come_by_range_requests_equal_to_the_file(target, tmp_path, monkeypatch, hub_server):
    """Every tensor of a hub draft read by real HTTP range requests (two per tensor: the header's length, then
    its bytes) equals the file's, and nothing asked for the whole file.
    Fails if the range is not honoured: checked by making `_hub_range` send no `range` header (CheckpointError)."""
    from domino_ray.spec_decode.checkpoint_sources import open_draft

    write_speculators(tiny_draft(target, draft_vocab=40), target, tmp_path)
    requests = fake_hub(monkeypatch, tmp_path, hub_server)
    files = open_draft("Eros483/Tiny-Domino")
    values = files.read(sorted(files.header))
    expected = load_file(str(tmp_path / "model.safetensors"))
    assert sorted(values) == sorted(expected) and all(torch.equal(values[k], expected[k]) for k in expected)
    assert len(requests) == 2 * len(expected) - sum(v.numel() == 0 for v in expected.values())
    assert all(name == "model.safetensors" and wanted and wanted.startswith("bytes=") for name, wanted in requests)


def test_preflight_reads_a_hub_draft_without_its_weights(target, tiny_pair, tmp_path, monkeypatch, hub_server):
    """A hub id: config.json, the headers, then only d2t's bytes ([Vd] int64) by real HTTP range requests; a
    bad map gives load_draft's error. Fails if the weights are fetched whole: checked by making `_hub_range` send
    no `range` header (a deserializing error instead of the d2t one)."""
    write_bad_d2t(target, tmp_path / "bad")
    with pytest.raises(CheckpointError, match=D2T) as loading:
        load_draft(tmp_path / "bad", target_config=target.config)
    job = job_config(tiny_pair, tmp_path / "in.parquet", tmp_path / "out", **{"draft.source": "Eros483/Tiny-Domino"})
    requests = fake_hub(monkeypatch, tmp_path / "bad", hub_server)
    with pytest.raises(ConfigError) as preflight:
        check_models(job)
    assert str(preflight.value) == f"config key draft.source='Eros483/Tiny-Domino': {loading.value}"
    spans = [[int(x) for x in wanted.removeprefix("bytes=").split("-")] for _, wanted in requests]
    assert [last + 1 - first for first, last in spans] == [8, 40 * 8]  # the header's length, then d2t
    write_speculators(tiny_draft(target, draft_vocab=40), target, tmp_path / "good")
    fake_hub(monkeypatch, tmp_path / "good", hub_server)
    assert check_models(job) == 4
