"""Table-driven acceptance cases from hand-built logits, and the sampling primitives."""

import pytest
import torch

from domino_ray.sample.sampling import sampling_probs

from domino_ray.sample.params import SamplingParams
from domino_ray.spec_decode.verify import greedy_accept, greedy_choice, rejection_accept, sample_from_probs

V = 10


def logits_for(tokens: list[list[int]]) -> torch.Tensor:
    """Logits `[n, len, V]` whose argmax at each position is the given token."""
    out = torch.zeros(len(tokens), len(tokens[0]), V)
    for i, row in enumerate(tokens):
        for j, t in enumerate(row):
            out[i, j, t] = 5.0
    return out


@pytest.mark.parametrize("name,drafts,target,limit,accepted", [
    ("perfect match", [1, 2, 3], [1, 2, 3, 4], 3, 3),
    ("early mismatch", [1, 9, 3], [1, 2, 3, 4], 3, 1),
    ("first wrong", [7, 2, 3], [1, 2, 3, 4], 3, 0),
    ("match after a mismatch does not count", [1, 5, 3], [1, 2, 3, 4], 3, 1),
    ("budget limit", [1, 2, 3], [1, 2, 3, 4], 1, 1),
    ("no budget for drafts", [1, 2, 3], [1, 2, 3, 4], 0, 0),
])
def test_greedy_accept(name, drafts, target, limit, accepted):
    a, tokens = greedy_accept(target_logits=logits_for([target]), drafts=torch.tensor([drafts]),
                              limit=torch.tensor([limit]))
    assert a.tolist() == [accepted], name
    assert tokens[0, :accepted + 1].tolist() == drafts[:accepted] + [target[accepted]], name


def test_greedy_accept_rows_are_independent():
    drafts = torch.tensor([[1, 2, 3], [1, 9, 3], [0, 0, 0]])
    target = logits_for([[1, 2, 3, 4], [1, 2, 3, 4], [5, 5, 5, 5]])
    a, tokens = greedy_accept(target_logits=target, drafts=drafts, limit=torch.tensor([3, 3, 3]))
    assert a.tolist() == [3, 1, 0]
    assert tokens.gather(1, a[:, None])[:, 0].tolist() == [4, 2, 5]  # bonus tokens


def test_greedy_accept_without_drafts_is_target_only():
    a, tokens = greedy_accept(target_logits=logits_for([[6], [2]]), drafts=torch.zeros(2, 0, dtype=torch.long),
                              limit=torch.tensor([5, 5]))
    assert a.tolist() == [0, 0] and tokens[:, 0].tolist() == [6, 2]


def test_rejection_accept_extremes():
    probs = torch.zeros(2, 3, V)
    probs[:, :, 4] = 1.0  # the target is certain of token 4 everywhere
    drafts = torch.tensor([[4, 4], [4, 7]])
    u = torch.full((2, 3), 0.999)
    a, tokens = rejection_accept(target_probs=probs, drafts=drafts, limit=torch.tensor([2, 2]), uniforms=u)
    assert a.tolist() == [2, 1]  # p(d)=1 is always accepted, p(d)=0 never
    assert tokens[0].tolist() == [4, 4, 4] and tokens[1, :2].tolist() == [4, 4]


def test_sample_from_probs_never_picks_zero_mass():
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.5, 0.0]] * 4)
    picks = sample_from_probs(probs, torch.tensor([0.0, 0.49999, 0.5, 0.99999]))
    assert picks.tolist() == [1, 1, 3, 3]


def test_sampling_probs_top_k_top_p_temperature():
    logits = torch.log(torch.tensor([[[0.5, 0.2, 0.15, 0.1, 0.05]]]))
    one = torch.ones(1)
    full = sampling_probs(logits, one, torch.zeros(1, dtype=torch.long), one, filtered=True)
    assert torch.allclose(full[0, 0], torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05]))
    top2 = sampling_probs(logits, one, torch.tensor([2]), one, filtered=True)[0, 0]
    assert torch.allclose(top2, torch.tensor([5 / 7, 2 / 7, 0, 0, 0]))
    # top_p=0.8 keeps the smallest prefix reaching 0.8: 0.5 + 0.2 + 0.15
    nucleus = sampling_probs(logits, one, torch.zeros(1, dtype=torch.long), torch.tensor([0.8]), filtered=True)[0, 0]
    assert torch.allclose(nucleus, torch.tensor([0.5, 0.2, 0.15, 0, 0]) / 0.85)
    hot = sampling_probs(logits, torch.tensor([2.0]), torch.zeros(1, dtype=torch.long), one, filtered=False)[0, 0]
    expected = torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05]).sqrt()
    assert torch.allclose(hot, expected / expected.sum())


@pytest.mark.parametrize("field,value", [("max_new_tokens", 0), ("temperature", -1.0), ("top_p", 0.0),
                                         ("top_p", 1.5), ("top_k", -1), ("seed", -3), ("temperature", "hot")])
def test_sampling_params_name_the_bad_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_sampling_probs_filters_every_position_of_a_block():
    logits = torch.randn(3, 4, V)  # [n, K+1, V]
    probs = sampling_probs(logits, torch.ones(3), torch.tensor([2, 0, 5]), torch.tensor([1.0, 0.5, 0.9]),
                           filtered=True)
    assert probs.shape == (3, 4, V)
    assert torch.allclose(probs.sum(-1), torch.ones(3, 4))
    assert ((probs[0] > 0).sum(-1) == 2).all()  # top_k=2 at every position


def test_greedy_choice_is_argmax_first_index_on_ties():
    """`greedy_choice` (max(-1).indices, faster than argmax on CPU) picks what argmax picks: the first of
    tied maxima, a NaN as the maximum, index 0 for a row of -inf."""
    x = torch.zeros(4, 1000)
    x[0, [10, 500]] = 1.0
    x[2, 7] = float("nan")
    x[3] = float("-inf")
    assert greedy_choice(x).tolist() == x.argmax(-1).tolist() == [10, 0, 7, 0]
    rounded = torch.randn(8, 9, 4096, generator=torch.Generator().manual_seed(0)).round(decimals=1)  # many ties
    assert torch.equal(greedy_choice(rounded), rounded.argmax(-1))
