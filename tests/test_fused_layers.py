"""Our Llama-family layer forward (fused projections) computes what HF's layer computes."""

import pytest
import torch
from torch import nn

from domino_ray.engine.request import Request
from domino_ray.engine.core import SpecEngine
from domino_ray.kv import pools as kv_cache
from domino_ray.target import forward as target_forward
from domino_ray.target.fused_layers import FusedLayer, fuse_layers, fuse_linears
from domino_ray.kv.pools import KVPool, StepKeys, query_limits
from domino_ray.target.packed_linear import pack_linears
from domino_ray.target.forward import RowAttention, install, rotary_table, run_decoder
from domino_ray.spec_decode.proposer import DominoProposer
from domino_ray.sample.params import SamplingParams
from tiny_models import hf_greedy, ragged_prompts, tiny_draft, tiny_target

FAMILIES = {"qwen3": {}, "llama": {}, "qwen2": {},  # Qwen2: q/k/v biases
            "llama-biased": {"attention_bias": True, "mlp_bias": True},
            "qwen3-d16": {"head_dim": 16}, "llama-d16": {"head_dim": 16}}  # fp32 on CPU: our rotary op too


def family(name: str, dtype=torch.float32):
    return tiny_target(name.split("-")[0], dtype=dtype, **FAMILIES[name])


BLOCK = 8


def scattered_tables(rows: int, blocks_per_row: int, seed: int = 0) -> torch.Tensor:
    """Block tables `[rows, nb]` naming blocks 1.. in a shuffled order (block 0 is the null block): rows' keys
    interleaved through the pool, as a paged engine's rows are."""
    g = torch.Generator().manual_seed(seed)
    return (1 + torch.randperm(rows * blocks_per_row, generator=g)).view(rows, blocks_per_row).to(torch.int32)


