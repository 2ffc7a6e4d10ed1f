"""Linear layers over packed weights and our kernel (`target/packed_linear.py`, `backend/csrc/linear.cpp`): the same
function as `nn.Linear`, in place, and the same numbers for a row whatever batch it is in."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from domino_ray.backend import ops
from domino_ray.target.packed_linear import OUR_ROWS, PackedLinear, can_pack, pack_linears

pytestmark = pytest.mark.skipif(not can_pack(nn.Linear(2, 2)), reason="our CPU kernels did not build")

# fp32 sums of 64-96 products of O(1/8) reordered by another kernel: errors ~1e-6 of outputs O(1); 1e-5 leaves
# room, a wrong weight, bias or layout is off by O(1).
TOL = dict(rtol=1e-5, atol=1e-5)


def small_model(seed: int = 0) -> nn.Sequential:
    gen = torch.Generator().manual_seed(seed)
    model = nn.Sequential(nn.Linear(64, 96), nn.SiLU(), nn.Linear(96, 48, bias=False))
    with torch.no_grad():
        for p in model.parameters():  # scaled as trained layers are: outputs O(1), not sums of O(10) terms
            p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
    return model


def test_packed_linear_is_the_same_function_in_place():
    model, reference = small_model(), small_model()
    first = model[0]
    keys = set(model.state_dict())
    assert pack_linears(model) == sum(m.weight.numel() * 4 for m in (model[0], model[2]))  # our panels
    assert model[0] is first and type(first) is PackedLinear and isinstance(first, nn.Linear)
    assert set(model.state_dict()) == keys  # the packed copies are not state
    gen = torch.Generator().manual_seed(1)
    with torch.inference_mode():
        for rows in (1, 3, 16, 17, 33, 144, OUR_ROWS.stop - 1, OUR_ROWS.stop):
            x = torch.randn(rows, 64, generator=gen)
            torch.testing.assert_close(model(x), reference(x), **TOL)
        # [b, q, C] inputs and a strided view: the rows are b*q
        x = torch.randn(4, 5, 128, generator=gen)[..., ::2]
        torch.testing.assert_close(model(x), reference(x), **TOL)


def test_packed_path_is_taken():
    """Within `OUR_ROWS` the output comes from our packed copy: swapped for a packing of twice the weight (the weight
    itself unchanged), the output doubles; beyond, it is `F.linear`."""
    layer = small_model()[0]
    pack_linears(layer)
    x = torch.randn(OUR_ROWS.stop, 64)
    ours = x[:OUR_ROWS.stop - 1]
    with torch.inference_mode():
        before = [layer(part) for part in (x[:1], ours, x)]
        layer.packed_weight = ops.pack_linear(2 * layer.weight)
        torch.testing.assert_close(layer(x[:1]), 2 * before[0] - layer.bias, **TOL)
        torch.testing.assert_close(layer(ours), 2 * before[1] - layer.bias, **TOL)
        torch.testing.assert_close(layer(x), before[2], **TOL)


def test_a_changed_weight_is_packed_again():
    model, reference = small_model(), small_model()
    pack_linears(model)
    x = torch.randn(16, 64)
    with torch.no_grad():
        model[0].weight.mul_(2)   # in place (an optimizer step)
        reference[0].weight.mul_(2)
    torch.testing.assert_close(model(x), reference(x), **TOL)
    model.load_state_dict(small_model(seed=3).state_dict())
    torch.testing.assert_close(model(x), small_model(seed=3)(x), **TOL)
    model[2].weight = nn.Parameter(torch.ones(48, 96))  # replaced
    with torch.inference_mode():
        torch.testing.assert_close(model[2](torch.ones(16, 96)), torch.full((16, 48), 96.0), **TOL)


def test_training_runs_f_linear_with_gradients():
    model, reference = small_model(), small_model()
    pack_linears(model)
    x = torch.randn(16, 64)
    model(x).square().sum().backward()
    reference(x).square().sum().backward()
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, **TOL)


def test_a_frozen_packed_layer_passes_gradients_to_its_input():
    """A frozen target's packed head under a draft being trained: the gradient reaches the draft's output."""
    model, reference = small_model().requires_grad_(False), small_model().requires_grad_(False)
    pack_linears(model)
    x, y = torch.randn(16, 64, requires_grad=True), torch.randn(16, 64, requires_grad=True)
    with torch.no_grad():
        y.copy_(x)
    model(x).square().sum().backward()
    reference(y).square().sum().backward()
    torch.testing.assert_close(x.grad, y.grad, **TOL)


def test_only_fp32_cpu_models_within_the_memory_budget():
    assert pack_linears(small_model().to(torch.bfloat16)) == 0
    model = small_model()
    assert pack_linears(model, budget_share=0.0) == 0  # the copies would not fit: nothing packed
    assert all(type(m) is nn.Linear for m in (model[0], model[2]))
    assert pack_linears(nn.SiLU(), None) == 0  # no parameters; None (a proposer without a draft model)


def test_f_linear_agrees_on_a_real_shape():
    """A decoder projection's shape (576 -> 1536) at the engine's row counts."""
    gen = torch.Generator().manual_seed(2)
    layer = nn.Linear(576, 1536)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(layer.weight.shape, generator=gen) / 24)
    weight, bias = layer.weight.detach().clone(), layer.bias.detach().clone()
    pack_linears(layer)
    with torch.inference_mode():
        for rows in (4, 16, 144):
            x = torch.randn(rows, 576, generator=gen)
            torch.testing.assert_close(layer(x), F.linear(x, weight, bias), **TOL)


def test_a_row_gets_the_same_numbers_in_any_batch():
    """Our kernel sums each output the same way whatever the rows and their chunking (chunks of up to 8 rows, as
    even as they come: 9 rows run as 5 + 4, 30 as 8 + 8 + 7 + 7): a row alone or in a batch of 9, 16, 30 or 144 (a
    16-row verify at W = 8), at any place, gives bit-identical outputs. Output columns off the 16-column panels (40: 3 panels, one of them part;
    64: a group of 3 and one left over) and a bias, as Qwen2's q/k/v have."""
    gen = torch.Generator().manual_seed(4)
    for out_features in (40, 64):
        layer = nn.Linear(576, out_features)
        with torch.no_grad():
            layer.weight.copy_(torch.randn(layer.weight.shape, generator=gen) / 24)
        pack_linears(layer)
        x = torch.randn(144, 576, generator=gen)
        picked = (0, 7, 15, 29)
        with torch.inference_mode():
            alone = torch.cat([layer(x[i:i + 1]) for i in picked])
            for batch in (x[:9], x[:16], x[:30], x):
                rows = [i for i in picked if i < len(batch)]
                assert torch.equal(layer(batch)[rows], alone[:len(rows)])
