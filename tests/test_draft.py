"""The Domino head: the stepwise GRU (O(K)) equals rerunning the GRU over the whole prefix (O(K^2),
the reference test harness), the GRU is PyTorch's bias-free cell as the papers define it, and its fp32 weights are
made once."""

import pytest
import torch
from torch.overrides import TorchFunctionMode

from domino_ray.spec_decode import draft as draft_module
from tiny_models import tiny_draft, tiny_target
from oracles import corrected_logits_full_prefix


def decisive_draft(seed: int, **draft_kwargs):
    """A tiny draft whose corrections are decisive (so a test sees them), the target's embedding and head, and six rows
    of block hidden states `[6, 8, C]` with their anchors."""
    target = tiny_target("qwen3", seed=seed)
    draft = tiny_draft(target, block_size=8, **draft_kwargs)
    with torch.no_grad():
        draft.embed_proj[2].weight.mul_(40.0)
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(6, 8, 32, generator=g, dtype=torch.float64)
    anchor = torch.randint(0, 95, (6,), generator=g)
    return draft, target.get_input_embeddings(), target.get_output_embeddings(), hidden, anchor


@pytest.mark.parametrize("shift_label,num_uncorrected,draft_vocab", [
    (True, 1, None), (True, 0, None), (False, 1, None), (True, 2, 40), (False, 0, 40)])
def test_stepwise_gru_equals_full_prefix(shift_label, num_uncorrected, draft_vocab):
    draft, embed, head, hidden, anchor = decisive_draft(51, shift_label=shift_label, num_uncorrected=num_uncorrected,
                                                        draft_vocab=draft_vocab)
    k = draft.config.max_draft_tokens
    with torch.no_grad():
        drafts = draft.draft_tokens(hidden, anchor, k, embed, head)                    # [6, K]
        slow = corrected_logits_full_prefix(draft, hidden, anchor, drafts, embed, head)  # [6, K, Vd]
        base = draft.base_logits(draft.select_draft_hidden(hidden, k), head)
    assert torch.equal(drafts, draft.to_target_ids(slow.argmax(-1)))
    corrected = draft.to_target_ids(base.argmax(-1)) != drafts
    assert not corrected[:, :num_uncorrected].any()      # the first P drafts are uncorrected
    assert corrected[:, num_uncorrected:].any()          # the head changes later ones


@pytest.mark.parametrize("num_uncorrected,draft_vocab", [(1, None), (0, None), (2, 40)])
def test_a_narrower_width_drafts_the_prefix_of_the_widest(num_uncorrected, draft_vocab):
    """Every width W drafts the first W tokens of the widest draft, W <= P (uncorrected drafts alone, no GRU) too."""
    draft, embed, head, hidden, anchor = decisive_draft(53, num_uncorrected=num_uncorrected, draft_vocab=draft_vocab)
    k = draft.config.max_draft_tokens
    with torch.no_grad():
        widest = draft.draft_tokens(hidden, anchor, k, embed, head)  # [6, K]
        for w in range(1, k + 1):
            assert torch.equal(draft.draft_tokens(hidden, anchor, w, embed, head), widest[:, :w]), w


@pytest.mark.parametrize("num_uncorrected,draft_vocab,rows", [(1, None, 1), (2, 40, 3), (0, None, 6)])
def test_the_corrections_as_our_op_are_the_loops_drafts(num_uncorrected, draft_vocab, rows, monkeypatch):
    """Where the engine packed the draft's linears (fp32 CPU), `draft_tokens`' corrections run as our op: the loop's
    own calls from C++ (so its drafts exactly, at every width), with a pruned vocabulary (`d2t`) too. Decisive
    corrections, so a wrong state or gate would show."""
    from domino_ray.target.packed_linear import pack_linears

    draft, embed, head, hidden, anchor = decisive_draft(52, num_uncorrected=num_uncorrected, draft_vocab=draft_vocab)
    draft, hidden, anchor = draft.float(), hidden[:rows].float(), anchor[:rows]
    with torch.no_grad():  # the GRU's state decisive too: the target's embeddings are small (std 0.02)
        draft.prefix_gru.weight_ih_l0.mul_(30.0)
        draft.embed_proj[0].weight[:, embed.weight.shape[1]:].mul_(10.0)
    assert pack_linears(draft) > 0
    calls, op, one_op_head = [], torch.ops.domino_ray.domino_corrections, draft_module.one_op_head
    monkeypatch.setattr(torch.ops.domino_ray, "domino_corrections", lambda *a: calls.append(1) or op(*a))
    with torch.inference_mode():  # a target of another dtype (fp64 here): the loop, whose casts the op does not make
        draft.draft_tokens(hidden, anchor, draft.config.max_draft_tokens, embed, head)
    assert not calls
    embed, head = embed.float(), head.float()

    def drafts(width: int, ours: bool) -> torch.Tensor:
        monkeypatch.setattr(draft_module, "one_op_head", one_op_head if ours else lambda *a: False)
        with torch.inference_mode():
            return draft.draft_tokens(hidden, anchor, width, embed, head)

    k = draft.config.max_draft_tokens
    for width in range(num_uncorrected + 1, k + 1):
        assert torch.equal(drafts(width, ours=True), drafts(width, ours=False)), width
    assert len(calls) == k - num_uncorrected
    base = draft.to_target_ids(draft.base_logits(draft.select_draft_hidden(hidden, k), head).argmax(-1))
    assert (drafts(k, ours=True) != base).any()  # the corrections change drafts


