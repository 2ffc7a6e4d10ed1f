"""The shipped demo pair (domino_ray/assets/demo): it loads through the real loaders, the draft is a trained
Domino draft in the HF/DFlash layout, greedy speculative output equals target-only output token for token
on held-out prompts, and the assets stay within budget."""

import json

import pyarrow.parquet as pq
import pytest
import torch

from domino_ray.config import DEMO_ASSETS, load_config
from domino_ray.engine.request import Request
from domino_ray.engine.core import SpecEngine
from domino_ray.target.loading import decode, encode_prompt, stop_token_ids
from domino_ray.spec_decode.proposer import DominoProposer
from domino_ray.sample.params import SamplingParams
from domino_ray.spec_decode.stats import total_stats
from oracles import corrected_logits_full_prefix
from tiny_models import load_demo_pair

MAX_ASSET_BYTES = 30 * 2**20


@pytest.fixture(scope="module")
def pair():
    return load_demo_pair()


@pytest.fixture(scope="module")
def prompts():
    return pq.read_table(DEMO_ASSETS / "prompts.parquet").to_pandas()


def test_assets_fit_the_budget():
    files = [p for p in DEMO_ASSETS.rglob("*") if p.is_file()]
    assert sum(p.stat().st_size for p in files) <= MAX_ASSET_BYTES
    assert all(p.suffix != ".bin" for p in files)  # safetensors only


def test_default_config_points_at_the_pair():
    cfg = load_config()
    assert cfg.model.source == str(DEMO_ASSETS / "target") and cfg.draft.source == str(DEMO_ASSETS / "draft")
    assert cfg.input.path == str(DEMO_ASSETS / "prompts.parquet")
    assert cfg.model.dtype == "auto" and cfg.model.chat_template is False


def test_prompts_are_held_out(prompts):
    schema = pq.read_schema(DEMO_ASSETS / "prompts.parquet")
    assert [(f.name, str(f.type)) for f in schema] == [("id", "string"), ("prompt", "string")]
    assert 200 <= len(prompts) <= 1000 and prompts["id"].is_unique
    assert all(p.strip() for p in prompts["prompt"])
    corpus = json.loads((DEMO_ASSETS / "corpus.json").read_text())
    held_out = set(corpus["held_out"])
    assert {i.rsplit(":", 1)[0] for i in prompts["id"]} <= held_out
    assert corpus["python"] and corpus["sha256"] and len(held_out) < corpus["num_files"] / 5


def test_target_and_tokenizer(pair):
    target, tokenizer, _ = pair
    assert target.config.model_type == "qwen3" and target.dtype == torch.float32
    eos = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    assert target.config.eos_token_id == eos and eos in stop_token_ids(target, tokenizer)
    assert len(tokenizer) == target.config.vocab_size
    chat = encode_prompt(tokenizer, messages=[{"role": "user", "content": "def add(a, b):"}])
    assert chat[0] == tokenizer.convert_tokens_to_ids("<|im_start|>")


def test_draft_is_a_trained_domino_draft(pair):
    _, tokenizer, draft = pair
    cfg = draft.config
    config_json = json.loads((DEMO_ASSETS / "draft" / "config.json").read_text())
    assert config_json["dflash_config"]["projector_type"] == "domino"  # HF/DFlash layout, as published drafts
    assert cfg.has_head and cfg.shift_label and cfg.num_uncorrected == 1 and cfg.block_size == 8
    assert cfg.mask_token_id == tokenizer.convert_tokens_to_ids("<|mask|>")
    assert (DEMO_ASSETS / "draft" / "training.json").exists()


def test_greedy_speculative_equals_target_only(pair, prompts):
    target, tokenizer, draft = pair
    eos = stop_token_ids(target, tokenizer)
    ids = [encode_prompt(tokenizer, prompt=p, chat_template=False) for p in prompts["prompt"][:6]]
    requests = lambda: [Request(i, p, SamplingParams(max_new_tokens=48)) for i, p in enumerate(ids)]
    baseline = SpecEngine(target, None, max_rows=3, eos_token_ids=eos).generate(requests())
    spec = SpecEngine(target, DominoProposer(draft, target), max_rows=3, eos_token_ids=eos).generate(requests())
    assert [c.token_ids for c in spec] == [c.token_ids for c in baseline]
    assert total_stats(c.stats for c in spec).mean_acceptance_length > 2.0  # trained: well above the untrained ~1.0
    text = decode(tokenizer, baseline[0].token_ids, eos)
    assert text.strip()


def test_trained_draft_training_logits_equal_inference(pair, prompts):
    """On the shipped (trained) draft: the training forward's logits at an anchor equal the inference path's
    (one block from scratch on the prefix, GRU stepped over the true tokens)."""
    from domino_ray.training.data import context_features
    from domino_ray.training.objective import block_logits

    target, tokenizer, draft = pair
    ids = encode_prompt(tokenizer, prompt=prompts["prompt"][7], chat_template=False)
    (done,) = SpecEngine(target, None, max_rows=1).generate([Request(0, ids, SamplingParams(max_new_tokens=40))])
    seq = torch.tensor([ids + done.token_ids])  # [1, T]
    embed, lm_head = target.get_input_embeddings(), target.get_output_embeddings()
    k, bs = draft.config.max_draft_tokens, draft.config.block_size
    anchors = torch.tensor([[len(ids) - 1, len(ids) + 9, len(ids) + 25]])
    with torch.no_grad():
        features = context_features(target, seq, draft.config.target_layer_ids)
        _, final = block_logits(draft, target, features, seq, anchors)
        for a, p in enumerate(anchors[0].tolist()):
            block = embed(torch.tensor([[seq[0, p].item()] + [draft.config.mask_token_id] * (bs - 1)]))
            hidden = draft.block_hidden(features[:, :p], block, torch.arange(p, p + bs)[None],
                                        torch.ones(1, 1, bs, p + bs, dtype=torch.bool))
            reference = corrected_logits_full_prefix(draft, hidden, seq[0, p:p + 1], seq[:, p + 1:p + 1 + k], embed,
                                                           lm_head)
            assert torch.allclose(final[0, a], reference[0], atol=1e-4, rtol=1e-4)
            assert torch.equal(final[0, a].argmax(-1), reference[0].argmax(-1))
