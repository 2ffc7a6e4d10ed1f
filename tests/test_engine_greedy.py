"""Greedy speculative decoding is lossless: token for token what the target alone produces."""

import pytest
import torch

from domino_ray.engine import SpecEngine
from domino_ray.request import Request
from domino_ray.proposer import DominoProposer
from domino_ray.sampling_params import SamplingParams
from tiny_models import hf_greedy, ragged_prompts, tiny_draft, tiny_target

MAX_NEW = 12


@pytest.fixture(scope="module")
def qwen3():
    return tiny_target("qwen3")


@pytest.fixture(scope="module")
def prompts():
    return ragged_prompts(7, seed=3)


@pytest.fixture(scope="module")
def reference(qwen3, prompts):
    return [hf_greedy(qwen3, p, MAX_NEW) for p in prompts]


def run(target, proposer, prompts, max_rows=3, **params):
    engine = SpecEngine(target, proposer, max_rows=max_rows)
    params.setdefault("max_new_tokens", MAX_NEW)
    return engine.generate([Request(i, p, SamplingParams(**params)) for i, p in enumerate(prompts)])


def test_target_only_equals_hf_generate(qwen3, prompts, reference):
    out = run(qwen3, None, prompts)
    assert [c.token_ids for c in out] == reference
    assert all(c.finish_reason == "length" and c.stats.num_spec_tokens == 0 for c in out)


# Block size 1 without shift_label has no draft slot (K = 0): that case is the target-only mode.
DRAFT_LAYOUTS = [(b, shift, p) for b in (1, 2, 4, 8, 16) for shift in (True, False) for p in (0, 1)
                 if shift or b > 1]


@pytest.mark.parametrize("block_size,shift_label,num_uncorrected", DRAFT_LAYOUTS)
def test_domino_draft_equals_target(qwen3, prompts, reference, block_size, shift_label, num_uncorrected):
    draft = tiny_draft(qwen3, block_size=block_size, shift_label=shift_label, num_uncorrected=num_uncorrected)
    out = run(qwen3, DominoProposer(draft, qwen3), prompts)
    assert [c.token_ids for c in out] == reference
    k = block_size if shift_label else block_size - 1
    assert all(c.stats.num_spec_tokens == k for c in out)


@pytest.mark.parametrize("head", [True, False])
def test_pruned_draft_vocabulary_equals_target(qwen3, prompts, reference, head):
    draft = tiny_draft(qwen3, block_size=4, draft_vocab=40, head=head)
    out = run(qwen3, DominoProposer(draft, qwen3), prompts)
    assert [c.token_ids for c in out] == reference


def test_llama_target(prompts):
    llama = tiny_target("llama", seed=5)
    reference = [hf_greedy(llama, p, MAX_NEW) for p in prompts]
    assert [c.token_ids for c in run(llama, None, prompts)] == reference
    draft = tiny_draft(llama, block_size=4)
    assert [c.token_ids for c in run(llama, DominoProposer(draft, llama), prompts)] == reference


def test_fewer_draft_tokens_than_the_block(qwen3, prompts, reference):
    draft = tiny_draft(qwen3, block_size=8)
    out = run(qwen3, DominoProposer(draft, qwen3, num_spec_tokens=3), prompts)
    assert [c.token_ids for c in out] == reference
    assert out[0].stats.num_spec_tokens == 3


def test_max_new_tokens_hit_exactly(qwen3, prompts):
    draft = tiny_draft(qwen3, block_size=8)
    for n in (1, 2, 5, 9):
        out = run(qwen3, DominoProposer(draft, qwen3), prompts, max_new_tokens=n)
        assert all(len(c.token_ids) == n and c.finish_reason == "length" for c in out)


def test_model_max_length_caps_generation(qwen3):
    prompt = list(range(1, 20))
    engine = SpecEngine(qwen3, DominoProposer(tiny_draft(qwen3, block_size=4), qwen3), max_rows=2, max_model_len=25)
    (out,) = engine.generate([Request(0, prompt, SamplingParams(max_new_tokens=50))])
    assert len(out.token_ids) == 25 - len(prompt) and out.finish_reason == "length"
    assert out.token_ids == hf_greedy(qwen3, prompt, 25 - len(prompt))
    with pytest.raises(ValueError, match="limit is 25"):
        engine.add_request(Request(1, list(range(25)), SamplingParams()))


def test_draft_without_slots_is_refused(qwen3):
    with pytest.raises(ValueError, match="num_draft_tokens=0 is out of range"):
        DominoProposer(tiny_draft(qwen3, block_size=1, shift_label=False), qwen3)


@pytest.mark.parametrize("kind", ["qwen3", "llama"])
def test_fused_layers_compute_hf_layers_and_share_their_weights(kind, prompts):
    """Our pass over fused q/k/v and gate/up weights equals HF's own forward (hidden states within float64
    rounding, greedy tokens equal), the stock modules' weights are views of the fused ones (no copy), and HF's
    generate on the installed model is what it was before."""
    from domino_ray.target_forward import RowAttention, install, run_decoder

    target = tiny_target(kind, seed=7)
    before = [hf_greedy(target, p, MAX_NEW) for p in prompts[:3]]
    engine = SpecEngine(target, None, max_rows=3)  # installs: fuses
    for layer in target.model.layers:
        weight, _ = layer.fused_qkv
        assert layer.self_attn.q_proj.weight.data_ptr() == weight.data_ptr()
        assert layer.self_attn.v_proj.weight.untyped_storage().data_ptr() == weight.untyped_storage().data_ptr()
        assert layer.mlp.up_proj.weight.untyped_storage().data_ptr() == layer.fused_gate_up[0].untyped_storage().data_ptr()
    assert [hf_greedy(target, p, MAX_NEW) for p in prompts[:3]] == before
    ids = torch.tensor([prompts[0][:6]])
    positions = torch.arange(6)[None]
    with torch.inference_mode():
        ours, _ = run_decoder(target.model, ids, positions,
                              RowAttention(engine.kv, write_index=positions, prefill_rows=slice(0, 1)), ())
        hf = target.model(input_ids=ids).last_hidden_state
    torch.testing.assert_close(ours, hf, rtol=1e-12, atol=1e-12)  # float64: only summation order differs
    assert [c.token_ids for c in run(target, None, prompts[:3])] == before


def test_other_layer_families_run_hf_layers_unchanged(prompts):
    """A decoder whose layers we do not reproduce (Qwen2: biased q/k/v) keeps HF's layers and still equals HF."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(2)
    target = Qwen2ForCausalLM(Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                          eos_token_id=None, bos_token_id=None, pad_token_id=None)).double().eval()
    target.generation_config.eos_token_id = None
    reference = [hf_greedy(target, [t % 64 for t in p], MAX_NEW) for p in prompts[:3]]
    out = run(target, None, [[t % 64 for t in p] for p in prompts[:3]])
    assert not hasattr(target.model.layers[0], "fused_qkv")
    assert [c.token_ids for c in out] == reference