def test_gru_is_the_bias_free_cell_of_the_papers():
    target = tiny_target("qwen3", seed=52)
    gru = tiny_draft(target).prefix_gru
    x = torch.randn(3, 5, 32, dtype=torch.float64)
    w_ir, w_iz, w_in = gru.weight_ih_l0.chunk(3)
    w_hr, w_hz, w_hn = gru.weight_hh_l0.chunk(3)
    h = torch.zeros(3, gru.hidden_size, dtype=torch.float64)
    for t in range(5):
        r = torch.sigmoid(x[:, t] @ w_ir.T + h @ w_hr.T)
        z = torch.sigmoid(x[:, t] @ w_iz.T + h @ w_hz.T)
        n = torch.tanh(x[:, t] @ w_in.T + r * (h @ w_hn.T))
        h = (1 - z) * n + z * h
    with torch.no_grad():
        _, state = gru(x)
    assert torch.allclose(state[0], h)


def test_fused_context_keys_values_equal_each_layers_own():
    from domino_ray.spec_decode.draft import context_key_value_weights, context_keys_values

    target = tiny_target()
    draft = tiny_draft(target, block_size=4)
    context = torch.randn(3, 5, draft.config.hidden_size, dtype=torch.float64)
    cos, sin = draft.rope(torch.arange(5).expand(3, 5), torch.float64)
    keys, values = context_keys_values(context, context_key_value_weights(draft.layers), draft.config.rms_norm_eps,
                                       draft.config.head_dim, cos, sin)  # [L, b, Hkv, q, D]
    for i, layer in enumerate(draft.layers):
        k, v = layer.self_attn.key_value(context, cos, sin)
        # One fused GEMM vs each layer's own: different shapes may take different BLAS kernels (summation
        # order), so equal up to float64 rounding (eps 2.2e-16 over sums of ~C terms), not bitwise.
        assert torch.allclose(keys[i], k, rtol=1e-12, atol=1e-12)
        assert torch.allclose(values[i], v, rtol=1e-12, atol=1e-12)


class Conversions(TorchFunctionMode):
    """Counts the float32 copies made of `weights` (`.float()`, `.to(...)`): a result that is a new tensor."""

    def __init__(self, weights):
        super().__init__()
        self.weights, self.count = weights, 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        source = args[0] if args else None
        self.count += any(source is w for w in self.weights) and isinstance(out, torch.Tensor) and out is not source \
            and out.dtype == torch.float32 and out.shape == source.shape
        return out


@pytest.mark.parametrize("dtype,copies", [(torch.bfloat16, 1), (torch.float32, 0)])
def test_the_loops_fp32_gru_weights_are_made_once_and_again_after_a_change(dtype, copies, monkeypatch):
    """The eager loop's fp32 GRU weights: bf16 ones converted once over several draft calls (not at every step: ~44 MB
    a step for the 4B draft), fp32 ones used as they are; the drafts those of a `.float()` per call (the loop as it
    was), before and after a weight changes in place, which converts again (no stale copy). Fails if the copies are made
    per call or kept past the change."""
    draft, embed, head, hidden, anchor = decisive_draft(54)
    draft, embed, head, hidden = draft.to(dtype), embed.to(dtype), head.to(dtype), hidden.to(dtype)
    gru, k = draft.prefix_gru, draft.config.max_draft_tokens
    weights = gru.weight_ih_l0, gru.weight_hh_l0

    def drafts(per_call: bool = False) -> torch.Tensor:  # [6, K]
        with monkeypatch.context() as m, torch.inference_mode():  # the engine's mode
            if per_call:
                m.setattr(draft, "gru_weights_fp32", lambda: (weights[0].float(), weights[1].float()))
            return draft.draft_tokens(hidden, anchor, k, embed, head)

    counter = Conversions(weights)
    with counter:
        before = [drafts() for _ in range(3)]
    assert counter.count == 2 * copies  # w_ih and w_hh, once each
    assert all(torch.equal(d, drafts(per_call=True)) for d in before)
    with torch.no_grad():
        gru.weight_ih_l0.mul_(30.0)  # the GRU's state decisive: the drafts change
    with counter:
        after = drafts()
    assert counter.count == 4 * copies and torch.equal(after, drafts(per_call=True))
    assert not torch.equal(after, before[0])