def forward_both(target, rows: int, prompt: int, width: int, runs=None):
    """The decoder over HF's layers and over `fuse_layers`, prefill then one decode step of `width` positions, each
    into its own paged KV pool (the same shuffled block tables; ragged prompts of `prompt - row % 3` tokens): (hidden
    states, KV pool, tables, prompt lengths) of each. `runs`: instead, (layers, whether a `FusedLayer` may run a decode
    step as our one op) pairs to run."""
    cfg, decoder = target.config, target.get_decoder()
    install(target)
    g = torch.Generator().manual_seed(0)
    lengths = [prompt - row % 3 for row in range(rows)]
    prompt_ids = torch.randint(0, cfg.vocab_size, (1, sum(lengths)), generator=g)
    step_ids = torch.randint(0, cfg.vocab_size, (rows, width), generator=g)
    tables = scattered_tables(rows, 64 // BLOCK)
    results = []
    for layers, native in runs or ((decoder.layers, False), (fuse_layers(decoder), False)):
        for layer in layers:
            if isinstance(layer, FusedLayer):
                layer.native = native
        kv = KVPool(cfg.num_hidden_layers, 1 + tables.numel(), BLOCK, cfg.num_key_value_heads, cfg.head_dim,
                    torch.float32, "cpu")
        positions = torch.cat([torch.arange(m) for m in lengths])[None]  # [1, N]: the prompts back to back
        blocks = torch.cat([tables[row, torch.arange(m) // BLOCK] for row, m in enumerate(lengths)]).long()
        with torch.inference_mode():
            prefill = RowAttention(kv, kv.flat_index_of(blocks, positions[0] % BLOCK), prefill_lengths=tuple(lengths),
                                   prefill_offsets=(0,) * rows, prefill_tables=tuple(tables[row:row + 1]
                                                                                      for row in range(rows)))
            first, _ = run_decoder(decoder, layers, prompt_ids, positions, prefill, ())
            positions = torch.tensor(lengths)[:, None] + torch.arange(width)  # [rows, W]
            limits = query_limits(positions + 1, cfg.num_attention_heads // cfg.num_key_value_heads)
            step = RowAttention(kv, kv.flat_index(tables, positions), StepKeys(tables, 64), limits)
            second, taps = run_decoder(decoder, layers, step_ids, positions, step, (2, 0, 2))  # tap layers as listed
        results.append(((first, second, taps), kv))
    return results


@pytest.mark.parametrize("name", FAMILIES)
def test_fused_layers_compute_what_hf_layers_compute(name):
    target = family(name)
    (hf_out, hf_kv), (ours_out, ours_kv) = forward_both(target, rows=5, prompt=7, width=3)
    assert all(isinstance(layer, FusedLayer) for layer in fuse_layers(target.get_decoder()))
    # fp32 through 4 layers; only the fused GEMMs' summation order may differ
    for hf, ours in zip(hf_out, ours_out):
        torch.testing.assert_close(ours, hf, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ours_kv.all_keys, hf_kv.all_keys, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ours_kv.all_values, hf_kv.all_values, rtol=1e-5, atol=1e-5)
    tables = scattered_tables(5, 64 // BLOCK)
    for row in range(5):  # each row's positions below its prompt + the step's 3 written, nothing past them
        keys, _ = ours_kv.gather(1, tables[row:row + 1], 64)  # [1, Hkv, 64, D]
        held = 7 - row % 3 + 3
        assert keys[:, :, :held].abs().sum(-1).gt(0).all() and keys[:, :, held:].abs().sum() == 0
    assert ours_kv.all_keys[:, 0].abs().sum() == 0  # the null block: no real row writes there


@pytest.mark.parametrize("all_layers", [True, False])
@pytest.mark.parametrize("width", [1, 3])
@pytest.mark.parametrize("name", FAMILIES)
def test_a_decode_step_as_our_one_op_computes_what_hf_layers_compute(name, width, all_layers, monkeypatch):
    """`FusedLayer`'s decode steps as `decode_layer` (packed weights, our CPU ops, ragged rows over shuffled blocks), all layers in one
    `decode_layers` call or each on its own, against HF's layers and against the same fused layers in Python (hidden
    states, the taps of layers 2, 0 and 2, the KV written)."""
    target = family(name)
    decoder = target.get_decoder()
    layers = fuse_layers(decoder)
    assert pack_linears(layers) > 0
    native_calls, one_op_calls = [], []
    forward, one_op_args = FusedLayer._native_forward, target_forward.one_op_args
    monkeypatch.setattr(FusedLayer, "_native_forward",
                        lambda self, *a: native_calls.append(out := forward(self, *a)) or out)
    monkeypatch.setattr(target_forward, "one_op_args",
                        lambda *a: one_op_calls.append(args := one_op_args(*a) if all_layers else None) or args)
    runs = ((decoder.layers, False), (layers, False), (layers, True))
    (hf_out, hf_kv), (python_out, python_kv), (ours_out, ours_kv) = forward_both(
        target, rows=5, prompt=7, width=width, runs=runs)
    ran_as_one_op = [args is not None for args in one_op_calls]  # six forwards: a prefill and a decode step each
    if all_layers:  # the decode step only, every layer in one call
        assert ran_as_one_op == [False] * 5 + [True] and not native_calls
    else:
        assert len(native_calls) == len(layers) and all(out is not None for out in native_calls)
    for reference, kv in ((hf_out, hf_kv), (python_out, python_kv)):
        for theirs, ours in zip(reference, ours_out):
            torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ours_kv.all_keys, kv.all_keys, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ours_kv.all_values, kv.all_values, rtol=1e-5, atol=1e-5)


def test_our_one_op_follows_weights_changed_in_place():
    """`decode_layer`'s arguments are built once per layer; a weight changed in place (an optimizer step) is packed
    again and used: the one op still computes what the Python forward computes."""
    target = family("qwen3-d16")
    layers = fuse_layers(target.get_decoder())
    pack_linears(layers)
    runs = ((layers, False), (layers, True))
    (before, _), (ours_before, _) = forward_both(target, rows=3, prompt=5, width=1, runs=runs)
    with torch.no_grad():
        for layer in target.get_decoder().layers:
            layer.mlp.down_proj.weight.mul_(2.0)
            layer.self_attn.k_proj.weight.add_(0.1)  # a view of the fused q/k/v weight
    (python, _), (ours, _) = forward_both(target, rows=3, prompt=5, width=1, runs=runs)
    assert not torch.allclose(python[1], before[1], rtol=1e-3, atol=1e-3)  # the change reaches the step's output
    for theirs, mine in zip(python, ours):
        torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("width", [1, 3])
def test_the_draft_layers_as_our_one_op_compute_what_their_python_forward_computes(width, monkeypatch):
    """Where the engine packed the draft's linears, the draft block's layers run as `decode_layer` (q/k/v and gate/up
    fused copies): the block's hidden states and the keys and values it writes are the Python layers', for ragged rows
    over shuffled blocks; a weight changed in place reaches the op."""
    target = family("qwen3-d16")
    draft = tiny_draft(target, block_size=4)
    pack_linears(draft)
    proposer = DominoProposer(draft, target)
    rows, g = 3, torch.Generator().manual_seed(0)
    tables = scattered_tables(rows, 64 // BLOCK)
    proposer.allocate(1 + tables.numel(), BLOCK, 64)
    taps = torch.randn(rows, 9, len(draft.config.target_layer_ids) * target.config.hidden_size, generator=g)
    anchor = torch.randint(0, target.config.vocab_size, (rows,), generator=g)
    lens = torch.tensor([5, 9, 7])
    with torch.inference_mode():
        proposer.append_context(tables, taps, torch.zeros(rows, dtype=torch.long))
    seen = []
    draft_tokens = draft.draft_tokens
    monkeypatch.setattr(draft, "draft_tokens", lambda hidden, *args: seen.append(hidden) or draft_tokens(hidden, *args))
    native_layers = proposer._native_layers

    def block(native: bool):
        monkeypatch.setattr(proposer, "_native_layers", native_layers if native else lambda: None)
        with torch.inference_mode():
            proposer.propose(rows, anchor, lens, StepKeys(tables, 32), width)
        return seen[-1], [b.clone() for b in (*proposer.kv.keys, *proposer.kv.values)]

    python, ours = block(False), block(True)
    assert proposer._native is not None  # our op ran
    for theirs, mine in ((python[0], ours[0]), *zip(python[1], ours[1])):
        torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        draft.layers[0].mlp.down_proj.weight.mul_(2.0)
        draft.layers[1].self_attn.k_proj.weight.add_(0.1)
    changed_python, changed_ours = block(False), block(True)
    assert not torch.allclose(changed_python[0], python[0], rtol=1e-3, atol=1e-3)
    for theirs, mine in ((changed_python[0], changed_ours[0]), *zip(changed_python[1], changed_ours[1])):
        torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["qwen3-d16", "qwen3"])  # our rotary op (head dim 16), torch's rotary math
def test_the_draft_context_update_as_our_one_op_writes_what_its_python_forward_writes(name, monkeypatch):
    """Where the engine packed the draft's `fc`, a context update of a few positions (a step's, the ring's) runs as
    `context_update`: every layer's keys and values written for rows at their own offsets are the Python path's
    (`project_context`, `context_keys_values`), and only theirs; a changed `fc` weight reaches the op."""
    target = family(name)
    draft = tiny_draft(target, block_size=4)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # norms of their own (built as ones): each layer's k_norm must be its own
        for norm in [draft.hidden_norm] + [layer.self_attn.k_norm for layer in draft.layers]:
            norm.weight.copy_(torch.rand(norm.weight.shape, generator=g) + 0.5)
    pack_linears(draft)
    proposer = DominoProposer(draft, target)
    tables = scattered_tables(4, 64 // BLOCK)
    proposer.allocate(1 + tables.numel(), BLOCK, 64)
    taps = torch.randn(2, 3, len(draft.config.target_layer_ids) * target.config.hidden_size, generator=g)  # [b, q, F]
    offsets = torch.tensor([7, 20])
    native_context, calls = proposer._native_context, []
    monkeypatch.setattr(torch.ops.domino_ray, "context_update", lambda *a, op=torch.ops.domino_ray.context_update:
                        calls.append(1) or op(*a))

    def update(native: bool):
        monkeypatch.setattr(proposer, "_native_context", native_context if native else lambda: None)
        for buffer in (proposer.kv.all_keys, proposer.kv.all_values):
            buffer.fill_(float("nan"))
        with torch.inference_mode():
            proposer.append_context(tables[1:3], taps, offsets)  # rows 1 and 2
        return proposer.kv.all_keys.clone(), proposer.kv.all_values.clone()

    python, ours = update(False), update(True)
    assert len(calls) == 1
    for theirs, mine in zip(python, ours):  # [L, N, Hkv, bs, D]; fp32, one GEMM either way
        written = ~theirs.isnan()
        assert written.sum() == theirs.shape[0] * 2 * theirs.shape[2] * 3 * theirs.shape[4]  # 2 rows x 3 positions
        assert torch.equal(written, ~mine.isnan())
        for row, offset in ((1, 7), (2, 20)):
            for p in range(offset, offset + 3):
                assert written[:, tables[row, p // BLOCK], :, p % BLOCK].all()
        torch.testing.assert_close(mine[written], theirs[written], rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        draft.fc.weight.add_(0.1)  # (a scale alone would not show: `hidden_norm` follows)
    changed_python, changed_ours = update(False), update(True)
    assert not torch.allclose(changed_python[1].nan_to_num(), python[1].nan_to_num(), rtol=1e-3, atol=1e-3)
    for theirs, mine in zip(changed_python, changed_ours):
        torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-5, equal_nan=True)


@pytest.mark.parametrize("name", ["qwen2", "llama-biased"])
def test_engine_greedy_equals_hf_generate_on_fused_families(name):
    target = family(name, dtype=torch.float64)
    prompts = ragged_prompts(5, seed=4)
    engine = SpecEngine(target, None, max_rows=3)
    out = engine.generate([Request(i, p, SamplingParams(max_new_tokens=10)) for i, p in enumerate(prompts)])
    assert [c.token_ids for c in out] == [hf_greedy(target, p, 10) for p in prompts]


def test_fuse_linears_keeps_each_layer_working_over_one_weight():
    torch.manual_seed(0)
    linears = [nn.Linear(6, n, bias=True) for n in (4, 2, 3)]
    x = torch.randn(5, 6)
    before = [m(x) for m in linears]
    fused = fuse_linears(*linears)
    torch.testing.assert_close(fused(x), torch.cat(before, -1))
    for m, out in zip(linears, before):
        assert torch.equal(m(x), out)
        assert m.weight.untyped_storage().data_ptr() == fused.weight.untyped_storage().data_ptr()  # a view
    with torch.no_grad():
        linears[1].weight.mul_(2)  # an in-place change of one reaches the fused weight
    torch.testing.assert_close(fused(x)[:, 4:6], 2 * before[1] - linears[1].bias, rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="bias"):
        fuse_linears(nn.Linear(6, 2, bias=True), nn.Linear(6, 2, bias=False))


def test_a_fused_target_still_saves_and_loads_as_hf_model(tmp_path):
    from transformers import AutoModelForCausalLM

    target = family("qwen2")
    fuse_layers(target.get_decoder())  # q/k/v and gate/up weights now share storage
    target.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    saved, reloaded = target.state_dict(), loaded.state_dict()
    assert saved.keys() == reloaded.keys() and all(torch.equal(saved[k], reloaded[k]) for k in saved)


@pytest.mark.parametrize("projection", ["q_proj", "v_proj"])
def test_fused_layers_are_built_once_per_decoder_and_again_after_a_weight_is_replaced(projection):
    target = family("qwen3")
    decoder = target.get_decoder()
    layers = fuse_layers(decoder)
    assert fuse_layers(decoder) is layers  # a second engine on the target shares them
    attn = decoder.layers[1].self_attn
    old = getattr(attn, projection).weight
    replaced = nn.Parameter(2 * old.detach())  # e.g. load_state_dict(assign=True)
    setattr(getattr(attn, projection), "weight", replaced)
    rebuilt = fuse_layers(decoder)
    assert rebuilt is not layers
    assert torch.equal(rebuilt[1].qkv.weight, torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]))


def test_layers_outside_the_family_or_with_hooks_keep_hf_forward():
    target = family("llama")
    decoder = target.get_decoder()
    decoder.layers[0].mlp.register_forward_hook(lambda *a: None)
    layer_class = type(decoder.layers[1])
    decoder.layers[1].__class__ = type("CustomDecoderLayer", (layer_class,), {})  # a subclass may change forward
    layers = fuse_layers(decoder)
    assert layers[0] is decoder.layers[0] and layers[1] is decoder.layers[1]
    assert all(isinstance(layer, FusedLayer) for layer in layers[2:])


@pytest.mark.parametrize("op", ["ours", "torch"])
def test_kv_write_puts_each_row_at_its_own_positions(op, monkeypatch):
    ran = []
    if op == "torch":  # the path for other dtypes and devices, and where our kernels do not build
        monkeypatch.setattr(kv_cache, "kv_write", lambda *args: False)
    else:
        ours = kv_cache.kv_write
        monkeypatch.setattr(kv_cache, "kv_write", lambda *args: ran.append(ours(*args)) or ran[-1])
    kv = KVPool(2, 9, 8, 2, 3, torch.float32, "cpu")
    tables = scattered_tables(4, 2)[1:]                     # rows 1..3 of 4, 2 blocks of 8 each
    index = torch.tensor([[5, 8], [0, 1], [9, 15]])         # [b, q]: across a block boundary too
    keys = torch.randn(3, 2, 2, 3)                          # [b, Hkv, q, D]
    kv.write(1, kv.flat_index(tables, index), keys, -keys)
    expected = torch.zeros(9, 2, 8, 3)
    for b in range(3):
        for i in range(2):
            p = int(index[b, i])
            expected[tables[b, p // 8], :, p % 8] = keys[b, :, i]
    assert torch.equal(kv.keys[1], expected) and torch.equal(kv.values[1], -expected)
    assert kv.keys[0].abs().sum() == 0
    assert ran == ([True] if op == "ours" else [])  # our op wrote it, not torch's fallback


def test_the_rotary_table_is_the_decoders_own_rotary_embedding():
    """The engine looks a step's cos/sin up in a table its decoder's rotary embedding computed once; a rope type whose
    values depend on more than the position (dynamic NTK scaling) gets no table."""
    decoder = family("qwen3").get_decoder()
    cos, sin = rotary_table(decoder, 64, torch.float32)  # [T, D]
    positions = torch.tensor([[0, 5, 63], [17, 1, 40]])
    want_cos, want_sin = decoder.rotary_emb(torch.empty(0), positions)
    # the same fp32 math over other lengths: one ulp where a length's tail leaves the vectorized loop
    torch.testing.assert_close(cos[positions], want_cos, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(sin[positions], want_sin, rtol=1e-6, atol=1e-6)
    dynamic = tiny_target("llama", rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0})
    assert rotary_table(dynamic.get_decoder(), 64, torch.float32) is None
