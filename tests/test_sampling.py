"""Speculative sampling is lossless in distribution.

Tolerance: for n samples of a categorical with c cells, Pearson's statistic follows chi-square with
c - 1 degrees of freedom when the sampler is right. We reject above the 0.999 quantile, so a correct
sampler fails one seed in a thousand; the seeds are fixed, so the test is deterministic. Each test
also shows the check has power: a plausible bug (no residual renormalisation, or ignoring the
target) is rejected by the same statistic at the same n.
"""

import itertools

import torch

from domino_ray.engine.request import Request
from domino_ray.engine.core import SpecEngine
from oracles import OracleProposer
from domino_ray.sample.sampling import sampling_probs
from domino_ray.sample.params import SamplingParams
from domino_ray.spec_decode.verify import rejection_accept, sample_from_probs
from tiny_models import tiny_target

# 0.999 quantiles of chi-square by degrees of freedom (scipy.stats.chi2.ppf(0.999, df)).
CHI2_999 = {7: 24.322, 15: 37.697}


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's statistic over cells with positive expected mass (a hit on a zero cell is infinite)."""
    n = counts.sum()
    expected = probs * n
    if (counts[probs == 0] > 0).any():
        return float("inf")
    mask = probs > 0
    return float(((counts[mask] - expected[mask]) ** 2 / expected[mask]).sum())


def test_rejection_sampling_matches_target_per_position():
    v, k, n = 8, 3, 200_000
    g = torch.Generator().manual_seed(0)
    probs = torch.softmax(torch.randn(k + 1, v, generator=g) * 1.5, -1)  # p_i, conditional on accepted drafts
    drafts = torch.tensor([int(probs[i].argmax()) for i in range(k)])    # greedy-style one-hot proposal
    batch_probs = probs.expand(n, k + 1, v)
    u = torch.rand(n, k + 1, generator=g, dtype=torch.float64)
    accepted, tokens = rejection_accept(target_probs=batch_probs, drafts=drafts.expand(n, k),
                                        limit=torch.full((n,), k), uniforms=u)
    first = torch.bincount(tokens[:, 0], minlength=v).double()
    assert chi_square(first, probs[0].double()) < CHI2_999[v - 1]
    # Position 1 exists given the first draft was accepted; then it must follow p_1.
    second = torch.bincount(tokens[accepted >= 1, 1], minlength=v).double()
    assert chi_square(second, probs[1].double()) < CHI2_999[v - 1]
    # Power: sampling the correction from p instead of the residual is caught.
    wrong_bonus = sample_from_probs(batch_probs[:, 0], u[:, k])
    naive_first = torch.where(accepted >= 1, drafts[0], wrong_bonus)
    assert chi_square(torch.bincount(naive_first, minlength=v).double(), probs[0].double()) > 10 * CHI2_999[v - 1]


def exact_marginals(target, prompt, params: SamplingParams):
    """Exact distributions of generated tokens 2 and 3 under the target alone."""
    v = target.config.vocab_size

    def dist(seqs):
        with torch.no_grad():
            logits = target(torch.tensor(seqs)).logits[:, -1:]  # [m, 1, V]
        m = len(seqs)
        return sampling_probs(logits, torch.full((m,), params.temperature), torch.full((m,), params.top_k),
                              torch.full((m,), params.top_p), filtered=True)[:, 0].double()

    p1 = dist([prompt])[0]                                                  # [V]
    p2 = dist([prompt + [a] for a in range(v)])                             # [V, V]
    pairs = list(itertools.product(range(v), range(v)))
    p3 = dist([prompt + [a, b] for a, b in pairs]).reshape(v, v, v)          # [V, V, V]
    joint12 = p1[:, None] * p2
    return joint12.sum(0), (joint12[:, :, None] * p3).sum((0, 1))


def run_spec(target, prompt, params, n, proposer_k=3, wrong_at=None):
    greedy = SpecEngine(target, None).generate([Request(0, prompt, SamplingParams(max_new_tokens=6))])[0]
    references = {i: prompt + greedy.token_ids for i in range(n)}
    proposer = OracleProposer(references, proposer_k, target.config.vocab_size,
                              wrong_at={i: wrong_at for i in range(n)} if wrong_at else None)
    engine = SpecEngine(target, proposer, max_rows=1024)
    out = engine.generate([Request(i, prompt, SamplingParams(**{**params.__dict__, "seed": 1000 + i}))
                           for i in range(n)])
    tokens = torch.tensor([c.token_ids[:3] for c in out])
    return tokens, out


def test_engine_sampling_matches_target_distribution():
    target = tiny_target("qwen3", seed=21, vocab=16)
    prompt = [3, 1, 4, 1, 5]
    n = 6_000
    for params in (SamplingParams(max_new_tokens=3, temperature=1.0),
                   SamplingParams(max_new_tokens=3, temperature=0.7, top_k=6, top_p=0.9)):
        p2, p3 = exact_marginals(target, prompt, params)
        tokens, out = run_spec(target, prompt, params, n, wrong_at=[1, 3])
        histogram = torch.tensor([c.stats.acceptance_histogram for c in out]).sum(0)
        assert histogram[0] > 500 and histogram[1:].sum() > 500  # both accept and reject paths ran
        for position, exact in ((1, p2), (2, p3)):
            counts = torch.bincount(tokens[:, position], minlength=16).double()
            assert chi_square(counts, exact) < CHI2_999[15], (params, position)
    # Power: the same statistic rejects a distribution that ignores the temperature.
    greedy_like, _ = exact_marginals(target, prompt, SamplingParams(temperature=0.3))
    counts = torch.bincount(tokens[:, 1], minlength=16).double()
    assert chi_square(counts, greedy_like) > 10 * CHI2_999[15]


def test_seeded_rows_are_reproducible_and_batch_independent():
    target = tiny_target("qwen3", seed=22)
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8], [9]]
    params = [SamplingParams(max_new_tokens=12, temperature=0.9, top_p=0.95, seed=s) for s in (5, 6, 7)]
    together = SpecEngine(target, None, max_rows=3).generate(
        [Request(i, p, sp) for i, (p, sp) in enumerate(zip(prompts, params))])
    alone = [SpecEngine(target, None, max_rows=1).generate([Request(0, p, sp)])[0]
             for p, sp in zip(prompts, params)]
    assert [c.token_ids for c in together] == [c.token_ids for c in alone]
    other_seed = SpecEngine(target, None).generate(
        [Request(0, prompts[1], SamplingParams(max_new_tokens=12, temperature=0.9, top_p=0.95, seed=99))])[0]
    assert other_seed.token_ids != together[1].token_ids
